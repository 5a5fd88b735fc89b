// A layer GEMM of our own on AMX tiles, y = epilogue(x·Wᵀ) (gate_up_amx.cpp: SiLU·up, or the plain
// output; docs/ARCHITECTURE.md, "Native CPU kernels"): the driver, the epilogue the caller's — what
// is written from a block's fp32 sums.
//
// x [M, K] bf16, rows lda elements apart; W [N, K] packed once (ops/amx_weights.py) into 32-column
// blocks b and k-steps s of 32, VNNI pairs innermost:
//   packed[b][s][h][kp][c][e] = W[col(b, h, c)][32s + 2kp + e]
// where col(b, h, c) is the weight row behind block b's tile column h·16 + c (gate/up interleaves
// the two halves, gate_up_amx.cpp). One 2×2 block of tiles (attn_amx.h) holds 32 rows × the block's
// 32 columns.
//
// Why a GEMM of our own: what pays is writing less — an epilogue that consumes the sums where they
// are (L1) instead of a pass reading the GEMM's output back. The GEMM itself is slower than
// oneDNN's: plain (column order, col = 32b + 16h + c) it measured 2.0 TFLOP/s at the 0.6B model's
// QKV and gate/up shapes and 3,996 rows against oneDNN's 2.4 (docs/cpu-log.md), so it pays
// only where the epilogue saves more than that: gate/up's SiLU·up (half the output, no pass) does;
// a QKV epilogue of q/k norm + RoPE + page write (the same output, one pass saved) did not.
//
// Blocking: tasks (column macro of kMacroCols columns, row chunk of kChunkRows rows), dealt
// column-macro-major so a thread keeps its macro's weight (kMacroCols × kChunkK × 2 bytes per
// k-chunk) in L2 over its row chunks; K in chunks of kChunkK so a 32-row slice of x stays in L1
// over the macro's column blocks; the block's fp32 sums in per-thread scratch between k-chunks
// (stored and reloaded exactly). A row's sums take the same k order whatever M, the row's place or
// the thread count: the result is batch-invariant. 256 / 256 / 256: the best of the blockings tried
// (docs/cpu-log.md).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstring>

#include "attn_amx.h"
#include "common.h"

namespace acr_amx_gemm {

constexpr int64_t kMacroCols = 256;  // columns of a task's macro
constexpr int64_t kChunkRows = 256;  // rows of a task's chunk
constexpr int64_t kChunkK = 256;     // k of a chunk between scratch stores
constexpr int64_t kScratchLd = kMacroCols + 16;  // a cache line past: a tile's 16 row stores do not share L1 sets

struct Gemm {
  const at::BFloat16* x;  // [M, K], rows lda apart
  int64_t M, K, lda;
  const at::BFloat16* packed;  // N·K, the layout above
  int64_t N;                   // a multiple of 32
};

// The checks every op on this GEMM makes of x [M, K] and a packed [N, K] weight; the Gemm (x's
// rows as they lie when they may: columns contiguous, rows not overlapping).
inline Gemm checked_gemm(const char* op, const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  ACR_CHECK_CPU(op, x, "input");
  ACR_CHECK_CPU(op, packed, "packed weight");
  ACR_CHECK_DTYPE(op, x, "input", at::kBFloat16);
  ACR_CHECK_DTYPE(op, packed, "packed weight", at::kBFloat16);
  ACR_CHECK_DIM(op, x, "input", 2);
  ACR_CHECK_DIM(op, packed, "packed weight", 1);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K > 0 && K % 32 == 0, op, ": input's K must be a positive multiple of 32, got shape ", x.sizes());
  TORCH_CHECK(N > 0 && N % 32 == 0, op, ": the weight's N must be a positive multiple of 32, got ", N);
  TORCH_CHECK(packed.numel() == N * K, op, ": packed weight holds ", packed.numel(), " elements, want ", N, "·", K,
              " = ", N * K, " for input K ", K, " (pack it with acarerank.ops.amx_weights)");
  TORCH_CHECK(packed.is_contiguous(), op, ": packed weight must be contiguous");
  TORCH_CHECK(M == 0 || (x.stride(1) == 1 && (M == 1 || x.stride(0) >= K)), op,
              ": input's rows must be contiguous and not overlap (got strides ", x.strides(), " for shape ",
              x.sizes(), "); call .contiguous() first");
#ifdef ACR_HAVE_AMX_CODE
  TORCH_CHECK(M == 0 || acr_attn::amx_tiles_usable(), op, ": this CPU (or this process) cannot use AMX-BF16 "
              "tiles; run the unfused layer (linear and the element-wise op)");
#else
  TORCH_CHECK(M == 0, op, ": acarerank._cpu was built without AMX code (no AVX512-BF16 compiler support); "
              "run the unfused layer (linear and the element-wise op)");
#endif
  return Gemm{x.const_data_ptr<at::BFloat16>(), M, K, M > 1 ? x.stride(0) : K, packed.const_data_ptr<at::BFloat16>(),
              N};  // one row: its stride is not read
}

