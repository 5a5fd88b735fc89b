// acarerank::vec_add(a, b) = a + b: the smallest op of the extension. It exists to prove the
// build end to end (TORCH_LIBRARY registration, at::vec, at::parallel_for on torch's OpenMP
// runtime) and is tested against torch's own add (tests/ops/test_native_ext.py).
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "common.h"

namespace {

at::Tensor vec_add(const at::Tensor& a, const at::Tensor& b) {
  constexpr const char* op = "vec_add";
  ACR_CHECK_CPU(op, a, "a");
  ACR_CHECK_CPU(op, b, "b");
  ACR_CHECK_DTYPE(op, a, "a", at::kFloat);
  ACR_CHECK_DTYPE(op, b, "b", at::kFloat);
  TORCH_CHECK(a.sizes() == b.sizes(), op, ": a ", a.sizes(), " and b ", b.sizes(), " differ in shape");
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor out = at::empty_like(ac);
  const float* pa = ac.const_data_ptr<float>();
  const float* pb = bc.const_data_ptr<float>();
  float* po = out.data_ptr<float>();
  using Vec = at::vec::Vectorized<float>;
  at::parallel_for(0, ac.numel(), 4096, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + Vec::size() <= end; i += Vec::size())
      (Vec::loadu(pa + i) + Vec::loadu(pb + i)).store(po + i);
    for (; i < end; ++i) po[i] = pa[i] + pb[i];
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(acarerank, m) {
  m.def("vec_add(Tensor a, Tensor b) -> Tensor");
}

TORCH_LIBRARY_IMPL(acarerank, CPU, m) {
  m.impl("vec_add", &vec_add);
}
