// The rest of a bf16 top-k log-prob call in one op (docs/ARCHITECTURE.md, "Top-k stack"): every
// logit of ids [id0, V) computed and folded into the running state block by block while the block
// is in L2, where the "native" core's chunk loop wrote each [T, 2,048] fp32 chunk of logits to
// memory (mm_bf16_f32) and read it back (topk_chunk_update): 4 MB a chunk at T 512. On the AMX
// Xeon the call took 1.24–1.33× the bare bf16 GEMM's time that way, 1.00–1.24× this way (docs/cpu-log.md,
// 2026-12-07).
//
//   acarerank::topk_gemm_update(Tensor hidden, Tensor weight, int id0, float temperature,
//                               Tensor targets, Tensor(a!) run_v, Tensor(b!) run_i, Tensor(c!) m,
//                               Tensor(d!) s, Tensor(e!) tgt) -> ()
//     hidden [T, H], weight [V, H]: bf16, rows contiguous, H even; the logits z = hidden · weight[id0:]ᵀ
//     in fp32 (logits_gemm.cpp's products and sums: the same panels and K blocks, so the same bits),
//     divided by temperature (a division, as the torch core); state as topk_chunk_update (topk_rows.h),
//     run_v holding k real entries with ids below id0. The result is the state topk_chunk_update
//     gives on the same logits chunk by chunk: the same top-k entries and target logits; the
//     log-sum-exp summed in another grouping (fp64 partial sums of fp32 terms: fp32 rounding).
//
// Work: the ids are cut into P column parts and the rows into R groups, R·P ≤ threads: R as large
// as groups of kGroupRows rows allow (a row group needs no second state, but reads and packs the
// whole weight itself), P the threads left while its copies fit kCopyBytes (else smaller row
// groups). A task (group, part) packs its part's weight a block at a time into the VNNI layout
// (≤ 256 columns and ≤ 512 kB: L2) and, kRowBlock rows of its group at a time, runs the GEMM
// into an L2 block of logits and folds it into its state at once. Part 0 folds into the caller's state; part p > 0
// into a copy of the held entries with m = −inf, s = 0 (its own log-sum-exp), merged into the
// caller's at the end: the k best of the parts' entries (the held ones, in every copy, counted
// once) and s = Σ_p s_p·exp(m_p − shift). Memory: the copies, (P − 1)·T·k·12 bytes ≤ kCopyBytes
// (64 MB); per thread the packed block and ≤ 256 kB of logits.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>
#include <memory>

#include "attn_tiles.h"
#include "common.h"
#include "pack_vnni_avx512.h"
#include "topk_rows.h"

