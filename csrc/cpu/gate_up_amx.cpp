// acarerank::gate_up_amx — the MLP's gate/up projection on AMX tiles, SiLU·up in its epilogue
// (docs/ARCHITECTURE.md, "Native CPU kernels"); the reference is acarerank/ops/gate_up_silu.py's
// gate_up_silu_ref.
//
//   silu true:   y [M, I]  = SiLU(x·W_gᵀ) · (x·W_uᵀ),   SiLU(g) = g / (1 + exp(−g))
//   silu false:  y [M, 2I] = x·[W_g; W_u]ᵀ              (the plain linear layer, [gate | up])
//
// x [M, K] bf16 (rows at any stride, columns contiguous); the weight [2I, K] = [W_g; W_u] packed
// once (gate_up_silu.py's pack_gate_up) into 32-column blocks b of 16 gate and 16 up columns and
// k-steps s of 32, VNNI pairs innermost:
//   packed[b][s][h][kp][c][e] = W[h·I + 16b + c][32s + 2kp + e]     (h 0: gate, 1: up)
// so one 2×2 block of tiles (attn_amx.h: rows 0–15 / 16–31 × columns 0–15 / 16–31) holds the gate
// and the up sums of the same 32 rows and 16 columns of y, and the epilogue reads both from L1.
//
// Why a GEMM of our own: at the model's row counts oneDNN's gate/up GEMM is bound by memory
// traffic, not by the tile unit (docs/cpu.md, "Targets"), so the gain is in what is not written:
// [M, I] instead of [M, 2I], and no silu_and_mul pass reading it back.
//
// Blocking: tasks (column macro of NC columns, row chunk of MC rows), dealt column-macro-major so
// a thread keeps its macro's weight (NC × KC × 2 bytes a k-chunk) in L2 over its row chunks; K in
// chunks of KC so a 32-row slice of x (32 × KC) stays in L1 over the macro's column blocks; the C
// block's fp32 sums in per-thread scratch between k-chunks (stored and reloaded exactly). A row's
// sums take the same k order whatever M, the row's position or the thread count: the result is
// batch-invariant. fp32 sums, one rounding to bf16 per output (RNE); the SiLU's exp is
// exp2_avx512 (relative error < 3e-6).
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "attn_amx.h"
#include "common.h"

namespace acarerank_cpu {
namespace {

using at::BFloat16;

constexpr const char* kOp = "gate_up_amx";
constexpr int64_t NC = 256;  // columns of a task's macro (of the packed [gate|up] blocks)
constexpr int64_t MC = 256;  // rows of a task's chunk
constexpr int64_t KC = 256;  // k of a chunk between C scratch stores

#ifdef ACR_HAVE_AMX_CODE
struct Shape {
  int64_t M, K, I, lda;
  bool silu;
};

// The epilogue of 32-column block b's sums for rows [0, rows): C [rows][ldc] fp32 at c (gate in
// columns 0–15, up in 16–31).
ACR_AMX inline void write_block(const float* c, int64_t ldc, int64_t rows, int64_t b, const Shape& sh,
                                BFloat16* y, int64_t r0) {
  if (sh.silu) {
    const __m512 neg_log2e = _mm512_set1_ps(-1.44269504088896341f), one = _mm512_set1_ps(1.f);
    for (int64_t i = 0; i < rows; ++i) {
      const __m512 g = _mm512_loadu_ps(c + i * ldc), u = _mm512_loadu_ps(c + i * ldc + 16);
      const __m512 e = acr_attn::exp2_avx512(_mm512_mul_ps(g, neg_log2e));  // exp(−g)
      const __m512 v = _mm512_div_ps(_mm512_mul_ps(g, u), _mm512_add_ps(one, e));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (r0 + i) * sh.I + b * 16), (__m256i)_mm512_cvtneps_pbh(v));
    }
    return;
  }
  for (int64_t i = 0; i < rows; ++i) {
    BFloat16* row = y + (r0 + i) * 2 * sh.I + b * 16;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + i * ldc)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + sh.I),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + i * ldc + 16)));
  }
}

