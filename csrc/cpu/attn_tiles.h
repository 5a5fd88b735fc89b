// Tile helpers of the prefix-shared CPU attention kernel (prefix_attention.cpp): the two GEMM
// shapes through at::native::cpublas::brgemm, key/value packing, and one online-softmax step.
//
// Two compute types (docs/ARCHITECTURE.md, "Native CPU kernels"):
//   float      fp32 inputs, and bf16/fp16 inputs on a CPU where cpublas cannot pack bf16 (no
//              AMX): q/K/V tiles are converted to fp32 when they are packed, one tile at a time
//              (never the whole K/V), the GEMMs run cpublas' fp32 brgemm (MKL/oneDNN underneath).
//   BFloat16   bf16 inputs on a CPU with native bf16 dot products, fp32 accumulation, P rounded
//              to bf16 for P·V, B VNNI-packed: cpublas::brgemm where could_pack(kBFloat16)
//              (oneDNN ukernels, AMX tiles); else, where the CPU has AVX512_BF16, our own
//              vdpbf16ps tiles on the same layout (gemm_bf16_avx512.h). bf16_path() says which.
//
// Layouts (compute type c_t, KT keys per tile, d head_dim):
//   Q tile  [M][d]       row i = (token, query head of this kv head), token-major
//   K tile  as the B of S = Q·Kᵀ: float [d][KT];  bf16 VNNI [d/2][KT][2]
//   V tile  as the B of O = P·V:  float [KT][d];  bf16 VNNI [KT/2][d][2]
//   S       [M][KT] fp32 scores;  P [M][KT] c_t;  acc [M][d] fp32
// Key columns past the tile's valid count, up to the columns its GEMMs read (gemm_cols), are zero
// in K and V: P is zero there too, and zero padding (never uninitialised memory) keeps NaN·0 out
// of the sums.
#pragma once

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#include "gemm_bf16_avx512.h"
#include "pack_vnni_avx512.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace acr_attn {

using at::BFloat16;

