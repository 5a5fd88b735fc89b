// RMSNorm and fused residual-add + RMSNorm on CPU (docs/ARCHITECTURE.md, "Native CPU ops around
// attention"); the plain-PyTorch references are acarerank/ops/layer_norm.py's *_ref.
//
//   rms_norm_cpu(x [N, H], w [H], eps)              -> y = x / sqrt(mean(x²) + eps) · w
//   fused_add_rms_norm_cpu(x, residual (a!), w, eps) -> residual := residual + x;  y = rms_norm(residual)
//
// fp32 math inside, x/residual/w/y in the activation dtype (fp32 or bf16), one rounding per
// stored element. The sum is rounded to the dtype *before* it is normalised, so y is the norm
// of exactly the residual stream that is stored (as in transformers' Qwen3 layer, where the add
// happens in the activation dtype). Rows are split over at::parallel_for (torch's OpenMP pool).
#include <torch/library.h>

#include <cmath>

#include "vec_io.h"

namespace acarerank_cpu {
namespace {

void check_norm_args(const char* op, const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": expects CPU tensors, got ", x.device(), " and ",
              w.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": activations must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), op, ": weight dtype ", w.scalar_type(),
              " differs from the activations' ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": input must have a non-empty last dim, got shape ", x.sizes());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), op, ": weight must be [", x.size(-1), "], got ", w.sizes());
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), op, ": input and weight must be contiguous (input strides ",
              x.strides(), "); call .contiguous() first");
}

// y = src / sqrt(mean(src²) + eps) · w for one row of H elements.
template <typename T>
inline void norm_row(const T* src, const T* w, T* y, int64_t H, float eps) {
  fVec acc(0.f);
  for (int64_t i = 0; i < H; i += kLanes) {
    const int64_t n = lanes_left(i, H);
    fVec v = load_f32(src + i, n);
    acc = at::vec::fmadd(v, v, acc);
  }
  const float scale = 1.f / std::sqrt(at::vec::vec_reduce_all<float>(std::plus<fVec>(), acc) / H + eps);
  const fVec s(scale);
  for (int64_t i = 0; i < H; i += kLanes) {
    const int64_t n = lanes_left(i, H);
    store_f32(y + i, load_f32(src + i, n) * s * load_f32(w + i, n), n);
  }
}

template <typename T>
void rms_norm_kernel(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, double eps) {
  const int64_t H = x.size(-1), rows = x.numel() / H;
  const T* xp = x.const_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  T* yp = y.mutable_data_ptr<T>();
  at::parallel_for(0, rows, row_grain(H), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * H, wp, yp + r * H, H, static_cast<float>(eps));
  });
}

template <typename T>
void fused_add_rms_norm_kernel(const at::Tensor& x, at::Tensor& res, const at::Tensor& w, at::Tensor& y,
                               double eps) {
  const int64_t H = x.size(-1), rows = x.numel() / H;
  const T* xp = x.const_data_ptr<T>();
  T* rp = res.mutable_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  T* yp = y.mutable_data_ptr<T>();
  at::parallel_for(0, rows, row_grain(H), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* rr = rp + r * H;
      const T* xr = xp + r * H;
      for (int64_t i = 0; i < H; i += kLanes) {  // the row is back in L1 for norm_row's two passes
        const int64_t n = lanes_left(i, H);
        store_f32(rr + i, load_f32(rr + i, n) + load_f32(xr + i, n), n);
      }
      norm_row(rr, wp, yp + r * H, H, static_cast<float>(eps));
    }
  });
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm_args("rms_norm_cpu", x, w);
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() == 0) return y;
  if (x.scalar_type() == at::kFloat) rms_norm_kernel<float>(x, w, y, eps);
  else rms_norm_kernel<at::BFloat16>(x, w, y, eps);
  return y;
}

at::Tensor fused_add_rms_norm_cpu(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  check_norm_args("fused_add_rms_norm_cpu", x, w);
  TORCH_CHECK(residual.sizes() == x.sizes(), "fused_add_rms_norm_cpu: residual shape ", residual.sizes(),
              " differs from the input's ", x.sizes());
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "fused_add_rms_norm_cpu: residual dtype ",
              residual.scalar_type(), " differs from the input's ", x.scalar_type());
  TORCH_CHECK(residual.is_contiguous(), "fused_add_rms_norm_cpu: residual must be contiguous (it is updated in place)");
  TORCH_CHECK(!residual.is_same(x) && residual.data_ptr() != x.data_ptr(),
              "fused_add_rms_norm_cpu: residual and input must not share memory");
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() == 0) return y;
  if (x.scalar_type() == at::kFloat) fused_add_rms_norm_kernel<float>(x, residual, w, y, eps);
  else fused_add_rms_norm_kernel<at::BFloat16>(x, residual, w, y, eps);
  return y;
}

}  // namespace
}  // namespace acarerank_cpu

TORCH_LIBRARY_FRAGMENT(acarerank, m) {
  m.def("rms_norm_cpu(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm_cpu(Tensor input, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(acarerank, CPU, m) {
  m.impl("rms_norm_cpu", &acarerank_cpu::rms_norm_cpu);
  m.impl("fused_add_rms_norm_cpu", &acarerank_cpu::fused_add_rms_norm_cpu);
}
