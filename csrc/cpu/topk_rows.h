// The top-k log-prob ops' per-row state update on one block of logits (docs/ARCHITECTURE.md,
// "Top-k stack"), shared by topk_chunk_update.cpp (a chunk of logits from the caller) and
// topk_gemm_update.cpp (blocks of logits it computes itself). Rows t of a block of n logits x[t, j]
// (ids id0 + j, blocks in increasing id0 for one state) fold into row r0 + t of a state:
//   rv, ri [T, k]  the k best logits so far under the tie rule (value desc, id asc) and their ids,
//                  sorted so, k real entries with ids below id0; an entry enters only above the
//                  k-th value θ (equal, it loses to the held one's lower id); NaN never
//   m [T], s [T]   the running max and Σ exp(z − shift(m)) in fp64: m' = max(m, max_j x) (NaN
//                  ignored), shift = m' unless ±inf (then 0), s' = s·exp(m − shift) + Σ_j exp(x − shift)
//                  (the old max's difference in fp32, the rescale and sum in fp64, the chunk's
//                  sum of fp32 terms: layer_kernels.h's topk_chunk_rows), as the torch core
//   tgt [T]        x[t, targets[r0 + t] − id0] where that target is in [id0, id0 + n)
// Ties and order are the torch core's (acarerank/ops/topk_logprobs.py), so the ids are bitwise its.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"
#include "layer_glue.h"

namespace acarerank_cpu {
namespace topk_rows {

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
inline void insert_row(const float* cv, const int64_t* ci, int64_t c, float* rv, int64_t* ri, int64_t k) {
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
inline void merge_row(const float* x, int64_t n, int64_t id0, float theta, const float* cv, const int64_t* ci, int64_t c,
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

// The state's tensors checked for an op named op over T rows (errors name the argument): targets
// [T] int64, run_v [T, k] fp32 and run_i [T, k] int64 with k >= 1, m [T] fp32, s [T] fp64, tgt [T]
// fp32, all contiguous CPU tensors. Returns k.
inline int64_t check_state(const char* op, int64_t T, const at::Tensor& targets, const at::Tensor& run_v,
                           const at::Tensor& run_i, const at::Tensor& m, const at::Tensor& s, const at::Tensor& tgt) {
  for (const at::Tensor* t : {&targets, &run_v, &run_i, &m, &s, &tgt}) ACR_CHECK_CPU(op, *t, "every tensor");
  ACR_CHECK_DTYPE(op, targets, "targets", at::kLong);
  ACR_CHECK_DTYPE(op, run_v, "run_v", at::kFloat);
  ACR_CHECK_DTYPE(op, run_i, "run_i", at::kLong);
  ACR_CHECK_DTYPE(op, m, "m", at::kFloat);
  ACR_CHECK_DTYPE(op, s, "s", at::kDouble);
  ACR_CHECK_DTYPE(op, tgt, "tgt", at::kFloat);
  ACR_CHECK_DIM(op, run_v, "run_v", 2);
  const int64_t k = run_v.size(1);
  for (const at::Tensor* t : {&targets, &m, &s, &tgt})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == T, op, ": targets, m, s and tgt must be [", T,
                "], got one of shape ", t->sizes());
  TORCH_CHECK(run_v.size(0) == T && k >= 1 && run_i.sizes() == run_v.sizes(), op, ": run_v and run_i must be [", T,
              ", k] with k >= 1, got ", run_v.sizes(), " and ", run_i.sizes());
  TORCH_CHECK(targets.is_contiguous() && run_v.is_contiguous() && run_i.is_contiguous() && m.is_contiguous() &&
                  s.is_contiguous() && tgt.is_contiguous(),
              op, ": targets, run_v, run_i, m, s and tgt must be contiguous");
  return k;
}

// One state's arrays (row 0 of each; rows are k, 1, 1 apart).
struct State {
  float* rv;
  int64_t* ri;
  float* m;
  double* s;
};

// Per-thread scratch of update_rows, grown to the largest block it sees.
struct Scratch {
  std::vector<float> theta, cv, m_new, csum;
  std::vector<int64_t> ci, cnt;
  std::vector<Entry> cand, out;
  void fit(int64_t rows, int64_t cap) {
    theta.resize(rows), m_new.resize(rows), csum.resize(rows), cnt.resize(rows);
    cv.resize(rows * cap), ci.resize(rows * cap);
  }
};

// Block rows x[0 .. rows) (ldx apart, n logits each, ids id0 ..) into state rows r0 .. r0 + rows.
inline void update_rows(acr_layer::Isa isa, const float* x, int64_t ldx, int64_t n, int64_t id0, int64_t r0,
                        int64_t rows, int64_t k, const int64_t* targets, const State& st, float* tgt, Scratch& sc) {
  // a row's candidates kept in id order, up to cap of them (more: merge_row reads the row again);
  // a block brings at most n, so min(k, n) keeps every one without rows × k of scratch
  const int64_t cap = std::min(k, n);
  sc.fit(rows, cap);
  for (int64_t t = 0; t < rows; ++t) sc.theta[t] = st.rv[(r0 + t) * k + k - 1];
  ACR_LAYER_KERNEL(isa, topk_chunk_rows, x, ldx, sc.theta.data(), st.m + r0, rows, n, id0, sc.cv.data(),
                   sc.ci.data(), cap, sc.cnt.data(), sc.m_new.data(), sc.csum.data());
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t row = r0 + t;
    const float* xr = x + t * ldx;
    float* rv = st.rv + row * k;
    int64_t* ri = st.ri + row * k;
    const int64_t c = sc.cnt[t];
    if (c > 0 && c <= std::min(kInsertAtMost, cap))  // all of them in cv/ci
      insert_row(sc.cv.data() + t * cap, sc.ci.data() + t * cap, c, rv, ri, k);
    else if (c > 0)
      merge_row(xr, n, id0, sc.theta[t], sc.cv.data() + t * cap, sc.ci.data() + t * cap, c, cap, rv, ri, k, sc.cand,
                sc.out);
    const float shift = std::isinf(sc.m_new[t]) ? 0.f : sc.m_new[t];
    st.s[row] = st.s[row] * std::exp(static_cast<double>(st.m[row] - shift)) + static_cast<double>(sc.csum[t]);
    st.m[row] = sc.m_new[t];
    if (targets[row] >= id0 && targets[row] < id0 + n) tgt[row] = xr[targets[row] - id0];
  }
}

}  // namespace topk_rows
}  // namespace acarerank_cpu
