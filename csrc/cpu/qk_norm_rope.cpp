// Qwen3's per-head q/k RMSNorm + RoPE (rotate-half / neox form) in one pass over the QKV
// projection output (docs/ARCHITECTURE.md, "Native CPU ops around attention"); the reference is
// acarerank/ops/qk_norm_rope.py's qk_norm_rope_ref.
//
//   qkv [T, (Hq + 2·Hkv)·d] -> q [T, Hq, d], k [T, Hkv, d], v [T, Hkv, d]
//   for each q head (weight q_w) and k head (weight k_w), with h = d/2:
//     x̂ = x / sqrt(mean(x²) + eps) · w
//     out[i]     = x̂[i]·cos[i]     − x̂[h+i]·sin[i]
//     out[h + i] = x̂[h+i]·cos[h+i] + x̂[i]·sin[h+i]        (i < h)
//   v is copied out unchanged.
//
// Optional page write (k_cache, v_cache [num_blocks, block_size, Hkv, d] in qkv's dtype, slots
// int64 [T]): row t's k and v are also stored at flat slot slots[t] of the caches (block
// slot / block_size, offset slot % block_size), in the same pass, while the row is in L1 — the
// same bits as the returned k, v, so a caller that attends to k, v needs no second copy
// (docs/ARCHITECTURE.md, "Native CPU ops around attention"). Every slot is checked before any
// write: in [0, num_blocks·block_size) and unique (two rows on one slot would race across
// threads), so a bad slot is an error naming it and the caches are untouched.
//
// cos, sin: [T, d] of the rows' positions, fp32 or the activation dtype (read as stored; the
// math is fp32 either way, so fp32 tables never need a cast to the activation dtype). One
// rounding per stored element; the normalised head stays in an fp32 buffer on the stack. Rows are
// split over at::parallel_for; the row kernel is layer_kernels.h's (AVX-512, AVX2 or baseline build, chosen at run time).
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "layer_glue.h"

