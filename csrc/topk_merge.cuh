// Streaming top-k merge over vocabulary chunks (teacher top-128 truncation, docs/ARCHITECTURE.md, "Top-k stack").
//
// Per row, the state is
//   vals[k], ids[k]  the k best logits seen so far, best first, under the order
//                    (value descending, vocabulary id ascending) — the tie rule everywhere;
//   row_max, row_sumexp  running max and Σ exp(x − row_max) over every logit seen (for the
//                    full-vocabulary log-sum-exp);
//   target_logit     the logit of the row's target id once its chunk has passed.
// Empty slots hold (−inf, id −k+i): negative ids sort below every real entry.
//
// Selection works on one 64-bit key per candidate, (orderable(value) << 32) | ~id, so
// "larger key" is exactly "better under the tie rule" and keys are unique. The k best of
// (state ∪ chunk) are found by an MSB-first radix select, 8 bits a pass (FlashInfer's top-k
// uses the same 8-bit passes), over the candidates whose key is >= the state's k-th key.
// Pass 0 reads the chunk once (fused with the log-sum-exp) and copies those candidates to a
// buffer; later passes and the gather read only the buffer. After the first chunk few
// logits qualify (~k·chunk/seen), so a merge costs about one read of the chunk. If the
// buffer overflows (the first chunk, on GPU where it lives in shared memory) the later
// passes re-read the chunk instead. The winners are bitonic-sorted (k ≤ 4096).
#pragma once

#include <cstring>

#include "common.cuh"

namespace acr {

constexpr int kTopKMax = 4096;  // keys of one row fit in 32 KB of shared memory

ACR_HD uint32_t float_bits(float v) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(v);
#else
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
#endif
}

ACR_HD float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
#endif
}

// Monotone map float -> uint32 (a < b  =>  orderable(a) < orderable(b)). −0 is folded
// into +0 first so that, like torch's comparisons, the two zeros tie (and the id decides).
// NaN maps above +inf (torch.topk also ranks NaN first).
ACR_HD uint32_t orderable(float v) {
  if (v == 0.0f) v = 0.0f;
  uint32_t u = float_bits(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

ACR_HD float from_orderable(uint32_t o) {
  return bits_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

ACR_HD uint64_t make_key(float v, int32_t id) {
  return (static_cast<uint64_t>(orderable(v)) << 32) | static_cast<uint64_t>(~static_cast<uint32_t>(id));
}
ACR_HD float key_value(uint64_t key) { return from_orderable(static_cast<uint32_t>(key >> 32)); }
ACR_HD int32_t key_id(uint64_t key) { return static_cast<int32_t>(~static_cast<uint32_t>(key & 0xffffffffu)); }

// -- online log-sum-exp: (m, s) stands for log(s) + m, s = Σ exp(x − m) accumulated in
// double (a 151,669-term float sum loses ~1e-5 relative; the contract is 1e-6 in log-probs).
struct LseAcc {
  float m;
  double s;
};

ACR_HD LseAcc lse_empty() { return LseAcc{-INFINITY, 0.0}; }

ACR_HD void lse_push(LseAcc& a, float v) {
  if (v > a.m) {  // new max: rescale (rare: ~log n times in a random order)
    a.s = a.s * exp(static_cast<double>(a.m) - static_cast<double>(v)) + 1.0;
    a.m = v;
  } else if (v == a.m) {  // also +inf == +inf and −inf == −inf, where v − m would be NaN
    a.s += 1.0;
  } else if (v > -INFINITY) {
    a.s += static_cast<double>(expf(v - a.m));
  } else if (v != v) {  // NaN reaches the log-sum-exp, as in torch
    a.s = NAN;
  }
}

ACR_HD LseAcc lse_merge(LseAcc a, LseAcc b) {
  LseAcc r;
  r.m = a.m > b.m ? a.m : b.m;
  // factor 1 when a part holds the max: avoids (±inf) − (±inf)
  const double fa = a.m == r.m ? 1.0 : exp(static_cast<double>(a.m) - static_cast<double>(r.m));
  const double fb = b.m == r.m ? 1.0 : exp(static_cast<double>(b.m) - static_cast<double>(r.m));
  r.s = a.s * fa + b.s * fb;
  return r;
}

// -- radix select bookkeeping, one 8-bit digit at a time (written by the group's thread 0)
struct TopKShared {
  uint32_t hist[256];
  uint64_t prefix;   // digits of the k-th key fixed so far
  uint64_t mask;     // which bits of prefix are fixed
  uint32_t k_rem;    // winners still to take among keys matching prefix
  uint32_t count;    // gather cursor
  uint32_t n_buf;    // candidates >= the state's k-th key seen in pass 0 (buffered if <= capacity)
  int done;          // the keys matching prefix are exactly the k_rem missing winners
  int unchanged;     // no chunk key beats the state's k-th key: nothing to do
};

// Find the digit bucket holding the k_rem-th largest key; `first` = pass 0, whose histogram
// also counts the k state keys, so a total of k means the chunk brought nothing better.
ACR_HD void radix_step(TopKShared* sh, int shift, int k, bool first) {
  uint32_t cum = 0, bucket = 0, above = 0, in_bucket = 0;
  bool found = false;
  for (int b = 255; b >= 0; --b) {
    const uint32_t h = sh->hist[b];
    if (!found && cum + h >= sh->k_rem) {
      bucket = static_cast<uint32_t>(b);
      above = cum;
      in_bucket = h;
      found = true;
    }
    cum += h;
  }
  if (first && cum == static_cast<uint32_t>(k)) {
    sh->done = 1;
    sh->unchanged = 1;
    return;
  }
  sh->prefix |= static_cast<uint64_t>(bucket) << shift;
  sh->mask |= static_cast<uint64_t>(0xffu) << shift;
  sh->k_rem -= above;
  // keys are unique, so after the last digit one key is left; shift 0 also ends the loop
  // if a caller merged the same vocabulary column twice (duplicates: the gather clamps)
  if (in_bucket == sh->k_rem || shift == 0) sh->done = 1;
}

// Bitonic sort of n (a power of two) keys, descending; each step ends with a group sync.
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Group>
ACR_HD void bitonic_sort_desc(const Group& g, uint64_t* keys, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = g.tid(); i < n; i += g.size()) {
        const int j = i ^ stride;
        if (j > i) {
          const bool desc = (i & size) == 0;  // final stage (size == n): all descending
          const uint64_t a = keys[i], b = keys[j];
          if ((a < b) == desc) {
            keys[i] = b;
            keys[j] = a;
          }
        }
      }
      g.sync();
    }
  }
}

