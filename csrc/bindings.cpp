// acarerank._C: the one binding file. Every function takes keyword arguments only —
// data pointers as integers (tensor.data_ptr()), sizes, strides — and fills a plain args
// struct (ops.h). The Python side is acarerank/ops/_cpp.py.
#include <pybind11/pybind11.h>

#include "ops.h"
#include "topk_merge.cuh"

#ifndef ACARERANK_CUDA_ARCHS
#define ACARERANK_CUDA_ARCHS ""
#endif
#ifndef ACARERANK_CUDA_COMPILER_VERSION
#define ACARERANK_CUDA_COMPILER_VERSION ""
#endif
#ifndef ACARERANK_NO_CUDA_REASON
#define ACARERANK_NO_CUDA_REASON ""
#endif

namespace py = pybind11;
using namespace acr;

namespace {

#ifdef ACARERANK_WITH_CUDA
constexpr bool kHasCuda = true;
#else
constexpr bool kHasCuda = false;
#endif
#ifdef _OPENMP
constexpr bool kHasOpenMP = true;
#else
constexpr bool kHasOpenMP = false;
#endif

#define TOPK_UPDATE_PARAMS                                                                                          \
  uintptr_t logits, int dtype, int64_t rows, int64_t n, int64_t row_stride, int64_t c0, float temperature,        \
      uintptr_t vals, uintptr_t ids, int64_t k, uintptr_t row_max, uintptr_t row_sumexp, uintptr_t targets,       \
      uintptr_t target_logit
#define TOPK_UPDATE_ARGS                                                                                     \
  TopKUpdateArgs{logits, dtype, rows, n, row_stride, c0, temperature, vals, ids, k, row_max, row_sumexp, targets, \
                 target_logit}
#define TOPK_UPDATE_PYARGS                                                                                     \
  py::arg("logits"), py::arg("dtype"), py::arg("rows"), py::arg("n"), py::arg("row_stride"), py::arg("c0"),  \
      py::arg("temperature"), py::arg("vals"), py::arg("ids"), py::arg("k"), py::arg("row_max"),             \
      py::arg("row_sumexp"), py::arg("targets"), py::arg("target_logit")

#define YES_NO_PARAMS                                                                                      \
  uintptr_t hidden, int dtype, int64_t rows, int64_t H, int64_t row_stride, uintptr_t norm_w, uintptr_t w_yes, \
      uintptr_t w_no, float eps, uintptr_t score, uintptr_t logit_diff
#define YES_NO_ARGS YesNoArgs{hidden, dtype, rows, H, row_stride, norm_w, w_yes, w_no, eps, score, logit_diff}
#define YES_NO_PYARGS                                                                                          \
  py::arg("hidden"), py::arg("dtype"), py::arg("rows"), py::arg("H"), py::arg("row_stride"), py::arg("norm_w"), \
      py::arg("w_yes"), py::arg("w_no"), py::arg("eps"), py::arg("score"), py::arg("logit_diff")

#define MERGE_PARAMS                                                                                            \
  int dtype, int64_t N, int64_t Hh, int64_t d, uintptr_t o_a, int64_t o_a_s0, int64_t o_a_s1, uintptr_t lse_a,  \
      int64_t lse_a_s0, int64_t lse_a_s1, uintptr_t o_b, int64_t o_b_s0, int64_t o_b_s1, uintptr_t lse_b,       \
      int64_t lse_b_s0, int64_t lse_b_s1, uintptr_t out, uintptr_t lse_out
#define MERGE_ARGS                                                                                                 \
  MergeStatesArgs{dtype, N, Hh, d, o_a, o_a_s0, o_a_s1, lse_a, lse_a_s0, lse_a_s1, o_b, o_b_s0, o_b_s1, lse_b, \
                  lse_b_s0, lse_b_s1, out, lse_out}
#define MERGE_PYARGS                                                                                             \
  py::arg("dtype"), py::arg("N"), py::arg("Hh"), py::arg("d"), py::arg("o_a"), py::arg("o_a_s0"),               \
      py::arg("o_a_s1"), py::arg("lse_a"), py::arg("lse_a_s0"), py::arg("lse_a_s1"), py::arg("o_b"),            \
      py::arg("o_b_s0"), py::arg("o_b_s1"), py::arg("lse_b"), py::arg("lse_b_s0"), py::arg("lse_b_s1"),        \
      py::arg("out"), py::arg("lse_out")

py::dict build_info() {
  py::dict d;
  d["has_cuda"] = kHasCuda;
  d["cuda_archs"] = std::string(ACARERANK_CUDA_ARCHS);
  d["cuda_compiler_version"] = std::string(ACARERANK_CUDA_COMPILER_VERSION);
  d["no_cuda_reason"] = std::string(ACARERANK_NO_CUDA_REASON);
#ifdef ACARERANK_WITH_CUDA
  d["cuda_runtime"] = cuda_runtime_info();  // live: runtime/driver versions, device count
#else
  d["cuda_runtime"] = std::string("");
#endif
  d["openmp"] = kHasOpenMP;
  d["topk_max_k"] = kTopKMax;
#if defined(__clang__)
  d["cxx_compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  d["cxx_compiler"] = std::string("gcc ") + __VERSION__;
#else
  d["cxx_compiler"] = std::string("unknown");
#endif
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "acarerank CUDA kernels and their C++ CPU twins (raw pointers, no libtorch); use acarerank.ops, not this "
      "module directly. has_cuda says whether the CUDA kernels were compiled in.";
  m.attr("has_cuda") = kHasCuda;
  m.attr("cuda_archs") = std::string(ACARERANK_CUDA_ARCHS);
  m.attr("topk_max_k") = kTopKMax;
  m.def("build_info", &build_info, "What this build holds: CUDA (archs, nvcc version, live runtime), OpenMP.");

  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("topk_merge_update_cpu", [](TOPK_UPDATE_PARAMS, int num_threads, int64_t buf_cap) {
    topk_merge_update_cpu(TOPK_UPDATE_ARGS, num_threads, buf_cap);
  }, py::kw_only(), TOPK_UPDATE_PYARGS, py::arg("num_threads"), py::arg("buf_cap") = 0, nogil);
  m.def("yes_no_cpu", [](YES_NO_PARAMS, int num_threads) { yes_no_cpu(YES_NO_ARGS, num_threads); },
        py::kw_only(), YES_NO_PYARGS, py::arg("num_threads"), nogil);
  m.def("merge_states_cpu", [](MERGE_PARAMS, int num_threads) { merge_states_cpu(MERGE_ARGS, num_threads); },
        py::kw_only(), MERGE_PYARGS, py::arg("num_threads"), nogil);

#ifdef ACARERANK_WITH_CUDA
  m.def("topk_merge_update_cuda", [](TOPK_UPDATE_PARAMS, int device, uintptr_t stream) {
    topk_merge_update_cuda(TOPK_UPDATE_ARGS, CudaLaunch{device, stream});
  }, py::kw_only(), TOPK_UPDATE_PYARGS, py::arg("device"), py::arg("stream"), nogil);
  m.def("yes_no_cuda", [](YES_NO_PARAMS, int device, uintptr_t stream) {
    yes_no_cuda(YES_NO_ARGS, CudaLaunch{device, stream});
  }, py::kw_only(), YES_NO_PYARGS, py::arg("device"), py::arg("stream"), nogil);
  m.def("merge_states_cuda", [](MERGE_PARAMS, int device, uintptr_t stream) {
    merge_states_cuda(MERGE_ARGS, CudaLaunch{device, stream});
  }, py::kw_only(), MERGE_PYARGS, py::arg("device"), py::arg("stream"), nogil);
#endif
}
