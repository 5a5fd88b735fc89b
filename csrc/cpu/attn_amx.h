// One bf16 key tile of the attention on AMX tiles directly (prefix_attention.cpp's prefix tiles and
// segments' own tiles, bf16 path "amx-brgemm"), the softmax interleaved with the tile products:
//
//   S = Q·Kᵀ;  the online-softmax step of every row (attn_tiles.h's softmax_step);  acc += P·V
//
// Through cpublas::brgemm the three ran one after the other, three library calls per tile with
// M cut into powers of two. Here the tile loops are our own (a 2×2 block of 16×16 fp32 tiles per
// k-step of 32) and the instruction stream alternates one k-step of tile products (4 tdpbf16ps)
// with one slice of softmax work (a row's max, or 128 of its scores), so out-of-order execution
// can run vector work while products are in flight. Measured on the AMX Xeon (docs/cpu-log.md):
// the kernel 8–12 % faster than through brgemm at M3 depth 20; the interleaving 5 % of
// that (the same loops one after the other, ad hoc). The overlap is small: alone, the matrix unit
// and the vector ports overlap fully, but tile loads and the softmax's vector work slow each
// other, and the softmax (~40 % of the kernel) stays mostly on top of the products.
//
// Pipeline over the tile's 32-row blocks b = 0 .. B−1 (rows past M: see tile_amx):
//   step b:  tiles:   S_{b+1} = Q_{b+1}·Kᵀ,  then  acc_{b−1} += P_{b−1}·V
//            vectors: the softmax step of block b's rows (S_b → P_b, m, l, acc_b rescaled)
// Each row gets the softmax step softmax_step gives it, part for part (attn_tiles.h's row pieces),
// and its products in k order, 32 at a time, accumulated in the tile (P·V from acc's values).
//
// Tiles (palette 1, all 16 rows × 64 bytes): 0–3 the 2×2 fp32 C block (rows 0–15 / 16–31 ×
// columns 0–15 / 16–31 of a 32 × 32 slab), 4–5 the A rows (bf16 [16][32]), 6–7 the VNNI B
// columns ([16 pairs][16][2]). Layouts as attn_tiles.h: Q [M][d], K [d/2][KT][2], V [KT/2][d][2],
// acc [M][d] fp32; S [M][KT + 16] fp32 and P [M][KT + 32] bf16, rows a cache line longer than the
// tile: at 2,048 and 1,024 bytes apart the 16 rows of a tile store or load share two or four L1
// sets (the S/P padding: tile products ~10 % faster, ad hoc). d and the GEMM's columns nc are
// multiples of 32.
//
// The thread's tile configuration is cpublas::brgemm's too: brgemm_release() before ours (so its
// next call loads its own again: it skips that while it believes its kernel is current) and
// tilerelease after.
#pragma once

#include "attn_tiles.h"

namespace acr_attn {
// S's and P's row strides in tile_amx (elements), and its row block: its callers' scratch
// holds M rounded up to whole blocks of rows of each.
constexpr int64_t amx_score_stride(int64_t KT) { return KT + 16; }
constexpr int64_t amx_weight_stride(int64_t KT) { return KT + 32; }
constexpr int64_t kAmxBlockRows = 32;
}  // namespace acr_attn

#if defined(ACR_HAVE_AVX512_BF16_CODE) && defined(__linux__) && !defined(ACR_VNNI_REFERENCE_GEMM)
#include <sys/syscall.h>
#include <unistd.h>

#include <cpuid.h>

