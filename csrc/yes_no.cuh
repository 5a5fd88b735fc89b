// Fused yes/no head of Qwen3-Reranker (docs/ARCHITECTURE.md, "Scoring facts"): two logits, never the vocabulary.
//
//   r          = 1 / sqrt(Σ h² / H + eps)                      (final RMSNorm)
//   logit_diff = r · Σ h · norm_w · (w_yes − w_no)            (= logit_yes − logit_no)
//   score      = sigmoid(logit_diff)
//
// A row is split over `nlanes` lanes (a CUDA warp, or one CPU thread); each lane sums a
// strided slice in Acc (float on GPU, double on CPU), the caller adds the lanes up and
// calls yes_no_finish.
#pragma once

#include "common.cuh"

namespace acr {

template <typename Acc>
struct YesNoSums {
  Acc sq;    // Σ h²
  Acc diff;  // Σ h · norm_w · (w_yes − w_no)
};

template <typename Acc, typename T>
ACR_HD YesNoSums<Acc> yes_no_partial(const T* h, const float* norm_w, const float* w_yes, const float* w_no,
                                     int H, int lane, int nlanes) {
  YesNoSums<Acc> s{Acc(0), Acc(0)};
  for (int i = lane; i < H; i += nlanes) {
    const Acc x = static_cast<Acc>(to_float(h[i]));
    s.sq += x * x;
    s.diff += x * static_cast<Acc>(norm_w[i]) * (static_cast<Acc>(w_yes[i]) - static_cast<Acc>(w_no[i]));
  }
  return s;
}

template <typename Acc>
ACR_HD void yes_no_finish(YesNoSums<Acc> s, int H, float eps, float* score, float* logit_diff) {
  const Acc r = Acc(1) / sqrt(s.sq / static_cast<Acc>(H) + static_cast<Acc>(eps));
  const Acc d = r * s.diff;
  *logit_diff = static_cast<float>(d);
  *score = static_cast<float>(Acc(1) / (Acc(1) + exp(-d)));  // exp overflow -> score 0, as sigmoid
}

}  // namespace acr
