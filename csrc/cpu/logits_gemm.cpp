// The bf16 logits GEMM of the top-k log-prob ops (docs/ARCHITECTURE.md, "Top-k stack"): fp32
// logits from bf16 hidden states and lm_head rows, which torch cannot give on a CPU (its bf16 mm
// rounds the output to bf16; mm's out_dtype is CUDA-only), so the ops upcast each weight chunk
// and ran an fp32 GEMM: 4.6× the time of the bf16 GEMM on an AVX512_BF16 CPU (docs/benchmarks.md).
//
//   acarerank::mm_bf16_f32(Tensor a, Tensor b, Tensor(a!) out) -> ()
//     out[M×N] = a[M×K] · b[N×K]ᵀ     a, b bf16 with contiguous rows, K even; out fp32 contiguous
//
// Exact bf16 products (they fit fp32) summed in fp32 — by vdpbf16ps, two products per step, on the
// AVX-512 tiles (which flush bf16 subnormal inputs and fp32 subnormal results, |x| < 1.2e-38, to
// zero), by oneDNN's brgemm on AMX — so the sum order differs from an fp32 GEMM's. Only on CPUs
// with AVX512_BF16; the ops call it where _cpu.bf16_logits_gemm() (acarerank/ops/_logits_gemm.py).
//
// b's rows are the GEMM's columns: a task packs a panel of kPanel of them into the VNNI layout
// (pack_pair_columns_avx512) once and runs the attention's bf16 tile GEMM (attn_tiles.h's gemm:
// cpublas::brgemm on AMX, or when ACARERANK_CPU_BF16_PATH=brgemm; else the avx512-bf16 tiles of
// gemm_bf16_avx512.h) over every row of a, kKBlock values of K at a time, so the panel's slice
// of the k loop stays in L1. brgemm's kernels are keyed by shape: M is cut into powers of two,
// N is 64 but for a chunk's last panel and K 256 but for H's remainder, so a model brings few.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <memory>

#include "attn_tiles.h"
#include "common.h"
#include "pack_vnni_avx512.h"

namespace acarerank_cpu {
namespace {

constexpr int64_t kPanel = 64;    // columns per task: one register block's width (gemm_bf16_avx512.h)
constexpr int64_t kKBlock = 256;  // K per sweep over a's rows: 128 pairs × 64 columns × 4 B = 32 KB of B

void mm_bf16_f32(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  constexpr const char* op = "mm_bf16_f32";
  ACR_CHECK_CPU(op, a, "a");
  ACR_CHECK_CPU(op, b, "b");
  ACR_CHECK_CPU(op, out, "out");
  ACR_CHECK_DTYPE(op, a, "a", at::kBFloat16);
  ACR_CHECK_DTYPE(op, b, "b", at::kBFloat16);
  ACR_CHECK_DTYPE(op, out, "out", at::kFloat);
  ACR_CHECK_DIM(op, a, "a", 2);
  ACR_CHECK_DIM(op, b, "b", 2);
  ACR_CHECK_DIM(op, out, "out", 2);
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  TORCH_CHECK(b.size(1) == K, op, ": a is [M, K] and b [N, K] with the same K, got a ", a.sizes(), " and b ", b.sizes());
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, op, ": out must be [", M, ", ", N, "], got ", out.sizes());
  TORCH_CHECK(K % 2 == 0, op, ": K must be even (vdpbf16ps takes K in pairs), got ", K);
  TORCH_CHECK((M == 0 || a.stride(1) == 1) && (N == 0 || b.stride(1) == 1),
              op, ": a's and b's rows must be contiguous, got strides ", a.strides(), " and ", b.strides());
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous, got strides ", out.strides());
  TORCH_CHECK(acr_attn::cpu_has_avx512_bf16(), op, ": this CPU has no AVX512_BF16 (acarerank/ops/_logits_gemm.py "
              "upcasts to an fp32 GEMM there)");
  acr_attn::bf16_path();  // chosen once per process; an ACARERANK_CPU_BF16_PATH this CPU cannot take is named here
  if (M == 0 || N == 0) return;
  if (K == 0) {
    out.zero_();
    return;
  }
#ifdef ACR_HAVE_AVX512_BF16_CODE
  const auto* A = a.const_data_ptr<c10::BFloat16>();
  const auto* B = b.const_data_ptr<c10::BFloat16>();
  float* C = out.data_ptr<float>();
  const int64_t lda = a.stride(0), ldb = b.stride(0), panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    acr_attn::GemmReleaseAtExit<c10::BFloat16> release;  // brgemm's per-thread tile state (AMX), as the attention's
    // the whole panel, [K/2 pairs][kPanel columns][2]: 128 KB at K = 1,024, in L2
    std::unique_ptr<c10::BFloat16[]> packed(new c10::BFloat16[K * kPanel]);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel, nn = std::min(kPanel, N - n0);
      acr_attn::pack_pair_columns_avx512([&](int64_t j) { return B + (n0 + j) * ldb; }, nn, kPanel, K, packed.get());
      for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
        const int64_t kk = std::min(kKBlock, K - k0);  // even: K and kKBlock are
        acr_attn::gemm(M, nn, kk, A + k0, lda, packed.get() + k0 * kPanel, kPanel, C + n0, N, /*add_C=*/k0 > 0);
      }
    }
    release.now();
  });
#endif
}

}  // namespace
}  // namespace acarerank_cpu

TORCH_LIBRARY_FRAGMENT(acarerank, m) { m.def("mm_bf16_f32(Tensor a, Tensor b, Tensor(a!) out) -> ()"); }

TORCH_LIBRARY_IMPL(acarerank, CPU, m) { m.impl("mm_bf16_f32", &acarerank_cpu::mm_bf16_f32); }
