// What the element-wise ops' glue (norm.cpp, qk_norm_rope.cpp, activation.cpp) shares: torch's
// headers, at::parallel_for, the row kernels (layer_kernels.h), their build and the rows-per-chunk rule.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "layer_kernels.h"

namespace acarerank_cpu {

// rows per at::parallel_for chunk: about 32k elements of work per chunk, so a short pass stays
// on one thread (the fork costs more than the work) and a long one uses every core.
inline int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

// The row kernels' build for this process (layer_kernels.h, chosen once); an error naming
// ACARERANK_CPU_LAYER_ISA when it asks for a build this CPU cannot run. Called by the glue before
// at::parallel_for, so the error reaches the caller from its own thread.
inline acr_layer::Isa checked_layer_isa() {
  const char* why = nullptr;
  const acr_layer::Isa* isa = acr_layer::chosen_isa(&why);
  TORCH_CHECK(isa != nullptr, why, " (got '", std::getenv("ACARERANK_CPU_LAYER_ISA"), "')");
  return *isa;
}

}  // namespace acarerank_cpu