template <typename T>
struct TopKChunk {
  const T* logits;     // [n] this row's logits for vocabulary ids c0 .. c0 + n − 1
  int n;
  int64_t c0;
  float temperature;   // logits are divided by it (IEEE division, as torch's x / t)
};

struct TopKRowState {
  float* vals;         // [k] best first
  int32_t* ids;        // [k]
  int k;
  float* row_max;      // scalar
  double* row_sumexp;  // scalar
  int64_t target;      // vocabulary id, or −1 for none
  float* target_logit; // scalar
};

// Scratch of one row update: sh; keys[kpad] (kpad = next pow2 ≥ k); buf[buf_cap] for the
// pass-0 candidates; red_m/red_s[g.size()] (g.size() a power of two).
struct TopKScratch {
  TopKShared* sh;
  uint64_t* keys;
  int kpad;
  uint64_t* buf;
  int buf_cap;
  float* red_m;
  double* red_s;
};

// Merge one chunk into one row's state. Candidates j < k are the state's entries, j ≥ k the
// chunk's logits, so the new top-k comes out of one selection.
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Group, typename T>
ACR_HD void topk_merge_row_update(const Group& g, const TopKChunk<T>& c, const TopKRowState& st,
                                  const TopKScratch& w) {
  const int k = st.k;
  const int n_cand = k + c.n;
  const int tid = g.tid(), nt = g.size();
  TopKShared* sh = w.sh;
  // The state's k keys are all >= its worst, so the k best of the union are among the
  // candidates >= worst; after the first chunk this filter rejects nearly every logit.
  const uint64_t worst = make_key(st.vals[k - 1], st.ids[k - 1]);
  auto cand_key = [&](int j) -> uint64_t {
    if (j < k) return make_key(st.vals[j], st.ids[j]);
    return make_key(to_float(c.logits[j - k]) / c.temperature, static_cast<int32_t>(c.c0 + (j - k)));
  };

  for (int b = tid; b < 256; b += nt) sh->hist[b] = 0;
  for (int i = tid; i < w.kpad; i += nt) w.keys[i] = 0;  // 0 is below every real or empty-slot key
  if (tid == 0) {
    sh->prefix = 0;
    sh->mask = 0;
    sh->k_rem = static_cast<uint32_t>(k);
    sh->count = 0;
    sh->n_buf = 0;
    sh->done = 0;
    sh->unchanged = 0;
  }
  g.sync();

  // -- pass 0 (top digit) fused with the running log-sum-exp: the one full read of the chunk
  auto take = [&](uint64_t key) {  // key >= worst: count its top digit, buffer it
    g.atomic_add(&sh->hist[key >> 56], 1u);
    const uint32_t pos = g.atomic_add(&sh->n_buf, 1u);
    if (pos < static_cast<uint32_t>(w.buf_cap)) w.buf[pos] = key;
  };
  for (int j = tid; j < k; j += nt) take(make_key(st.vals[j], st.ids[j]));  // all >= worst
  // v < worst's value implies key < worst whatever the ids: most logits stop at this compare
  const float worst_v = key_value(worst);
  LseAcc acc = lse_empty();
  for (int j = tid; j < c.n; j += nt) {
    const float v = to_float(c.logits[j]) / c.temperature;
    lse_push(acc, v);
    if (v < worst_v) continue;
    const uint64_t key = make_key(v, static_cast<int32_t>(c.c0 + j));
    if (key >= worst) take(key);
  }
  w.red_m[tid] = acc.m;
  w.red_s[tid] = acc.s;
  g.sync();
  for (int off = nt >> 1; off > 0; off >>= 1) {
    if (tid < off) {
      const LseAcc r = lse_merge(LseAcc{w.red_m[tid], w.red_s[tid]}, LseAcc{w.red_m[tid + off], w.red_s[tid + off]});
      w.red_m[tid] = r.m;
      w.red_s[tid] = r.s;
    }
    g.sync();
  }
  if (tid == 0) {
    const LseAcc r = lse_merge(LseAcc{*st.row_max, *st.row_sumexp}, LseAcc{w.red_m[0], w.red_s[0]});
    *st.row_max = r.m;
    *st.row_sumexp = r.s;
    if (st.target >= c.c0 && st.target < c.c0 + c.n)
      *st.target_logit = to_float(c.logits[st.target - c.c0]) / c.temperature;
    radix_step(sh, 56, k, /*first=*/true);
  }
  g.sync();
  if (sh->unchanged) return;

  // Later passes read the buffered candidates (all >= worst), or re-read the chunk if the
  // buffer overflowed.
  const bool buffered = sh->n_buf <= static_cast<uint32_t>(w.buf_cap);
  const int n_scan = buffered ? static_cast<int>(sh->n_buf) : n_cand;
  auto scan_key = [&](int j, uint64_t* key) -> bool {
    *key = buffered ? w.buf[j] : cand_key(j);
    return buffered || *key >= worst;
  };

  // -- remaining digits, only among keys that match the digits fixed so far
  for (int shift = 48; shift >= 0 && !sh->done; shift -= 8) {
    for (int b = tid; b < 256; b += nt) sh->hist[b] = 0;
    g.sync();
    const uint64_t mask = sh->mask, prefix = sh->prefix;
    for (int j = tid; j < n_scan; j += nt) {
      uint64_t key;
      if (scan_key(j, &key) && (key & mask) == prefix) g.atomic_add(&sh->hist[(key >> shift) & 0xffu], 1u);
    }
    g.sync();
    if (tid == 0) radix_step(sh, shift, k, /*first=*/false);
    g.sync();
  }

  // -- gather the k winners: keys whose fixed digits are >= the k-th key's
  {
    const uint64_t mask = sh->mask, prefix = sh->prefix;
    for (int j = tid; j < n_scan; j += nt) {
      uint64_t key;
      if (scan_key(j, &key) && (key & mask) >= prefix) {
        const uint32_t pos = g.atomic_add(&sh->count, 1u);
        if (pos < static_cast<uint32_t>(k)) w.keys[pos] = key;
      }
    }
  }
  g.sync();  // every read of the old state is done before it is overwritten below
  bitonic_sort_desc(g, w.keys, w.kpad);
  for (int i = tid; i < k; i += nt) {
    st.vals[i] = key_value(w.keys[i]);
    st.ids[i] = key_id(w.keys[i]);
  }
}

}  // namespace acr
