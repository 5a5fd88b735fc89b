// Decode-like row blocks of the prefix-shared CPU attention (prefix_attention.cpp), computed
// straight from the K/V rows where they lie (pages or inputs), with no packed tile.
//
// A row block of a few rows — a one-token segment per group, as every step of setwise decoding
// sends: r rows (the query heads of one kv head) against P prefix keys — does r·P·d·4 FLOP on
// 2·P·d values of K and V: a GEMV, bound by reading K/V once. The tile path packs both first
// (one more read and a write of each, for a GEMM of r rows), so there it spends ~2× the memory
// traffic of the work itself. Here each key row is converted to fp32 once (L1) and dotted with
// every row's q; the same online softmax follows per block of kKeys keys, in fp32 (P is not
// rounded to bf16: a more exact weight than the tile path's), and acc_i += p_ij · v_j per key.
//
//   s_ij = q_i · k_j        (j visible to row i: the whole prefix, own keys a_s .. t_i)
//   m_i' = max(m_i, max_j s_ij);  p_ij = exp(scale·(s_ij − m_i'));  l_i' = l_i·α + Σ_j p_ij;
//   acc_i' = acc_i·α + Σ_j p_ij · v_j,   α = exp(scale·(m_i − m_i'))
//
// A NaN score loses the max and makes p, l and the row's output NaN, as on the tile path; keys a
// row cannot see are never read for it. AVX-512 code (ACR_AVX512_BF16: the exp is
// attn_tiles.h's exp2_avx512), called only where bf16_avx512().
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "attn_tiles.h"

namespace acr_attn {

constexpr int64_t kDirectRows = 16;  // row blocks of at most this many rows take this path
constexpr int64_t kDirectKeys = 64;  // keys per softmax step: S and P of kDirectRows × kDirectKeys

#ifdef ACR_HAVE_AVX512_BF16_CODE
ACR_AVX512_BF16 inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// Rows kAhead keys ahead are fetched while this one is used: key rows lie in scattered pages (a
// page boundary every block_size keys), where the hardware prefetcher loses the stream.
constexpr int64_t kAhead = 8;
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b);
}

// d values of a key/value row as fp32: bf16 widened into buf (the low 16 bits zero), fp32 as it is.
ACR_AVX512_BF16 inline const float* row_f32(const BFloat16* x, int64_t d, float* buf) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(x);
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 mk = tail_mask(d - c);
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, u + c));
    _mm512_mask_storeu_ps(buf + c, mk, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
  return buf;
}
ACR_AVX512_BF16 inline const float* row_f32(const float* x, int64_t, float*) { return x; }

ACR_AVX512_BF16 inline float dot_f32(const float* a, const float* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 mk = tail_mask(d - c);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, a + c), _mm512_maskz_loadu_ps(mk, b + c), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// acc[0, d) += p · v[0, d)
ACR_AVX512_BF16 inline void axpy_f32(float p, const float* v, float* acc, int64_t d) {
  const __m512 vp = _mm512_set1_ps(p);
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 mk = tail_mask(d - c);
    const __m512 a = _mm512_maskz_loadu_ps(mk, acc + c);
    _mm512_mask_storeu_ps(acc + c, mk, _mm512_fmadd_ps(vp, _mm512_maskz_loadu_ps(mk, v + c), a));
  }
}

// One softmax step of a row over its n >= 1 visible scores s[0, n): s is overwritten by p.
ACR_AVX512_BF16 inline void softmax_row_direct(float* s, int64_t n, int64_t d, float scale, float& m, float& l,
                                               float* acc) {
  const RowMax rm = row_max_avx512(s, n, scale, m);
  const float m_new = rm.m_new, alpha = rm.alpha;
  const __m512 vs = rm.vs, voff = rm.voff;
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mk = tail_mask(n - j);
    const __m512 p = _mm512_maskz_mov_ps(mk, exp2_avx512(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(mk, s + j), vs, voff)));
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

// Rows [0, M) (M <= kDirectRows; q fp32, row i at q + i·d) against keys [0, nkeys): key j's rows
// at krow(j) / vrow(j) (d values each), row i seeing keys [0, visible(i)). Continues each row's
// running (m, l, acc). kf: d floats of scratch; s: kDirectRows × kDirectKeys floats.
template <typename T, typename KRow, typename VRow, typename Visible>
ACR_AVX512_BF16 void direct_keys(const float* q, int64_t M, int64_t d, float scale, int64_t nkeys, KRow&& krow,
                                 VRow&& vrow, Visible&& visible, float* m, float* l, float* acc, float* kf,
                                 float* s) {
  int64_t cnt[kDirectRows];
  for (int64_t j0 = 0; j0 < nkeys; j0 += kDirectKeys) {
    const int64_t n = std::min(kDirectKeys, nkeys - j0);
    int64_t widest = 0;  // the most keys of this step any row sees
    for (int64_t i = 0; i < M; ++i) {
      cnt[i] = std::clamp<int64_t>(visible(i) - j0, 0, n);
      widest = std::max(widest, cnt[i]);
    }
    for (int64_t j = 0; j < widest; ++j) {
      if (j + kAhead < widest) prefetch_row(krow(j0 + j + kAhead), d * sizeof(T));
      const float* k = row_f32(static_cast<const T*>(krow(j0 + j)), d, kf);
      for (int64_t i = 0; i < M; ++i)
        if (j < cnt[i]) s[i * kDirectKeys + j] = dot_f32(q + i * d, k, d);
    }
    for (int64_t i = 0; i < M; ++i)
      if (cnt[i] > 0) softmax_row_direct(s + i * kDirectKeys, cnt[i], d, scale, m[i], l[i], acc + i * d);
    for (int64_t j = 0; j < widest; ++j) {
      if (j + kAhead < widest) prefetch_row(vrow(j0 + j + kAhead), d * sizeof(T));
      const float* v = row_f32(static_cast<const T*>(vrow(j0 + j)), d, kf);
      for (int64_t i = 0; i < M; ++i)
        if (j < cnt[i]) axpy_f32(s[i * kDirectKeys + j], v, acc + i * d, d);
    }
  }
}
#endif

}  // namespace acr_attn
