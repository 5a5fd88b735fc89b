// Decode-like row blocks of the prefix-shared CPU attention (prefix_attention.cpp), computed
// straight from the K/V rows where they lie (pages or inputs), with no packed tile.
//
// A row block of a few rows — a one-token segment per group, as every step of setwise decoding
// sends: r rows (the query heads of one kv head) against P prefix keys — does r·P·d·4 FLOP on
// 2·P·d values of K and V: a GEMV, bound by reading K/V once. The tile path packs both first
// (one more read and a write of each, for a GEMM of r rows), so there it spends ~2× the memory
// traffic of the work itself. Here, per step of kDirectKeys keys and per kv head of the task:
// scores 16 keys at a time (each key row dotted with each row's q, bf16 widened on load; the 16
// partial vectors finished by one pairwise reduction, sum16), the online softmax in fp32 (P is
// not rounded to bf16: a more exact weight than the tile path's), then P·V with up to 4 rows'
// accumulators held in registers across the step's keys.
//
//   s_ij = q_i · k_j        (j visible to row i: the whole prefix, own keys a_s .. t_i)
//   m_i' = max(m_i, max_j s_ij);  p_ij = exp(scale·(s_ij − m_i'));  l_i' = l_i·α + Σ_j p_ij;
//   acc_i' = acc_i·α + Σ_j p_ij · v_j,   α = exp(scale·(m_i − m_i'))
//
// A NaN score loses the max and makes p, l and the row's output NaN, as on the tile path; a key a
// row cannot see may be scored with the others of its 16 and is never used for it. AVX-512 code (ACR_AVX512_BF16: the exp is
// attn_tiles.h's exp2_f32_weights_avx512 or exp2_avx512), called only where bf16_avx512().
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "attn_tiles.h"

namespace acr_attn {

constexpr int64_t kDirectRows = 16;  // row blocks of at most this many rows take this path
constexpr int64_t kDirectKeys = 64;  // keys per softmax step: scores of a task's rows × kDirectKeys

#ifdef ACR_HAVE_AVX512_BF16_CODE
ACR_AVX512_BF16 inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// Key rows are fetched ahead of their use: they lie in scattered pages (a page boundary every
// block_size keys), where the hardware prefetcher loses the stream. Into L2 (prefetcht1), not L1:
// a step's V rows are up to kDirectKeys × 2 KB (all heads of a 4B slot row), several times L1, so
// prefetcht0 evicted its own lines before they were read (one group over 1,600 keys: 25-35 %
// faster into L2; EPYC Zen 4, 2 threads, docs/cpu.md "Decode-like blocks"). A whole step ahead,
// head by head beside the step's own work: fetched 16 keys ahead (K) or just before the softmax
// (V), the rows came a few hundred cycles before their loads, which stalled on them (perf: the P·V
// loads of V were the kernel's hottest instructions), and a burst of a step's V rows stalled on
// the prefetches themselves.
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 2);
}

// 16 values (lanes past mk zero) as fp32: bf16 widened (the low 16 bits zero), fp32 as they are.
ACR_AVX512_BF16 inline __m512 load16_f32(const BFloat16* x, __mmask16 mk) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, reinterpret_cast<const uint16_t*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
ACR_AVX512_BF16 inline __m512 load16_f32(const float* x, __mmask16 mk) { return _mm512_maskz_loadu_ps(mk, x); }

// d values of a row as fp32 into buf (q rows of a bf16 task).
ACR_AVX512_BF16 inline void row_f32(const BFloat16* x, int64_t d, float* buf) {
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 mk = tail_mask(d - c);
    _mm512_mask_storeu_ps(buf + c, mk, load16_f32(x + c, mk));
  }
}

