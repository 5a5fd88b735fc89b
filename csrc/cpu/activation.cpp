// SiLU(gate)·up over the fused gate_up projection output (docs/ARCHITECTURE.md, "Native CPU ops
// around attention"); the reference is acarerank/ops/silu_and_mul.py's silu_and_mul_ref.
//
//   x [N, 2·I] = [gate | up] -> y [N, I],  y = gate / (1 + exp(−gate)) · up
//
// fp32 math inside (exp from layer_kernels_impl.h, within 2 ulp), one rounding per stored element,
// in/out in the activation dtype; rows split over at::parallel_for.
#include <torch/library.h>

#include "layer_glue.h"

namespace acarerank_cpu {
namespace {

template <typename T, typename K>
void silu_and_mul_kernel(const at::Tensor& x, at::Tensor& y) {
  const int64_t I = y.size(-1), rows = y.numel() / I;
  const K* xp = reinterpret_cast<const K*>(x.const_data_ptr<T>());
  K* yp = reinterpret_cast<K*>(y.mutable_data_ptr<T>());
  const acr_layer::Isa isa = checked_layer_isa();
  at::parallel_for(0, rows, row_grain(2 * I), [&](int64_t r0, int64_t r1) {
    ACR_LAYER_KERNEL(isa, silu_and_mul_rows, xp + r0 * 2 * I, yp + r0 * I, r1 - r0, I);
  });
}

at::Tensor silu_and_mul_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "silu_and_mul_cpu: expects a CPU tensor, got one on ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "silu_and_mul_cpu: input must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_and_mul_cpu: the last dim holds [gate | up] and must be "
              "even, got shape ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), "silu_and_mul_cpu: input must be contiguous (got strides ", x.strides(),
              "); call .contiguous() first");
  auto shape = x.sizes().vec();
  shape.back() /= 2;
  auto y = at::empty(shape, x.options());
  if (y.numel() == 0) return y;
  if (x.scalar_type() == at::kFloat) silu_and_mul_kernel<float, float>(x, y);
  else silu_and_mul_kernel<at::BFloat16, uint16_t>(x, y);
  return y;
}

}  // namespace
}  // namespace acarerank_cpu

TORCH_LIBRARY_FRAGMENT(acarerank, m) { m.def("silu_and_mul_cpu(Tensor input) -> Tensor"); }

TORCH_LIBRARY_IMPL(acarerank, CPU, m) { m.impl("silu_and_mul_cpu", &acarerank_cpu::silu_and_mul_cpu); }
