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
//     targets [T] int64; run_v [T, k] fp32, run_i [T, k] int64: the k best logits so far under the
//     tie rule (value desc, id asc) and their ids, sorted so, k real entries (ids below id0);
//     m [T] fp32, s [T] fp64: the running max and Σ exp(z − shift(m)); tgt [T] fp32. Per row t:
//       run_v, run_i  the k best of the held entries and the chunk's, sorted: an entry enters only
//                     above the k-th value θ (equal, it loses to the held one's lower id); NaN never
//       m, s          m' = max(m, max_j x[t, j]) (NaN ignored), shift = m' unless ±inf (then 0),
//                     s' = s·exp(m − shift) + Σ_j exp(x[t, j] − shift) (the sum in fp32 terms:
//                     topk_chunk_rows; NaN if the row holds a NaN), as the torch core's update
//       tgt           x[t, targets[t] − id0] where targets[t] is in [id0, id0 + n), else unchanged
// Ties and order are the torch core's (acarerank/ops/topk_logprobs.py), so the ids are bitwise its.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"
#include "layer_glue.h"

namespace acarerank_cpu {
namespace {

// up to this many candidates in a row are inserted one by one (most chunks bring a few), more are
// sorted and merged (the chunks right after the first k, or logits rising with the id)
constexpr int64_t kInsertAtMost = 24;

struct Entry {
  float v;
  int64_t id;
};
// the tie rule: a before b when its value is larger, or equal with a lower id (no NaN reaches here)
inline bool better(const Entry& a, const Entry& b) { return a.v > b.v || (a.v == b.v && a.id < b.id); }

// A few candidates (c of them, in id order) put into the held k one at a time: each still above
// the k-th (which rises as they go in) takes its place by binary search, the worse held ones move
// down one. Equal values keep id order: a candidate goes after every held entry of its value.
void insert_row(const float* cv, const int64_t* ci, int64_t c, float* rv, int64_t* ri, int64_t k) {
  for (int64_t j = 0; j < c; ++j) {
    const Entry e{cv[j], ci[j]};
    if (!better(e, Entry{rv[k - 1], ri[k - 1]})) continue;
    int64_t lo = 0, hi = k - 1;  // the first place whose entry e beats
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (better(e, Entry{rv[mid], ri[mid]}))
        hi = mid;
      else
        lo = mid + 1;
    }
    std::memmove(rv + lo + 1, rv + lo, sizeof(float) * (k - 1 - lo));
    std::memmove(ri + lo + 1, ri + lo, sizeof(int64_t) * (k - 1 - lo));
    rv[lo] = e.v, ri[lo] = e.id;
  }
}

// Row t's candidates merged into its held k: cand holds c entries above θ; the first min(c, cap)
// of them are in cv/ci (id order), all of them when c <= cap, else the row is read again.
void merge_row(const float* x, int64_t n, int64_t id0, float theta, const float* cv, const int64_t* ci, int64_t c,
               int64_t cap, float* rv, int64_t* ri, int64_t k, std::vector<Entry>& cand, std::vector<Entry>& out) {
  cand.clear();
  if (c <= cap) {
    for (int64_t j = 0; j < c; ++j) cand.push_back({cv[j], ci[j]});
  } else {  // more than cap above θ (the first chunks after the k are held, logits rising with the id)
    for (int64_t j = 0; j < n; ++j)
      if (x[j] > theta) cand.push_back({x[j], id0 + j});
  }
  const int64_t take = std::min<int64_t>(k, static_cast<int64_t>(cand.size()));
  std::partial_sort(cand.begin(), cand.begin() + take, cand.end(), better);
  out.clear();
  int64_t a = 0, b = 0;  // held entries win ties: their ids are below every candidate's
  while (static_cast<int64_t>(out.size()) < k) {
    if (b < take && !better(Entry{rv[a], ri[a]}, cand[b]))
      out.push_back(cand[b++]);
    else
      out.push_back({rv[a], ri[a]}), ++a;
  }
  for (int64_t j = 0; j < k; ++j) rv[j] = out[j].v, ri[j] = out[j].id;
}

void topk_chunk_update(const at::Tensor& x, int64_t id0, const at::Tensor& targets, at::Tensor& run_v,
                       at::Tensor& run_i, at::Tensor& m, at::Tensor& s, at::Tensor& tgt) {
  constexpr const char* op = "topk_chunk_update";
  for (const at::Tensor* t : {&x, &targets, static_cast<const at::Tensor*>(&run_v),
                              static_cast<const at::Tensor*>(&run_i), static_cast<const at::Tensor*>(&m),
                              static_cast<const at::Tensor*>(&s), static_cast<const at::Tensor*>(&tgt)})
    ACR_CHECK_CPU(op, *t, "every tensor");
  ACR_CHECK_DTYPE(op, x, "x", at::kFloat);
  ACR_CHECK_DTYPE(op, targets, "targets", at::kLong);
  ACR_CHECK_DTYPE(op, run_v, "run_v", at::kFloat);
  ACR_CHECK_DTYPE(op, run_i, "run_i", at::kLong);
  ACR_CHECK_DTYPE(op, m, "m", at::kFloat);
  ACR_CHECK_DTYPE(op, s, "s", at::kDouble);
  ACR_CHECK_DTYPE(op, tgt, "tgt", at::kFloat);
  ACR_CHECK_DIM(op, x, "x", 2);
  ACR_CHECK_DIM(op, run_v, "run_v", 2);
  const int64_t T = x.size(0), n = x.size(1), k = run_v.size(1);
  for (const at::Tensor* t : {&targets, static_cast<const at::Tensor*>(&m), static_cast<const at::Tensor*>(&s),
                              static_cast<const at::Tensor*>(&tgt)})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == T, op, ": targets, m, s and tgt must be [", T,
                "], got one of shape ", t->sizes());
  TORCH_CHECK(run_v.size(0) == T && k >= 1 && run_i.sizes() == run_v.sizes(), op, ": run_v and run_i must be [", T,
              ", k] with k >= 1, got ", run_v.sizes(), " and ", run_i.sizes());
  TORCH_CHECK(T == 0 || n == 0 || x.stride(1) == 1, op, ": x's rows must be contiguous, got strides ", x.strides());
  TORCH_CHECK(targets.is_contiguous() && run_v.is_contiguous() && run_i.is_contiguous() && m.is_contiguous() &&
                  s.is_contiguous() && tgt.is_contiguous(),
              op, ": every tensor but x must be contiguous");
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
  at::parallel_for(0, T, row_grain(n), [&](int64_t r0, int64_t r1) {
    const int64_t rows = r1 - r0;
    std::vector<float> theta(rows), cv(rows * k), m_new(rows), csum(rows);
    std::vector<int64_t> ci(rows * k), cnt(rows);
    std::vector<Entry> cand, out;
    out.reserve(k);
    for (int64_t t = 0; t < rows; ++t) theta[t] = rv[(r0 + t) * k + k - 1];
    ACR_LAYER_KERNEL(isa, topk_chunk_rows, X + r0 * ldx, ldx, theta.data(), mp + r0, rows, n, id0, cv.data(),
                     ci.data(), k, cnt.data(), m_new.data(), csum.data());
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t row = r0 + t;
      const float* xr = X + row * ldx;
      if (cnt[t] > 0 && cnt[t] <= std::min(kInsertAtMost, k))  // all of them in cv/ci (cap k)
        insert_row(cv.data() + t * k, ci.data() + t * k, cnt[t], rv + row * k, ri + row * k, k);
      else if (cnt[t] > 0)
        merge_row(xr, n, id0, theta[t], cv.data() + t * k, ci.data() + t * k, cnt[t], k, rv + row * k, ri + row * k,
                  k, cand, out);
      // the torch core's update: the old max's difference in fp32, the rescale and sum in fp64
      const float shift = std::isinf(m_new[t]) ? 0.f : m_new[t];
      sp[row] = sp[row] * std::exp(static_cast<double>(mp[row] - shift)) + static_cast<double>(csum[t]);
      mp[row] = m_new[t];
      if (tg[row] >= id0 && tg[row] < id0 + n) tp[row] = xr[tg[row] - id0];
    }
  });
}

}  // namespace
}  // namespace acarerank_cpu

TORCH_LIBRARY_FRAGMENT(acarerank, m) {
  m.def("topk_chunk_update(Tensor x, int id0, Tensor targets, Tensor(a!) run_v, Tensor(b!) run_i, Tensor(c!) m, "
        "Tensor(d!) s, Tensor(e!) tgt) -> ()");
}

TORCH_LIBRARY_IMPL(acarerank, CPU, m) { m.impl("topk_chunk_update", &acarerank_cpu::topk_chunk_update); }
