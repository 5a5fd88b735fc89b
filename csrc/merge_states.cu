// CUDA attention-state merge: one warp per (token, head) row, lanes over head_dim
// (merge_states.cuh's row code with 32 lanes, float math, o in its own dtype).
#include "cuda_utils.cuh"
#include "merge_states.cuh"

namespace acr {

constexpr int kMergeBlock = 256;  // 8 rows per block
constexpr int kWarp = 32;

template <typename T>
__global__ void __launch_bounds__(kMergeBlock) _merge_states_kernel(MergeStatesArgs a) {
  const int lane = threadIdx.x % kWarp;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (kMergeBlock / kWarp) + threadIdx.x / kWarp;
  if (r >= a.N * a.Hh) return;
  const int64_t t = r / a.Hh, h = r % a.Hh;
  const float* la = reinterpret_cast<const float*>(a.lse_a);
  const float* lb = reinterpret_cast<const float*>(a.lse_b);
  merge_state_row<float>(reinterpret_cast<const T*>(a.o_a) + t * a.o_a_s0 + h * a.o_a_s1,
                         la[t * a.lse_a_s0 + h * a.lse_a_s1],
                         reinterpret_cast<const T*>(a.o_b) + t * a.o_b_s0 + h * a.o_b_s1,
                         lb[t * a.lse_b_s0 + h * a.lse_b_s1], reinterpret_cast<T*>(a.out) + r * a.d,
                         reinterpret_cast<float*>(a.lse_out) + r, static_cast<int>(a.d), lane, kWarp);
}

void merge_states_cuda(const MergeStatesArgs& a, const CudaLaunch& l) {
  check_merge_states(a);
  if (a.N * a.Hh == 0) return;
  DeviceGuard guard(l.device);
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    _merge_states_kernel<T><<<grid_for(a.N * a.Hh, kMergeBlock / kWarp), kMergeBlock, 0, as_stream(l)>>>(a);
  });
  cuda_check(cudaGetLastError(), "merge_states kernel launch");
}

}  // namespace acr
