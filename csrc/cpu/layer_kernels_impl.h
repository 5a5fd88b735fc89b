// The row kernels of layer_kernels.h, included once per ISA build inside namespace
// acr_layer::ACR_LAYER_ISA (no include guard on purpose). Only compiler builtins here: no library
// inline function may be compiled into an ISA-specific build (layer_kernels.h).
//
// Loops are written for the auto-vectoriser: fixed-width partial sums (kAcc lanes) instead of one
// running sum (a float reduction is not reassociated without -ffast-math), branch-free bf16
// rounding and a branch-free exp.

namespace acr_layer {
namespace ACR_LAYER_ISA {
namespace {

constexpr int kAcc = 16;

inline float ld(float v) { return v; }
inline float ld(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &b, 4);
  return f;
}
inline void st(float* p, float v) { *p = v; }
inline void st(uint16_t* p, float v) {  // round to nearest even; NaN stays a (quiet) NaN
  uint32_t u;
  __builtin_memcpy(&u, &v, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  *p = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  float acc[kAcc] = {};
  int64_t i = 0;
  for (; i + kAcc <= n; i += kAcc)
    for (int j = 0; j < kAcc; ++j) {
      const float v = ld(x[i + j]);
      acc[j] += v * v;
    }
  float s = 0.f;
  for (; i < n; ++i) {
    const float v = ld(x[i]);
    s += v * v;
  }
  for (int j = 0; j < kAcc; ++j) s += acc[j];
  return s;
}

template <typename T>
inline void norm_row(const T* x, const T* w, T* y, int64_t H, float eps) {
  const float scale = 1.f / __builtin_sqrtf(sum_squares(x, H) / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) st(y + i, ld(x[i]) * scale * ld(w[i]));
}

template <typename T>
inline void add_norm_row(const T* x, T* r, const T* w, T* y, int64_t H, float eps) {
  for (int64_t i = 0; i < H; ++i) st(r + i, ld(r[i]) + ld(x[i]));  // rounded: the stored stream is normed
  norm_row(r, w, y, H, eps);
}

// RMSNorm of one head then RoPE (rotate-half): out[i] = a·cos[i] − b·sin[i], out[h+i] = b·cos[h+i] + a·sin[h+i]
template <typename T, typename C>
inline void norm_rope_head(const T* x, const T* w, const C* cos, const C* sin, T* out, int64_t d, float eps) {
  float buf[kMaxHeadDim];
  const float scale = 1.f / __builtin_sqrtf(sum_squares(x, d) / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) buf[i] = ld(x[i]) * scale * ld(w[i]);
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = buf[i], b = buf[h + i];
    st(out + i, a * ld(cos[i]) - b * ld(sin[i]));
    st(out + h + i, b * ld(cos[h + i]) + a * ld(sin[h + i]));
  }
}

// exp(x) in fp32 for x in [-87.3, 88.7] (Cephes' expf: x = n·ln2 + r, a degree-6 polynomial for e^r,
// 2^n written into the exponent bits), within 2 ulp; the caller clamps x to that range
inline float exp_f32(float x) {
  const float shifter = 12582912.f;  // 1.5·2^23: adding it rounds x·log2(e) to an integer in the low bits
  const float t = x * 1.44269504088896341f + shifter;
  const float n = t - shifter;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  // in uint32: a NaN x (its result is discarded by every caller) puts any bits in t, and the
  // same sum in int32 would overflow, which C++ leaves undefined
  uint32_t ti;
  __builtin_memcpy(&ti, &t, 4);
  const uint32_t bits = (ti - 0x4B400000u + 127u) << 23;  // 0x4B400000: the bits of `shifter`
  float two_n;
  __builtin_memcpy(&two_n, &bits, 4);
  return p * two_n;
}

// y = g / (1 + exp(−g)) · u in chunks of kChunk, one loop per step: with the clamp and the exp in
// one loop body the vectoriser gives up ("control flow in loop", GCC 12), split they each vectorise
constexpr int64_t kChunk = 256;

template <typename T>
inline void silu_mul_row(const T* g, const T* u, T* y, int64_t I) {
  float e[kChunk];
  for (int64_t i0 = 0; i0 < I; i0 += kChunk) {
    const int64_t n = I - i0 < kChunk ? I - i0 : kChunk;
    for (int64_t j = 0; j < n; ++j) {
      const float x = -ld(g[i0 + j]);
      e[j] = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);  // exp(−g) saturates: silu → g or → 0
    }
    for (int64_t j = 0; j < n; ++j) e[j] = exp_f32(e[j]);
    for (int64_t j = 0; j < n; ++j) {
      const float gv = ld(g[i0 + j]);
      st(y + i0 + j, gv / (1.f + e[j]) * ld(u[i0 + j]));
    }
  }
}

#ifdef ACR_LAYER_AVX512_INTRINSICS
#include "layer_rows_avx512.h"

// topk_chunk_row's AVX-512 build, in intrinsics (always-inline compiler builtins, so nothing is
// shared with the other builds): the same contract and the same exp_f32 steps on 16 lanes, in
// two passes over the row (it stays in L1 between them). GCC's vectorisation of the portable loops
// below ran 1.26–1.29 ns a logit on one core of an AMX Xeon, this 0.34 (2048-logit rows, timed
// ad hoc; the op's figures: docs/cpu-log.md). Sums: one 16-lane fp32 accumulator per
// kChunk logits (each lane at most 16 terms, as the portable code's), added in double.
inline void topk_chunk_row_avx512(const float* x, int64_t n, float theta, float m_old, int64_t id0, float* vals,
                                  int64_t* ids, int64_t cap, int64_t* count, float* m_new, float* csum) {
  const __m512 ninf = _mm512_set1_ps(-__builtin_inff()), vth = _mm512_set1_ps(theta);
  __m512 mx0 = ninf, mx1 = ninf;
  int64_t c = 0;
  auto take = [&](int64_t i, uint32_t hits) {  // the entries above theta of block i, in id order
    while (hits) {
      const int j = __builtin_ctz(hits);
      hits &= hits - 1;
      if (c < cap) vals[c] = x[i + j], ids[c] = id0 + i + j;
      ++c;
    }
  };
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
    mx0 = _mm512_max_ps(a, mx0);  // a NaN loses: vmaxps returns its second operand then
    mx1 = _mm512_max_ps(b, mx1);
    const uint32_t ha = _mm512_cmp_ps_mask(a, vth, _CMP_GT_OQ), hb = _mm512_cmp_ps_mask(b, vth, _CMP_GT_OQ);
    if (__builtin_expect((ha | hb) != 0, 0)) take(i, ha | (hb << 16));
  }
  for (; i < n; i += 16) {
    const __mmask16 mk = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 a = _mm512_mask_loadu_ps(ninf, mk, x + i);
    mx0 = _mm512_max_ps(a, mx0);
    const uint32_t ha = _mm512_mask_cmp_ps_mask(mk, a, vth, _CMP_GT_OQ);
    if (ha) take(i, ha);
  }
  const float mx = _mm512_reduce_max_ps(_mm512_max_ps(mx0, mx1));
  const float m = mx > m_old ? mx : m_old;
  *m_new = m;
  *count = c;
  // Σ exp(x − shift): exp_f32's steps on 16 lanes; a NaN x stays NaN through them (min/max return
  // their second operand, the NaN, then) and makes the row's sum NaN
  const float shift = (m == __builtin_inff() || m == -__builtin_inff()) ? 0.f : m;
  const __m512 vsh = _mm512_set1_ps(shift), lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(88.7f);
  const __m512 shifter = _mm512_set1_ps(12582912.f);
  double total = 0.0;
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t w = n - i0 < kChunk ? n - i0 : kChunk;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < w; j += 16) {
      const __mmask16 mk = w - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (w - j)) - 1);
      const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(mk, x + i0 + j), vsh);
      const __mmask16 keep = _mm512_mask_cmp_ps_mask(mk, d, lo, _CMP_NLT_UQ);  // d >= −87.3, or NaN
      const __m512 e = _mm512_min_ps(hi, _mm512_max_ps(lo, d));
      const __m512 t = _mm512_fmadd_ps(e, _mm512_set1_ps(1.44269504088896341f), shifter);
      const __m512 nn = _mm512_sub_ps(t, shifter);
      __m512 r = _mm512_fnmadd_ps(nn, _mm512_set1_ps(0.693359375f), e);
      r = _mm512_fmadd_ps(nn, _mm512_set1_ps(2.12194440e-4f), r);
      __m512 p = _mm512_set1_ps(1.9875691500e-4f);
      p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
      p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
      p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
      p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
      p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
      p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
      const __m512i bits = _mm512_slli_epi32(
          _mm512_add_epi32(_mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4B400000)), _mm512_set1_epi32(127)), 23);
      acc = _mm512_mask_add_ps(acc, keep, acc, _mm512_mul_ps(p, _mm512_castsi512_ps(bits)));
    }
    total += _mm512_reduce_add_ps(acc);
  }
  *csum = static_cast<float>(total);
}
#endif

