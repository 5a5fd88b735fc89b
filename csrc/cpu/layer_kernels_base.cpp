// layer_kernels_impl.h for the baseline ISA of the build (any x86-64, or another CPU), and the
// run-time choice between the builds (layer_kernels.h).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "layer_kernels.h"

#define ACR_LAYER_ISA base
#include "layer_kernels_impl.h"
#undef ACR_LAYER_ISA

namespace acr_layer {

namespace {

bool cpu_has(Isa isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == Isa::avx2) return avx2;
  if (isa == Isa::avx512)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return true;
#else
  return isa == Isa::base;
#endif
}

// ACARERANK_CPU_BASELINE: unset, "" or "0" off, "1" on; anything else (true, yes, " 1") was read
// as off, silently (attn_tiles.h's cpu_baseline_forced refuses it by name)
bool baseline_env_valid() {
  const char* e = std::getenv("ACARERANK_CPU_BASELINE");
  return e == nullptr || *e == '\0' || std::strcmp(e, "0") == 0 || std::strcmp(e, "1") == 0;
}
bool baseline_env_on() {
  const char* e = std::getenv("ACARERANK_CPU_BASELINE");
  return e != nullptr && std::strcmp(e, "1") == 0;
}

// what chosen_isa() holds once: the build, or why there is none
struct Choice {
  Isa isa = Isa::base;
  const char* why = nullptr;
};

Choice choose() {
  const char* want = std::getenv("ACARERANK_CPU_LAYER_ISA");
  if (!baseline_env_valid()) return {Isa::base, "ACARERANK_CPU_BASELINE must be 0 or 1 (or unset)"};
  if (want == nullptr || *want == '\0' || std::strcmp(want, "auto") == 0) {
    if (baseline_env_on()) return {Isa::base};
    return {cpu_has(Isa::avx512) ? Isa::avx512 : cpu_has(Isa::avx2) ? Isa::avx2 : Isa::base};
  }
  for (Isa isa : {Isa::avx512, Isa::avx2, Isa::base}) {
    if (std::strcmp(want, isa_name(isa)) != 0) continue;
    if (cpu_has(isa)) return {isa};
    return {isa, isa == Isa::avx512 ? "ACARERANK_CPU_LAYER_ISA=avx512, but this CPU lacks AVX-512 F/BW/VL/DQ; "
                                      "use auto, avx2 or baseline"
                                    : "ACARERANK_CPU_LAYER_ISA=avx2, but this CPU lacks AVX2+FMA; "
                                      "use auto or baseline"};
  }
  return {Isa::base, "ACARERANK_CPU_LAYER_ISA must be auto, avx512, avx2 or baseline"};
}

}  // namespace

const char* isa_name(Isa isa) {
  return isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "baseline";
}

const Isa* chosen_isa(const char** why) {
  static const Choice choice = choose();
  *why = choice.why;
  return choice.why ? nullptr : &choice.isa;
}

}  // namespace acr_layer