namespace acarerank_cpu {
namespace {

using topk_rows::Entry;

constexpr int64_t kPanel = 64;        // columns per packed panel, as logits_gemm.cpp
constexpr int64_t kKBlock = 256;      // K per GEMM call, as logits_gemm.cpp (the same sums)
constexpr int64_t kRowBlock = 256;    // rows per block of logits
// rows a group needs before the rows are split among threads: a group reads and packs the whole
// weight itself, which costs about as much as its GEMM at 256 rows (64 columns × H from memory
// against 256 × 64 × H products), so fewer rows split the vocabulary instead
constexpr int64_t kGroupRows = 1024;
constexpr int64_t kPackedBytes = 512 * 1024;  // the packed weight block's budget
constexpr int64_t kLogitsBytes = 256 * 1024;  // the block of logits' budget (kRowBlock rows)
constexpr int64_t kCopyBytes = 64 << 20;      // the column parts' copies of the state, at most

// Merge state b (its rows' k entries, m, s) into a: the k best of both under the tie rule, an id
// held by both (an entry held before id0) counted once; a's log-sum-exp combined with b's.
void merge_part_row(float* av, int64_t* ai, float& am, double& as, const float* bv, const int64_t* bi, float bm,
                    double bs, int64_t k, std::vector<Entry>& out) {
  out.clear();
  int64_t x = 0, y = 0;
  while (static_cast<int64_t>(out.size()) < k) {
    const Entry ea{av[x], ai[x]}, eb{bv[y], bi[y]};
    if (ea.id == eb.id) {
      out.push_back(ea), ++x, ++y;
    } else if (topk_rows::better(ea, eb)) {
      out.push_back(ea), ++x;
    } else {
      out.push_back(eb), ++y;
    }
  }
  for (int64_t j = 0; j < k; ++j) av[j] = out[j].v, ai[j] = out[j].id;
  const float mx = std::max(am, bm);
  const float shift = std::isinf(mx) ? 0.f : mx;
  as = as * std::exp(static_cast<double>(am - shift)) + bs * std::exp(static_cast<double>(bm - shift));
  am = mx;
}

#ifdef ACR_HAVE_AVX512_BF16_CODE
// z[t, j] /= tau for the block's rows: a division, as the torch core's x.div_(temperature) (the
// same bits), 16 lanes at a time (this file's default build has only SSE2's 4).
ACR_AVX512_BF16 void divide_rows(float* z, int64_t ld, int64_t rows, int64_t cols, float tau) {
  const __m512 vt = _mm512_set1_ps(tau);
  for (int64_t t = 0; t < rows; ++t) {
    float* r = z + t * ld;
    int64_t j = 0;
    for (; j + 16 <= cols; j += 16) _mm512_storeu_ps(r + j, _mm512_div_ps(_mm512_loadu_ps(r + j), vt));
    for (; j < cols; ++j) r[j] /= tau;
  }
}
#endif

void topk_gemm_update(const at::Tensor& hidden, const at::Tensor& weight, int64_t id0, double temperature,
                      const at::Tensor& targets, at::Tensor& run_v, at::Tensor& run_i, at::Tensor& m, at::Tensor& s,
                      at::Tensor& tgt) {
  constexpr const char* op = "topk_gemm_update";
  ACR_CHECK_CPU(op, hidden, "every tensor");
  ACR_CHECK_CPU(op, weight, "every tensor");
  ACR_CHECK_DTYPE(op, hidden, "hidden", at::kBFloat16);
  ACR_CHECK_DTYPE(op, weight, "weight", at::kBFloat16);
  ACR_CHECK_DIM(op, hidden, "hidden", 2);
  ACR_CHECK_DIM(op, weight, "weight", 2);
  const int64_t T = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  const int64_t k = topk_rows::check_state(op, T, targets, run_v, run_i, m, s, tgt);
  TORCH_CHECK(weight.size(1) == H, op, ": hidden is [T, H] and weight [V, H] with the same H, got ", hidden.sizes(),
              " and ", weight.sizes());
  TORCH_CHECK(H > 0 && H % 2 == 0, op, ": H must be even and > 0 (the bf16 products take K in pairs; H = 0 "
              "divided by zero sizing the blocks), got ", H);
  TORCH_CHECK((T == 0 || hidden.stride(1) == 1) && (V == 0 || weight.stride(1) == 1), op,
              ": hidden's and weight's rows must be contiguous, got strides ", hidden.strides(), " and ",
              weight.strides());
  TORCH_CHECK(id0 >= 0 && id0 <= V, op, ": id0 must be in [0, V = ", V, "], got ", id0);
  TORCH_CHECK(V <= acr_layer::kTopkIdLimit, op, ": ids must stay below 2**31 - 1, got V=", V);
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0, op, ": temperature must be finite and > 0, got ",
              temperature);
  TORCH_CHECK(acr_attn::cpu_has_avx512_bf16(), op, ": this CPU has no AVX512_BF16 (acarerank/ops/_logits_gemm.py "
              "upcasts to an fp32 GEMM there)");
  acr_attn::bf16_path();  // chosen once per process; an ACARERANK_CPU_BF16_PATH this CPU cannot take is named here
  const acr_layer::Isa isa = checked_layer_isa();
  const int64_t n = V - id0;
  if (T == 0 || n == 0) return;
#ifdef ACR_HAVE_AVX512_BF16_CODE
  const auto* A = hidden.const_data_ptr<c10::BFloat16>();
  const auto* W = weight.const_data_ptr<c10::BFloat16>() + id0 * weight.stride(0);
  const int64_t lda = hidden.stride(0), ldw = weight.stride(0);
  const int64_t* tg = targets.const_data_ptr<int64_t>();
  float* tp = tgt.data_ptr<float>();
  const float tau = static_cast<float>(temperature);
  const bool divide = temperature != 1.0;

  const int64_t panels = (n + kPanel - 1) / kPanel, threads = at::get_num_threads();
  const int64_t copies_allowed = kCopyBytes / std::max<int64_t>(1, T * k * 12);
  int64_t R = std::max<int64_t>(1, std::min(threads, (T + kGroupRows - 1) / kGroupRows));
  const int64_t P = std::max<int64_t>(1, std::min({threads / R, panels, 1 + copies_allowed}));
  if (R * P < threads) R = std::max<int64_t>(1, std::min(threads / P, T));  // copies capped: smaller row groups
  const int64_t group = (T + R - 1) / R;
  // a block: ≤ kPackedBytes of packed weight and ≤ kLogitsBytes of logits (256 columns), ≥ one panel
  const int64_t block_panels = std::clamp<int64_t>(kPackedBytes / (H * kPanel * 2), 1, kLogitsBytes / (kRowBlock * kPanel * 4));
  const int64_t block_cols = block_panels * kPanel;

