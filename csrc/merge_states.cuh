// Merge two partial attention results over disjoint key sets (the cascade's last step):
//
//   m   = max(lse_a, lse_b),  w_a = exp(lse_a − m),  w_b = exp(lse_b − m)
//   out = (o_a · w_a + o_b · w_b) / (w_a + w_b)
//   lse = m + log(w_a + w_b)
//
// equal to (o_a·e^{lse_a} + o_b·e^{lse_b}) / (e^{lse_a} + e^{lse_b}) without overflow.
// A part with lse = −inf (no keys) has weight exactly 0 and its o is never read into the
// sum (so NaN/garbage there cannot leak); both −inf gives out = 0, lse = −inf.
// One (token, head) row of head_dim d is split over `nlanes` lanes (a CUDA warp or one CPU
// thread); Acc is float on GPU, double on CPU.
#pragma once

#include "common.cuh"

namespace acr {

template <typename Acc, typename T>
ACR_HD void merge_state_row(const T* o_a, float lse_a, const T* o_b, float lse_b, T* out, float* lse_out,
                            int d, int lane, int nlanes) {
  const float m = lse_a > lse_b ? lse_a : lse_b;  // a NaN lse makes m or a weight NaN: it propagates
  if (m == -INFINITY) {
    for (int i = lane; i < d; i += nlanes) store_float(out + i, 0.0f);
    if (lane == 0) *lse_out = -INFINITY;
    return;
  }
  // the part holding the max gets weight exactly 1 (also when both are +inf)
  const Acc w_a = lse_a == m ? Acc(1) : exp(static_cast<Acc>(lse_a) - static_cast<Acc>(m));
  const Acc w_b = lse_b == m ? Acc(1) : exp(static_cast<Acc>(lse_b) - static_cast<Acc>(m));
  const Acc inv = Acc(1) / (w_a + w_b);
  for (int i = lane; i < d; i += nlanes) {
    Acc v = Acc(0);
    if (w_a != Acc(0)) v += static_cast<Acc>(to_float(o_a[i])) * w_a;
    if (w_b != Acc(0)) v += static_cast<Acc>(to_float(o_b[i])) * w_b;
    store_float(out + i, static_cast<float>(v * inv));
  }
  if (lane == 0) *lse_out = static_cast<float>(static_cast<Acc>(m) + log(w_a + w_b));
}

}  // namespace acr
