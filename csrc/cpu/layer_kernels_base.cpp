// layer_kernels_impl.h for the baseline ISA of the build (any x86-64, or another CPU), and the
// run-time choice between it and the AVX2 build (layer_kernels.h).
#include <cstdint>

#include "layer_kernels.h"

#define ACR_LAYER_ISA base
#include "layer_kernels_impl.h"
#undef ACR_LAYER_ISA

namespace acr_layer {

bool use_avx2() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

}  // namespace acr_layer
