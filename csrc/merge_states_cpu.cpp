// CPU twin of the attention-state merge: merge_states.cuh's row code, one lane, double.
#include "host_utils.h"
#include "merge_states.cuh"
#include "ops.h"

namespace acr {

void check_merge_states(const MergeStatesArgs& a) {
  require(a.N >= 0 && a.Hh >= 0 && a.d >= 1, "merge_states: need N >= 0, heads >= 0, head_dim >= 1");
  require(a.d <= (int64_t(1) << 30), "merge_states: head_dim too large");
  require(a.dtype == kFloat32 || a.dtype == kFloat16 || a.dtype == kBFloat16,
          "merge_states: unknown dtype code " + std::to_string(a.dtype));
  require(a.N * a.Hh == 0 || (a.o_a && a.o_b && a.lse_a && a.lse_b && a.out && a.lse_out),
          "merge_states: null data pointer");
}

void merge_states_cpu(const MergeStatesArgs& a, int num_threads) {
  check_merge_states(a);
  require(a.dtype == kFloat32, "merge_states_cpu: o_a/o_b must be float32 (the Python glue upcasts)");
  const float* oa = reinterpret_cast<const float*>(a.o_a);
  const float* ob = reinterpret_cast<const float*>(a.o_b);
  const float* la = reinterpret_cast<const float*>(a.lse_a);
  const float* lb = reinterpret_cast<const float*>(a.lse_b);
  float* out = reinterpret_cast<float*>(a.out);
  float* lse_out = reinterpret_cast<float*>(a.lse_out);
  const int64_t rows = a.N * a.Hh;
  const int d = static_cast<int>(a.d);
  const int nt = resolve_threads(num_threads);
  (void)nt;
#pragma omp parallel for num_threads(nt) if (rows * a.d > (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / a.Hh, h = r % a.Hh;
    merge_state_row<double>(oa + t * a.o_a_s0 + h * a.o_a_s1, la[t * a.lse_a_s0 + h * a.lse_a_s1],
                            ob + t * a.o_b_s0 + h * a.o_b_s1, lb[t * a.lse_b_s0 + h * a.lse_b_s1],
                            out + r * a.d, lse_out + r, d, 0, 1);
  }
}

}  // namespace acr
