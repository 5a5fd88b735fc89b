// The candidates of a logits chunk for the top-k log-prob ops' running top-k (docs/ARCHITECTURE.md,
// "Top-k stack"): once a row holds k logits, only entries above its k-th value θ can enter, and
// there are few of them (≈ k·C/c0 for random order). torch's CPU top-k reads and partially sorts
// the whole row whatever k asks, which cost the native core half as much again as its bf16 GEMM
// (docs/benchmarks.md, "Ops and kernels"); this is one compare per entry.
//
//   acarerank::topk_candidates(Tensor x, Tensor theta, int id0, Tensor(a!) vals, Tensor(b!) ids,
//                              Tensor(c!) counts) -> ()
//     x [T, n] fp32 (rows contiguous), theta [T] fp32, vals [T, cap] fp32, ids [T, cap] int64,
//     counts [T] int64 (all contiguous). Per row t: the entries x[t, j] > theta[t] in increasing
//     j, as (x[t, j], id0 + j), fill vals[t, :] / ids[t, :] from the left; the slots past them
//     hold (−inf, kPadId), which lose every tie to a real logit (ties go to the lower id) and
//     never enter a top-k that already holds k real entries; counts[t] is the number of entries
//     above theta[t], also when more than cap (then only the first cap are written). NaN is
//     never above theta (as torch.gt).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>

#include "common.h"

namespace acarerank_cpu {
namespace {

constexpr int64_t kPadId = (int64_t{1} << 31) - 1;  // the largest id order_keys takes

void topk_candidates(const at::Tensor& x, const at::Tensor& theta, int64_t id0, at::Tensor& vals, at::Tensor& ids,
                     at::Tensor& counts) {
  constexpr const char* op = "topk_candidates";
  for (const at::Tensor* t : {&x, &theta, static_cast<const at::Tensor*>(&vals), static_cast<const at::Tensor*>(&ids),
                              static_cast<const at::Tensor*>(&counts)})
    ACR_CHECK_CPU(op, *t, "every tensor");
  ACR_CHECK_DTYPE(op, x, "x", at::kFloat);
  ACR_CHECK_DTYPE(op, theta, "theta", at::kFloat);
  ACR_CHECK_DTYPE(op, vals, "vals", at::kFloat);
  ACR_CHECK_DTYPE(op, ids, "ids", at::kLong);
  ACR_CHECK_DTYPE(op, counts, "counts", at::kLong);
  ACR_CHECK_DIM(op, x, "x", 2);
  ACR_CHECK_DIM(op, vals, "vals", 2);
  const int64_t T = x.size(0), n = x.size(1), cap = vals.size(1);
  TORCH_CHECK(theta.dim() == 1 && theta.size(0) == T && counts.dim() == 1 && counts.size(0) == T, op,
              ": theta and counts must be [", T, "], got ", theta.sizes(), " and ", counts.sizes());
  TORCH_CHECK(vals.size(0) == T && ids.sizes() == vals.sizes(), op, ": vals and ids must be [", T, ", cap], got ",
              vals.sizes(), " and ", ids.sizes());
  TORCH_CHECK(T == 0 || n == 0 || x.stride(1) == 1, op, ": x's rows must be contiguous, got strides ", x.strides());
  TORCH_CHECK(theta.is_contiguous() && vals.is_contiguous() && ids.is_contiguous() && counts.is_contiguous(), op,
              ": theta, vals, ids and counts must be contiguous");
  TORCH_CHECK(id0 >= 0 && id0 + n <= kPadId, op, ": ids id0 + j must stay below 2**31 - 1, got id0=", id0, ", n=", n);
  const float* X = x.const_data_ptr<float>();
  const float* th = theta.const_data_ptr<float>();
  float* V = vals.data_ptr<float>();
  int64_t* I = ids.data_ptr<int64_t>();
  int64_t* cnt = counts.data_ptr<int64_t>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, T, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, n)), [&](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
      const float* row = X + t * ldx;
      const float bound = th[t];
      float* v = V + t * cap;
      int64_t* id = I + t * cap;
      int64_t c = 0;
      for (int64_t j = 0; j < n; ++j) {
        if (row[j] > bound) {  // rare past the first chunks: a predictable branch
          if (c < cap) v[c] = row[j], id[c] = id0 + j;
          ++c;
        }
      }
      cnt[t] = c;
      for (int64_t s = std::min(c, cap); s < cap; ++s) v[s] = -std::numeric_limits<float>::infinity(), id[s] = kPadId;
    }
  });
}

}  // namespace
}  // namespace acarerank_cpu

TORCH_LIBRARY_FRAGMENT(acarerank, m) {
  m.def("topk_candidates(Tensor x, Tensor theta, int id0, Tensor(a!) vals, Tensor(b!) ids, Tensor(c!) counts) -> ()");
}

TORCH_LIBRARY_IMPL(acarerank, CPU, m) { m.impl("topk_candidates", &acarerank_cpu::topk_candidates); }
