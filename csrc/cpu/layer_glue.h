// What the element-wise ops' glue (norm.cpp, qk_norm_rope.cpp, activation.cpp) shares: torch's
// headers, at::parallel_for, the row kernels (layer_kernels.h) and the rows-per-chunk rule.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "layer_kernels.h"

namespace acarerank_cpu {

// rows per at::parallel_for chunk: about 32k elements of work per chunk, so a short pass stays
// on one thread (the fork costs more than the work) and a long one uses every core.
inline int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

}  // namespace acarerank_cpu
