// layer_kernels_impl.h for the baseline ISA of the build (any x86-64, or another CPU), and the
// run-time choice between it and the AVX2 build (layer_kernels.h).
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "layer_kernels.h"

#define ACR_LAYER_ISA base
#include "layer_kernels_impl.h"
#undef ACR_LAYER_ISA

namespace acr_layer {

// ACARERANK_CPU_BASELINE=1 forces the baseline build (tests run both builds on one machine)
bool use_avx2() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          !(std::getenv("ACARERANK_CPU_BASELINE") && std::strcmp(std::getenv("ACARERANK_CPU_BASELINE"), "1") == 0);
  return yes;
#else
  return false;
#endif
}

}  // namespace acr_layer
