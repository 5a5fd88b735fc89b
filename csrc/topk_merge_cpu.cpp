// CPU twin of the streaming top-k merge: the same row algorithm as the CUDA kernel
// (topk_merge.cuh), run by one thread per row (SerialGroup), OpenMP over rows.
#include <limits>
#include <vector>

#include "host_utils.h"
#include "ops.h"
#include "topk_merge.cuh"

namespace acr {

void check_topk_update(const TopKUpdateArgs& a) {
  require(a.rows >= 0 && a.n >= 0, "topk_merge_update: rows and chunk width must be >= 0");
  require(a.k >= 1 && a.k <= kTopKMax,
          "topk_merge_update: k=" + std::to_string(a.k) + " must be in [1, " + std::to_string(kTopKMax) + "]");
  require(a.n + a.k <= std::numeric_limits<int>::max(), "topk_merge_update: chunk width + k must fit in int32");
  require(a.rows <= 1 || a.row_stride >= a.n, "topk_merge_update: row_stride is smaller than the chunk width");
  require(a.c0 >= 0 && a.c0 + a.n <= std::numeric_limits<int32_t>::max(),
          "topk_merge_update: vocabulary ids c0 .. c0+n must lie in [0, 2^31)");
  require(a.temperature > 0.0f && a.temperature < INFINITY,
          "topk_merge_update: temperature must be finite and > 0, got " + std::to_string(a.temperature));
  require(a.dtype == kFloat32 || a.dtype == kFloat16 || a.dtype == kBFloat16,
          "topk_merge_update: unknown dtype code " + std::to_string(a.dtype));
  require(a.rows == 0 || (a.vals && a.ids && a.row_max && a.row_sumexp && a.target_logit && (a.n == 0 || a.logits)),
          "topk_merge_update: null data pointer");
}

void topk_merge_update_cpu(const TopKUpdateArgs& a, int num_threads, int64_t buf_cap) {
  check_topk_update(a);
  require(a.dtype == kFloat32, "topk_merge_update_cpu: logits must be float32 (the Python glue upcasts)");
  const int k = static_cast<int>(a.k);
  const int kpad = next_pow2(k);
  const float* logits = reinterpret_cast<const float*>(a.logits);
  float* vals = reinterpret_cast<float*>(a.vals);
  int32_t* ids = reinterpret_cast<int32_t*>(a.ids);
  float* row_max = reinterpret_cast<float*>(a.row_max);
  double* row_sumexp = reinterpret_cast<double*>(a.row_sumexp);
  const int64_t* targets = reinterpret_cast<const int64_t*>(a.targets);
  float* target_logit = reinterpret_cast<float*>(a.target_logit);
  const int nt = resolve_threads(num_threads);
  (void)nt;
  // Threads only for real work: this libgomp and torch's are two runtimes, and ours spins
  // for a while after each parallel region, stealing cores from torch's next op.
#pragma omp parallel num_threads(nt) if (a.rows > 1 && a.rows * (a.n + a.k) >= (1 << 18))
  {
    // per-thread scratch; by default the candidate buffer holds every candidate (no overflow)
    const int64_t cap = buf_cap > 0 && buf_cap < k + a.n ? buf_cap : k + a.n;
    std::vector<uint64_t> keys(kpad), buf(static_cast<size_t>(cap));
    TopKShared sh;
    float red_m;
    double red_s;
    const TopKScratch w{&sh, keys.data(), kpad, buf.data(), static_cast<int>(buf.size()), &red_m, &red_s};
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < a.rows; ++r) {
      const TopKChunk<float> c{logits + r * a.row_stride, static_cast<int>(a.n), a.c0, a.temperature};
      const TopKRowState st{vals + r * k, ids + r * k, k, row_max + r, row_sumexp + r,
                            targets ? targets[r] : -1, target_logit + r};
      topk_merge_row_update(SerialGroup{}, c, st, w);
    }
  }
}

}  // namespace acr
