// CUDA streaming top-k merge: one thread block per row runs topk_merge_row_update
// (topk_merge.cuh) — the same code the CPU twin runs with one thread.
#include "cuda_utils.cuh"
#include "host_utils.h"
#include "topk_merge.cuh"

namespace acr {

// 512 threads: a 16K-wide chunk row is 32 logits per thread; the per-thread log-sum-exp
// partials (float + double) take 6 KB of shared memory.
constexpr int kTopKBlock = 512;
// Pass-0 candidate buffer in shared memory (32 KB): holds the qualifying keys of every
// chunk but the first (~k·chunk/seen of them); on overflow the kernel re-reads the chunk.
constexpr int kTopKBufCap = 4096;
constexpr size_t kDefaultSmem = 48 * 1024;  // static + dynamic above this: the kernel must opt in

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

void topk_merge_update_cuda(const TopKUpdateArgs& a, const CudaLaunch& l) {
  check_topk_update(a);
  if (a.rows == 0) return;
  const int kpad = next_pow2(a.k);
  DeviceGuard guard(l.device);
  const size_t smem = (static_cast<size_t>(kpad) + kTopKBufCap) * sizeof(uint64_t);
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    // The 48 KB default limit covers static + dynamic shared memory. The kernel's static part
    // (TopKShared + the 512-thread log-sum-exp partials, ~7 KB) counts too: k in 1,025..2,048
    // asks for exactly 48 KB of dynamic memory, which alone looks legal but fails to launch.
    cudaFuncAttributes attr{};
    cuda_check(cudaFuncGetAttributes(&attr, _topk_merge_update_kernel<T>), "topk_merge_update: kernel attributes");
    if (attr.sharedSizeBytes + smem > kDefaultSmem) {
      int optin = 0;
      cuda_check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, l.device),
                 "topk_merge_update: shared memory limit");
      require(attr.sharedSizeBytes + smem <= static_cast<size_t>(optin),
              "topk_merge_update: k=" + std::to_string(a.k) + " needs " +
                  std::to_string(attr.sharedSizeBytes + smem) + " bytes of shared memory per block; this GPU allows " +
                  std::to_string(optin));
      cuda_check(cudaFuncSetAttribute(_topk_merge_update_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)),
                 "topk_merge_update: opt in to shared memory");
    }
    _topk_merge_update_kernel<T><<<grid_for(a.rows, 1), kTopKBlock, smem, as_stream(l)>>>(a, kpad);
  });
  cuda_check(cudaGetLastError(), "topk_merge_update kernel launch");
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