// Scratch on 64-byte boundaries (cache lines, and whole AVX-512 vectors): GEMM libraries may take
// another code path for an operand malloc happened to place on a 16-byte boundary.
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(std::size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (!p) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) { std::free(p); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
template <typename T>
using scratch = std::vector<T, Aligned64<T>>;

// -- which bf16 compute path this CPU takes (read once; docs/cpu.md, "Attention")
//   "amx-brgemm"      cpublas::could_pack(kBFloat16): brgemm on VNNI tiles (AMX)
//   "avx512-bf16"     AVX512_BF16 without AMX: gemm_bf16_avx512.h on the same VNNI tiles
//   "fp32-convert"    neither, or ACARERANK_CPU_BASELINE=1 without AMX: tiles converted to fp32 as
//                     they are packed, fp32 brgemm
//   "brgemm"          ACARERANK_CPU_BF16_PATH=brgemm on a CPU without AMX: the amx-brgemm code
//                     (packing, row chunks, leading dimensions, release) on cpublas' non-AMX bf16
//                     brgemm (oneDNN's ukernel, which takes a VNNI B from AVX-512 on; without
//                     AVX-512 cpublas refuses a VNNI B, and asking for this path is an error), so
//                     any AVX-512 CPU tests that code; only oneDNN's AMX ukernel is not run
//   "vnni-reference"  a development build with ACR_VNNI_REFERENCE_GEMM (never shipped)
// ACARERANK_CPU_BF16_PATH=auto|brgemm|avx512-bf16|fp32-convert overrides the choice; a value this
// CPU cannot run or that is not one of these is an error on every bf16 call.
inline bool bf16_amx() {
  static const bool ok = at::native::cpublas::could_pack(at::kBFloat16);
  return ok;
}
inline bool cpu_baseline_forced() {
  const char* e = std::getenv("ACARERANK_CPU_BASELINE");
  const bool on = e != nullptr && std::strcmp(e, "1") == 0;
  TORCH_CHECK(e == nullptr || *e == '\0' || on || std::strcmp(e, "0") == 0,
              "ACARERANK_CPU_BASELINE must be 0 or 1 (or unset), got '", e, "'");
  return on;
}
// Whether cpublas::brgemm multiplies bf16 with a VNNI-packed B here (oneDNN's ukernel: AMX, or
// AVX-512 without it); elsewhere it raises. Asked by doing one 1×16×2 product, as cpublas exposes
// no query for it (could_pack is AMX only).
inline bool cpublas_takes_vnni_bf16() {
  alignas(64) BFloat16 a[2] = {BFloat16(1.f), BFloat16(2.f)};
  alignas(64) BFloat16 b[32];
  for (int i = 0; i < 32; ++i) b[i] = BFloat16(static_cast<float>(i % 2 + 1));  // (k, n) = k + 1
  alignas(64) float c[16] = {};
  try {
    at::native::cpublas::brgemm(1, 16, 2, 2, 16, 16, false, a, b, c, /*is_vnni=*/true);
    at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  } catch (const c10::Error&) {
    return false;
  }
  for (float x : c)
    if (x != 5.f) return false;  // 1·1 + 2·2 in every column
  return true;
}
// The path, or nullptr with *why set when ACARERANK_CPU_BF16_PATH asks for one this CPU cannot take.
inline const char* choose_bf16_path(const char** why) {
  const char* want = std::getenv("ACARERANK_CPU_BF16_PATH");
  if (want == nullptr || *want == '\0' || std::strcmp(want, "auto") == 0)
    return bf16_amx()                                          ? "amx-brgemm"
           : cpu_has_avx512_bf16() && !cpu_baseline_forced() ? "avx512-bf16"
                                                               : "fp32-convert";
  if (std::strcmp(want, "brgemm") == 0 || std::strcmp(want, "amx-brgemm") == 0) {
    if (bf16_amx()) return "amx-brgemm";
    if (cpublas_takes_vnni_bf16()) return "brgemm";
    *why = "ACARERANK_CPU_BF16_PATH=brgemm, but cpublas' bf16 brgemm refuses VNNI tiles on this CPU "
           "(it needs AVX-512 and oneDNN's ukernels); use auto or fp32-convert";
    return nullptr;
  }
  if (std::strcmp(want, "fp32-convert") == 0) return "fp32-convert";
  if (std::strcmp(want, "avx512-bf16") == 0) {
    if (cpu_has_avx512_bf16()) return "avx512-bf16";
    *why = "ACARERANK_CPU_BF16_PATH=avx512-bf16, but this CPU (or this build) has no AVX512_BF16; "
           "use auto, brgemm or fp32-convert";
    return nullptr;
  }
  *why = "ACARERANK_CPU_BF16_PATH must be auto, brgemm, avx512-bf16 or fp32-convert";
  return nullptr;
}
inline const char* bf16_path() {
#ifdef ACR_VNNI_REFERENCE_GEMM
  return "vnni-reference";
#else
  static const char* why = nullptr;
  static const char* path = choose_bf16_path(&why);
  TORCH_CHECK(path != nullptr, why, " (got '", std::getenv("ACARERANK_CPU_BF16_PATH"), "')");
  return path;
#endif
}
// The bf16 tiles go through cpublas::brgemm (AMX, or forced): chosen once with the path.
inline bool bf16_brgemm() {
  static const bool yes = [] {
    const char* p = bf16_path();
    return std::strcmp(p, "amx-brgemm") == 0 || std::strcmp(p, "brgemm") == 0;
  }();
  return yes;
}
// The bf16 paths' vector code (VNNI packing, the softmax writing bf16 P, bf16 output rows) runs
// AVX-512 where the CPU has AVX512_BF16, unless ACARERANK_CPU_BASELINE=1.
inline bool bf16_avx512() {
  static const bool ok = cpu_has_avx512_bf16() && !cpu_baseline_forced();
  return ok;
}

// -- GEMMs: C[M×N] (+)= A[M×K] · B[K×N]
//
// cpublas::brgemm generates one oneDNN kernel per (M, N, K, lda, ldb, ldc, add_C) and keeps it,
// with its scratchpad, in a per-thread map that is never evicted, for the life of the process.
// Called with the row and key counts of real traffic (every segment length is another M or N),
// it grows without bound: +1.2 GB over 2,000 calls of random lengths, fp32, measured. So what it
// sees is bounded: M is cut into power-of-two chunks of at most kBrgemmRows rows (largest
// first; each chunk reads its own rows of A and writes its own rows of C, so no padding row
// is ever touched), and N or K, when they count keys, come from gemm_cols (a multiple of 16
// or 32, at most KT). Per thread and head_dim that is at most 9 × KT/16 kernels per GEMM shape.
constexpr int64_t kBrgemmRows = 256;

// Keys per tile of the tile path (prefix_attention.cpp's KT), also the batch-invariant alignment
// (acarerank/ops/cpu_attention.py's TILE_KEYS, checked against the module's tile_keys()). 512 rather
// than 256: half the per-row softmax steps (max, α, rescale) per key, 6–12 % faster on AMX and in
// fp32, the same on the avx512-bf16 tiles (docs/cpu-log.md); S (fp32) and P of a 256-row
// block are then 512 and 256 KB, in L2 beside the two packed tiles.
constexpr int64_t kTileKeys = 512;

template <typename T>
inline void brgemm_pow2_rows(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
                             float* C, int64_t ldc, bool add_C, bool is_vnni) {
  while (M > 0) {
    int64_t m = kBrgemmRows;
    while (m > M) m >>= 1;
    at::native::cpublas::brgemm(m, N, K, lda, ldb, ldc, add_C, A, B, C, is_vnni);
    A += m * lda;
    C += m * ldc;
    M -= m;
  }
}

inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                 float* C, int64_t ldc, bool add_C) {
  brgemm_pow2_rows(M, N, K, A, lda, B, ldb, C, ldc, add_C, /*is_vnni=*/false);
}
// cpublas runs its bf16 brgemm on oneDNN's ukernel only while torch.backends.mkldnn is enabled (it
// reads at::globalContext().userEnabledMkldnn() on every call) and raises on a VNNI B while it is
// off. The path is chosen once, so turning mkldnn off after the first bf16 call made every later
// bf16 call (on AMX, by default) fail inside the kernel; while it is off, the brgemm paths run the
// avx512-bf16 tiles on the same VNNI operands (docs/cpu.md, "Native CPU kernels").
inline bool brgemm_takes_bf16_now() { return at::globalContext().userEnabledMkldnn(); }

