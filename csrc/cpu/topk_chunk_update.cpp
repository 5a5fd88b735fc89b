// One logits chunk folded into the top-k log-prob ops' running state (docs/ARCHITECTURE.md, "Top-k
// stack"), every row in one call: the chunk's candidates and log-sum-exp terms from the row kernel
// (layer_kernels.h's topk_chunk_rows, one pass per row while it is in L1), then, per row, the
// candidates merged into the held top-k, the running log-sum-exp and the target's logit. In
// Python these were a dozen small torch ops per chunk (a merge by order keys and torch.topk every
// k candidates, the log-sum-exp update, the target gather): ~45 ms of a 190 ms bf16 call at T 512,
// V 151,669 on an AMX Xeon, against a 125 ms GEMM (docs/benchmarks.md, "Ops and kernels").
//
//   acarerank::topk_chunk_update(Tensor x, int id0, Tensor targets, Tensor(a!) run_v, Tensor(b!) run_i,
//                                Tensor(c!) m, Tensor(d!) s, Tensor(e!) tgt) -> ()
//     x [T, n] fp32 (rows contiguous): logits of ids [id0, id0 + n), chunks given in increasing id0;
//     targets [T] int64; run_v [T, k] fp32, run_i [T, k] int64, m [T] fp32, s [T] fp64, tgt [T]
//     fp32: the state, each row updated as topk_rows.h's update_rows says (the rule and its ties
//     are the torch core's, acarerank/ops/topk_logprobs.py, so the ids are bitwise its).
// On bf16 logits where the CPU has AVX512_BF16, the native core runs this for the first chunk only
// and topk_gemm_update.cpp for the rest (the logits never leave L2 there).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"
#include "topk_rows.h"

namespace acarerank_cpu {
namespace {

void topk_chunk_update(const at::Tensor& x, int64_t id0, const at::Tensor& targets, at::Tensor& run_v,
                       at::Tensor& run_i, at::Tensor& m, at::Tensor& s, at::Tensor& tgt) {
  constexpr const char* op = "topk_chunk_update";
  ACR_CHECK_CPU(op, x, "every tensor");
  ACR_CHECK_DTYPE(op, x, "x", at::kFloat);
  ACR_CHECK_DIM(op, x, "x", 2);
  const int64_t T = x.size(0), n = x.size(1);
  const int64_t k = topk_rows::check_state(op, T, targets, run_v, run_i, m, s, tgt);
  TORCH_CHECK(T == 0 || n == 0 || x.stride(1) == 1, op, ": x's rows must be contiguous, got strides ", x.strides());
  TORCH_CHECK(id0 >= 0 && id0 + n <= acr_layer::kTopkIdLimit, op,
              ": ids id0 + j must stay below 2**31 - 1, got id0=", id0, ", n=", n);
  const acr_layer::Isa isa = checked_layer_isa();
  const float* X = x.const_data_ptr<float>();
  const int64_t* tg = targets.const_data_ptr<int64_t>();
  float* rv = run_v.data_ptr<float>();
  int64_t* ri = run_i.data_ptr<int64_t>();
  float* mp = m.data_ptr<float>();
  double* sp = s.data_ptr<double>();
  float* tp = tgt.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const topk_rows::State st{rv, ri, mp, sp};
  at::parallel_for(0, T, row_grain(n), [&](int64_t r0, int64_t r1) {
    topk_rows::Scratch sc;
    topk_rows::update_rows(isa, X + r0 * ldx, ldx, n, id0, r0, r1 - r0, k, tg, st, tp, sc);
  });
}

}  // namespace
}  // namespace acarerank_cpu

TORCH_LIBRARY_FRAGMENT(acarerank, m) {
  m.def("topk_chunk_update(Tensor x, int id0, Tensor targets, Tensor(a!) run_v, Tensor(b!) run_i, Tensor(c!) m, "
        "Tensor(d!) s, Tensor(e!) tgt) -> ()");
}

TORCH_LIBRARY_IMPL(acarerank, CPU, m) { m.impl("topk_chunk_update", &acarerank_cpu::topk_chunk_update); }