// One row of a logits chunk for the top-k core (topk_chunk_update.cpp's first step): the first
// `cap` entries above theta in id order (the slots past them untouched); their count; m_new = max(m_old, the
// row's max); csum = Σ_j exp(x_j − shift), shift = m_new unless it is ±inf (then 0), NaN if the
// row holds a NaN. exp_f32 is within 2 ulp; a difference below −87.3 counts 0 (its true exp is
// below 1.2e-38 and a row's sum is at least 1 where its max lies, e^0); fp32 partial sums of at
// most 16 terms, added in double.
inline void topk_chunk_row(const float* x, int64_t n, float theta, float m_old, int64_t id0, float* vals,
                           int64_t* ids, int64_t cap, int64_t* count, float* m_new, float* csum) {
#ifdef ACR_LAYER_AVX512_INTRINSICS
  return topk_chunk_row_avx512(x, n, theta, m_old, id0, vals, ids, cap, count, m_new, csum);
#endif
  const float inf = __builtin_inff();
  float mx[kAcc];
  int nan[kAcc];
  for (int j = 0; j < kAcc; ++j) mx[j] = -inf, nan[j] = 0;
  int64_t c = 0;
  // blocks of kAcc: the max, NaN and "any above theta" are vector work; only a block holding an
  // entry above theta (rare once k are held) is scanned entry by entry for the candidates
  for (int64_t i = 0; i < n; i += kAcc) {
    int hit = 0;
    if (i + kAcc <= n) {
      for (int j = 0; j < kAcc; ++j) {
        const float v = x[i + j];
        mx[j] = v > mx[j] ? v : mx[j];
        nan[j] |= v != v;
        hit |= v > theta;
      }
    } else {
      for (int j = 0; i + j < n; ++j) {
        const float v = x[i + j];
        mx[j] = v > mx[j] ? v : mx[j];
        nan[j] |= v != v;
        hit |= v > theta;
      }
    }
    if (!hit) continue;
    for (int64_t j = i; j < n && j < i + kAcc; ++j)
      if (x[j] > theta) {
        if (c < cap) vals[c] = x[j], ids[c] = id0 + j;
        ++c;
      }
  }
  float m = m_old;
  int any_nan = 0;
  for (int j = 0; j < kAcc; ++j) m = mx[j] > m ? mx[j] : m, any_nan |= nan[j];
  *m_new = m;
  *count = c;
  const float shift = (m == inf || m == -inf) ? 0.f : m;
  double total = 0.0;  // each kChunk's fp32 lanes (16 terms each) summed into a double: no long fp32 run
  float e[kChunk];
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {  // three loops per chunk: each vectorises (silu_mul_row)
    const int64_t w = n - i0 < kChunk ? n - i0 : kChunk;
    float acc[kAcc] = {};
    for (int64_t j = 0; j < w; ++j) {
      const float d = x[i0 + j] - shift;
      e[j] = d < -87.3f ? -87.3f : (d > 88.7f ? 88.7f : d);
    }
    for (int64_t j = 0; j < w; ++j) e[j] = exp_f32(e[j]);
    for (int64_t j = 0; j < w; ++j) e[j] = x[i0 + j] - shift < -87.3f ? 0.f : e[j];
    int64_t j = 0;
    for (; j + kAcc <= w; j += kAcc)
      for (int l = 0; l < kAcc; ++l) acc[l] += e[j + l];
    for (int l = 0; j + l < w; ++l) acc[l] += e[j + l];
    float part = 0.f;
    for (int l = 0; l < kAcc; ++l) part += acc[l];
    total += part;
  }
  *csum = any_nan ? __builtin_nanf("") : static_cast<float>(total);
}