inline void gemm(int64_t M, int64_t N, int64_t K, const BFloat16* A, int64_t lda, const BFloat16* B, int64_t ldb,
                 float* C, int64_t ldc, bool add_C) {
#ifdef ACR_VNNI_REFERENCE_GEMM
  // development check only (never in a shipped build): the VNNI layout read element by element,
  // B(k, n) at ((k/2)·ldb + n)·2 + k%2, so the bf16 path can be run on a CPU without AMX
  for (int64_t i = 0; i < M; ++i)
    for (int64_t n = 0; n < N; ++n) {
      float acc = add_C ? C[i * ldc + n] : 0.f;
      for (int64_t k = 0; k < K; ++k)
        acc += static_cast<float>(A[i * lda + k]) * static_cast<float>(B[((k >> 1) * ldb + n) * 2 + (k & 1)]);
      C[i * ldc + n] = acc;
    }
#else
  if (bf16_brgemm()) {
    if (brgemm_takes_bf16_now()) {
      brgemm_pow2_rows(M, N, K, A, lda, B, ldb, C, ldc, add_C, /*is_vnni=*/true);
      return;
    }
    // forced brgemm on an AVX-512 CPU without AVX512_BF16: no own tiles to fall back to
    TORCH_CHECK(cpu_has_avx512_bf16(), "bf16 path '", bf16_path(), "' runs cpublas' oneDNN brgemm, but "
                "torch.backends.mkldnn is disabled and this CPU has no AVX512_BF16 for the kernel's own bf16 "
                "tiles; enable torch.backends.mkldnn, or set ACARERANK_CPU_BF16_PATH=fp32-convert");
  }
#ifdef ACR_HAVE_AVX512_BF16_CODE
  gemm_bf16_vnni_avx512(M, N, K, A, lda, B, ldb, C, ldc, add_C);  // bf16_path(), or a brgemm path with mkldnn off
#else
  TORCH_CHECK(false, "prefix_shared_attention_cpu: bf16 tiles need AMX or AVX512_BF16; bf16_path() is ", bf16_path());
#endif
#endif
}
template <typename c_t>
inline void gemm_release() {
#ifndef ACR_VNNI_REFERENCE_GEMM
  if (std::is_same_v<c_t, float> || bf16_brgemm())
    at::native::cpublas::brgemm_release(/*is_vnni=*/std::is_same_v<c_t, BFloat16>);
#endif
}

// gemm_release() for a thread's chunk of an at::parallel_for: ``now()`` at its normal end (a
// release error propagates), the destructor when an exception leaves the chunk first (an
// allocation failing after a brgemm): a skipped release left this thread's tile configuration for
// the next brgemm of the same shape to trust (AMX: an illegal instruction if other code released
// the tiles meanwhile). A release error while unwinding is dropped: the first exception goes on.
template <typename c_t>
struct GemmReleaseAtExit {
  bool released = false;
  GemmReleaseAtExit() = default;
  GemmReleaseAtExit(const GemmReleaseAtExit&) = delete;
  GemmReleaseAtExit& operator=(const GemmReleaseAtExit&) = delete;
  void now() {
    released = true;
    gemm_release<c_t>();
  }
  ~GemmReleaseAtExit() {
    if (released) return;
    try {
      gemm_release<c_t>();
    } catch (...) {  // unwinding already: a second exception would be std::terminate
    }
  }
};

template <typename c_t>
constexpr bool kVnni = std::is_same_v<c_t, BFloat16>;

// Key columns a GEMM over a tile of n valid keys computes: n rounded up to 16 in fp32, to 32 in
// bf16 (VNNI pairs keys), at most kt: few distinct shapes, so brgemm's kernel cache stays bounded
// (see gemm above). The packed K/V are zero in columns [n, gemm_cols) and P is zero there.
template <typename c_t>
inline int64_t gemm_cols(int64_t n, int64_t kt) {
  constexpr int64_t q = kVnni<c_t> ? 32 : 16;
  return std::min<int64_t>(kt, (n + q - 1) / q * q);
}

// -- packing one key tile of one kv head: rows[j] points at key j's d values (n valid keys, n <= KT)
// Returns whether every packed V value is finite (the caller's causal tiles need to know: a masked
// non-finite value times a zero weight would still give NaN).
template <typename s_t, typename c_t, typename KRow, typename VRow>
inline bool pack_kv_tile(KRow&& krow, VRow&& vrow, int64_t n, int64_t KT, int64_t d, c_t* kt, c_t* vt) {
  bool finite = true;
  if constexpr (kVnni<c_t>) {
    // K as B[d][KT] in VNNI: element (kk, j) at ((kk/2)*KT + j)*2 + kk%2, i.e. the 32-bit pair
    // (kk, kk+1) of key j is lane (kk/2)*KT + j: a transpose of 32-bit pairs.  V as B[KT][d]:
    // (j, c) at ((j/2)*d + c)*2 + j%2. Only the columns (keys) a GEMM reads, [0, gemm_cols(n)),
    // are written: zeros past n (a one-token decode tile writes 32 columns, not KT).
    static_assert(sizeof(c_t) == 2 && sizeof(s_t) == 2, "VNNI pairs are two 16-bit values (s_t == c_t)");
    const int64_t nc = gemm_cols<c_t>(n, KT);
    uint32_t* k32 = reinterpret_cast<uint32_t*>(kt);
#ifdef ACR_HAVE_AVX512_BF16_CODE
    if (bf16_avx512() && KT % 16 == 0) {
      finite = pack_kv_rows_vnni_avx512(krow, vrow, n, KT, d, kt, vt);
    } else
#endif
    {
      for (int64_t j = 0; j < n; ++j) {
        const s_t* kr = krow(j);
        for (int64_t kp = 0; kp < d / 2; ++kp) {
          uint32_t pair;
          std::memcpy(&pair, kr + 2 * kp, sizeof(pair));
          k32[kp * KT + j] = pair;
        }
        const s_t* vr = vrow(j);
        c_t* vdst = vt + (j >> 1) * d * 2 + (j & 1);
        for (int64_t c = 0; c < d; ++c) vdst[c * 2] = static_cast<c_t>(vr[c]);
        for (int64_t c = 0; c < d; ++c) finite &= std::isfinite(static_cast<float>(vr[c]));
      }
    }
    for (int64_t kp = 0; kp < d / 2; ++kp)
      for (int64_t j = n; j < nc; ++j) k32[kp * KT + j] = 0;
    if (n < nc) {
      // rows [n, nc) of V; an odd n shares its pair row with the last key: zero only its odd half
      if (n & 1)
        for (int64_t c = 0; c < d; ++c) vt[((n >> 1) * d + c) * 2 + 1] = c_t(0);
      const int64_t r0 = (n + 1) / 2;
      std::memset(static_cast<void*>(vt + r0 * d * 2), 0, sizeof(c_t) * (nc / 2 - r0) * d * 2);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const s_t* kr = krow(j);
      const s_t* vr = vrow(j);
      for (int64_t kk = 0; kk < d; ++kk) kt[kk * KT + j] = static_cast<c_t>(kr[kk]);
      c_t* vdst = vt + j * d;
      for (int64_t c = 0; c < d; ++c) {
        vdst[c] = static_cast<c_t>(vr[c]);
        finite &= std::isfinite(static_cast<float>(vdst[c]));
      }
    }
    const int64_t nc = gemm_cols<c_t>(n, KT);  // zeros in the columns a GEMM reads past n
    for (int64_t kk = 0; kk < d; ++kk)
      for (int64_t j = n; j < nc; ++j) kt[kk * KT + j] = c_t(0);
    std::memset(static_cast<void*>(vt + n * d), 0, sizeof(c_t) * (nc - n) * d);
  }
  return finite;
}

