// SiLU(gate)·up over the fused gate_up projection output (docs/ARCHITECTURE.md, "Native CPU ops
// around attention"); the reference is acarerank/ops/silu_and_mul.py's silu_and_mul_ref.
//
//   x [N, 2·I] = [gate | up] -> y [N, I],  y = gate / (1 + exp(−gate)) · up
//
// fp32 math inside, one rounding per stored element, in/out in the activation dtype.
#include <torch/library.h>

#include "vec_io.h"

namespace acarerank_cpu {
namespace {

template <typename T>
void silu_and_mul_kernel(const at::Tensor& x, at::Tensor& y) {
  const int64_t I = y.size(-1), rows = y.numel() / I;
  const T* xp = x.const_data_ptr<T>();
  T* yp = y.mutable_data_ptr<T>();
  const fVec one(1.f);
  at::parallel_for(0, rows, row_grain(2 * I), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = xp + r * 2 * I;
      const T* u = g + I;
      T* out = yp + r * I;
      for (int64_t i = 0; i < I; i += kLanes) {
        const int64_t n = lanes_left(i, I);
        const fVec gv = load_f32(g + i, n);
        store_f32(out + i, gv / (one + gv.neg().exp()) * load_f32(u + i, n), n);
      }
    }
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
  if (x.scalar_type() == at::kFloat) silu_and_mul_kernel<float>(x, y);
  else silu_and_mul_kernel<at::BFloat16>(x, y);
  return y;
}

}  // namespace
}  // namespace acarerank_cpu

TORCH_LIBRARY_FRAGMENT(acarerank, m) { m.def("silu_and_mul_cpu(Tensor input) -> Tensor"); }

TORCH_LIBRARY_IMPL(acarerank, CPU, m) { m.impl("silu_and_mul_cpu", &acarerank_cpu::silu_and_mul_cpu); }
