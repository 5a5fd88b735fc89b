// CUDA yes/no head: one warp per row (yes_no.cuh's row code with 32 lanes, float sums,
// butterfly reduction); the hidden state is read in its own dtype.
#include "cuda_utils.cuh"
#include "yes_no.cuh"

namespace acr {

constexpr int kYesNoBlock = 256;  // 8 rows per block
constexpr int kWarp = 32;

template <typename T>
__global__ void __launch_bounds__(kYesNoBlock) _yes_no_kernel(YesNoArgs a) {
  const int lane = threadIdx.x % kWarp;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (kYesNoBlock / kWarp) + threadIdx.x / kWarp;
  if (r >= a.rows) return;  // whole warps leave together
  YesNoSums<float> s = yes_no_partial<float>(reinterpret_cast<const T*>(a.hidden) + r * a.row_stride,
                                             reinterpret_cast<const float*>(a.norm_w),
                                             reinterpret_cast<const float*>(a.w_yes),
                                             reinterpret_cast<const float*>(a.w_no), static_cast<int>(a.H), lane, kWarp);
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    s.sq += __shfl_xor_sync(0xffffffffu, s.sq, off);
    s.diff += __shfl_xor_sync(0xffffffffu, s.diff, off);
  }
  if (lane == 0)
    yes_no_finish(s, static_cast<int>(a.H), a.eps, reinterpret_cast<float*>(a.score) + r,
                  reinterpret_cast<float*>(a.logit_diff) + r);
}

void yes_no_cuda(const YesNoArgs& a, const CudaLaunch& l) {
  check_yes_no(a);
  if (a.rows == 0) return;
  DeviceGuard guard(l.device);
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    _yes_no_kernel<T><<<grid_for(a.rows, kYesNoBlock / kWarp), kYesNoBlock, 0, as_stream(l)>>>(a);
  });
  cuda_check(cudaGetLastError(), "yes_no kernel launch");
}

}  // namespace acr
