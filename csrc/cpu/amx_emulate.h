// The AMX tile instructions the kernels use, in software: a development build with ACR_AMX_EMULATE
// (never shipped; tests/ops/test_op_amx_emulated.py) runs attn_amx.h's tile kernel and amx_gemm.h's
// GEMM driver — their operand layouts, row and column tails, the softmax interleaved with the
// products, the release of cpublas' configuration — on any CPU with AVX512_BF16, which otherwise
// runs none of that code. What it cannot show: the matrix unit's speed, and its flushing of
// subnormal inputs and outputs (the emulation keeps them; the kernels' tests use none).
//
// State per thread, as the hardware's: the configuration (rows and bytes per row of each of the 8
// tiles, palette 1) and 8 tiles of 16 rows × 64 bytes. Each operation follows the Intel SDM's
// pseudocode for palette 1:
//   loadd(t, p, s)   row r < rows[t] of tile t = colsb[t] bytes at p + r·s; the rest of the tile 0
//   stored(t, p, s)  those bytes back to p + r·s
//   zero(t)          tile t = 0
//   dpbf16ps(c, a, b)  C[m][n] += A[m][2k]·B[k][2n] + A[m][2k+1]·B[k][2n+1] over k < colsb[a]/4, in
//                    that order, m < rows[c], n < colsb[c]/4 (fp32; a bf16 product is exact in fp32,
//                    so each step is one rounding, as the instruction's)
// A use the hardware would fault on (no configuration loaded, shapes that do not chain) is a
// TORCH_CHECK here, so a kernel bug surfaces as an error naming the operation.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <cstring>

namespace acr_amx_emu {

struct State {
  bool configured = false;
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  alignas(64) uint8_t tile[8][16][64] = {};
};
inline State& state() {
  static thread_local State s;
  return s;
}
// tdpbf16ps executed by every thread since the process started (the test checks the tile code ran)
inline std::atomic<int64_t>& products() {
  static std::atomic<int64_t> n{0};
  return n;
}

// The 64-byte configuration tile_amx and amx_gemm.h pass (acr_attn::TileConfig's layout).
inline void loadconfig(const void* cfg) {
  const uint8_t* c = static_cast<const uint8_t*>(cfg);
  TORCH_CHECK(c[0] == 1, "amx emulation: ldtilecfg with palette ", int(c[0]), ", only palette 1 exists");
  State& s = state();
  for (int t = 0; t < 8; ++t) {
    std::memcpy(&s.colsb[t], c + 16 + 2 * t, 2);
    s.rows[t] = c[48 + t];
    TORCH_CHECK(s.rows[t] <= 16 && s.colsb[t] <= 64, "amx emulation: tile ", t, " configured ", int(s.rows[t]),
                " rows x ", s.colsb[t], " bytes, past 16 x 64");
  }
  s.configured = true;
}
inline void release() {
  State& s = state();
  s.configured = false;
  std::memset(s.tile, 0, sizeof(s.tile));
}
inline State& configured(const char* op, int t) {
  State& s = state();
  TORCH_CHECK(s.configured, "amx emulation: ", op, " on tile ", t, " with no tile configuration loaded "
              "(on the hardware: #UD, an illegal instruction)");
  TORCH_CHECK(t >= 0 && t < 8, "amx emulation: ", op, " on tile ", t);
  return s;
}
inline void zero(int t) {
  State& s = configured("tilezero", t);
  std::memset(s.tile[t], 0, sizeof(s.tile[t]));
}
inline void loadd(int t, const void* base, int64_t stride) {
  State& s = configured("tileloadd", t);
  std::memset(s.tile[t], 0, sizeof(s.tile[t]));
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(s.tile[t][r], static_cast<const uint8_t*>(base) + r * stride, s.colsb[t]);
}
inline void stored(int t, void* base, int64_t stride) {
  State& s = configured("tilestored", t);
  for (int r = 0; r < s.rows[t]; ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.tile[t][r], s.colsb[t]);
}
inline void dpbf16ps(int c, int a, int b) {
  State& s = configured("tdpbf16ps", c);
  configured("tdpbf16ps", a);
  configured("tdpbf16ps", b);
  const int M = s.rows[c], N = s.colsb[c] / 4, K = s.colsb[a] / 4;
  TORCH_CHECK(s.rows[a] == M && s.rows[b] == K && s.colsb[b] == s.colsb[c] && c != a && c != b && a != b,
              "amx emulation: tdpbf16ps tiles ", c, ", ", a, ", ", b, " do not chain (rows ", int(s.rows[c]), "/",
              int(s.rows[a]), "/", int(s.rows[b]), ", bytes ", s.colsb[c], "/", s.colsb[a], "/", s.colsb[b], ")");
  for (int m = 0; m < M; ++m) {
    float* cr = reinterpret_cast<float*>(s.tile[c][m]);
    const c10::BFloat16* ar = reinterpret_cast<const c10::BFloat16*>(s.tile[a][m]);
    for (int k = 0; k < K; ++k) {
      const c10::BFloat16* br = reinterpret_cast<const c10::BFloat16*>(s.tile[b][k]);
      const float a0 = static_cast<float>(ar[2 * k]), a1 = static_cast<float>(ar[2 * k + 1]);
      for (int n = 0; n < N; ++n) {
        float acc = cr[n];
        acc += a0 * static_cast<float>(br[2 * n]);
        acc += a1 * static_cast<float>(br[2 * n + 1]);
        cr[n] = acc;
      }
    }
  }
  products().fetch_add(1, std::memory_order_relaxed);
}

}  // namespace acr_amx_emu