// -- one online-softmax step for rows [0, M) of a tile (FlashAttention-2, Alg. 1), raw scores S:
//   m' = max(m, max_{j<cnt_i} S_ij);  p_ij = exp(scale·(S_ij − m')) for j < cnt_i, else 0
//   l' = e^{scale·(m − m')}·l + Σ_j p_ij;   acc' = e^{scale·(m − m')}·acc   (P·V is added by the caller)
// cnt(i) is row i's number of visible key columns in this tile (all of them on the prefix, the
// causal count on the diagonal); a row with cnt 0 is left as it is. A NaN score (a NaN in q)
// is never the max, so m' stays −inf on an all-NaN row and every later value is NaN: the row
// comes out NaN, as plain softmax gives. A row whose visible scores so far are all −inf (a key
// holding a −inf, or a q·k past fp32's range) keeps m' = −inf with α = 1 and no offset, so those
// weights are exactly 0 (FlashAttention's Check_inf): scale·(m − m') and s − m' were
// −inf − (−inf) = NaN, and the row came out NaN where plain softmax gives those keys weight 0
// and is finite once the row sees a finite score (NaN still if it never does: l stays 0).
// P is written for j < width (the columns its GEMM reads): p_ij, then zeros.

#if defined(__x86_64__)
// AVX2+FMA row step, chosen at run time (cpu_has_avx2): the function carries its own target
// attribute, so the module itself stays baseline x86-64 and no torch header is compiled for AVX2.
// exp: Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial, 2^n by exponent
// bits), ~2 ulp on [-87, 88]; clamped to that range for the polynomial, and 0 exactly below it
// (clamped alone it was ~1.2e-38: a key of weight e^−200 times a value of 3e38 added 3.5 to a row
// the reference gives 0 there, and an infinite value made inf where the reference has NaN); NaN
// kept (max/min return their second operand, x, when it is NaN; the "below" compare is false).
// Its constants, shared with the AVX-512 width (exp_avx512): n = round(x·log2 e), r = x − n·(C1 + C2)
// (ln 2 in two parts, n·C1 exact), e^r ≈ 1 + r + r²·P(r), times 2^n.
namespace cephes_exp {
constexpr float kMaxX = 88.3762626647949f, kMinX = -87.3365478515625f, kLog2e = 1.44269504088896341f;
constexpr float kC1 = 0.693359375f, kC2 = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
}  // namespace cephes_exp

__attribute__((target("avx2,fma"))) inline __m256 exp_avx2(__m256 x) {
  using namespace cephes_exp;
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(kMinX), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_set1_ps(kMaxX), x);
  x = _mm256_max_ps(_mm256_set1_ps(kMinX), x);
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kC1), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kC2), r);
  __m256 y = _mm256_set1_ps(kP0);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP1));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP2));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP3));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP4));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP5));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

__attribute__((target("avx2,fma"))) inline void softmax_row_avx2(const float* s, int64_t n, int64_t d, float scale,
                                                                 float& m, float& l, float* acc, float* p) {
  __m256 vmx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) vmx = _mm256_max_ps(_mm256_loadu_ps(s + j), vmx);  // a NaN score loses
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmx);
  float mx = lanes[0];
  for (int k = 1; k < 8; ++k) mx = lanes[k] > mx ? lanes[k] : mx;
  for (; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
  const float m_new = m > mx ? m : mx;
  if (m_new == -std::numeric_limits<float>::infinity()) {
    // every visible score so far −inf (see softmax_step): weights exp(−inf) = 0 exactly, a NaN
    // stays NaN; α = 1
    float sum = 0.f;
    for (j = 0; j < n; ++j) sum += p[j] = std::exp(scale * s[j]);
    l += sum;
    return;
  }
  const float alpha = std::exp(scale * (m - m_new));
  // scale·(s − m'), the difference first: s·scale − m'·scale rounded m'·scale, off by up to half its
  // ulp — ~4e6 at scores of 1e15, enough to overflow exp — where s − m' is exact near the max
  const __m256 vs = _mm256_set1_ps(scale), vm = _mm256_set1_ps(m_new);
  __m256 vsum = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 e = exp_avx2(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm), vs));
    _mm256_storeu_ps(p + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  _mm256_store_ps(lanes, vsum);
  float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; j < n; ++j) {
    const float e = std::exp(scale * (s[j] - m_new));
    p[j] = e;
    sum += e;
  }
  l = l * alpha + sum;
  m = m_new;
  if (alpha != 1.f) {
    const __m256 va = _mm256_set1_ps(alpha);
    int64_t c = 0;
    for (; c + 8 <= d; c += 8) _mm256_storeu_ps(acc + c, _mm256_mul_ps(_mm256_loadu_ps(acc + c), va));
    for (; c < d; ++c) acc[c] *= alpha;
  }
}