// Lane j of the result = the sum of v[j]'s 16 lanes: 16 dot products finished in 15 pairwise
// steps (unpack/shuffle + add) instead of 16 horizontal reductions of 4 steps each.
ACR_AVX512_BF16 inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of v[2k], v[2k+1]
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // per 128-bit lane: the lane's sum of v[4k .. 4k+3]
    u[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0xEE));
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// s[0, nk) = q · k[jj] for nk <= 16 key rows k[jj] (d values each; q fp32). NC > 0: d == 16·NC,
// q held in registers; NC == 0: any d, masked tail.
template <int NC, typename T>
ACR_AVX512_BF16 inline void dots16(const float* q, const T* const* k, int64_t nk, int64_t d, float* s) {
  __m512 part[16];
  if constexpr (NC > 0) {
    __m512 qr[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) qr[c] = _mm512_loadu_ps(q + 16 * c);
    for (int64_t jj = 0; jj < 16; ++jj) {
      __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();  // two chains: half the FMA latency
      if (jj < nk) {
#pragma GCC unroll 8
        for (int c = 0; c < NC; c += 2) {
          a = _mm512_fmadd_ps(qr[c], load16_f32(k[jj] + 16 * c, 0xFFFF), a);
          if (c + 1 < NC) b = _mm512_fmadd_ps(qr[c + 1], load16_f32(k[jj] + 16 * c + 16, 0xFFFF), b);
        }
      }
      part[jj] = _mm512_add_ps(a, b);
    }
  } else {
    for (int64_t jj = 0; jj < 16; ++jj) {
      __m512 a = _mm512_setzero_ps();
      if (jj < nk)
        for (int64_t c = 0; c < d; c += 16) {
          const __mmask16 mk = tail_mask(d - c);
          a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, q + c), load16_f32(k[jj] + c, mk), a);
        }
      part[jj] = a;
    }
  }
  _mm512_mask_storeu_ps(s, tail_mask(nk), sum16(part));
}

// The same for bf16 q and K rows, d == 32·NC2: vdpbf16ps multiplies 32 bf16 pairs into 16 fp32
// lanes, K read as it lies (no widening). Every product is exact in fp32 either way (q is bf16
// already), so only the order of the fp32 additions differs from dots16's.
template <int NC2>
ACR_AVX512_BF16 inline void dots16_bf16(const BFloat16* q, const BFloat16* const* k, int64_t nk, float* s) {
  __m512 part[16];
  __m512i qr[NC2];
#pragma GCC unroll 8
  for (int c = 0; c < NC2; ++c) qr[c] = _mm512_loadu_si512(q + 32 * c);
  for (int64_t jj = 0; jj < 16; ++jj) {
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();  // two chains: half the latency
    if (jj < nk) {
#pragma GCC unroll 8
      for (int c = 0; c < NC2; c += 2) {
        a = _mm512_dpbf16_ps(a, (__m512bh)qr[c], (__m512bh)_mm512_loadu_si512(k[jj] + 32 * c));
        if (c + 1 < NC2) b = _mm512_dpbf16_ps(b, (__m512bh)qr[c + 1], (__m512bh)_mm512_loadu_si512(k[jj] + 32 * c + 32));
      }
    }
    part[jj] = _mm512_add_ps(a, b);
  }
  _mm512_mask_storeu_ps(s, tail_mask(nk), sum16(part));
}

// acc_i[0, d) += Σ_{j < cnt[i]} p_i[j] · v[j][0, d) for R <= 4 rows i (p_i at p + i·ps, acc_i at
// acc + i·d), over the widest of cnt keys: 64 columns at a time, the rows' accumulators held in
// registers across all keys (one load and store of acc per call, not per key).
template <int R, typename T>
ACR_AVX512_BF16 inline void axpy_rows(const float* p, int64_t ps, const int64_t* cnt, int64_t widest,
                                      const T* const* v, int64_t d, float* acc) {
  for (int64_t c = 0; c < d; c += 64) {
    __mmask16 mk[4];
    for (int k = 0; k < 4; ++k) mk[k] = c + 16 * k < d ? tail_mask(d - c - 16 * k) : __mmask16(0);
    __m512 a[R][4];
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) a[i][k] = _mm512_maskz_loadu_ps(mk[k], acc + i * d + c + 16 * k);
    for (int64_t j = 0; j < widest; ++j) {
      __m512 vv[4];
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) vv[k] = load16_f32(v[j] + c + 16 * k, mk[k]);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i)
        if (j < cnt[i]) {  // a key the row cannot see is never used for it (a NaN there stays out)
          const __m512 pj = _mm512_set1_ps(p[i * ps + j]);
#pragma GCC unroll 4
          for (int k = 0; k < 4; ++k) a[i][k] = _mm512_fmadd_ps(pj, vv[k], a[i][k]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) _mm512_mask_storeu_ps(acc + i * d + c + 16 * k, mk[k], a[i][k]);
  }
}

