// Host entry points of acarerank._C: plain pointers, sizes and strides, no torch types.
// The CPU twins are always built; the *_cuda launchers exist when ACARERANK_WITH_CUDA is
// defined (nvcc found and ACARERANK_NO_CUDA off). Pointers arrive as integers from
// acarerank/ops/_cpp.py, which checks shapes, dtypes and devices; these functions re-check
// only what would corrupt memory and throw std::invalid_argument (Python ValueError).
#pragma once

#include <cstdint>
#include <string>

namespace acr {

// Streaming top-k merge (topk_merge.cuh). Row r of the chunk is logits[r*row_stride + j],
// j < n, vocabulary ids c0 + j; state arrays are contiguous [rows, k] / [rows].
struct TopKUpdateArgs {
  uintptr_t logits;       // const T*   (T by dtype)
  int dtype;              // DType code; CPU twin: float32 only
  int64_t rows, n, row_stride, c0;
  float temperature;
  uintptr_t vals;         // float   [rows, k]
  uintptr_t ids;          // int32   [rows, k]
  int64_t k;
  uintptr_t row_max;      // float   [rows]
  uintptr_t row_sumexp;   // double  [rows]
  uintptr_t targets;      // int64   [rows], or 0 for none
  uintptr_t target_logit; // float   [rows]
};

// Yes/no head (yes_no.cuh): hidden row r is hidden[r*row_stride + i], i < H; weights fp32 [H].
struct YesNoArgs {
  uintptr_t hidden;
  int dtype;
  int64_t rows, H, row_stride;
  uintptr_t norm_w, w_yes, w_no;
  float eps;
  uintptr_t score, logit_diff;  // float [rows]
};

// Attention-state merge (merge_states.cuh): o_* [N, Hh, d] with strides (s0, s1, 1), lse_*
// [N, Hh] with strides (s0, s1); out contiguous [N, Hh, d] (o's dtype), lse_out fp32 [N, Hh].
struct MergeStatesArgs {
  int dtype;
  int64_t N, Hh, d;
  uintptr_t o_a; int64_t o_a_s0, o_a_s1;
  uintptr_t lse_a; int64_t lse_a_s0, lse_a_s1;
  uintptr_t o_b; int64_t o_b_s0, o_b_s1;
  uintptr_t lse_b; int64_t lse_b_s0, lse_b_s1;
  uintptr_t out, lse_out;
};

// CUDA launches go to `stream` (a cudaStream_t as an integer, e.g. torch's
// current_stream().cuda_stream) on `device`; the caller's current device is restored.
struct CudaLaunch {
  int device;
  uintptr_t stream;
};

void check_topk_update(const TopKUpdateArgs& a);
void check_yes_no(const YesNoArgs& a);
void check_merge_states(const MergeStatesArgs& a);

// buf_cap > 0 caps the pass-0 candidate buffer (tests force the GPU's overflow path with it)
void topk_merge_update_cpu(const TopKUpdateArgs& a, int num_threads, int64_t buf_cap = 0);
void yes_no_cpu(const YesNoArgs& a, int num_threads);
void merge_states_cpu(const MergeStatesArgs& a, int num_threads);

#ifdef ACARERANK_WITH_CUDA
void topk_merge_update_cuda(const TopKUpdateArgs& a, const CudaLaunch& l);
void yes_no_cuda(const YesNoArgs& a, const CudaLaunch& l);
void merge_states_cuda(const MergeStatesArgs& a, const CudaLaunch& l);
std::string cuda_runtime_info();  // "runtime X.Y, driver X.Y, N devices" or the error
#endif

}  // namespace acr
