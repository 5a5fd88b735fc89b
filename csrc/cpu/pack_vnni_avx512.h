// VNNI packing of one bf16 key tile with AVX-512, for pack_kv_tile (attn_tiles.h) on the bf16
// paths. The layouts are the ones the scalar loops there write:
//   K as B[d][KT]:  the 32-bit pair (kk, kk+1) of key j at lane (kk/2)·KT + j — the transpose of
//                   the [n][d/2] matrix of pairs, done 16 keys × 16 pairs at a time in registers
//   V as B[KT][d]:  (j, c) at ((j/2)·d + c)·2 + j%2 — rows j and j+1 interleaved, 32 columns at a time
// Written: K columns [0, n rounded up to 16) (zeros past n), V rows [0, n rounded up to 2) (zeros
// past n); the caller zeroes the rest up to gemm_cols. Returns whether every V value is finite
// (bf16: exponent bits not all ones).
#pragma once

#include "gemm_bf16_avx512.h"

#ifdef ACR_HAVE_AVX512_BF16_CODE

namespace acr_attn {

// r[i][j] <- r[j][i] for a 16×16 matrix of 32-bit lanes: interleave 32-bit then 64-bit halves inside
// each 128-bit lane (4×4 blocks transposed in place), then a 4×4 transpose of the 128-bit lanes.
ACR_AVX512_BF16 inline void transpose_16x16_epi32(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // u[4k+m], lane L: column 4L+m of rows 4k..4k+3
    u[4 * k + 0] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // row 4L+m = lane L of u[m], u[4+m], u[8+m], u[12+m]
    const __m512i v0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88);      // u[m].L0 L2, u[4+m].L0 L2
    const __m512i v1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xDD);      // u[m].L1 L3, u[4+m].L1 L3
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xDD);
    r[m] = _mm512_shuffle_i32x4(v0, v2, 0x88);       // lane 0 of each
    r[4 + m] = _mm512_shuffle_i32x4(v1, v3, 0x88);   // lane 1
    r[8 + m] = _mm512_shuffle_i32x4(v0, v2, 0xDD);   // lane 2
    r[12 + m] = _mm512_shuffle_i32x4(v1, v3, 0xDD);  // lane 3
  }
}

inline __mmask32 low_bits32(int64_t w) { return w >= 32 ? ~__mmask32(0) : (__mmask32(1) << w) - 1; }
inline __mmask16 low_bits16(int64_t w) { return w >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << w) - 1); }

// The K layout alone: row(j)'s d bf16 values (d even, n <= KT, KT a multiple of 16) as the columns
// j of B[d][KT] (pair p of row j at 32-bit lane p·KT + j). Also the weight panels of the logits
// GEMM (logits_gemm.cpp), whose weight rows are its columns as keys are here.
template <typename Row>
ACR_AVX512_BF16 inline void pack_pair_columns_avx512(Row&& krow, int64_t n, int64_t KT, int64_t d, c10::BFloat16* kt) {
  const int64_t d2 = d / 2;
  uint32_t* k32 = reinterpret_cast<uint32_t*>(kt);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nj = std::min<int64_t>(16, n - j0);
    for (int64_t p0 = 0; p0 < d2; p0 += 16) {
      const __mmask16 pm = low_bits16(d2 - p0);
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i)
        r[i] = i < nj ? _mm512_maskz_loadu_epi32(pm, reinterpret_cast<const uint32_t*>(krow(j0 + i)) + p0)
                      : _mm512_setzero_si512();
      transpose_16x16_epi32(r);
      for (int64_t i = 0, np = std::min<int64_t>(16, d2 - p0); i < np; ++i)
        _mm512_storeu_si512(k32 + (p0 + i) * KT + j0, r[i]);
    }
  }
}

// krow(j) / vrow(j): key j's d bf16 values (d even, n <= KT, KT a multiple of 16).
template <typename KRow, typename VRow>
ACR_AVX512_BF16 inline bool pack_kv_rows_vnni_avx512(KRow&& krow, VRow&& vrow, int64_t n, int64_t KT, int64_t d,
                                                     c10::BFloat16* kt, c10::BFloat16* vt) {
  pack_pair_columns_avx512(krow, n, KT, d, kt);
  // V: pairs of rows; lo takes columns c0..c0+15 of both rows, hi c0+16..c0+31, as (row j, row j+1)
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 16; ++i) {
    lo_idx[2 * i] = i, lo_idx[2 * i + 1] = 32 + i;
    hi_idx[2 * i] = 16 + i, hi_idx[2 * i + 1] = 48 + i;
  }
  const __m512i vlo = _mm512_load_si512(lo_idx), vhi = _mm512_load_si512(hi_idx);
  const __m512i exp_bits = _mm512_set1_epi16(0x7F80);
  __mmask32 bad = 0;
  uint16_t* v16 = reinterpret_cast<uint16_t*>(vt);
  for (int64_t j = 0; j < n; j += 2) {
    const uint16_t* a_row = reinterpret_cast<const uint16_t*>(vrow(j));
    const uint16_t* b_row = j + 1 < n ? reinterpret_cast<const uint16_t*>(vrow(j + 1)) : nullptr;
    uint16_t* dst = v16 + (j >> 1) * d * 2;
    for (int64_t c0 = 0; c0 < d; c0 += 32) {
      const int64_t w = std::min<int64_t>(32, d - c0);
      const __mmask32 m = low_bits32(w);
      const __m512i a = _mm512_maskz_loadu_epi16(m, a_row + c0);
      const __m512i b = b_row ? _mm512_maskz_loadu_epi16(m, b_row + c0) : _mm512_setzero_si512();
      bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(a, exp_bits), exp_bits) |
             _mm512_cmpeq_epi16_mask(_mm512_and_si512(b, exp_bits), exp_bits);
      _mm512_mask_storeu_epi16(dst + c0 * 2, low_bits32(2 * w), _mm512_permutex2var_epi16(a, vlo, b));
      if (w > 16) _mm512_mask_storeu_epi16(dst + c0 * 2 + 32, low_bits32(2 * (w - 16)), _mm512_permutex2var_epi16(a, vhi, b));
    }
  }
  return bad == 0;
}

}  // namespace acr_attn

#endif  // ACR_HAVE_AVX512_BF16_CODE
