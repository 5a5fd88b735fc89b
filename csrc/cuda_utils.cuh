// Launch plumbing for the .cu files: error checks and a device guard. No ATen: the stream
// arrives as an integer (torch.cuda.current_stream().cuda_stream) and the pointers are raw.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common.cuh"
#include "ops.h"

namespace acr {

inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("acarerank._C: ") + what + ": " + cudaGetErrorString(e));
}

// Launch on `device`, then give the calling thread its previous current device back, so
// torch's notion of the current device is left as it was.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cuda_check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device) cuda_check(cudaSetDevice(device), "cudaSetDevice");
    else prev_ = -1;
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

inline cudaStream_t as_stream(const CudaLaunch& l) { return reinterpret_cast<cudaStream_t>(l.stream); }

inline unsigned grid_for(int64_t items, int per_block) {
  const int64_t g = (items + per_block - 1) / per_block;
  if (g > 0x7fffffff) throw std::invalid_argument("acarerank._C: too many rows for one launch");
  return static_cast<unsigned>(g);
}

// Element type from the dtype code, for kernels templated on it.
template <class F>
void dispatch_dtype(int dtype, F&& f) {
  switch (dtype) {
    case kFloat32: f(float{}); break;
    case kFloat16: f(__half{}); break;
    case kBFloat16: f(__nv_bfloat16{}); break;
    default: throw std::invalid_argument("acarerank._C: unknown dtype code " + std::to_string(dtype));
  }
}

}  // namespace acr
