// Row kernels of the decoder layer's element-wise ops (docs/ARCHITECTURE.md, "Native CPU ops
// around attention"), compiled twice from layer_kernels_impl.h: for AVX2+FMA
// (layer_kernels_avx2.cpp) and for baseline x86-64 / any other CPU (layer_kernels_base.cpp).
// The op glue (norm.cpp, qk_norm_rope.cpp, activation.cpp) checks the inputs, splits the rows over
// at::parallel_for and calls ACR_LAYER_KERNEL(fn, ...), which picks the AVX2 build when the CPU has
// it. The kernels are plain loops over raw pointers (bf16 as its uint16_t bits) that the compiler
// vectorises for the ISA of each build; they include no torch header, so the two builds share no
// inline function (nothing compiled for AVX2 can run on a CPU without it).
//
// All math is fp32; every stored element is rounded once (bf16: round-to-nearest-even).
#pragma once

#include <cstdint>

#define ACR_LAYER_DECLARE_KERNELS                                                                           \
  void rms_norm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t H, float eps);        \
  void rms_norm_rows(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t rows, int64_t H, float eps); \
  void add_rms_norm_rows(const float* x, float* res, const float* w, float* y, int64_t rows, int64_t H,     \
                         float eps);                                                                        \
  void add_rms_norm_rows(const uint16_t* x, uint16_t* res, const uint16_t* w, uint16_t* y, int64_t rows,    \
                         int64_t H, float eps);                                                             \
  void qk_norm_rope_rows(const float* qkv, const float* qw, const float* kw, const float* cos,              \
                         const float* sin, float* q, float* k, float* v, int64_t rows, int64_t Hq,          \
                         int64_t Hkv, int64_t d, float eps, const PageWrite<float>& pages);                 \
  void qk_norm_rope_rows(const uint16_t* qkv, const uint16_t* qw, const uint16_t* kw, const float* cos,     \
                         const float* sin, uint16_t* q, uint16_t* k, uint16_t* v, int64_t rows, int64_t Hq, \
                         int64_t Hkv, int64_t d, float eps, const PageWrite<uint16_t>& pages);              \
  void qk_norm_rope_rows(const uint16_t* qkv, const uint16_t* qw, const uint16_t* kw, const uint16_t* cos,  \
                         const uint16_t* sin, uint16_t* q, uint16_t* k, uint16_t* v, int64_t rows,          \
                         int64_t Hq, int64_t Hkv, int64_t d, float eps, const PageWrite<uint16_t>& pages);  \
  void silu_and_mul_rows(const float* x, float* y, int64_t rows, int64_t I);                                \
  void silu_and_mul_rows(const uint16_t* x, uint16_t* y, int64_t rows, int64_t I);

namespace acr_layer {

// Where qk_norm_rope_rows also stores each row's new k and v (the paged KV cache, vLLM's layout
// [num_blocks, block_size, Hkv, d] seen as flat rows of Hkv·d): row t goes to row slots[t] of
// k_pages / v_pages. k_pages == nullptr: no page write. slots points at the chunk's first row;
// the glue has checked every slot is in range and unique. A trivial aggregate on purpose: no
// inline constructor that an ISA build could compile (see above).
template <typename T>
struct PageWrite {
  T* k_pages;
  T* v_pages;
  const int64_t* slots;
};

//: largest head_dim qk_norm_rope_rows takes (the normalised head is kept in a stack buffer)
constexpr int64_t kMaxHeadDim = 512;

namespace avx2 {
ACR_LAYER_DECLARE_KERNELS
}
namespace base {
ACR_LAYER_DECLARE_KERNELS
}

// whether this CPU runs the AVX2+FMA build (checked once)
bool use_avx2();

}  // namespace acr_layer

#define ACR_LAYER_KERNEL(fn, ...) \
  (acr_layer::use_avx2() ? acr_layer::avx2::fn(__VA_ARGS__) : acr_layer::base::fn(__VA_ARGS__))
