// layer_kernels_impl.h compiled for AVX2 + FMA (every function of this file, nothing else: it
// includes no library header after the target switch). Called only when acr_layer::chosen_isa() is Isa::avx2.
#include <cstdint>

#include "layer_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define ACR_LAYER_ISA avx2
#include "layer_kernels_impl.h"
#undef ACR_LAYER_ISA
#pragma GCC pop_options
#elif defined(__x86_64__) && defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#define ACR_LAYER_ISA avx2
#include "layer_kernels_impl.h"
#undef ACR_LAYER_ISA
#pragma clang attribute pop
#else
// not x86-64: use_avx2() is false and these are never called; the baseline build stands in
#define ACR_LAYER_ISA avx2
#include "layer_kernels_impl.h"
#undef ACR_LAYER_ISA
#endif