namespace acarerank_cpu {
namespace {

using acr_layer::kMaxHeadDim;

// T: the activation type, K: its kernel type (bf16 as uint16_t bits), C/CK: the same for the tables
template <typename T, typename K, typename C, typename CK>
void qk_norm_rope_kernel(const at::Tensor& qkv, const at::Tensor& qw, const at::Tensor& kw, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor& q, at::Tensor& k, at::Tensor& v, int64_t Hq,
                         int64_t Hkv, int64_t d, double eps, const std::optional<at::Tensor>& k_cache,
                         const std::optional<at::Tensor>& v_cache, const std::optional<at::Tensor>& slots) {
  const int64_t rows = qkv.size(0), width = (Hq + 2 * Hkv) * d;
  auto in = [](const at::Tensor& t) { return reinterpret_cast<const K*>(t.const_data_ptr<T>()); };
  auto out = [](at::Tensor& t) { return reinterpret_cast<K*>(t.mutable_data_ptr<T>()); };
  const K *src = in(qkv), *qwp = in(qw), *kwp = in(kw);
  const CK* cp = reinterpret_cast<const CK*>(cos.const_data_ptr<C>());
  const CK* sp = reinterpret_cast<const CK*>(sin.const_data_ptr<C>());
  K *qp = out(q), *kp = out(k), *vp = out(v);
  K* kc = k_cache ? reinterpret_cast<K*>(k_cache->mutable_data_ptr<T>()) : nullptr;
  K* vc = v_cache ? reinterpret_cast<K*>(v_cache->mutable_data_ptr<T>()) : nullptr;
  const int64_t* slot = slots ? slots->const_data_ptr<int64_t>() : nullptr;
  const acr_layer::Isa isa = checked_layer_isa();
  at::parallel_for(0, rows, row_grain(width), [&](int64_t r0, int64_t r1) {
    const acr_layer::PageWrite<K> pages{kc, vc, slot ? slot + r0 : nullptr};
    ACR_LAYER_KERNEL(isa, qk_norm_rope_rows, src + r0 * width, qwp, kwp, cp + r0 * d, sp + r0 * d, qp + r0 * Hq * d,
                     kp + r0 * Hkv * d, vp + r0 * Hkv * d, r1 - r0, Hq, Hkv, d, static_cast<float>(eps), pages);
  });
}

// The page write's inputs (file comment): all three or none, caches [num_blocks, block_size,
// Hkv, d] in qkv's dtype, contiguous, not sharing memory with each other or qkv; slots int64 [T],
// each in range, no two equal. Returns whether there is a page write.
bool check_page_write(const char* op, const at::Tensor& qkv, const std::optional<at::Tensor>& k_cache,
                      const std::optional<at::Tensor>& v_cache, const std::optional<at::Tensor>& slots,
                      int64_t Hkv, int64_t d) {
  const int given = k_cache.has_value() + v_cache.has_value() + slots.has_value();
  if (given == 0) return false;
  TORCH_CHECK(given == 3, op, ": k_cache, v_cache and slots go together (got ", given, " of the 3)");
  const at::Tensor &kc = *k_cache, &vc = *v_cache, &sl = *slots;
  for (const at::Tensor* t : {&kc, &vc, &sl})
    TORCH_CHECK(t->device().is_cpu(), op, ": expects CPU tensors, got one on ", t->device());
  TORCH_CHECK(kc.dim() == 4 && kc.size(2) == Hkv && kc.size(3) == d, op,
              ": k_cache must be [num_blocks, block_size, ", Hkv, ", ", d, "], got ", kc.sizes());
  TORCH_CHECK(vc.sizes() == kc.sizes(), op, ": v_cache must have k_cache's shape ", kc.sizes(), ", got ",
              vc.sizes());
  TORCH_CHECK(kc.scalar_type() == qkv.scalar_type() && vc.scalar_type() == qkv.scalar_type(), op,
              ": k_cache/v_cache must be in qkv's dtype ", qkv.scalar_type(), ", got ", kc.scalar_type(), " and ",
              vc.scalar_type());
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous(), op, ": k_cache and v_cache must be contiguous (strides ",
              kc.strides(), " and ", vc.strides(), ")");
  TORCH_CHECK(!kc.is_alias_of(vc) && !kc.is_alias_of(qkv) && !vc.is_alias_of(qkv), op,
              ": k_cache, v_cache and qkv must not share memory");
  TORCH_CHECK(sl.scalar_type() == at::kLong, op, ": slots must be int64, got ", sl.scalar_type());
  TORCH_CHECK(sl.dim() == 1 && sl.size(0) == qkv.size(0), op, ": slots must be [T] = [", qkv.size(0), "], got ",
              sl.sizes());
  const int64_t T = sl.size(0), capacity = kc.size(0) * kc.size(1);
  const at::Tensor slc = sl.contiguous();
  const int64_t* p = slc.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(p[t] >= 0 && p[t] < capacity, op, ": slots[", t, "] = ", p[t], " is outside the caches' [0, ",
                capacity, ") (num_blocks·block_size = ", kc.size(0), "·", kc.size(1), ")");
  std::vector<int64_t> sorted(p, p + T);  // O(T log T) for T rows: nothing beside the rows' norm work
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  TORCH_CHECK(dup == sorted.end(), op, ": slot ", *dup,
              " appears more than once in slots (each new row needs its own slot)");
  return true;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_cpu(
    const at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight, const at::Tensor& cos,
    const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, double eps, const std::optional<at::Tensor>& k_cache,
    const std::optional<at::Tensor>& v_cache, const std::optional<at::Tensor>& slots) {
  const char* op = "qk_norm_rope_cpu";
  for (const at::Tensor* t : {&qkv, &q_weight, &k_weight, &cos, &sin})
    TORCH_CHECK(t->device().is_cpu(), op, ": expects CPU tensors, got one on ", t->device());
  const auto dt = qkv.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, op, ": qkv must be float32 or bfloat16, got ", dt);
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0, op, ": num_heads and num_kv_heads must be positive, got ",
              num_heads, " and ", num_kv_heads);
  const int64_t d = q_weight.numel();
  TORCH_CHECK(q_weight.dim() == 1 && k_weight.dim() == 1 && k_weight.numel() == d, op,
              ": q_weight and k_weight must both be [head_dim], got ", q_weight.sizes(), " and ", k_weight.sizes());
  TORCH_CHECK(d > 0 && d % 2 == 0 && d <= kMaxHeadDim, op, ": head_dim must be even and in [2, ", kMaxHeadDim,
              "], got ", d);
  TORCH_CHECK(q_weight.scalar_type() == dt && k_weight.scalar_type() == dt, op,
              ": q_weight/k_weight dtype must match qkv's ", dt);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * d, op, ": qkv must be [T, ",
              (num_heads + 2 * num_kv_heads) * d, "] (= (", num_heads, " + 2·", num_kv_heads, ")·", d, "), got ",
              qkv.sizes());
  const int64_t T = qkv.size(0);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == T && cos.size(1) == d, op,
              ": cos and sin must both be [", T, ", ", d, "], got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(cos.scalar_type() == sin.scalar_type() && (cos.scalar_type() == at::kFloat || cos.scalar_type() == dt),
              op, ": cos/sin must both be float32 or qkv's dtype ", dt, ", got ", cos.scalar_type(), " and ",
              sin.scalar_type());
  for (const at::Tensor* t : {&qkv, &q_weight, &k_weight, &cos, &sin})
    TORCH_CHECK(t->is_contiguous(), op, ": inputs must be contiguous (got strides ", t->strides(),
                "); call .contiguous() first");
  const bool paged = check_page_write(op, qkv, k_cache, v_cache, slots, num_kv_heads, d);
  const std::optional<at::Tensor> slots_c = paged ? std::optional<at::Tensor>(slots->contiguous()) : std::nullopt;
  auto q = at::empty({T, num_heads, d}, qkv.options());
  auto k = at::empty({T, num_kv_heads, d}, qkv.options());
  auto v = at::empty({T, num_kv_heads, d}, qkv.options());
  if (T == 0) return {q, k, v};
  const bool f32_tables = cos.scalar_type() == at::kFloat;
  if (dt == at::kFloat) {
    qk_norm_rope_kernel<float, float, float, float>(qkv, q_weight, k_weight, cos, sin, q, k, v, num_heads,
                                                    num_kv_heads, d, eps, k_cache, v_cache, slots_c);
  } else if (f32_tables) {
    qk_norm_rope_kernel<at::BFloat16, uint16_t, float, float>(qkv, q_weight, k_weight, cos, sin, q, k, v, num_heads,
                                                              num_kv_heads, d, eps, k_cache, v_cache, slots_c);
  } else {
    qk_norm_rope_kernel<at::BFloat16, uint16_t, at::BFloat16, uint16_t>(qkv, q_weight, k_weight, cos, sin, q, k, v,
                                                                        num_heads, num_kv_heads, d, eps, k_cache,
                                                                        v_cache, slots_c);
  }
  return {q, k, v};
}

}  // namespace
}  // namespace acarerank_cpu

TORCH_LIBRARY_FRAGMENT(acarerank, m) {
  m.def("qk_norm_rope_cpu(Tensor qkv, Tensor q_weight, Tensor k_weight, Tensor cos, Tensor sin, int num_heads, "
        "int num_kv_heads, float eps, Tensor(a!)? k_cache=None, Tensor(b!)? v_cache=None, Tensor? slots=None) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(acarerank, CPU, m) { m.impl("qk_norm_rope_cpu", &acarerank_cpu::qk_norm_rope_cpu); }
