// Host helpers: argument checks, OpenMP thread count (OpenMP is optional: without it the
// CPU twins run their row loops on one thread).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace acr {

// num_threads <= 0: the OpenMP default. The glue passes torch.get_num_threads() so the
// extension never uses more cores than torch was told to.
inline int resolve_threads(int num_threads) {
#ifdef _OPENMP
  return num_threads > 0 ? num_threads : omp_get_max_threads();
#else
  (void)num_threads;
  return 1;
#endif
}

inline void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

inline int next_pow2(int64_t x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

}  // namespace acr