#ifdef ACR_HAVE_AVX512_BF16_CODE
// The same step on AVX-512 with P written as bf16 (vcvtneps2bf16, round to nearest even), for
// the bf16 paths, 16 lanes, the tail of a row masked. Its exp is base 2 (log2(e) folded into the
// scale): 2^t = 2^f · 2^n, n = round(t), |f| ≤ 1/2, 2^f by a polynomial, 2^n applied by vscalefps,
// which also gives 0 for t far below −126. exp2_avx512 (α, whose error scales a row's l and acc
// alike, and gate_up_amx's SiLU): Taylor of degree 5, relative error < 3.3e-6; the direct path's
// fp32 weights: exp2_f32_weights_avx512, the bf16 weights: exp2_bf16_weights_avx512, below.
// t is clamped at −150 so f is never −inf − (−inf); a NaN t stays NaN (max returns its second
// operand, t, when it is NaN). At t = 0 (the row's max) it is exactly 1. Half the instructions of
// a Cephes expf, which P's 8-bit mantissa cannot use.
// Taylor of degree kDegree (5 or 7) for 2^f on that reduction; the degree-5 chain is the degree-7
// one's last six steps, so both round alike there.
template <int kDegree>
ACR_AVX512_BF16 inline __m512 exp2_taylor_avx512(__m512 t) {
  static_assert(kDegree == 5 || kDegree == 7, "degree 5 (bf16 weights, alpha) or 7 (fp32 weights)");
  t = _mm512_max_ps(_mm512_set1_ps(-150.f), t);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 y;
  if constexpr (kDegree == 7) {
    y = _mm512_set1_ps(1.5252733804e-5f);                              // ln2^7 / 7!
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.5403530393e-4f));       // ln2^6 / 6!
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3333558146e-3f));       // ln2^5 / 5!
  } else {
    y = _mm512_set1_ps(1.3333558146e-3f);
  }
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076e-3f));  // ln2^4 / 4!
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108665e-2f));  // ln2^3 / 3!
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650696e-1f));  // ln2^2 / 2!
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718056e-1f));  // ln2
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}
ACR_AVX512_BF16 inline __m512 exp2_avx512(__m512 t) { return exp2_taylor_avx512<5>(t); }
// exp2_avx512 to fp32's precision, for weights kept in fp32 (the direct path's, attn_direct_avx512.h):
// degree 7, relative error < 7.1e-9 (below half an fp32 ulp; degree 5's 3.2e-6 made a weight's error
// 2–2.5× plain fp32 PyTorch's against fp64). Two FMAs more per 16 weights on a path bound by
// reading K/V.
ACR_AVX512_BF16 inline __m512 exp2_f32_weights_avx512(__m512 t) { return exp2_taylor_avx512<7>(t); }
// exp2_avx512 for weights rounded to bf16 next (P of the bf16 paths), from t1 = t + 1/2:
//   2^t = 2^⌊t1⌋ · 2^(f − 1/2),   f = t1 − ⌊t1⌋ ∈ [0, 1]
// f by one vreduceps (round down), 2^⌊t1⌋ by vscalefps (which floors its exponent operand
// itself), 2^(f − 1/2) by a degree-3 polynomial: the minimax q(g) ≈ 2^g on |g| ≤ 1/2 with q(0) = 1
// (fitted by reweighted least squares on 20,001 points), expanded at g = f − 1/2. Relative error
// < 1.02e-4 on [0, 1] in fp32 FMA Horner (checked on 2·10⁷ points of t1 ∈ [−20, 1/2]), 38× below
// bf16's half-ulp of 2^-8, and exactly 1 at f = 1/2 (t = 0, the row's max). No clamp: vreduceps
// gives 0 for ±inf and vscalefps then 0 (−inf) or inf; a NaN stays NaN. One vreduceps where a
// clamp, a roundscale and a subtraction were, and with the one-FMA exponent (RowMax) three vector
// operations fewer per 16 weights: no faster alone, ~4 % of the kernel on the AMX Xeon once α's
// chain was off the first step (docs/cpu-log.md, that night).
ACR_AVX512_BF16 inline __m512 exp2_bf16_weights_avx512(__m512 t1) {
  const __m512 f = _mm512_reduce_ps(t1, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 y = _mm512_set1_ps(5.5008582771e-2f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.5969750285e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(4.9232897162e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(7.0703506470e-1f));
  return _mm512_scalef_ps(y, t1);
}

// The online softmax's new running max of a row over its n >= 1 visible scores s[0, n) (a NaN
// score loses), the factor alpha = exp(scale·(m − m')) its old sums are rescaled by (0 at the first
// visible step, m = −inf), and the operands of the weights in base 2:
// exp(scale·(s − m')) = 2^((s − vm)·vs), vs = scale·log2(e), vm = m' (0 while every score is −inf).
// The difference comes first: s·vs − m'·vs rounded m'·vs, off by up to half its ulp — ~4e6 in
// the exponent at scores of 1e15, an overflow to inf and a NaN row where plain softmax is finite —
// while s − m' is exact near the max. The bf16 weights' exponent t1 = (s − m')·vs + 1/2
// (exp2_bf16_weights_avx512) is one FMA, s·vs − vc with vc = m'·vs − 1/2, where that rounding is
// small (fused: |m'·vs| < 128; m'·vs and vc each round by at most 2^-18, so the weights move by
// < 6e-6 relative, beside the polynomial's 1e-4); else the difference first (bf16_weight_exponent).
struct RowMax {
  float m_new, alpha;
  __m512 vs, vm, vc;
  bool fused;
};
template <bool kFused>
ACR_AVX512_BF16 inline __m512 bf16_weight_exponent(__m512 s, const RowMax& rm) {
  if constexpr (kFused) return _mm512_fmsub_ps(s, rm.vs, rm.vc);
  return _mm512_fmadd_ps(_mm512_sub_ps(s, rm.vm), rm.vs, _mm512_set1_ps(0.5f));
}
ACR_AVX512_BF16 inline RowMax row_max_avx512(const float* s, int64_t n, float scale, float m) {
  // four running maxima, so the loop is not one chain of vmaxps latencies (max is exact: the
  // order cannot change the result)
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 vmx = ninf, vmx1 = ninf, vmx2 = ninf, vmx3 = ninf;
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {  // a NaN score loses: vmaxps returns its second operand then
    vmx = _mm512_max_ps(_mm512_loadu_ps(s + j), vmx);
    vmx1 = _mm512_max_ps(_mm512_loadu_ps(s + j + 16), vmx1);
    vmx2 = _mm512_max_ps(_mm512_loadu_ps(s + j + 32), vmx2);
    vmx3 = _mm512_max_ps(_mm512_loadu_ps(s + j + 48), vmx3);
  }
  for (; j + 16 <= n; j += 16) vmx = _mm512_max_ps(_mm512_loadu_ps(s + j), vmx);
  vmx = _mm512_max_ps(_mm512_max_ps(vmx, vmx1), _mm512_max_ps(vmx2, vmx3));
  if (j < n) {
    const __mmask16 mk = static_cast<__mmask16>((1u << (n - j)) - 1);
    vmx = _mm512_mask_max_ps(vmx, mk, _mm512_maskz_loadu_ps(mk, s + j), vmx);
  }
  const float mx = _mm512_reduce_max_ps(vmx);
  const float m_new = m > mx ? m : mx;
  // every visible score so far −inf (see softmax_step): α = 1, no offset, and 2^−inf is
  // exp2_avx512(−150) = 0 exactly
  const bool none = m_new == -std::numeric_limits<float>::infinity();
  constexpr float kLog2e = 1.44269504088896341f;
  // α by the weights' own exp2, no libm call per row; none where the max did not move, and 0 at
  // the first visible step (m = −inf) without one: that exp's chain of dependent operations held
  // up the row's weights (the kernel ~5 % faster on the AMX Xeon without it, docs/cpu-log.md).
  // Its error scales a row's l and acc alike, so acc / l keeps none of it.
  const float vs = scale * kLog2e;
  const float alpha = none || m == m_new                            ? 1.f
                      : m == -std::numeric_limits<float>::infinity() ? 0.f
                                                                      : _mm512_cvtss_f32(exp2_avx512(_mm512_set1_ps((m - m_new) * vs)));
  const float mo = none ? 0.f : m_new, mvs = mo * vs;
  return {m_new, alpha, _mm512_set1_ps(vs), _mm512_set1_ps(mo), _mm512_set1_ps(mvs - 0.5f), std::fabs(mvs) < 128.f};
}

// Row i of the step in parts, so attn_amx.h can run a row between its tile products: row_max_avx512,
// then softmax_row_pairs_bf16 over [0, n32) in any slices of whole 32-score pairs (n32 = n rounded
// down to 32), then softmax_row_finish_bf16. softmax_row_avx512_bf16 runs them in one go; the
// values are the same either way.
//
// l sums the rounded weights P·V will use, so the output is an exact weighted mean of V: the bf16 P
// summed by vdpbf16ps against ones (one instruction; pairs first, then the 8 lanes). Whole vectors
// of visible scores first, unmasked (no mask to build per vector), two at a time into two sums;
// then the row's tail and P's zero padding, masked. With the four maxima and α above: the kernel
// ~8 % faster on AMX at long prefixes (docs/cpu-log.md).
struct RowSums {
  __m256 s0, s1;
};
ACR_AVX512_BF16 inline RowSums row_sums_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }

// Weights of scores [j0, j1) (both multiples of 32, j1 <= n) into p, their sums into rs.
template <bool kFused>
ACR_AVX512_BF16 inline void softmax_row_pairs_bf16_as(const float* s, int64_t j0, int64_t j1, const RowMax& rm,
                                                      BFloat16* p, RowSums& rs) {
  const __m256bh ones = (__m256bh)_mm256_set1_epi16(0x3F80);  // bf16 1.0
  uint16_t* pp = reinterpret_cast<uint16_t*>(p);
  __m256 vsum = rs.s0, vsum1 = rs.s1;
  for (; j0 < j1; j0 += 32) {
    const __m256bh p0 = _mm512_cvtneps_pbh(exp2_bf16_weights_avx512(bf16_weight_exponent<kFused>(_mm512_loadu_ps(s + j0), rm)));
    const __m256bh p1 = _mm512_cvtneps_pbh(exp2_bf16_weights_avx512(bf16_weight_exponent<kFused>(_mm512_loadu_ps(s + j0 + 16), rm)));
    vsum = _mm256_dpbf16_ps(vsum, p0, ones);
    vsum1 = _mm256_dpbf16_ps(vsum1, p1, ones);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + j0), (__m256i)p0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + j0 + 16), (__m256i)p1);
  }
  rs = {vsum, vsum1};
}
ACR_AVX512_BF16 inline void softmax_row_pairs_bf16(const float* s, int64_t j0, int64_t j1, const RowMax& rm,
                                                   BFloat16* p, RowSums& rs) {
  if (rm.fused)
    softmax_row_pairs_bf16_as<true>(s, j0, j1, rm, p, rs);
  else
    softmax_row_pairs_bf16_as<false>(s, j0, j1, rm, p, rs);
}