  std::vector<topk_rows::State> states(P);
  std::vector<float> cv((P - 1) * T * k), cm((P - 1) * T, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> ci((P - 1) * T * k);
  std::vector<double> cs((P - 1) * T, 0.0);
  states[0] = {run_v.data_ptr<float>(), run_i.data_ptr<int64_t>(), m.data_ptr<float>(), s.data_ptr<double>()};
  for (int64_t p = 1; p < P; ++p) {
    float* v = cv.data() + (p - 1) * T * k;
    int64_t* i = ci.data() + (p - 1) * T * k;
    std::memcpy(v, states[0].rv, sizeof(float) * T * k);
    std::memcpy(i, states[0].ri, sizeof(int64_t) * T * k);
    states[p] = {v, i, cm.data() + (p - 1) * T, cs.data() + (p - 1) * T};
  }

  at::parallel_for(0, R * P, 1, [&](int64_t t0, int64_t t1) {
    acr_attn::GemmReleaseAtExit<c10::BFloat16> release;  // brgemm's per-thread tile state (AMX)
    std::unique_ptr<c10::BFloat16[]> packed(new c10::BFloat16[block_cols * H]);
    std::vector<float, acr_attn::Aligned64<float>> z(kRowBlock * block_cols);
    topk_rows::Scratch sc;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t g = task / P, p = task % P;
      const int64_t r_begin = g * group, r_end = std::min(T, r_begin + group);
      const int64_t c_begin = p * panels / P * kPanel, c_end = std::min(n, (p + 1) * panels / P * kPanel);
      for (int64_t b0 = c_begin; b0 < c_end; b0 += block_cols) {
        const int64_t cols = std::min(block_cols, c_end - b0);
        for (int64_t q = 0; q * kPanel < cols; ++q) {
          const int64_t nn = std::min(kPanel, cols - q * kPanel);
          acr_attn::pack_pair_columns_avx512([&](int64_t j) { return W + (b0 + q * kPanel + j) * ldw; }, nn, kPanel,
                                             H, packed.get() + q * kPanel * H);
        }
        for (int64_t r0 = r_begin; r0 < r_end; r0 += kRowBlock) {
          const int64_t rows = std::min(kRowBlock, r_end - r0);
          for (int64_t q = 0; q * kPanel < cols; ++q) {
            const int64_t nn = std::min(kPanel, cols - q * kPanel);
            for (int64_t k0 = 0; k0 < H; k0 += kKBlock)
              acr_attn::gemm(rows, nn, std::min(kKBlock, H - k0), A + r0 * lda + k0, lda,
                             packed.get() + q * kPanel * H + k0 * kPanel, kPanel, z.data() + q * kPanel, block_cols,
                             /*add_C=*/k0 > 0);
          }
          if (divide) divide_rows(z.data(), block_cols, rows, cols, tau);
          topk_rows::update_rows(isa, z.data(), block_cols, cols, id0 + b0, r0, rows, k, tg, states[p], tp, sc);
        }
      }
    }
    release.now();
  });

  if (P > 1)
    at::parallel_for(0, T, 64, [&](int64_t r0, int64_t r1) {
      std::vector<Entry> out;
      out.reserve(k);
      const topk_rows::State& a = states[0];
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t p = 1; p < P; ++p) {
          const topk_rows::State& b = states[p];
          merge_part_row(a.rv + r * k, a.ri + r * k, a.m[r], a.s[r], b.rv + r * k, b.ri + r * k, b.m[r], b.s[r], k,
                         out);
        }
    });
#endif
}

}  // namespace
}  // namespace acarerank_cpu

TORCH_LIBRARY_FRAGMENT(acarerank, m) {
  m.def("topk_gemm_update(Tensor hidden, Tensor weight, int id0, float temperature, Tensor targets, "
        "Tensor(a!) run_v, Tensor(b!) run_i, Tensor(c!) m, Tensor(d!) s, Tensor(e!) tgt) -> ()");
}

TORCH_LIBRARY_IMPL(acarerank, CPU, m) { m.impl("topk_gemm_update", &acarerank_cpu::topk_gemm_update); }