// One softmax step of a row over its n >= 1 visible scores s[0, n): s is overwritten by p. Weights
// to fp32's precision for fp32 inputs (kExact: exp2_f32_weights_avx512); for bf16 ones exp2_avx512's
// 3.3e-6 is far below what the bf16 V and output keep, and two FMAs fewer per 16 weights (decode
// steps of one group ~5 % faster on a Zen 4).
template <bool kExact>
ACR_AVX512_BF16 inline void softmax_row_direct(float* s, int64_t n, int64_t d, float scale, float& m, float& l,
                                               float* acc) {
  const RowMax rm = row_max_avx512(s, n, scale, m);
  const float m_new = rm.m_new, alpha = rm.alpha;
  const __m512 vs = rm.vs, vm = rm.vm;
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mk = tail_mask(n - j);
    const __m512 t = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + j), vm), vs);
    const __m512 p = _mm512_maskz_mov_ps(mk, kExact ? exp2_f32_weights_avx512(t) : exp2_avx512(t));
    vsum = _mm512_add_ps(vsum, p);
    _mm512_mask_storeu_ps(s + j, mk, p);
  }
  l = l * alpha + _mm512_reduce_add_ps(vsum);
  m = m_new;
  if (alpha != 1.f) {
    const __m512 va = _mm512_set1_ps(alpha);
    for (int64_t c = 0; c < d; c += 16) {
      const __mmask16 mk = tail_mask(d - c);
      _mm512_mask_storeu_ps(acc + c, mk, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, acc + c), va));
    }
  }
}