// The rest of the row from j0 = n32: its tail and P's zeros to width, masked; then l, m and acc.
ACR_AVX512_BF16 inline void softmax_row_finish_bf16(const float* s, int64_t n, int64_t width, int64_t j0, int64_t d,
                                                    const RowMax& rm, RowSums rs, float& m, float& l, float* acc,
                                                    BFloat16* p) {
  const __m256bh ones = (__m256bh)_mm256_set1_epi16(0x3F80);
  uint16_t* pp = reinterpret_cast<uint16_t*>(p);
  __m256 vsum = _mm256_add_ps(rs.s0, rs.s1);
  for (int64_t j = j0; j < width; j += 16) {
    const int64_t left = n - j;
    const __mmask16 mk = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    // masked-off columns load 0 and convert to 0 (zero-masking), never exp(−offset)
    const __m512 sj = _mm512_maskz_loadu_ps(mk, s + j);
    const __m512 t1 = rm.fused ? bf16_weight_exponent<true>(sj, rm) : bf16_weight_exponent<false>(sj, rm);
    const __m256bh pb = _mm512_maskz_cvtneps_pbh(mk, exp2_bf16_weights_avx512(t1));
    vsum = _mm256_dpbf16_ps(vsum, pb, ones);
    const int64_t w = width - j;
    if (w >= 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + j), (__m256i)pb);
    else
      _mm256_mask_storeu_epi16(pp + j, static_cast<__mmask16>((1u << w) - 1), (__m256i)pb);
  }
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(vsum), _mm256_extractf128_ps(vsum, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
  const float alpha = rm.alpha;
  l = l * alpha + _mm_cvtss_f32(s4);
  m = rm.m_new;
  if (alpha != 1.f) {
    const __m512 va = _mm512_set1_ps(alpha);
    int64_t c = 0;
    for (; c + 16 <= d; c += 16) _mm512_storeu_ps(acc + c, _mm512_mul_ps(_mm512_loadu_ps(acc + c), va));
    for (; c < d; ++c) acc[c] *= alpha;
  }
}

