// layer_kernels_impl.h compiled for AVX-512 (F, BW, VL, DQ; 16 fp32 lanes), the same way as the
// AVX2 build (layer_kernels_avx2.cpp). Called only when acr_layer::chosen_isa() is Isa::avx512.
// On x86-64 its top-k row is written in intrinsics (ACR_LAYER_AVX512_INTRINSICS).
#include <cstdint>

#include "layer_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>  // outside the target region: the intrinsics carry their own targets
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#define ACR_LAYER_ISA avx512
#define ACR_LAYER_AVX512_INTRINSICS 1
#include "layer_kernels_impl.h"
#undef ACR_LAYER_AVX512_INTRINSICS
#undef ACR_LAYER_ISA
#pragma GCC pop_options
#elif defined(__x86_64__) && defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))), apply_to = function)
#define ACR_LAYER_ISA avx512
#define ACR_LAYER_AVX512_INTRINSICS 1
#include "layer_kernels_impl.h"
#undef ACR_LAYER_AVX512_INTRINSICS
#undef ACR_LAYER_ISA
#pragma clang attribute pop
#else
// not x86-64: use_avx512() is false and these are never called; the baseline build stands in
#define ACR_LAYER_ISA avx512
#include "layer_kernels_impl.h"
#undef ACR_LAYER_ISA
#endif
