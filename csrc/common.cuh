// Shared by the CUDA kernels (*.cu, compiled by nvcc) and their C++ CPU twins (*.cpp, plain
// g++): one copy of each per-row algorithm, written once as __host__ __device__ code.
//
// A "group" is whoever cooperates on one row: a CUDA thread block (BlockGroup) or one CPU
// thread (SerialGroup, size 1). Row algorithms written against it run unchanged on both, so
// the CPU tests exercise the exact selection/merge logic the GPU runs; only the parallel
// schedule differs.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define ACR_HD __host__ __device__ __forceinline__
#else
#define ACR_HD inline
#endif

namespace acr {

// Element-type codes passed from Python (acarerank/ops/_cpp.py keeps the same table).
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

ACR_HD float to_float(float x) { return x; }
ACR_HD void store_float(float* p, float v) { *p = v; }
#ifdef __CUDACC__
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
// Round-to-nearest-even, the same rounding as torch's .to(float16/bfloat16).
__device__ __forceinline__ void store_float(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store_float(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
#endif

// One CPU thread does the whole row; "atomics" are plain read-modify-writes.
struct SerialGroup {
  ACR_HD int tid() const { return 0; }
  ACR_HD int size() const { return 1; }
  ACR_HD void sync() const {}
  ACR_HD uint32_t atomic_add(uint32_t* p, uint32_t v) const {
    uint32_t old = *p;
    *p = old + v;
    return old;
  }
};

#ifdef __CUDACC__
// The thread block cooperates on one row; shared-memory atomics and __syncthreads.
struct BlockGroup {
  __device__ __forceinline__ int tid() const { return threadIdx.x; }
  __device__ __forceinline__ int size() const { return blockDim.x; }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
  __device__ __forceinline__ uint32_t atomic_add(uint32_t* p, uint32_t v) const { return atomicAdd(p, v); }
};
#endif

}  // namespace acr