// Row i of the step: n visible scores (n >= 1), P written for [0, width) (p_ij, then zeros).
ACR_AVX512_BF16 inline void softmax_row_avx512_bf16(const float* s, int64_t n, int64_t width, int64_t d, float scale,
                                                    float& m, float& l, float* acc, BFloat16* p) {
  const RowMax rm = row_max_avx512(s, n, scale, m);
  RowSums rs = row_sums_zero();
  const int64_t n32 = n / 32 * 32;
  softmax_row_pairs_bf16(s, 0, n32, rm, p, rs);
  softmax_row_finish_bf16(s, n, width, n32, d, rm, rs, m, l, acc, p);
}
// The fp32 step (P in fp32) on AVX-512F, 16 lanes: the AVX2 code's Cephes exp and order of work
// (exp_avx2, softmax_row_avx2) on twice the lanes, 2^n applied by vscalefps; the tail of a row
// masked (masked-off lanes load 0 and are zeroed after the exp, never exp(−offset)) and the
// stores run to width, so P's padding columns are written 0 in the same pass. Rounding differs
// from the AVX2 step in the row sum's order (16 lanes) and in a row's tail (the polynomial, where
// AVX2 takes std::exp one score at a time). Where the CPU has AVX-512F, unless
// ACARERANK_CPU_BASELINE=1 (f32_avx512()); fp32-convert's bf16 tiles take it too, the other
// bf16 paths their own step above.
#define ACR_AVX512F __attribute__((target("avx512f")))
ACR_AVX512F inline __m512 exp_avx512(__m512 x) {
  using namespace cephes_exp;
  const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kMinX), _CMP_NLT_UQ);  // 0 below the range
  x = _mm512_min_ps(_mm512_set1_ps(kMaxX), x);  // NaN kept: min/max return x then
  x = _mm512_max_ps(_mm512_set1_ps(kMinX), x);
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kC1), x);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kC2), r);
  __m512 y = _mm512_set1_ps(kP0);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP1));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP2));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP3));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP4));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP5));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(kept, _mm512_scalef_ps(y, fx));
}

