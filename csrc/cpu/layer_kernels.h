// Row kernels of the decoder layer's element-wise ops (docs/ARCHITECTURE.md, "Native CPU ops
// around attention") and of the top-k core's logits chunks (topk_chunk_update.cpp), compiled three times from layer_kernels_impl.h: for AVX-512
// (layer_kernels_avx512.cpp), for AVX2+FMA (layer_kernels_avx2.cpp) and for baseline x86-64 / any
// other CPU (layer_kernels_base.cpp). The op glue (norm.cpp, qk_norm_rope.cpp, activation.cpp)
// checks the inputs, takes the build chosen once per process (layer_glue.h, checked_layer_isa()),
// splits the rows over at::parallel_for and calls ACR_LAYER_KERNEL(isa, fn, ...). The kernels are
// plain loops over raw pointers (bf16 as its uint16_t bits) that the compiler vectorises for the
// ISA of each build; they include no torch header, so the builds share no inline function
// (nothing compiled for AVX-512 can run on a CPU without it).
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
  void silu_and_mul_rows(const uint16_t* x, uint16_t* y, int64_t rows, int64_t I);                          \
  void topk_chunk_rows(const float* x, int64_t ldx, const float* theta, const float* m_old, int64_t rows,    \
                       int64_t n, int64_t id0, float* vals, int64_t* ids, int64_t cap, int64_t* counts,      \
                       float* m_new, float* csum);

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

//: the bound on the top-k's ids (2³¹ − 1: its order keys take ids below it; topk_chunk_update.cpp)
constexpr int64_t kTopkIdLimit = (int64_t{1} << 31) - 1;

//: largest head_dim qk_norm_rope_rows takes (the normalised head is kept in a stack buffer)
constexpr int64_t kMaxHeadDim = 512;

namespace avx512 {
ACR_LAYER_DECLARE_KERNELS
}
namespace avx2 {
ACR_LAYER_DECLARE_KERNELS
}
namespace base {
ACR_LAYER_DECLARE_KERNELS
}

enum class Isa { base, avx2, avx512 };

// The build this process runs, chosen once: the widest the CPU has (AVX-512 F/BW/VL/DQ, else
// AVX2+FMA, else the baseline), unless ACARERANK_CPU_LAYER_ISA names one (auto, avx512, avx2,
// baseline) or ACARERANK_CPU_BASELINE=1 asks for the baseline. nullptr and *why set when the
// variable names a build this CPU cannot run or no build at all (layer_glue.h turns it into an error).
const Isa* chosen_isa(const char** why);
const char* isa_name(Isa isa);

}  // namespace acr_layer

#define ACR_LAYER_KERNEL(isa, fn, ...)                                            \
  ((isa) == acr_layer::Isa::avx512 ? acr_layer::avx512::fn(__VA_ARGS__)           \
   : (isa) == acr_layer::Isa::avx2 ? acr_layer::avx2::fn(__VA_ARGS__)             \
                                   : acr_layer::base::fn(__VA_ARGS__))
