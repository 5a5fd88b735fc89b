// Tile helpers of the prefix-shared CPU attention kernel (prefix_attention.cpp): the two GEMM
// shapes through at::native::cpublas::brgemm, key/value packing, and one online-softmax step.
//
// Two compute types (docs/ARCHITECTURE.md, "Native CPU kernels"):
//   float      fp32 inputs, and bf16/fp16 inputs on a CPU where cpublas cannot pack bf16 (no
//              AMX): q/K/V tiles are converted to fp32 when they are packed, one tile at a time
//              (never the whole K/V), the GEMMs run cpublas' fp32 brgemm (MKL/oneDNN underneath).
//   BFloat16   bf16 inputs where cpublas::could_pack(kBFloat16): brgemm on VNNI-packed B
//              (oneDNN ukernels, AMX tiles), fp32 accumulation; P rounded to bf16 for P·V.
//
// Layouts (compute type c_t, KT keys per tile, d head_dim):
//   Q tile  [M][d]       row i = (token, query head of this kv head), token-major
//   K tile  as the B of S = Q·Kᵀ: float [d][KT];  bf16 VNNI [d/2][KT][2]
//   V tile  as the B of O = P·V:  float [KT][d];  bf16 VNNI [KT/2][d][2]
//   S       [M][KT] fp32 scores;  P [M][KT] c_t;  acc [M][d] fp32
// Key columns past the tile's valid count are zero in K and V: P is zero there too, and zero
// padding (never uninitialised memory) keeps NaN·0 out of the sums.
#pragma once

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace acr_attn {

using at::BFloat16;

// -- GEMMs: C[M×N] (+)= A[M×K] · B[K×N]
inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                 float* C, int64_t ldc, bool add_C) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_C, A, B, C, /*is_vnni=*/false);
}
inline void gemm(int64_t M, int64_t N, int64_t K, const BFloat16* A, int64_t lda, const BFloat16* B, int64_t ldb,
                 float* C, int64_t ldc, bool add_C) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_C, A, B, C, /*is_vnni=*/true);
}
template <typename c_t>
inline void gemm_release() {
  at::native::cpublas::brgemm_release(/*is_vnni=*/std::is_same_v<c_t, BFloat16>);
}

template <typename c_t>
constexpr bool kVnni = std::is_same_v<c_t, BFloat16>;

// Key columns a GEMM over a tile of n valid keys computes: n in fp32; in bf16 rounded up to 32
// (VNNI pairs keys, and few distinct shapes keep oneDNN's kernel cache small), at most kt.
template <typename c_t>
inline int64_t gemm_cols(int64_t n, int64_t kt) {
  return kVnni<c_t> ? std::min<int64_t>(kt, (n + 31) / 32 * 32) : n;
}

// -- packing one key tile of one kv head: rows[j] points at key j's d values (n valid keys, n <= KT)
// Returns whether every packed V value is finite (the caller's causal tiles need to know: a masked
// non-finite value times a zero weight would still give NaN).
template <typename s_t, typename c_t, typename KRow, typename VRow>
bool pack_kv_tile(KRow&& krow, VRow&& vrow, int64_t n, int64_t KT, int64_t d, c_t* kt, c_t* vt) {
  bool finite = true;
  if constexpr (kVnni<c_t>) {
    // K as B[d][KT] in VNNI: element (kk, j) at ((kk/2)*KT + j)*2 + kk%2;  V as B[KT][d]: (j, c) at ((j/2)*d + c)*2 + j%2
    std::memset(static_cast<void*>(kt), 0, sizeof(c_t) * d * KT);
    std::memset(static_cast<void*>(vt), 0, sizeof(c_t) * KT * d);
    for (int64_t j = 0; j < n; ++j) {
      const s_t* kr = krow(j);
      const s_t* vr = vrow(j);
      for (int64_t kk = 0; kk < d; ++kk) kt[((kk >> 1) * KT + j) * 2 + (kk & 1)] = static_cast<c_t>(kr[kk]);
      c_t* vdst = vt + (j >> 1) * d * 2 + (j & 1);
      for (int64_t c = 0; c < d; ++c) {
        vdst[c * 2] = static_cast<c_t>(vr[c]);
        finite &= std::isfinite(static_cast<float>(vr[c]));
      }
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const s_t* kr = krow(j);
      const s_t* vr = vrow(j);
      for (int64_t kk = 0; kk < d; ++kk) kt[kk * KT + j] = static_cast<c_t>(kr[kk]);
      c_t* vdst = vt + j * d;
      for (int64_t c = 0; c < d; ++c) {
        vdst[c] = static_cast<c_t>(vr[c]);
        finite &= std::isfinite(static_cast<float>(vdst[c]));
      }
    }
    for (int64_t kk = 0; kk < d; ++kk)
      for (int64_t j = n; j < KT; ++j) kt[kk * KT + j] = c_t(0);
    std::memset(static_cast<void*>(vt + n * d), 0, sizeof(c_t) * (KT - n) * d);
  }
  return finite;
}

// -- one online-softmax step for rows [0, M) of a tile (FlashAttention-2, Alg. 1), raw scores S:
//   m' = max(m, max_{j<cnt_i} S_ij);  p_ij = exp(scale·(S_ij − m')) for j < cnt_i, else 0
//   l' = e^{scale·(m − m')}·l + Σ_j p_ij;   acc' = e^{scale·(m − m')}·acc   (P·V is added by the caller)
// cnt(i) is row i's number of visible key columns in this tile (all of them on the prefix, the
// causal count on the diagonal); a row with cnt 0 is left as it is. A NaN score (a NaN in q)
// is never the max (`>`), so m' stays −inf on an all-NaN row and every later value is NaN: the
// row comes out NaN, as plain softmax gives.
template <typename c_t, typename CntFn>
void softmax_step(int64_t M, int64_t KT, int64_t d, float scale, const float* S, CntFn&& cnt, float* m, float* l,
                  float* acc, c_t* P) {
  for (int64_t i = 0; i < M; ++i) {
    const int64_t n = cnt(i);
    const float* s = S + i * KT;
    c_t* p = P + i * KT;
    if (n <= 0) {
      std::memset(static_cast<void*>(p), 0, sizeof(c_t) * KT);
      continue;
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
    const float m_new = m[i] > mx ? m[i] : mx;
    const float alpha = std::exp(scale * (m[i] - m_new));  // 0 at the first visible tile (m = −inf)
    const float off = scale * m_new;
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      const float e = std::exp(scale * s[j] - off);
      sum += e;
      p[j] = static_cast<c_t>(e);
    }
    for (int64_t j = n; j < KT; ++j) p[j] = c_t(0);
    l[i] = l[i] * alpha + sum;
    m[i] = m_new;
    if (alpha != 1.f) {
      float* a = acc + i * d;
      for (int64_t c = 0; c < d; ++c) a[c] *= alpha;
    }
  }
}

}  // namespace acr_attn