// Row i of the step: n visible scores (n >= 1), P written for [0, width) (p_ij, then zeros).
ACR_AVX512F inline void softmax_row_avx512_f32(const float* s, int64_t n, int64_t width, int64_t d, float scale,
                                               float& m, float& l, float* acc, float* p) {
  auto mask = [](int64_t left) {
    return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : static_cast<__mmask16>((1u << left) - 1);
  };
  __m512 vmx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) vmx = _mm512_max_ps(_mm512_loadu_ps(s + j), vmx);  // a NaN score loses
  if (j < n) vmx = _mm512_mask_max_ps(vmx, mask(n - j), _mm512_maskz_loadu_ps(mask(n - j), s + j), vmx);
  const float mx = _mm512_reduce_max_ps(vmx);
  const float m_new = m > mx ? m : mx;
  if (m_new == -std::numeric_limits<float>::infinity()) {
    // every visible score so far −inf (see softmax_step): weights exp(−inf) = 0 exactly, a NaN
    // stays NaN; α = 1
    float sum = 0.f;
    for (j = 0; j < n; ++j) sum += p[j] = std::exp(scale * s[j]);
    for (; j < width; ++j) p[j] = 0.f;
    l += sum;
    return;
  }
  const float alpha = std::exp(scale * (m - m_new));
  // scale·(s − m'), the difference first (softmax_row_avx2)
  const __m512 vs = _mm512_set1_ps(scale), vm = _mm512_set1_ps(m_new);
  __m512 vsum = _mm512_setzero_ps();
  for (j = 0; j < width; j += 16) {
    const __mmask16 mk = mask(n - j);
    const __m512 e = _mm512_maskz_mov_ps(mk, exp_avx512(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + j), vm), vs)));
    _mm512_mask_storeu_ps(p + j, mask(width - j), e);
    vsum = _mm512_add_ps(vsum, e);
  }
  l = l * alpha + _mm512_reduce_add_ps(vsum);
  m = m_new;
  if (alpha != 1.f) {
    const __m512 va = _mm512_set1_ps(alpha);
    for (int64_t c = 0; c < d; c += 16) _mm512_mask_storeu_ps(acc + c, mask(d - c), _mm512_mul_ps(_mm512_maskz_loadu_ps(mask(d - c), acc + c), va));
  }
}

inline bool f32_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && !cpu_baseline_forced();
  return ok;
}

// One output row: dst[c] = acc[c] · inv in the output dtype. bf16 with AVX-512 (vcvtneps2bf16,
// round to nearest even as c10's conversion; a NaN stays NaN) where the softmax writes its P so.
ACR_AVX512_BF16 inline void scale_row_to_bf16_avx512(const float* acc, float inv, int64_t d, BFloat16* dst) {
  const __m512 vi = _mm512_set1_ps(inv);
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  for (int64_t c = 0; c < d; c += 16) {
    const int64_t w = d - c;
    const __mmask16 mk = w >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << w) - 1);
    const __m256i pb = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, acc + c), vi));
    _mm256_mask_storeu_epi16(out + c, mk, pb);
  }
}
#endif

inline bool cpu_has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}
#endif

template <typename s_t>
inline void scale_row_out(const float* acc, float inv, int64_t d, s_t* dst) {
#ifdef ACR_HAVE_AVX512_BF16_CODE
  if constexpr (std::is_same_v<s_t, BFloat16>) {
    if (bf16_avx512()) {
      scale_row_to_bf16_avx512(acc, inv, d, dst);
      return;
    }
  }
#endif
  for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<s_t>(acc[c] * inv);
}

template <typename c_t, typename CntFn>
void softmax_step(int64_t M, int64_t KT, int64_t width, int64_t d, float scale, const float* S, CntFn&& cnt,
                  float* m, float* l, float* acc, c_t* P) {
#if defined(__x86_64__)
#ifdef ACR_HAVE_AVX512_BF16_CODE
  if constexpr (std::is_same_v<c_t, BFloat16>) {
    if (bf16_avx512()) {
      for (int64_t i = 0; i < M; ++i) {
        const int64_t n = std::max<int64_t>(0, cnt(i));
        if (n > 0)
          softmax_row_avx512_bf16(S + i * KT, n, width, d, scale, m[i], l[i], acc + i * d, P + i * KT);
        else
          std::memset(static_cast<void*>(P + i * KT), 0, sizeof(BFloat16) * width);
      }
      return;
    }
  }
#endif
  if constexpr (std::is_same_v<c_t, float>) {
#ifdef ACR_HAVE_AVX512_BF16_CODE
    if (f32_avx512()) {
      for (int64_t i = 0; i < M; ++i) {
        const int64_t n = std::max<int64_t>(0, cnt(i));
        if (n > 0)
          softmax_row_avx512_f32(S + i * KT, n, width, d, scale, m[i], l[i], acc + i * d, P + i * KT);
        else
          std::memset(static_cast<void*>(P + i * KT), 0, sizeof(float) * width);
      }
      return;
    }
#endif
    if (cpu_has_avx2()) {
      for (int64_t i = 0; i < M; ++i) {
        const int64_t n = std::max<int64_t>(0, cnt(i));
        if (n > 0) softmax_row_avx2(S + i * KT, n, d, scale, m[i], l[i], acc + i * d, P + i * KT);
        if (n < width) std::memset(static_cast<void*>(P + i * KT + n), 0, sizeof(float) * (width - n));
      }
      return;
    }
  }
#endif
  for (int64_t i = 0; i < M; ++i) {
    const int64_t n = cnt(i);
    const float* s = S + i * KT;
    c_t* p = P + i * KT;
    if (n <= 0) {
      std::memset(static_cast<void*>(p), 0, sizeof(c_t) * width);
      continue;
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
    const float m_new = m[i] > mx ? m[i] : mx;
    const bool none = m_new == -std::numeric_limits<float>::infinity();  // every score so far −inf (above)
    const float alpha = none ? 1.f : std::exp(scale * (m[i] - m_new));  // 0 at the first visible tile (m = −inf)
    const float mo = none ? 0.f : m_new;  // the difference first (RowMax)
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      p[j] = static_cast<c_t>(std::exp(scale * (s[j] - mo)));
      sum += static_cast<float>(p[j]);  // the weight P·V uses (bf16: rounded), so acc / l is a weighted mean
    }
    for (int64_t j = n; j < width; ++j) p[j] = c_t(0);
    l[i] = l[i] * alpha + sum;
    m[i] = m_new;
    if (alpha != 1.f) {
      float* a = acc + i * d;
      for (int64_t c = 0; c < d; ++c) a[c] *= alpha;
    }
  }
}

}  // namespace acr_attn