// Rows of nh heads against keys [0, nkeys): head hh's M rows are rows hh·hrows .. hh·hrows + M of
// q (fp32, row i at q + i·d) and of m / l / acc; key j's K/V rows of head hh at krow(j) + hh·kstride
// / vrow(j) + hh·vstride (d values each); row i of a head sees keys [0, visible(i)), i in [0, M).
// qt: the same rows in T (bf16 d 64 / 128 dot them as they are; q may then be unset). Continues
// each row's running (m, l, acc). s: nh·M × kDirectKeys floats of scratch.
// A task of all kv heads of a group reads each key's whole slot row (Hkv·d values, contiguous in a
// page) in one pass, where a task per head reads d of every Hkv·d: one stream instead of Hkv strided
// ones, each touching a new page every other key (a 2 KB slot row at the 4B shapes).
template <typename T, typename KRow, typename VRow, typename Visible>
ACR_AVX512_BF16 void direct_keys(const float* q, const T* qt, int64_t nh, int64_t hrows, int64_t M, int64_t kstride,
                                 int64_t vstride, int64_t d, float scale, int64_t nkeys, KRow&& krow, VRow&& vrow,
                                 Visible&& visible, float* m, float* l, float* acc, float* s) {
  int64_t cnt[kDirectRows];
  const T* kr[kDirectKeys];  // this step's key rows (head 0 of the task)
  const T* vr[kDirectKeys];
  const T* hr[kDirectKeys];  // one head's rows
  const T* fk[kDirectKeys];  // the next step's key rows (head 0 of the task), fetched ahead
  const T* fv[kDirectKeys];
  const int64_t kspan = ((nh - 1) * kstride + d) * static_cast<int64_t>(sizeof(T));  // bytes of a key's rows
  const int64_t vspan = ((nh - 1) * vstride + d) * static_cast<int64_t>(sizeof(T));
  const int64_t hbytes = d * static_cast<int64_t>(sizeof(T));
  auto dots = d == 128 ? dots16<8, T> : d == 64 ? dots16<4, T> : dots16<0, T>;
  // bf16 rows of d 64 / 128 (Qwen3's): q and K as bf16 pairs (qt), q as fp32 (q) not used
  constexpr bool bf16 = std::is_same_v<T, BFloat16>;
  const bool pairs = bf16 && (d == 128 || d == 64);
  for (int64_t j0 = 0; j0 < nkeys; j0 += kDirectKeys) {
    const int64_t n = std::min(kDirectKeys, nkeys - j0);
    int64_t widest = 0;  // the most keys of this step any row sees
    for (int64_t i = 0; i < M; ++i) {
      cnt[i] = std::clamp<int64_t>(visible(i) - j0, 0, n);
      widest = std::max(widest, cnt[i]);
    }
    for (int64_t j = 0; j < widest; ++j) {
      kr[j] = static_cast<const T*>(krow(j0 + j));
      vr[j] = static_cast<const T*>(vrow(j0 + j));
    }
    // K/V rows one step ahead (kDirectKeys keys), fetched head by head inside this step's work
    // (docs/cpu.md "Decode-like blocks"): the first step's rows at once, then step j0 + 1's K rows
    // beside step j0's scores and its V rows beside step j0's P·V
    if (j0 == 0)
      for (int64_t j = 0; j < std::min(nkeys, kDirectKeys); ++j) {
        prefetch_row(krow(j), kspan);
        prefetch_row(vrow(j), vspan);
      }
    const int64_t nf = std::clamp<int64_t>(nkeys - j0 - kDirectKeys, 0, kDirectKeys);  // keys of the next step
    for (int64_t j = 0; j < nf; ++j) {
      fk[j] = static_cast<const T*>(krow(j0 + kDirectKeys + j));
      fv[j] = static_cast<const T*>(vrow(j0 + kDirectKeys + j));
    }
    // S = Q·Kᵀ, 16 keys at a time; scores of keys a row cannot see are computed and never read
    for (int64_t jb = 0; jb < widest; jb += 16) {
      const int64_t nk = std::min<int64_t>(16, widest - jb);
      for (int64_t hh = 0; hh < nh; ++hh) {
        for (int64_t j = jb; j < std::min(nf, jb + 16); ++j) prefetch_row(fk[j] + hh * kstride, hbytes);
        for (int64_t jj = 0; jj < nk; ++jj) hr[jj] = kr[jb + jj] + hh * kstride;
        for (int64_t i = 0; i < M; ++i) {
          float* si = s + (hh * M + i) * kDirectKeys + jb;
          if constexpr (bf16) {
            if (pairs) {
              const BFloat16* qi = qt + (hh * hrows + i) * d;
              d == 128 ? dots16_bf16<4>(qi, hr, nk, si) : dots16_bf16<2>(qi, hr, nk, si);
              continue;
            }
          }
          dots(q + (hh * hrows + i) * d, hr, nk, d, si);
        }
      }
    }
    for (int64_t hh = 0; hh < nh; ++hh)
      for (int64_t i = 0; i < M; ++i) {
        const int64_t row = hh * hrows + i;
        if (cnt[i] > 0)
          softmax_row_direct<std::is_same_v<T, float>>(s + (hh * M + i) * kDirectKeys, cnt[i], d, scale, m[row], l[row], acc + row * d);
      }
    // acc += P·V, four rows at a time
    for (int64_t hh = 0; hh < nh; ++hh) {
      for (int64_t j = 0; j < nf; ++j) prefetch_row(fv[j] + hh * vstride, hbytes);
      for (int64_t j = 0; j < widest; ++j) hr[j] = vr[j] + hh * vstride;
      for (int64_t i = 0; i < M; i += 4) {
        const float* p = s + (hh * M + i) * kDirectKeys;
        float* a = acc + (hh * hrows + i) * d;
        switch (std::min<int64_t>(4, M - i)) {
          case 4: axpy_rows<4, T>(p, kDirectKeys, cnt + i, widest, hr, d, a); break;
          case 3: axpy_rows<3, T>(p, kDirectKeys, cnt + i, widest, hr, d, a); break;
          case 2: axpy_rows<2, T>(p, kDirectKeys, cnt + i, widest, hr, d, a); break;
          default: axpy_rows<1, T>(p, kDirectKeys, cnt + i, widest, hr, d, a);
        }
      }
    }
  }
}
#endif

}  // namespace acr_attn
