// Shared helpers of the native CPU kernels (acarerank._cpu): input checks with messages a user
// can act on. Every op in csrc/cpu/*.cpp registers itself with
//   TORCH_LIBRARY_FRAGMENT(acarerank, m) { m.def("name(Tensor x, ...) -> Tensor"); }
//   TORCH_LIBRARY_IMPL(acarerank, CPU, m) { m.impl("name", &fn); }
// and becomes torch.ops.acarerank.name (docs/ARCHITECTURE.md, "Native CPU kernels").
#pragma once

#include <ATen/ATen.h>

#define ACR_CHECK_CPU(op, t, name) \
  TORCH_CHECK((t).device().is_cpu(), op, ": ", name, " must be a CPU tensor, got one on ", (t).device())

#define ACR_CHECK_DTYPE(op, t, name, dt) \
  TORCH_CHECK((t).scalar_type() == (dt), op, ": ", name, " must be ", (dt), ", got ", (t).scalar_type())

#define ACR_CHECK_DIM(op, t, name, n) \
  TORCH_CHECK((t).dim() == (n), op, ": ", name, " must be ", n, "-D, got shape ", (t).sizes())
