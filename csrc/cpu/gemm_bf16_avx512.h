// bf16 tiles on AVX512_BF16 (vdpbf16ps) for the prefix-shared CPU attention (attn_tiles.h), on
// CPUs with native bf16 dot products but no AMX (AMD Zen 4/5, Intel Cooper Lake). Written when
// cpublas' bf16 brgemm was taken for an AMX-only path; it also runs there (oneDNN's AVX-512
// ukernel, ACARERANK_CPU_BF16_PATH=brgemm) and measured the same speed on a Zen 4 (docs/cpu.md),
// so these tiles stay the default for keeping no generated kernel per shape.
//
//   C[M×N] (+)= A[M×K] · B[K×N]       fp32 accumulation, C fp32
//   A  bf16 row-major, row i at A + i·lda (K even: the pairs (k, k+1) are one 32-bit lane)
//   B  bf16 in the VNNI layout the AMX path packs: (k, n) at ((k/2)·ldb + n)·2 + k%2
//
// Register blocking: MR = 6 rows × NV = 4 vectors of 16 columns = 24 fp32 accumulators, the B
// vectors of one k pair (4) and one broadcast A pair: 29 of 32 zmm registers. Per k pair, 4 loads
// of B + 6 broadcasts feed 24 vdpbf16ps (64 FLOP each). Columns are the outer loop, so one panel
// of B (K/2 pairs × 64 columns, 16 KB at K = 128) stays in L1 while every row block passes over it.
// The last vector of a panel is masked (any N); rows past M are never touched (any M).
//
// Every function carries its own target attribute: the module stays baseline x86-64 and these
// are called only where cpu_has_avx512_bf16() (run time).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ACR_HAVE_AVX512_BF16_CODE 1
#define ACR_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#endif

namespace acr_attn {

// Whether this CPU runs vdpbf16ps (and the AVX-512 subsets the tiles use).
inline bool cpu_has_avx512_bf16() {
#ifdef ACR_HAVE_AVX512_BF16_CODE
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

#ifdef ACR_HAVE_AVX512_BF16_CODE

constexpr int kMR = 6;   // rows per register block
constexpr int kNV = 4;   // 16-column vectors per register block

// One MR × (16·NV) block of C over the whole K. `last` masks the columns of the last vector.
template <int MR, int NV>
ACR_AVX512_BF16 inline void bf16_block(int64_t K2, const c10::BFloat16* A, int64_t lda, const c10::BFloat16* B,
                                       int64_t ldb, float* C, int64_t ldc, bool add_C, __mmask16 last) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mk = v == NV - 1 ? last : __mmask16(0xFFFF);
      acc[i][v] = add_C ? _mm512_maskz_loadu_ps(mk, C + i * ldc + 16 * v) : _mm512_setzero_ps();
    }
  const int32_t* b32 = reinterpret_cast<const int32_t*>(B);  // one lane = the (k, k+1) pair of a column
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512i b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mk = v == NV - 1 ? last : __mmask16(0xFFFF);
      b[v] = _mm512_maskz_loadu_epi32(mk, b32 + kp * ldb + 16 * v);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, A + i * lda + 2 * kp, sizeof(pair));
      const __m512i a = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], (__m512bh)a, (__m512bh)b[v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mk = v == NV - 1 ? last : __mmask16(0xFFFF);
      _mm512_mask_storeu_ps(C + i * ldc + 16 * v, mk, acc[i][v]);
    }
}

// The (rows, vectors) instance for a block at the edge of C.
template <int MR>
ACR_AVX512_BF16 inline void bf16_block_nv(int nv, int64_t K2, const c10::BFloat16* A, int64_t lda,
                                          const c10::BFloat16* B, int64_t ldb, float* C, int64_t ldc, bool add_C,
                                          __mmask16 last) {
  switch (nv) {
    case 1: return bf16_block<MR, 1>(K2, A, lda, B, ldb, C, ldc, add_C, last);
    case 2: return bf16_block<MR, 2>(K2, A, lda, B, ldb, C, ldc, add_C, last);
    case 3: return bf16_block<MR, 3>(K2, A, lda, B, ldb, C, ldc, add_C, last);
    default: return bf16_block<MR, 4>(K2, A, lda, B, ldb, C, ldc, add_C, last);
  }
}

// C[M×N] (+)= A[M×K] · B[K×N] as described at the top; K must be even (the caller checks).
ACR_AVX512_BF16 inline void gemm_bf16_vnni_avx512(int64_t M, int64_t N, int64_t K, const c10::BFloat16* A,
                                                  int64_t lda, const c10::BFloat16* B, int64_t ldb, float* C,
                                                  int64_t ldc, bool add_C) {
  const int64_t K2 = K / 2;
  for (int64_t n0 = 0; n0 < N; n0 += 16 * kNV) {
    const int64_t nn = std::min<int64_t>(16 * kNV, N - n0);
    const int nv = static_cast<int>((nn + 15) / 16);
    const int tail = static_cast<int>(nn - 16 * (nv - 1));
    const __mmask16 last = static_cast<__mmask16>(tail == 16 ? 0xFFFF : (1u << tail) - 1);
    const c10::BFloat16* Bn = B + n0 * 2;
    float* Cn = C + n0;
    int64_t i0 = 0;
    for (; i0 + kMR <= M; i0 += kMR) bf16_block_nv<kMR>(nv, K2, A + i0 * lda, lda, Bn, ldb, Cn + i0 * ldc, ldc, add_C, last);
    switch (M - i0) {
      case 1: bf16_block_nv<1>(nv, K2, A + i0 * lda, lda, Bn, ldb, Cn + i0 * ldc, ldc, add_C, last); break;
      case 2: bf16_block_nv<2>(nv, K2, A + i0 * lda, lda, Bn, ldb, Cn + i0 * ldc, ldc, add_C, last); break;
      case 3: bf16_block_nv<3>(nv, K2, A + i0 * lda, lda, Bn, ldb, Cn + i0 * ldc, ldc, add_C, last); break;
      case 4: bf16_block_nv<4>(nv, K2, A + i0 * lda, lda, Bn, ldb, Cn + i0 * ldc, ldc, add_C, last); break;
      case 5: bf16_block_nv<5>(nv, K2, A + i0 * lda, lda, Bn, ldb, Cn + i0 * ldc, ldc, add_C, last); break;
      default: break;
    }
  }
}

#endif  // ACR_HAVE_AVX512_BF16_CODE

}  // namespace acr_attn