#define ACR_HAVE_AMX_CODE 1
// The tile instructions, or with ACR_AMX_EMULATE (a development build, never shipped) their
// software twins (amx_emulate.h), so this code runs on a CPU without AMX. Tile numbers are
// constants, as the instructions take them.
#ifdef ACR_AMX_EMULATE
#include "amx_emulate.h"
#define ACR_AMX ACR_AVX512_BF16
#define ACR_TILE_LOADCONFIG(cfg) acr_amx_emu::loadconfig(cfg)
#define ACR_TILE_RELEASE() acr_amx_emu::release()
#define ACR_TILE_ZERO(t) acr_amx_emu::zero(t)
#define ACR_TILE_LOADD(t, base, stride) acr_amx_emu::loadd(t, base, stride)
#define ACR_TILE_STORED(t, base, stride) acr_amx_emu::stored(t, base, stride)
#define ACR_TILE_DPBF16PS(c, a, b) acr_amx_emu::dpbf16ps(c, a, b)
#else
#define ACR_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define ACR_TILE_LOADCONFIG(cfg) _tile_loadconfig(cfg)
#define ACR_TILE_RELEASE() _tile_release()
#define ACR_TILE_ZERO(t) _tile_zero(t)
#define ACR_TILE_LOADD(t, base, stride) _tile_loadd(t, base, stride)
#define ACR_TILE_STORED(t, base, stride) _tile_stored(t, base, stride)
#define ACR_TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