#ifdef ACR_HAVE_AMX_CODE
// Tasks [t0, t1) of one thread. After the last k-chunk of a 32-row block of a macro,
//   epilogue(c, ldc, rows, r0, col0, col1)
// with c the block's fp32 sums [32][ldc] (rows [0, rows) valid: x rows r0 .. r0 + rows) of
// packed columns [col0, col1) (c's column 0 is col0).
template <typename Epilogue>
ACR_AMX void run_tasks(int64_t t0, int64_t t1, const Gemm& g, const Epilogue& epilogue) {
  using at::BFloat16;
  const int64_t KS = g.K / 32, NB = g.N / 32, MB = (g.M + 31) / 32;
  const int64_t nb_per = kMacroCols / 32, mb_per = kChunkRows / 32, ks_per = kChunkK / 32;
  const int64_t chunks = (MB + mb_per - 1) / mb_per;
  // a chunk's sums, no more rows than the call has (a decode step's few rows: 35 kB, not 278)
  acr_attn::scratch<float> C(std::min(kChunkRows, MB * 32) * kScratchLd);
  acr_attn::scratch<BFloat16> pad;  // the last block's rows when fewer than 32, zeros after them
  at::native::cpublas::brgemm_release(/*is_vnni=*/true);  // brgemm reloads its own config after us
  acr_attn::TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  ACR_TILE_LOADCONFIG(&cfg);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t nb0 = (t / chunks) * nb_per, nb1 = std::min(NB, nb0 + nb_per);
    const int64_t mb0 = (t % chunks) * mb_per, mb1 = std::min(MB, mb0 + mb_per);
    for (int64_t k0 = 0; k0 < KS; k0 += ks_per) {
      const int64_t k1 = std::min(KS, k0 + ks_per);
      for (int64_t mb = mb0; mb < mb1; ++mb) {
        const int64_t r0 = mb * 32, rows = std::min<int64_t>(32, g.M - r0);
        const BFloat16* a = g.x + r0 * g.lda;
        int64_t lda = g.lda;
        if (rows < 32) {
          if (pad.empty()) {  // only the last row block is short: one copy serves all its tasks
            pad.assign(32 * g.K, BFloat16(0.f));
            for (int64_t i = 0; i < rows; ++i) std::memcpy(&pad[i * g.K], a + i * g.lda, g.K * sizeof(BFloat16));
          }
          a = pad.data();
          lda = g.K;
        }
        float* cm = C.data() + (mb - mb0) * 32 * kScratchLd;
        auto operands = [&](int64_t nb, int64_t ks) {
          const BFloat16* b = g.packed + (nb * KS + ks) * 1024;
          return acr_attn::Operands32{a + ks * 32, lda * 2, b, b + 512, 64};
        };
        for (int64_t nb = nb0; nb < nb1; ++nb) {
          float* c = cm + (nb - nb0) * 32;
          if (k0 > 0) {
            acr_attn::load_2x2(c, kScratchLd);
          } else {
            ACR_TILE_ZERO(0);
            ACR_TILE_ZERO(1);
            ACR_TILE_ZERO(2);
            ACR_TILE_ZERO(3);
          }
          acr_attn::load_operands(operands(nb, k0));
          for (int64_t ks = k0; ks < k1; ++ks) {
            const acr_attn::Operands32 next = ks + 1 < k1 ? operands(nb, ks + 1) : acr_attn::Operands32{};
            acr_attn::products_2x2_then_load(ks + 1 < k1 ? &next : nullptr);
          }
          acr_attn::store_2x2(c, kScratchLd);
        }
        if (k1 == KS) epilogue(static_cast<const float*>(cm), kScratchLd, rows, r0, nb0 * 32, nb1 * 32);
      }
    }
  }
  ACR_TILE_RELEASE();
}

// The whole GEMM over at::parallel_for (tasks in the order above).
template <typename Epilogue>
void run(const Gemm& g, const Epilogue& epilogue) {
  const int64_t MB = (g.M + 31) / 32, chunks = (MB + kChunkRows / 32 - 1) / (kChunkRows / 32);
  const int64_t macros = (g.N + kMacroCols - 1) / kMacroCols;
  at::parallel_for(0, macros * chunks, 1, [&](int64_t t0, int64_t t1) { run_tasks(t0, t1, g, epilogue); });
}
#endif

}  // namespace acr_amx_gemm
