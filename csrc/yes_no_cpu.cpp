// CPU twin of the yes/no head: the row code of yes_no.cuh with one lane, double sums.
#include "host_utils.h"
#include "ops.h"
#include "yes_no.cuh"

namespace acr {

void check_yes_no(const YesNoArgs& a) {
  require(a.rows >= 0 && a.H >= 1, "yes_no: need rows >= 0 and hidden size >= 1");
  require(a.H <= (int64_t(1) << 30), "yes_no: hidden size too large");
  require(a.rows <= 1 || a.row_stride >= a.H, "yes_no: row_stride is smaller than the hidden size");
  require(a.dtype == kFloat32 || a.dtype == kFloat16 || a.dtype == kBFloat16,
          "yes_no: unknown dtype code " + std::to_string(a.dtype));
  require(a.eps >= 0.0f, "yes_no: eps must be >= 0");
  require(a.rows == 0 || (a.hidden && a.norm_w && a.w_yes && a.w_no && a.score && a.logit_diff),
          "yes_no: null data pointer");
}

void yes_no_cpu(const YesNoArgs& a, int num_threads) {
  check_yes_no(a);
  require(a.dtype == kFloat32, "yes_no_cpu: hidden must be float32 (the Python glue upcasts)");
  const float* h = reinterpret_cast<const float*>(a.hidden);
  const float* nw = reinterpret_cast<const float*>(a.norm_w);
  const float* wy = reinterpret_cast<const float*>(a.w_yes);
  const float* wn = reinterpret_cast<const float*>(a.w_no);
  float* score = reinterpret_cast<float*>(a.score);
  float* diff = reinterpret_cast<float*>(a.logit_diff);
  const int H = static_cast<int>(a.H);
  const int nt = resolve_threads(num_threads);
  (void)nt;
#pragma omp parallel for num_threads(nt) if (a.rows * a.H > (1 << 16))
  for (int64_t r = 0; r < a.rows; ++r) {
    const YesNoSums<double> s = yes_no_partial<double>(h + r * a.row_stride, nw, wy, wn, H, 0, 1);
    yes_no_finish(s, H, a.eps, score + r, diff + r);
  }
}

}  // namespace acr
