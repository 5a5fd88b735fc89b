// One logits chunk of the top-k log-prob ops' running top-k and log-sum-exp (docs/ARCHITECTURE.md,
// "Top-k stack"), one pass per row while the row is in L1. Once a row holds k logits only entries
// above its k-th value θ can enter, and there are few (≈ k·C/c0 for random order): torch's CPU
// top-k reads and partially sorts the whole row whatever k asks, and the log-sum-exp took three
// more passes (subtract, exp, sum), which together cost the native core half as much again as its
// bf16 GEMM (docs/benchmarks.md, "Ops and kernels").
//
//   acarerank::topk_candidates(Tensor x, Tensor theta, Tensor m_old, int id0, Tensor(a!) vals,
//                              Tensor(b!) ids, Tensor(c!) counts, Tensor(d!) m_new, Tensor(e!) csum) -> ()
//     x [T, n] fp32 (rows contiguous); theta, m_old [T] fp32; vals [T, cap] fp32, ids [T, cap]
//     int64; counts [T] int64; m_new, csum [T] fp32 (all but x contiguous). Per row t:
//       vals[t, :], ids[t, :]  the entries x[t, j] > theta[t] in increasing j, as (x[t, j], id0 + j),
//                              from the left; the slots past them hold (−inf, 2³¹ − 1), which lose
//                              every tie to a real logit (ties go to the lower id) and never enter a
//                              top-k that already holds k real entries
//       counts[t]              how many entries are above theta[t], also when more than cap (then
//                              only the first cap are written); NaN is never above (as torch.gt)
//       m_new[t]               max(m_old[t], max_j x[t, j]) (NaN ignored)
//       csum[t]                Σ_j exp(x[t, j] − shift), shift = m_new[t] unless ±inf (then 0), in
//                              fp32 (layer_kernels_impl.h's exp_f32, within 2 ulp); NaN if the row
//                              holds a NaN
// The row kernel is layer_kernels.h's topk_chunk_rows, in the ISA build chosen for the process.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"
#include "layer_glue.h"

namespace acarerank_cpu {
namespace {

void topk_candidates(const at::Tensor& x, const at::Tensor& theta, const at::Tensor& m_old, int64_t id0,
                     at::Tensor& vals, at::Tensor& ids, at::Tensor& counts, at::Tensor& m_new, at::Tensor& csum) {
  constexpr const char* op = "topk_candidates";
  for (const at::Tensor* t : {&x, &theta, &m_old, static_cast<const at::Tensor*>(&vals),
                              static_cast<const at::Tensor*>(&ids), static_cast<const at::Tensor*>(&counts),
                              static_cast<const at::Tensor*>(&m_new), static_cast<const at::Tensor*>(&csum)})
    ACR_CHECK_CPU(op, *t, "every tensor");
  ACR_CHECK_DTYPE(op, x, "x", at::kFloat);
  ACR_CHECK_DTYPE(op, theta, "theta", at::kFloat);
  ACR_CHECK_DTYPE(op, m_old, "m_old", at::kFloat);
  ACR_CHECK_DTYPE(op, vals, "vals", at::kFloat);
  ACR_CHECK_DTYPE(op, ids, "ids", at::kLong);
  ACR_CHECK_DTYPE(op, counts, "counts", at::kLong);
  ACR_CHECK_DTYPE(op, m_new, "m_new", at::kFloat);
  ACR_CHECK_DTYPE(op, csum, "csum", at::kFloat);
  ACR_CHECK_DIM(op, x, "x", 2);
  ACR_CHECK_DIM(op, vals, "vals", 2);
  const int64_t T = x.size(0), n = x.size(1), cap = vals.size(1);
  for (const at::Tensor* t : {&theta, &m_old, static_cast<const at::Tensor*>(&counts),
                              static_cast<const at::Tensor*>(&m_new), static_cast<const at::Tensor*>(&csum)})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == T, op, ": theta, m_old, counts, m_new and csum must be [", T,
                "], got one of shape ", t->sizes());
  TORCH_CHECK(vals.size(0) == T && ids.sizes() == vals.sizes(), op, ": vals and ids must be [", T, ", cap], got ",
              vals.sizes(), " and ", ids.sizes());
  TORCH_CHECK(T == 0 || n == 0 || x.stride(1) == 1, op, ": x's rows must be contiguous, got strides ", x.strides());
  TORCH_CHECK(theta.is_contiguous() && m_old.is_contiguous() && vals.is_contiguous() && ids.is_contiguous() &&
                  counts.is_contiguous() && m_new.is_contiguous() && csum.is_contiguous(),
              op, ": every tensor but x must be contiguous");
  TORCH_CHECK(id0 >= 0 && id0 + n <= acr_layer::kTopkPadId, op, ": ids id0 + j must stay below 2**31 - 1, got id0=",
              id0, ", n=", n);
  const acr_layer::Isa isa = checked_layer_isa();
  const float* X = x.const_data_ptr<float>();
  const float* th = theta.const_data_ptr<float>();
  const float* m0 = m_old.const_data_ptr<float>();
  float* V = vals.data_ptr<float>();
  int64_t* I = ids.data_ptr<int64_t>();
  int64_t* cnt = counts.data_ptr<int64_t>();
  float* m1 = m_new.data_ptr<float>();
  float* cs = csum.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, T, row_grain(n), [&](int64_t r0, int64_t r1) {
    ACR_LAYER_KERNEL(isa, topk_chunk_rows, X + r0 * ldx, ldx, th + r0, m0 + r0, r1 - r0, n, id0, V + r0 * cap,
                     I + r0 * cap, cap, cnt + r0, m1 + r0, cs + r0);
  });
}

}  // namespace
}  // namespace acarerank_cpu

TORCH_LIBRARY_FRAGMENT(acarerank, m) {
  m.def("topk_candidates(Tensor x, Tensor theta, Tensor m_old, int id0, Tensor(a!) vals, Tensor(b!) ids, "
        "Tensor(c!) counts, Tensor(d!) m_new, Tensor(e!) csum) -> ()");
}

TORCH_LIBRARY_IMPL(acarerank, CPU, m) { m.impl("topk_candidates", &acarerank_cpu::topk_candidates); }
