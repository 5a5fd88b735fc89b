// Loads and stores of activations (fp32 or bf16) as fp32 vectors, for the element-wise CPU
// kernels of the decoder layer (docs/ARCHITECTURE.md, "Native CPU ops around attention").
//
// Every kernel computes in fp32 and rounds once per stored element; these helpers convert one
// at::vec::Vectorized<float> (8 lanes on AVX2, 16 on AVX-512) at a time, with a lane count for
// row tails, so a row of any length (not a multiple of the vector width) is read and written
// exactly, never past its end.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>

namespace acarerank_cpu {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = fVec::size();

static_assert(at::vec::Vectorized<at::BFloat16>::size() == 2 * fVec::size(),
              "a bf16 vector holds two fp32 vectors' lanes");

// n (1..kLanes) elements at p as fp32; lanes past n are zero.
inline fVec load_f32(const float* p, int64_t n) { return fVec::loadu(p, n); }

inline fVec load_f32(const at::BFloat16* p, int64_t n) {
  auto b = at::vec::Vectorized<at::BFloat16>::loadu(p, n);
  return std::get<0>(at::vec::convert_to_float<at::BFloat16>(b));
}

// the first n (1..kLanes) lanes of v, rounded to the element type (round-to-nearest-even).
inline void store_f32(float* p, const fVec& v, int64_t n) { v.store(p, n); }

inline void store_f32(at::BFloat16* p, const fVec& v, int64_t n) {
  at::vec::convert_from_float<at::BFloat16>(v, v).store(p, n);
}

// v rounded to the element type and back (identity for fp32): what a store then a load gives.
inline fVec round_to(const fVec& v, const float*) { return v; }

inline fVec round_to(const fVec& v, const at::BFloat16*) {
  auto b = at::vec::convert_from_float<at::BFloat16>(v, v);
  return std::get<0>(at::vec::convert_to_float<at::BFloat16>(b));
}

inline int64_t lanes_left(int64_t i, int64_t n) { return std::min(kLanes, n - i); }

// rows per at::parallel_for chunk: about 32k elements of work per chunk, so a short pass stays
// on one thread (the fork costs more than the work) and a long one uses every core.
inline int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

}  // namespace acarerank_cpu