namespace acr_attn {

// AMX-BF16 and AMX-TILE in CPUID and the tile data state granted to this process by the kernel
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA: Linux 5.16+; without it the first tile load
// faults). oneDNN asks too; asking again is a no-op.
inline bool amx_tiles_usable() {
#ifdef ACR_AMX_EMULATE
  return true;  // the emulated tiles need no CPU support and no permission
#endif
  static const bool ok = [] {
    unsigned a, b, c, dx;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &dx)) return false;
    const bool bf16 = (dx >> 22) & 1, tile = (dx >> 24) & 1;
    if (!bf16 || !tile) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// The interleaved kernel for bf16 key tiles: on the amx-brgemm path where the tiles are usable,
// unless ACARERANK_CPU_AMX_TILES=0 (brgemm then; read once). The caller also needs head_dim % 32 == 0
// and, on an own tile, finite values (else its masked P·V).
inline bool amx_tiles_kernel() {
  static const bool on = [] {
    const char* e = std::getenv("ACARERANK_CPU_AMX_TILES");
    const bool off = e != nullptr && std::strcmp(e, "0") == 0;
    TORCH_CHECK(e == nullptr || *e == '\0' || off || std::strcmp(e, "1") == 0,
                "ACARERANK_CPU_AMX_TILES must be 0 or 1, got '", e, "'");
#ifdef ACR_AMX_EMULATE
    // emulated: also on the brgemm path (ACARERANK_CPU_BF16_PATH=brgemm), the amx-brgemm code on
    // cpublas' non-AMX brgemm: with the tiles emulated, what an AMX CPU runs but oneDNN's ukernel
    if (!off && std::strcmp(bf16_path(), "brgemm") == 0) return true;
#endif
    return !off && std::strcmp(bf16_path(), "amx-brgemm") == 0 && amx_tiles_usable();
  }();
  return on;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Rows [i, end) of S through the softmax step, a slice per step(): a row's max, then kSliceScores
// of its scores at a time, its tail and l/m/acc with the last slice. Row i sees cnt(i) of the
// tile's columns (the causal count on a diagonal tile; at most width); a row that sees none gets
// P zeros to width and keeps m, l and acc, as softmax_step. Slices of 32 to 512 scores measured
// the same.
template <typename CntFn>
struct SoftmaxSlices {
  static constexpr int64_t kSliceScores = 128;
  const float* S;
  BFloat16* P;
  float *m, *l, *acc;
  int64_t ls, lp, width, d;
  float scale;
  CntFn cnt;
  int64_t i, end;
  bool have_max = false;
  int64_t n = 0, n32 = 0, j = 0;
  RowMax rm;
  RowSums rs;

  ACR_AVX512_BF16 void step() {
    if (i >= end) return;
    const float* s = S + i * ls;
    if (!have_max) {
      n = std::max<int64_t>(0, cnt(i));
      if (n == 0) {
        std::memset(static_cast<void*>(P + i * lp), 0, sizeof(BFloat16) * width);
        ++i;
        return;
      }
      n32 = n / 32 * 32;
      rm = row_max_avx512(s, n, scale, m[i]);
      rs = row_sums_zero();
      j = 0;
      have_max = true;
      return;
    }
    const int64_t j1 = std::min(n32, j + kSliceScores);
    softmax_row_pairs_bf16(s, j, j1, rm, P + i * lp, rs);
    j = j1;
    if (j == n32) {
      softmax_row_finish_bf16(s, n, width, n32, d, rm, rs, m[i], l[i], acc + i * d, P + i * lp);
      have_max = false;
      ++i;
    }
  }
  ACR_AVX512_BF16 void finish() {
    while (i < end) step();
  }
};

// One k-step's operands: A rows [0, 16) at a, rows [16, 32) lda bytes further on; B columns at b0
// and b1 (ldb bytes a row).
struct Operands32 {
  const void* a;
  int64_t lda;
  const void* b0;
  const void* b1;
  int64_t ldb;
  const void* a1() const { return static_cast<const char*>(a) + 16 * lda; }
};
ACR_AMX inline void load_operands(const Operands32& o) {
  ACR_TILE_LOADD(4, o.a, o.lda);
  ACR_TILE_LOADD(5, o.a1(), o.lda);
  ACR_TILE_LOADD(6, o.b0, o.ldb);
  ACR_TILE_LOADD(7, o.b1, o.ldb);
}
// The 2×2 block's products of one k-step, the next k-step's operands loaded as soon as the
// products before have read the tile they replace (the tiles have no renaming: a load into a tile
// waits for the products reading it): A rows 0–15 after the second product, B columns 0–15 after
// the third, the rest after the fourth. Against the four loads after the four products: 4B heads
// 98.8 against 102.2 ms, 0.6B 45.8 against 46.2 (M3 depth 20, means of five interleaved rounds;
// docs/cpu-log.md), as in a loop of S products alone (K from L2: 23–24 against 25–26 TSC
// cycles a product, 12 with no loads at all).
ACR_AMX inline void products_2x2_then_load(const Operands32* next) {
  ACR_TILE_DPBF16PS(0, 4, 6);
  ACR_TILE_DPBF16PS(1, 4, 7);
  if (next) ACR_TILE_LOADD(4, next->a, next->lda);
  ACR_TILE_DPBF16PS(2, 5, 6);
  if (next) ACR_TILE_LOADD(6, next->b0, next->ldb);
  ACR_TILE_DPBF16PS(3, 5, 7);
  if (next) {
    ACR_TILE_LOADD(5, next->a1(), next->lda);
    ACR_TILE_LOADD(7, next->b1, next->ldb);
  }
}
ACR_AMX inline void store_2x2(float* c, int64_t ldc) {
  ACR_TILE_STORED(0, c, ldc * 4);
  ACR_TILE_STORED(1, c + 16, ldc * 4);
  ACR_TILE_STORED(2, c + 16 * ldc, ldc * 4);
  ACR_TILE_STORED(3, c + 16 * ldc + 16, ldc * 4);
}

ACR_AMX inline void load_2x2(const float* c, int64_t ldc) {
  ACR_TILE_LOADD(0, c, ldc * 4);
  ACR_TILE_LOADD(1, c + 16, ldc * 4);
  ACR_TILE_LOADD(2, c + 16 * ldc, ldc * 4);
  ACR_TILE_LOADD(3, c + 16 * ldc + 16, ldc * 4);
}

// C rows [0, 32) (+)= A · B over K (both multiples of 32), 32 columns of C at a time, one softmax
// slice per k-step; operands(j, k) gives the k-step's A rows and B columns j .. j + 31. Each
// k-step's products load the next k-step's operands (products_2x2_then_load), the next columns'
// first ones too, before this block's C is stored: the store waits for the last products and the
// next C for the store; the loads need not (7.7 → 6.9 ns per tdpbf16ps in isolation on the AMX
// Xeon, ad hoc).
template <typename Operands, typename Slices>
ACR_AMX inline void gemm_32_rows(int64_t cols, int64_t K, float* C, int64_t ldc, bool accumulate,
                                 const Operands& operands, Slices& sm) {
  load_operands(operands(0, 0));
  for (int64_t j = 0; j < cols; j += 32) {
    if (accumulate) {
      load_2x2(C + j, ldc);
    } else {
      ACR_TILE_ZERO(0);
      ACR_TILE_ZERO(1);
      ACR_TILE_ZERO(2);
      ACR_TILE_ZERO(3);
    }
    for (int64_t k = 0; k < K; k += 32) {
      const bool more = k + 32 < K || j + 32 < cols;
      const Operands32 next = k + 32 < K ? operands(j, k + 32) : more ? operands(j + 32, 0) : Operands32{};
      products_2x2_then_load(more ? &next : nullptr);
      sm.step();
    }
    store_2x2(C + j, ldc);
  }
}

// One key tile for rows [0, M): row i sees cnt(i) of its columns (all n on the prefix, the causal
// count on a segment's own tile), the GEMMs run over nc = gemm_cols(n) (a multiple of 32; the
// packed K and V are zero past n); d a multiple of 32. m, l, acc: the rows' running state, as
// softmax_step. Q, S, P and acc hold whole 32-row blocks (M rounded up to 32); the last block's
// rows past M may be other rows' (an own sub-block's neighbour): their Q and acc are read, and
// their P is set to zero, so P·V adds exact zeros (V finite: the caller's check) to their acc.
template <typename CntFn>
ACR_AMX inline void tile_amx(int64_t M, int64_t nc, int64_t d, float scale, const BFloat16* Q, const BFloat16* kt,
                             const BFloat16* vt, int64_t KT, float* S, BFloat16* P, float* m, float* l, float* acc,
                             const CntFn& cnt) {
  const int64_t ls = amx_score_stride(KT), lp = amx_weight_stride(KT);
  at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  ACR_TILE_LOADCONFIG(&cfg);
  const int64_t B = (M + 31) / 32;
  for (int64_t i = M; i < B * 32; ++i) std::memset(static_cast<void*>(P + i * lp), 0, sizeof(BFloat16) * nc);
  for (int64_t b = -1; b <= B; ++b) {
    const bool rows = b >= 0 && b < B;
    SoftmaxSlices<const CntFn&> sm{S, P, m, l, acc, ls, lp, nc, d, scale, cnt,
                                   rows ? b * 32 : 0, rows ? std::min(M, b * 32 + 32) : 0};
    if (b + 1 < B) {  // S_{b+1} = Q_{b+1}·Kᵀ
      const BFloat16* q = Q + (b + 1) * 32 * d;
      gemm_32_rows(nc, d, S + (b + 1) * 32 * ls, ls, false, [&](int64_t j, int64_t k) {
        return Operands32{q + k, d * 2, kt + ((k / 2) * KT + j) * 2, kt + ((k / 2) * KT + j + 16) * 2, KT * 4};
      }, sm);
    }
    if (b >= 1) {  // acc_{b−1} += P_{b−1}·V
      const BFloat16* p = P + (b - 1) * 32 * lp;
      gemm_32_rows(d, nc, acc + (b - 1) * 32 * d, d, true, [&](int64_t c, int64_t k) {
        return Operands32{p + k, lp * 2, vt + ((k / 2) * d + c) * 2, vt + ((k / 2) * d + c + 16) * 2, d * 4};
      }, sm);
    }
    sm.finish();
  }
  ACR_TILE_RELEASE();
}

}  // namespace acr_attn
#endif
