// CUDA streaming top-k merge: one thread block per row runs topk_merge_row_update
// (topk_merge.cuh) — the same code the CPU twin runs with one thread.
#include "cuda_utils.cuh"
#include "host_utils.h"
#include "topk_merge.cuh"

namespace acr {

// 512 threads: a 16K-wide chunk row is 32 logits per thread; the per-thread log-sum-exp
// partials (float + double) take 6 KB of shared memory.
constexpr int kTopKBlock = 512;
constexpr int kFinalizeBlock = 128;
// Pass-0 candidate buffer in shared memory (32 KB): holds the qualifying keys of every
// chunk but the first (~k·chunk/seen of them); on overflow the kernel re-reads the chunk.
constexpr int kTopKBufCap = 4096;
constexpr size_t kDefaultSmem = 48 * 1024;  // above this a kernel must opt in

template <typename T>
__global__ void __launch_bounds__(kTopKBlock) _topk_merge_update_kernel(TopKUpdateArgs a, int kpad) {
  extern __shared__ uint64_t s_dyn[];  // keys [kpad] then buf [kTopKBufCap]
  __shared__ TopKShared sh;
  __shared__ float red_m[kTopKBlock];
  __shared__ double red_s[kTopKBlock];
  const int64_t r = blockIdx.x;
  const int k = static_cast<int>(a.k);
  const int64_t* targets = reinterpret_cast<const int64_t*>(a.targets);
  const TopKChunk<T> c{reinterpret_cast<const T*>(a.logits) + r * a.row_stride, static_cast<int>(a.n), a.c0,
                       a.temperature};
  const TopKRowState st{reinterpret_cast<float*>(a.vals) + r * k, reinterpret_cast<int32_t*>(a.ids) + r * k, k,
                        reinterpret_cast<float*>(a.row_max) + r, reinterpret_cast<double*>(a.row_sumexp) + r,
                        targets ? targets[r] : -1, reinterpret_cast<float*>(a.target_logit) + r};
  const TopKScratch w{&sh, s_dyn, kpad, s_dyn + kpad, kTopKBufCap, red_m, red_s};
  topk_merge_row_update(BlockGroup{}, c, st, w);
}

__global__ void _topk_finalize_kernel(TopKFinalizeArgs a) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= a.rows) return;
  const int k = static_cast<int>(a.k);
  const int64_t* targets = reinterpret_cast<const int64_t*>(a.targets);
  float* lp_full = reinterpret_cast<float*>(a.lp_full);
  const TopKFinalOut o{reinterpret_cast<float*>(a.lse) + r, reinterpret_cast<float*>(a.lp_topk) + r * k,
                       lp_full ? lp_full + r * k : nullptr, reinterpret_cast<float*>(a.tlp_full) + r,
                       reinterpret_cast<float*>(a.tlp_topk) + r, reinterpret_cast<uint8_t*>(a.in_topk) + r};
  topk_finalize_row(reinterpret_cast<const float*>(a.vals) + r * k, reinterpret_cast<const int32_t*>(a.ids) + r * k,
                    k, reinterpret_cast<const float*>(a.row_max)[r], reinterpret_cast<const double*>(a.row_sumexp)[r],
                    targets ? targets[r] : -1, reinterpret_cast<const float*>(a.target_logit)[r], o);
}

void topk_merge_update_cuda(const TopKUpdateArgs& a, const CudaLaunch& l) {
  check_topk_update(a);
  if (a.rows == 0) return;
  const int kpad = next_pow2(a.k);
  DeviceGuard guard(l.device);
  const size_t smem = (static_cast<size_t>(kpad) + kTopKBufCap) * sizeof(uint64_t);
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (smem > kDefaultSmem)  // large k: 32 KB of keys + 32 KB of buffer
      cuda_check(cudaFuncSetAttribute(_topk_merge_update_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)),
                 "topk_merge_update: opt in to shared memory");
    _topk_merge_update_kernel<T><<<grid_for(a.rows, 1), kTopKBlock, smem, as_stream(l)>>>(a, kpad);
  });
  cuda_check(cudaGetLastError(), "topk_merge_update kernel launch");
}

void topk_finalize_cuda(const TopKFinalizeArgs& a, const CudaLaunch& l) {
  check_topk_finalize(a);
  if (a.rows == 0) return;
  DeviceGuard guard(l.device);
  _topk_finalize_kernel<<<grid_for(a.rows, kFinalizeBlock), kFinalizeBlock, 0, as_stream(l)>>>(a);
  cuda_check(cudaGetLastError(), "topk_finalize kernel launch");
}

std::string cuda_runtime_info() {
  int rt = 0, drv = 0, n = 0;
  std::string s;
  if (cudaRuntimeGetVersion(&rt) == cudaSuccess) s += "runtime " + std::to_string(rt / 1000) + "." + std::to_string(rt % 1000 / 10);
  if (cudaDriverGetVersion(&drv) == cudaSuccess)
    s += ", driver " + (drv ? std::to_string(drv / 1000) + "." + std::to_string(drv % 1000 / 10) : std::string("none"));
  const cudaError_t e = cudaGetDeviceCount(&n);
  s += e == cudaSuccess ? ", " + std::to_string(n) + " device(s)" : std::string(", no device: ") + cudaGetErrorString(e);
  cudaGetLastError();  // a failed query must not linger as the next launch's error
  return s;
}

}  // namespace acr