// Tasks [t0, t1) of one thread (see the file's header for the order).
ACR_AMX void run_tasks(int64_t t0, int64_t t1, const Shape& sh, const BFloat16* x, const BFloat16* wp, BFloat16* y) {
  const int64_t KS = sh.K / 32, NB = 2 * sh.I / 32, MB = (sh.M + 31) / 32;
  const int64_t nb_per = NC / 32, mb_per = MC / 32, ks_per = KC / 32;
  const int64_t chunks = (MB + mb_per - 1) / mb_per;
  const int64_t ldc = NC + 16;  // a cache line past NC: the 16 rows of a tile store do not share L1 sets
  acr_attn::scratch<float> C(MC * ldc);
  acr_attn::scratch<BFloat16> pad;  // the last block's rows when fewer than 32, zeros after them
  at::native::cpublas::brgemm_release(/*is_vnni=*/true);  // brgemm reloads its own config after us
  acr_attn::TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t nb0 = (t / chunks) * nb_per, nb1 = std::min(NB, nb0 + nb_per);
    const int64_t mb0 = (t % chunks) * mb_per, mb1 = std::min(MB, mb0 + mb_per);
    for (int64_t k0 = 0; k0 < KS; k0 += ks_per) {
      const int64_t k1 = std::min(KS, k0 + ks_per);
      for (int64_t mb = mb0; mb < mb1; ++mb) {
        const int64_t r0 = mb * 32, rows = std::min<int64_t>(32, sh.M - r0);
        const BFloat16* a = x + r0 * sh.lda;
        int64_t lda = sh.lda;
        if (rows < 32) {
          if (pad.empty()) {  // only the last row block is short: one copy serves all its tasks
            pad.assign(32 * sh.K, BFloat16(0.f));
            for (int64_t i = 0; i < rows; ++i) std::memcpy(&pad[i * sh.K], a + i * sh.lda, sh.K * sizeof(BFloat16));
          }
          a = pad.data();
          lda = sh.K;
        }
        float* cm = C.data() + (mb - mb0) * 32 * ldc;
        auto operands = [&](int64_t nb, int64_t ks) {
          const BFloat16* b = wp + (nb * KS + ks) * 1024;
          return acr_attn::Operands32{a + ks * 32, lda * 2, b, b + 512, 64};
        };
        for (int64_t nb = nb0; nb < nb1; ++nb) {
          float* c = cm + (nb - nb0) * 32;
          if (k0 > 0) {
            acr_attn::load_2x2(c, ldc);
          } else {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
          }
          acr_attn::load_operands(operands(nb, k0));
          for (int64_t ks = k0; ks < k1; ++ks) {
            const acr_attn::Operands32 next = ks + 1 < k1 ? operands(nb, ks + 1) : acr_attn::Operands32{};
            acr_attn::products_2x2_then_load(ks + 1 < k1 ? &next : nullptr);
          }
          acr_attn::store_2x2(c, ldc);
          if (k1 == KS) write_block(c, ldc, rows, nb, sh, y, r0);
        }
      }
    }
  }
  _tile_release();
}
#endif

at::Tensor gate_up_amx(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate, bool silu) {
  ACR_CHECK_CPU(kOp, x, "input");
  ACR_CHECK_CPU(kOp, packed, "packed weight");
  ACR_CHECK_DTYPE(kOp, x, "input", at::kBFloat16);
  ACR_CHECK_DTYPE(kOp, packed, "packed weight", at::kBFloat16);
  ACR_CHECK_DIM(kOp, x, "input", 2);
  ACR_CHECK_DIM(kOp, packed, "packed weight", 1);
  const int64_t M = x.size(0), K = x.size(1), I = intermediate;
  TORCH_CHECK(I > 0 && I % 16 == 0, kOp, ": intermediate size must be a positive multiple of 16, got ", I);
  TORCH_CHECK(K > 0 && K % 32 == 0, kOp, ": input's K must be a positive multiple of 32, got shape ", x.sizes());
  TORCH_CHECK(packed.numel() == 2 * I * K, kOp, ": packed weight holds ", packed.numel(), " elements, want 2·",
              I, "·", K, " = ", 2 * I * K, " for input K ", K, " (pack it with gate_up_silu.pack_gate_up)");
  TORCH_CHECK(packed.is_contiguous(), kOp, ": packed weight must be contiguous");
  TORCH_CHECK(M == 0 || (x.stride(1) == 1 && (M == 1 || x.stride(0) >= K)), kOp, ": input's rows must be contiguous and not "
              "overlap (got strides ", x.strides(), " for shape ", x.sizes(), "); call .contiguous() first");
  at::Tensor y = at::empty({M, silu ? I : 2 * I}, x.options());
  if (M == 0) return y;
#ifdef ACR_HAVE_AMX_CODE
  TORCH_CHECK(acr_attn::amx_tiles_usable(), kOp, ": this CPU (or this process) cannot use AMX-BF16 tiles; ",
              "run the gate/up projection as linear + silu_and_mul (the \"torch\" backend of gate_up_silu)");
  const Shape sh{M, K, I, M > 1 ? x.stride(0) : K, silu};  // one row: its stride is not read
  const int64_t MB = (M + 31) / 32, chunks = (MB + MC / 32 - 1) / (MC / 32);
  const int64_t macros = (2 * I / 32 + NC / 32 - 1) / (NC / 32);
  const BFloat16* xp = x.const_data_ptr<BFloat16>();
  const BFloat16* wp = packed.const_data_ptr<BFloat16>();
  BFloat16* yp = y.mutable_data_ptr<BFloat16>();
  at::parallel_for(0, macros * chunks, 1, [&](int64_t t0, int64_t t1) { run_tasks(t0, t1, sh, xp, wp, yp); });
#else
  TORCH_CHECK(false, kOp, ": acarerank._cpu was built without AMX code (no AVX512-BF16 compiler support); ",
              "use the \"torch\" backend of gate_up_silu");
#endif
  return y;
}

}  // namespace
}  // namespace acarerank_cpu

TORCH_LIBRARY_FRAGMENT(acarerank, m) {
  m.def("gate_up_amx(Tensor input, Tensor packed, int intermediate, bool silu) -> Tensor");
}

TORCH_LIBRARY_IMPL(acarerank, CPU, m) { m.impl("gate_up_amx", &acarerank_cpu::gate_up_amx); }
