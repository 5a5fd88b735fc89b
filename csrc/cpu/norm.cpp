// RMSNorm and fused residual-add + RMSNorm on CPU (docs/ARCHITECTURE.md, "Native CPU ops around
// attention"); the plain-PyTorch references are acarerank/ops/rms_norm.py's *_ref.
//
//   rms_norm_cpu(x [N, H], w [H], eps)              -> y = x / sqrt(mean(x²) + eps) · w
//   fused_add_rms_norm_cpu(x, residual (a!), w, eps) -> residual := residual + x;  y = rms_norm(residual)
//
// fp32 math inside, x/residual/w/y in the activation dtype (fp32 or bf16), one rounding per
// stored element. The sum is rounded to the dtype *before* it is normalised, so y is the norm
// of exactly the residual stream that is stored (as in transformers' Qwen3 layer, where the add
// happens in the activation dtype). Rows are split over at::parallel_for (torch's OpenMP pool); the
// row kernels are layer_kernels.h's (AVX-512, AVX2 or baseline build, chosen at run time).
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include "layer_glue.h"

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

template <typename T, typename K>
const K* bits(const at::Tensor& t) {
  return reinterpret_cast<const K*>(t.const_data_ptr<T>());
}
template <typename T, typename K>
K* mbits(at::Tensor& t) {
  return reinterpret_cast<K*>(t.mutable_data_ptr<T>());
}

// the kernels take bf16 as its uint16_t bits (layer_kernels.h)
template <typename T, typename K>
void rms_norm_kernel(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, double eps) {
  const int64_t H = x.size(-1), rows = x.numel() / H;
  const K* xp = bits<T, K>(x);
  const K* wp = bits<T, K>(w);
  K* yp = mbits<T, K>(y);
  const acr_layer::Isa isa = checked_layer_isa();
  at::parallel_for(0, rows, row_grain(H), [&](int64_t r0, int64_t r1) {
    ACR_LAYER_KERNEL(isa, rms_norm_rows, xp + r0 * H, wp, yp + r0 * H, r1 - r0, H, static_cast<float>(eps));
  });
}

template <typename T, typename K>
void fused_add_rms_norm_kernel(const at::Tensor& x, at::Tensor& res, const at::Tensor& w, at::Tensor& y,
                               double eps) {
  const int64_t H = x.size(-1), rows = x.numel() / H;
  const K* xp = bits<T, K>(x);
  K* rp = mbits<T, K>(res);
  const K* wp = bits<T, K>(w);
  K* yp = mbits<T, K>(y);
  const acr_layer::Isa isa = checked_layer_isa();
  at::parallel_for(0, rows, row_grain(H), [&](int64_t r0, int64_t r1) {
    ACR_LAYER_KERNEL(isa, add_rms_norm_rows, xp + r0 * H, rp + r0 * H, wp, yp + r0 * H, r1 - r0, H,
                     static_cast<float>(eps));
  });
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm_args("rms_norm_cpu", x, w);
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() == 0) return y;
  if (x.scalar_type() == at::kFloat) rms_norm_kernel<float, float>(x, w, y, eps);
  else rms_norm_kernel<at::BFloat16, uint16_t>(x, w, y, eps);
  return y;
}

at::Tensor fused_add_rms_norm_cpu(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  check_norm_args("fused_add_rms_norm_cpu", x, w);
  TORCH_CHECK(residual.sizes() == x.sizes(), "fused_add_rms_norm_cpu: residual shape ", residual.sizes(),
              " differs from the input's ", x.sizes());
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "fused_add_rms_norm_cpu: residual dtype ",
              residual.scalar_type(), " differs from the input's ", x.scalar_type());
  TORCH_CHECK(residual.is_contiguous(), "fused_add_rms_norm_cpu: residual must be contiguous (it is updated in place)");
  // any overlap, not only the same first element: rows are written in place while later rows (and
  // other threads' rows) are still read, so x one row behind residual summed already-updated rows
  // without an error. Empty tensors hold no memory to share: a pass of no rows is legal.
  TORCH_CHECK(x.numel() == 0 || at::get_overlap_status(residual, x) == at::MemOverlapStatus::No,
              "fused_add_rms_norm_cpu: residual and input must not share memory");
  TORCH_CHECK(x.numel() == 0 || at::get_overlap_status(residual, w) == at::MemOverlapStatus::No,
              "fused_add_rms_norm_cpu: residual and weight must not share memory");
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() == 0) return y;
  if (x.scalar_type() == at::kFloat) fused_add_rms_norm_kernel<float, float>(x, residual, w, y, eps);
  else fused_add_rms_norm_kernel<at::BFloat16, uint16_t>(x, residual, w, y, eps);
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
