// acarerank::gate_up_amx — the MLP's gate/up projection on AMX tiles (amx_gemm.h), SiLU·up in its
// epilogue (docs/ARCHITECTURE.md, "Native CPU kernels"); the reference is acarerank/ops/gate_up_silu.py's
// gate_up_silu_ref.
//
//   silu true:   y [M, I]  = SiLU(x·W_gᵀ) · (x·W_uᵀ),   SiLU(g) = g / (1 + exp(−g))
//   silu false:  y [M, 2I] = x·[W_g; W_u]ᵀ              (the plain linear layer, [gate | up])
//
// The weight [2I, K] = [W_g; W_u] packed with gate and up interleaved (ops/amx_weights.py's
// pack_gate_up): block b's tile columns 0–15 are gate rows 16b .. 16b + 15, columns 16–31 the up
// rows I + 16b .. — so one 2×2 tile block holds the gate and the up sums of the same 32 rows and
// 16 outputs, and the epilogue reads both from L1: [M, I] is written instead of [M, 2I], and no
// silu_and_mul pass reads it back. fp32 sums, one rounding to bf16 per output (RNE); the SiLU's exp
// is exp2_avx512 (relative error < 3e-6).
#include <torch/library.h>

#include "amx_gemm.h"

namespace acarerank_cpu {
namespace {

using at::BFloat16;

constexpr const char* kOp = "gate_up_amx";

#ifdef ACR_HAVE_AMX_CODE
struct GateUpEpilogue {
  BFloat16* y;
  int64_t I;
  bool silu;

  // packed columns [col0, col1): 32-column blocks b = col / 32 of 16 gate and 16 up sums
  ACR_AMX void operator()(const float* c, int64_t ldc, int64_t rows, int64_t r0, int64_t col0, int64_t col1) const {
    const __m512 neg_log2e = _mm512_set1_ps(-1.44269504088896341f), one = _mm512_set1_ps(1.f);
    for (int64_t i = 0; i < rows; ++i) {
      const float* ci = c + i * ldc;
      for (int64_t j = 0; j < col1 - col0; j += 32) {
        const int64_t out = (col0 + j) / 2;  // block b's first output: 16b
        const __m512 g = _mm512_loadu_ps(ci + j), u = _mm512_loadu_ps(ci + j + 16);
        if (silu) {
          const __m512 e = acr_attn::exp2_avx512(_mm512_mul_ps(g, neg_log2e));  // exp(−g)
          const __m512 v = _mm512_div_ps(_mm512_mul_ps(g, u), _mm512_add_ps(one, e));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (r0 + i) * I + out), (__m256i)_mm512_cvtneps_pbh(v));
        } else {
          BFloat16* row = y + (r0 + i) * 2 * I + out;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), (__m256i)_mm512_cvtneps_pbh(g));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + I), (__m256i)_mm512_cvtneps_pbh(u));
        }
      }
    }
  }
};
#endif

at::Tensor gate_up_amx(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate, bool silu) {
  const int64_t I = intermediate;
  TORCH_CHECK(I > 0 && I % 16 == 0, kOp, ": intermediate size must be a positive multiple of 16, got ", I);
  const acr_amx_gemm::Gemm g = acr_amx_gemm::checked_gemm(kOp, x, packed, 2 * I);
  at::Tensor y = at::empty({g.M, silu ? I : 2 * I}, x.options());
#ifdef ACR_HAVE_AMX_CODE
  if (g.M > 0) acr_amx_gemm::run(g, GateUpEpilogue{y.mutable_data_ptr<BFloat16>(), I, silu});
#endif
  return y;
}

}  // namespace
}  // namespace acarerank_cpu

TORCH_LIBRARY_FRAGMENT(acarerank, m) {
  m.def("gate_up_amx(Tensor input, Tensor packed, int intermediate, bool silu) -> Tensor");
}

TORCH_LIBRARY_IMPL(acarerank, CPU, m) { m.impl("gate_up_amx", &acarerank_cpu::gate_up_amx); }