template <typename T>
void rms_norm_t(const T* x, const T* w, T* y, int64_t rows, int64_t H, float eps) {
  for (int64_t r = 0; r < rows; ++r) norm_row(x + r * H, w, y + r * H, H, eps);
}

template <typename T>
void add_rms_norm_t(const T* x, T* res, const T* w, T* y, int64_t rows, int64_t H, float eps) {
  for (int64_t r = 0; r < rows; ++r) add_norm_row(x + r * H, res + r * H, w, y + r * H, H, eps);
}

template <typename T, typename C>
void qk_norm_rope_t(const T* qkv, const T* qw, const T* kw, const C* cos, const C* sin, T* q, T* k, T* v,
                    int64_t rows, int64_t Hq, int64_t Hkv, int64_t d, float eps, const PageWrite<T>& pages) {
  const int64_t width = (Hq + 2 * Hkv) * d, kv = Hkv * d;
  auto head = [&](const T* x, const T* w, const C* c, const C* s, T* out) {
#ifdef ACR_LAYER_AVX512_INTRINSICS
    if (d % 32 == 0) return norm_rope_head_avx512(x, w, c, s, out, d, eps);  // whole vectors per half
#endif
    norm_rope_head(x, w, c, s, out, d, eps);
  };
  for (int64_t t = 0; t < rows; ++t) {
    const T* row = qkv + t * width;
    const C* c = cos + t * d;
    const C* s = sin + t * d;
    for (int64_t hd = 0; hd < Hq; ++hd) head(row + hd * d, qw, c, s, q + (t * Hq + hd) * d);
    for (int64_t hd = 0; hd < Hkv; ++hd) head(row + (Hq + hd) * d, kw, c, s, k + (t * Hkv + hd) * d);
    __builtin_memcpy(v + t * kv, row + (Hq + Hkv) * d, sizeof(T) * kv);
    if (pages.k_pages) {  // the same stored bits again, while the row is still in L1
      __builtin_memcpy(pages.k_pages + pages.slots[t] * kv, k + t * kv, sizeof(T) * kv);
      __builtin_memcpy(pages.v_pages + pages.slots[t] * kv, v + t * kv, sizeof(T) * kv);
    }
  }
}

template <typename T>
void silu_and_mul_t(const T* x, T* y, int64_t rows, int64_t I) {
  for (int64_t r = 0; r < rows; ++r) silu_mul_row(x + r * 2 * I, x + r * 2 * I + I, y + r * I, I);
}

}  // namespace

void rms_norm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t H, float eps) {
  rms_norm_t(x, w, y, rows, H, eps);
}
void rms_norm_rows(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t rows, int64_t H, float eps) {
  rms_norm_t(x, w, y, rows, H, eps);
}
void add_rms_norm_rows(const float* x, float* res, const float* w, float* y, int64_t rows, int64_t H, float eps) {
  add_rms_norm_t(x, res, w, y, rows, H, eps);
}
void add_rms_norm_rows(const uint16_t* x, uint16_t* res, const uint16_t* w, uint16_t* y, int64_t rows, int64_t H,
                       float eps) {
  add_rms_norm_t(x, res, w, y, rows, H, eps);
}
void qk_norm_rope_rows(const float* qkv, const float* qw, const float* kw, const float* cos, const float* sin,
                       float* q, float* k, float* v, int64_t rows, int64_t Hq, int64_t Hkv, int64_t d, float eps,
                       const PageWrite<float>& pages) {
  qk_norm_rope_t(qkv, qw, kw, cos, sin, q, k, v, rows, Hq, Hkv, d, eps, pages);
}
void qk_norm_rope_rows(const uint16_t* qkv, const uint16_t* qw, const uint16_t* kw, const float* cos,
                       const float* sin, uint16_t* q, uint16_t* k, uint16_t* v, int64_t rows, int64_t Hq,
                       int64_t Hkv, int64_t d, float eps, const PageWrite<uint16_t>& pages) {
  qk_norm_rope_t(qkv, qw, kw, cos, sin, q, k, v, rows, Hq, Hkv, d, eps, pages);
}
void qk_norm_rope_rows(const uint16_t* qkv, const uint16_t* qw, const uint16_t* kw, const uint16_t* cos,
                       const uint16_t* sin, uint16_t* q, uint16_t* k, uint16_t* v, int64_t rows, int64_t Hq,
                       int64_t Hkv, int64_t d, float eps, const PageWrite<uint16_t>& pages) {
  qk_norm_rope_t(qkv, qw, kw, cos, sin, q, k, v, rows, Hq, Hkv, d, eps, pages);
}
void silu_and_mul_rows(const float* x, float* y, int64_t rows, int64_t I) { silu_and_mul_t(x, y, rows, I); }
void silu_and_mul_rows(const uint16_t* x, uint16_t* y, int64_t rows, int64_t I) { silu_and_mul_t(x, y, rows, I); }
void topk_chunk_rows(const float* x, int64_t ldx, const float* theta, const float* m_old, int64_t rows, int64_t n,
                     int64_t id0, float* vals, int64_t* ids, int64_t cap, int64_t* counts, float* m_new, float* csum) {
  for (int64_t r = 0; r < rows; ++r)
    topk_chunk_row(x + r * ldx, n, theta[r], m_old[r], id0, vals + r * cap, ids + r * cap, cap, counts + r, m_new + r,
                   csum + r);
}

}  // namespace ACR_LAYER_ISA
}  // namespace acr_layer
