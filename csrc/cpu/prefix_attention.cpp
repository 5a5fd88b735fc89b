// acarerank::prefix_shared_attention_cpu — prefix-shared attention of a whole packed batch (every
// group, every segment, one layer) in one call (docs/ARCHITECTURE.md, "Native CPU kernels").
//
//   out[t] = softmax(scale · q[t] · [K_g; k[s_0..t]]ᵀ) · [V_g; v[s_0..t]]     (segment s of group g)
//
// The prefix K_g/V_g are read where they are: from pages (block_table given; k_cache
// [num_blocks, block_size, Hkv, d], token c of group g in block block_table[g, c / block_size],
// slot c % block_size) or from packed rows (block_table None; prefix_k [Ptot, Hkv, d], group g's
// rows cu_prefix_lens[g]..cu_prefix_lens[g+1]).
//
// Work: tasks (group, kv head, row block). A row block holds up to ROWS query rows of one group —
// consecutive tokens of its segments (a block may span segments) × the r query heads of the kv
// head, token-major — so one GEMM serves every query head of a kv head and every segment of the
// group at once. Per task, one online softmax in fp32 scratch over
//   1. the prefix, tile by tile (KT keys): S = Q·Kᵀ, softmax step, acc += P·V;
//   2. each segment's own keys, causally, continuing the same running max / sum (no merge).
// No [rows, keys] tensor beyond one [ROWS, KT] tile, no fp32 copy of K/V or q beyond one tile.
//
// Packing: where the compute type is the input type (fp32; bf16 on a bf16 path) a group's
// prefix tiles are packed once per layer per (kv head, tile), in parallel, and every row block of
// the group reads them (when it has more than one and the prefix fills its whole tiles at least
// half; else each task packs the tiles it reads); otherwise (bf16 converted to fp32 on this CPU)
// each task converts the tile it is about to use into its own scratch, so no fp32 copy of the
// prefix ever exists. The own keys of a segment longer than a row block are packed once the same
// way; a piece of a shorter one is packed by the task that needs it (a few hundred rows).
// A decode-like row block (a few rows, direct_rows_limit()) whose keys nobody packed is not packed
// at all: attn_direct_avx512.h reads its K/V rows where they lie — unless the call passes
// tiles_only (batch-invariant mode: that path rounds otherwise, docs/cpu.md "Decode-like blocks").
// Its prefix, when longer than direct_chunk_keys(), runs in chunks, one online softmax each,
// merged after (3.) — flash-decoding's split-K, so one long decode group keeps every thread busy
// on whole slot rows.
//
// Balance: tasks are dealt to threads longest first (LPT) by their cost rows × (P_g + own keys),
// then one at::parallel_for runs each thread's list; brgemm_release() ends each thread's chunk
// (GemmReleaseAtExit: also when it throws).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <cstring>
#include <numeric>
#include <optional>
#include <vector>

#include "attn_amx.h"
#include "attn_direct_avx512.h"
#include "attn_tiles.h"
#include "common.h"

namespace {

using namespace acr_attn;

constexpr const char* kOp = "prefix_shared_attention_cpu";
constexpr int64_t KT = kTileKeys;  // keys per tile (attn_tiles.h)
constexpr int64_t ROWS = 256;  // query rows (tokens × r) per task
constexpr int64_t OWN_ROWS = 64;  // query rows per causal sub-block of the own part
constexpr int64_t MAX_HEAD_DIM = 512;

// Host view of the metadata, read once per call.
struct Meta {
  int64_t T, Hq, Hkv, r, d;
  std::vector<int64_t> cs, cp, sg;  // cu_seqlens [S+1], cu_prefix_lens [G+1], segment_group [S]
  const int32_t* bt = nullptr;      // block table [G, max_blocks] or nullptr (packed prefix)
  at::Tensor bt_owner;              // keeps bt alive
  int64_t max_blocks = 0, block_size = 1;
};

struct Piece {    // rows of one segment inside a task
  int64_t seg;    // segment index
  int64_t t0, t1; // token rows [t0, t1) of q (absolute)
  int64_t m0;     // first row of this piece in the task's M rows (= (token offset) × r)
};

struct Task {
  int64_t g, h;
  std::vector<Piece> pieces;
  int64_t M;      // rows per kv head = tokens × r
  double cost;
  int64_t nh = 1;       // kv heads h .. h + nh (more than one on the direct path only)
  bool direct = false;  // decode-like: K/V read where they lie (attn_direct_avx512.h)
  // direct path: prefix keys [k0, k1) of this task, and chunk (its partial's index in the group,
  // -1: the group is one chunk, written out by its task). The group's last chunk also reads the
  // segments' own keys.
  int64_t k0 = 0, k1 = 0, chunk = -1;
};

template <typename T>
std::vector<int64_t> to_host(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const T* p = c.const_data_ptr<T>();
  return std::vector<int64_t>(p, p + c.numel());
}

// Keys per chunk of each group's prefix on the direct path (P, or more: one chunk): the prefix in
// ceil(P / chunk_keys) equal chunks, rounded up to whole kDirectKeys steps where longer than one
// (5,291 keys in 1,024-key chunks: 5 of 896 and one of 811). chunk_keys 0: one chunk.
std::vector<int64_t> direct_chunk_lens(const Meta& mt, int64_t chunk_keys) {
  const int64_t G = static_cast<int64_t>(mt.cp.size()) - 1;
  std::vector<int64_t> lens(G);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t P = mt.cp[g + 1] - mt.cp[g];
    if (chunk_keys <= 0 || P <= chunk_keys) {
      lens[g] = std::max<int64_t>(P, 1);
      continue;
    }
    const int64_t nc = (P + chunk_keys - 1) / chunk_keys;
    const int64_t even = (P + nc - 1) / nc;
    lens[g] = even > kDirectKeys ? (even + kDirectKeys - 1) / kDirectKeys * kDirectKeys : even;
  }
  return lens;
}

// Row blocks of every group: consecutive tokens of its segments, up to ROWS / r tokens each; a task
// per (row block, kv head). A group of one row block of at most direct_rows rows (decode-like) is
// direct instead: its prefix in chunks of about chunk_keys keys (one chunk: chunk_keys 0, or P up
// to chunk_keys), each chunk in tasks of several kv heads: as many heads (a divisor of Hkv) as
// leave ~4 tasks per thread over all such chunks, and at most ROWS rows (the task's scratch). The
// chunks depend on P and chunk_keys only, so a row's bits do not depend on the thread count.
std::vector<Task> make_tasks(const Meta& mt, int64_t direct_rows, int64_t chunk_keys, int64_t nthreads) {
  const int64_t S = static_cast<int64_t>(mt.sg.size());
  const int64_t G = static_cast<int64_t>(mt.cp.size()) - 1;
  std::vector<std::vector<int64_t>> segs(G);
  for (int64_t s = 0; s < S; ++s)
    if (mt.cs[s + 1] > mt.cs[s]) segs[mt.sg[s]].push_back(s);
  const int64_t tok_per_block = std::max<int64_t>(1, ROWS / mt.r);
  std::vector<std::vector<Task>> group_blocks(G);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t P = mt.cp[g + 1] - mt.cp[g];
    std::vector<Task>& blocks = group_blocks[g];
    Task cur{g, 0, {}, 0, 0.0};
    for (int64_t s : segs[g]) {
      int64_t t = mt.cs[s];
      while (t < mt.cs[s + 1]) {
        const int64_t take = std::min(mt.cs[s + 1] - t, tok_per_block - cur.M / mt.r);
        cur.pieces.push_back({s, t, t + take, cur.M});
        cur.M += take * mt.r;
        // own keys this piece reads: its segment's rows up to its last token
        cur.cost += static_cast<double>(take * mt.r) * static_cast<double>(P + (t + take - mt.cs[s]));
        t += take;
        if (cur.M / mt.r == tok_per_block) {
          blocks.push_back(std::move(cur));
          cur = Task{g, 0, {}, 0, 0.0};
        }
      }
    }
    if (cur.M) blocks.push_back(std::move(cur));
  }
  auto is_direct = [&](const std::vector<Task>& b) { return b.size() == 1 && b[0].M <= direct_rows; };
  const std::vector<int64_t> lens = direct_chunk_lens(mt, chunk_keys);
  auto chunks = [&](int64_t g) {
    const int64_t P = mt.cp[g + 1] - mt.cp[g];
    return P > lens[g] ? (P + lens[g] - 1) / lens[g] : int64_t{1};
  };
  int64_t direct_chunks = 0;
  for (int64_t g = 0; g < G; ++g)
    if (is_direct(group_blocks[g])) direct_chunks += chunks(g);
  int64_t heads_per_task =
      std::clamp<int64_t>(mt.Hkv * direct_chunks / std::max<int64_t>(1, 4 * nthreads), 1, mt.Hkv);
  while (mt.Hkv % heads_per_task != 0) --heads_per_task;  // equal tasks: 6 + 2 heads balanced worse than 4 + 4
  std::vector<Task> tasks;
  for (int64_t g = 0; g < G; ++g) {
    const std::vector<Task>& blocks = group_blocks[g];
    if (is_direct(blocks)) {
      const int64_t nh = std::min(heads_per_task, std::max<int64_t>(1, ROWS / blocks[0].M));
      const int64_t P = mt.cp[g + 1] - mt.cp[g], nc = chunks(g), len = lens[g];
      const double own = blocks[0].cost / static_cast<double>(blocks[0].M) - static_cast<double>(P);  // own keys per row
      for (int64_t c = 0; c < nc; ++c)
        for (int64_t h = 0; h < mt.Hkv; h += nh) {
          Task tk = blocks[0];
          tk.h = h;
          tk.nh = std::min(nh, mt.Hkv - h);
          tk.k0 = c * len;
          tk.k1 = std::min(P, (c + 1) * len);
          tk.chunk = nc == 1 ? -1 : c;
          tk.cost = static_cast<double>(tk.M * tk.nh) * (static_cast<double>(tk.k1 - tk.k0) + (c + 1 == nc ? own : 0.0));
          tk.direct = true;
          tasks.push_back(std::move(tk));
        }
      continue;
    }
    for (int64_t h = 0; h < mt.Hkv; ++h)
      for (const Task& b : blocks) {
        Task tk = b;
        tk.h = h;
        tasks.push_back(std::move(tk));
      }
  }
  return tasks;
}

// Longest processing time first: each task to the least loaded thread.
std::vector<std::vector<int64_t>> deal(const std::vector<Task>& tasks, int64_t nthreads) {
  std::vector<int64_t> order(tasks.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return tasks[a].cost > tasks[b].cost; });
  std::vector<std::vector<int64_t>> lists(nthreads);
  std::vector<double> load(nthreads, 0.0);
  for (int64_t i : order) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    lists[t].push_back(i);
    load[t] += tasks[i].cost;
  }
  return lists;
}

// Pointer to the d values of prefix row c (of group g, kv head h) in the cache.
template <typename s_t>
struct PrefixRows {
  const s_t* base;
  int64_t st_blk, st_slot, st_head;  // strides (elements); packed form: st_blk = row stride, st_slot unused
  const Meta* mt;
  const s_t* operator()(int64_t g, int64_t c, int64_t h) const {
    if (mt->bt) {
      const int64_t b = mt->bt[g * mt->max_blocks + c / mt->block_size];
      return base + b * st_blk + (c % mt->block_size) * st_slot + h * st_head;
    }
    return base + (mt->cp[g] + c) * st_blk + h * st_head;
  }
};

// Row blocks of at most this many rows take the direct path (attn_direct_avx512.h), where the
// compute type is the input type (fp32, or bf16 on a bf16 path) and the CPU runs the AVX-512 code
// (bf16_avx512()); else 0. Measured against the tile path (16 groups of 1-8 tokens each over 1,600
// prefix keys in 16-token pages, 0.6B heads; EPYC Zen 4, avx512_bf16, 2 threads): fp32 2-4x faster
// up to 16 rows; bf16 (q·K as vdpbf16ps pairs) 1.6-2x up to 8 rows, 1.3-1.8x at 16 with many
// groups and equal with one (docs/cpu.md). ACARERANK_CPU_DIRECT_ROWS=0..16 sets the limit (0:
// never; the tests run both paths so), read once; a call's tiles_only makes it 0 for that call.
// Keys per chunk of a long prefix on the direct path (direct_chunk_lens): the chunks of a group run
// as separate tasks, each its own online softmax, merged after (flash-decoding's split-K): a decode
// step of one group over 5,291 keys is otherwise Hkv tasks of one kv head, each reading d of every
// slot row (a new 4 KB page every key in fp32, docs/cpu.md "Decode-like blocks").
// ACARERANK_CPU_DIRECT_CHUNK=0 (never split) or a key count sets it, read once (the tests split
// short prefixes so).
constexpr int64_t kDirectChunk = 1024;
int64_t direct_chunk_keys() {
  static const int64_t v = [] {
    const char* e = std::getenv("ACARERANK_CPU_DIRECT_CHUNK");
    if (e == nullptr || *e == '\0') return kDirectChunk;
    char* end = nullptr;
    const long long x = std::strtoll(e, &end, 10);
    TORCH_CHECK(*end == '\0' && x >= 0, "ACARERANK_CPU_DIRECT_CHUNK must be an integer >= 0, got '", e, "'");
    return static_cast<int64_t>(x);
  }();
  return v;
}

template <typename s_t, typename c_t>
int64_t direct_rows_limit() {
  if constexpr (std::is_same_v<s_t, c_t> && (std::is_same_v<s_t, float> || std::is_same_v<s_t, at::BFloat16>)) {
#ifdef ACR_HAVE_AVX512_BF16_CODE
    static const int64_t set = [] {  // -1: not set
      const char* e = std::getenv("ACARERANK_CPU_DIRECT_ROWS");
      if (e == nullptr || *e == '\0') return int64_t{-1};
      char* end = nullptr;
      const long v = std::strtol(e, &end, 10);
      TORCH_CHECK(*end == '\0' && v >= 0 && v <= kDirectRows, "ACARERANK_CPU_DIRECT_ROWS must be an integer in [0, ",
                  kDirectRows, "], got '", e, "'");
      return static_cast<int64_t>(v);
    }();
    if (!bf16_avx512()) return 0;
    return set >= 0 ? set : kDirectRows;
#endif
  }
  return 0;
}

// One decode-like task on the direct path: its rows' fp32 q (head hh's M rows at hh·M), then the
// prefix (every row sees every key), then each piece's own keys causally (row (t, i) sees a_s .. t).
// pk / pv / own_k / own_v give the task's first kv head's row of a key; the next heads follow at
// the given strides. Fills m, l, acc.
template <typename s_t, typename c_t, typename PK, typename PV, typename OK, typename OV>
void run_direct_rows(const Task& tk, const Meta& mt, int64_t P, float scale, const c_t* Q, float* Qf, float* S,
                     float* m, float* l, float* acc, PK&& pk, PV&& pv, int64_t pk_stride, int64_t pv_stride,
                     OK&& own_k, OV&& own_v, int64_t ok_stride, int64_t ov_stride) {
#ifdef ACR_HAVE_AVX512_BF16_CODE
  if constexpr (std::is_same_v<s_t, c_t>) {
    const int64_t d = mt.d, r = mt.r, M = tk.M, nh = tk.nh;
    const float* qf = Qf;  // fp32 q rows: the task's own (fp32), or widened from bf16 into Qf
    if constexpr (std::is_same_v<c_t, float>)
      qf = Q;
    else if (d != 128 && d != 64)  // else direct_keys dots the bf16 rows as they are
      for (int64_t i = 0; i < nh * M; ++i) row_f32(Q + i * d, d, Qf + i * d);
    const int64_t n = tk.k1 - tk.k0;  // the task's prefix keys (all of them unless split)
    direct_keys<s_t>(qf, Q, nh, M, M, pk_stride, pv_stride, d, scale, n, [&](int64_t j) { return pk(tk.k0 + j); },
                     [&](int64_t j) { return pv(tk.k0 + j); }, [n](int64_t) { return n; }, m, l, acc, S);
    if (tk.k1 != P) return;  // the own keys: the last chunk's
    for (const Piece& pc : tk.pieces) {
      const int64_t a = mt.cs[pc.seg];
      direct_keys<s_t>(qf + pc.m0 * d, Q + pc.m0 * d, nh, M, (pc.t1 - pc.t0) * r, ok_stride, ov_stride, d, scale, pc.t1 - a,
                       [&](int64_t j) { return own_k(a + j); }, [&](int64_t j) { return own_v(a + j); },
                       [&](int64_t i) { return pc.t0 + i / r - a + 1; }, m + pc.m0, l + pc.m0, acc + pc.m0 * d, S);
    }
    return;
  }
#endif
  TORCH_CHECK(false, kOp, ": the direct path was taken without its AVX-512 code (internal error)");
}

template <typename s_t, typename c_t>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc, const at::Tensor& vc,
         const Meta& mt, float scale, bool tiles_only, at::Tensor& out) {
  const int64_t d = mt.d, r = mt.r, Hkv = mt.Hkv;
  const int64_t G = static_cast<int64_t>(mt.cp.size()) - 1;
  const bool paged = mt.bt != nullptr;
  const PrefixRows<s_t> pk{kc.const_data_ptr<s_t>(), kc.stride(0), paged ? kc.stride(1) : 0,
                           kc.stride(paged ? 2 : 1), &mt};
  const PrefixRows<s_t> pv{vc.const_data_ptr<s_t>(), vc.stride(0), paged ? vc.stride(1) : 0,
                           vc.stride(paged ? 2 : 1), &mt};
  const s_t* qp = q.const_data_ptr<s_t>();
  const s_t* kp = k.const_data_ptr<s_t>();
  const s_t* vp = v.const_data_ptr<s_t>();
  s_t* op = out.data_ptr<s_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t tile_elems = KT * d;  // one packed K (or V) tile

  // -- 1. shared prefix pack, once per (group, kv head, tile), when no conversion is involved, more
  // than one row block of the group reads it, and its whole KT-key tiles hold at most twice its keys
  // (worth_sharing). Otherwise each task packs the tiles it reads into its thread's scratch: the
  // same tiles (same bits), and no buffer padded to whole tiles per group: with thousands of
  // one-token prefixes it was ~10x the inputs; 512 groups of an 8-token prefix and a 129-token
  // segment (two row blocks at r = 2) packed 1.2 GB of tiles (1b too) beside 0.5 GB of inputs.
  constexpr bool shared = std::is_same_v<s_t, c_t>;
  auto worth_sharing = [](int64_t n) { return (n + KT - 1) / KT * KT <= 2 * n; };
  // tiles_only: no direct path, whatever a group's rows — its bits differ from the tile path's, so
  // a row's output would depend on how many rows its group has in this call (docs/cpu.md)
  const int64_t direct_rows = tiles_only ? 0 : direct_rows_limit<s_t, c_t>();
  const int64_t chunk_keys = direct_chunk_keys();
#ifdef ACR_HAVE_AMX_CODE
  // bf16 key tiles on AMX directly, the softmax between the tile products (attn_amx.h)
  // (the variable is read, and a bad value named, at the first bf16 call whatever its head dim)
  const bool amx_tiles = std::is_same_v<c_t, BFloat16> && amx_tiles_kernel() && d % 32 == 0;
#endif
  const std::vector<Task> tasks = make_tasks(mt, direct_rows, chunk_keys, at::get_num_threads());
  std::vector<int64_t> blocks(G, 0);  // row blocks of group g (per kv head)
  for (const Task& tk : tasks) blocks[tk.g] += tk.h == 0 && tk.chunk <= 0;
  // partial (m, l, acc) of every row of a direct group's chunks (a group of more than one): group
  // g's rows from part0[g], chunk-major, then kv head, then the group's M rows
  std::vector<int64_t> part0(G + 1, 0), nchunk(G, 0), gM(G, 0), gtask(G, 0);
  for (int64_t i = 0; i < static_cast<int64_t>(tasks.size()); ++i)
    if (tasks[i].chunk >= 0 && tasks[i].h == 0) ++nchunk[tasks[i].g], gM[tasks[i].g] = tasks[i].M, gtask[tasks[i].g] = i;
  for (int64_t g = 0; g < G; ++g) part0[g + 1] = part0[g] + nchunk[g] * Hkv * gM[g];
  std::vector<float> part_m(part0[G]), part_l(part0[G]), part_acc(part0[G] * d);
  std::vector<int64_t> tile0(G + 1, 0);  // group g's first tile in the buffer (none: tile0[g+1] == tile0[g])
  for (int64_t g = 0; g < G; ++g)
    tile0[g + 1] = tile0[g] + (shared && blocks[g] > 1 && worth_sharing(mt.cp[g + 1] - mt.cp[g])
                                   ? (mt.cp[g + 1] - mt.cp[g] + KT - 1) / KT
                                   : 0);
  at::Tensor packed;
  c_t* pbuf = nullptr;
  if (tile0[G] > 0) {
    packed = at::empty({tile0[G], Hkv, 2, tile_elems}, q.options().dtype(c10::CppTypeToScalarType<c_t>::value));
    pbuf = packed.data_ptr<c_t>();
    const int64_t items = tile0[G] * Hkv;
    at::parallel_for(0, items, 1, [&](int64_t b, int64_t e) {
      for (int64_t it = b; it < e; ++it) {
        const int64_t tile = it / Hkv, h = it % Hkv;
        const int64_t g = std::upper_bound(tile0.begin(), tile0.end(), tile) - tile0.begin() - 1;
        const int64_t j0 = (tile - tile0[g]) * KT;
        const int64_t n = std::min(KT, mt.cp[g + 1] - mt.cp[g] - j0);
        c_t* dst = pbuf + it * 2 * tile_elems;
        pack_kv_tile<s_t, c_t>([&](int64_t j) { return pk(g, j0 + j, h); }, [&](int64_t j) { return pv(g, j0 + j, h); },
                               n, KT, d, dst, dst + tile_elems);
      }
    });
  }

  // -- 1b. own keys of the segments longer than one row block, once per (segment, kv head, tile),
  // same conditions (no conversion, whole tiles at most twice the keys): every task that reads such
  // a segment's keys (its later row blocks, in a long prefill) reads this one copy, instead of
  // packing all of its keys up to its rows again (O(L²/ROWS) packing per segment). The keys of a
  // shorter segment, or of one under KT/2 keys, are packed by each task that reads them, into its
  // scratch (no buffer per decode token of a batch, none padded 4x for 129-token segments).
  const int64_t S = static_cast<int64_t>(mt.sg.size());
  const int64_t tok_per_block = std::max<int64_t>(1, ROWS / r);
  std::vector<int64_t> otile0(S + 1, 0);  // first shared own tile of segment s (none: otile0[s+1] == otile0[s])
  for (int64_t s = 0; s < S; ++s) {
    const int64_t L = mt.cs[s + 1] - mt.cs[s];
    otile0[s + 1] = otile0[s] + (shared && L > tok_per_block && worth_sharing(L) ? (L + KT - 1) / KT : 0);
  }
  at::Tensor opacked;
  c_t* obuf = nullptr;
  std::vector<char> ofinite;  // per (tile, kv head): every V value finite
  if (shared && otile0[S] > 0) {
    opacked = at::empty({otile0[S], Hkv, 2, tile_elems}, q.options().dtype(c10::CppTypeToScalarType<c_t>::value));
    obuf = opacked.data_ptr<c_t>();
    const int64_t items = otile0[S] * Hkv;
    ofinite.assign(items, 1);
    at::parallel_for(0, items, 1, [&](int64_t b, int64_t e) {
      for (int64_t it = b; it < e; ++it) {
        const int64_t tile = it / Hkv, h = it % Hkv;
        const int64_t s = std::upper_bound(otile0.begin(), otile0.end(), tile) - otile0.begin() - 1;
        const int64_t j0 = mt.cs[s] + (tile - otile0[s]) * KT;
        c_t* dst = obuf + it * 2 * tile_elems;
        ofinite[it] = pack_kv_tile<s_t, c_t>([&](int64_t j) { return kp + (j0 + j) * ks0 + h * ks1; },
                                             [&](int64_t j) { return vp + (j0 + j) * vs0 + h * vs1; },
                                             std::min(KT, mt.cs[s + 1] - j0), KT, d, dst, dst + tile_elems);
      }
    });
  }

  // -- 3. (in 2., by the group's last chunk task to finish: no second parallel region, which on a
  // busy machine waits for another time slice of every thread) the chunks of a split group merged,
  // per row (flash-decoding's merge of online softmaxes):
  //   m = max_c m_c;  w_c = exp(scale·(m_c − m));  out = Σ_c w_c·acc_c / Σ_c w_c·l_c
  // A chunk whose scores were all −inf has w_c = 0 and adds nothing; a NaN in any chunk's l or
  // acc makes the row NaN, as in one softmax over all the keys (docs/cpu.md "Decode-like blocks").
  std::unique_ptr<std::atomic<int64_t>[]> chunks_left(new std::atomic<int64_t>[G]);
  for (int64_t g = 0; g < G; ++g) chunks_left[g].store(0, std::memory_order_relaxed);
  for (const Task& tk : tasks)
    if (tk.chunk >= 0) chunks_left[tk.g].fetch_add(1, std::memory_order_relaxed);
  auto merge_group = [&](int64_t g, float* o) {
    const int64_t M = gM[g], nc = nchunk[g];
    for (int64_t h = 0; h < Hkv; ++h)
      for (const Piece& pc : tasks[gtask[g]].pieces)  // the group's row block: its rows' tokens
        for (int64_t t = pc.t0; t < pc.t1; ++t)
          for (int64_t i = 0; i < r; ++i) {
            const int64_t row = pc.m0 + (t - pc.t0) * r + i;
            auto at = [&](int64_t c) { return part0[g] + (c * Hkv + h) * M + row; };
            float mx = -std::numeric_limits<float>::infinity();
            for (int64_t c = 0; c < nc; ++c) mx = std::max(mx, part_m[at(c)]);
            // every score −inf: no offset, every w_c 0 (the row's 0/0 = NaN, as unsplit)
            const float base = mx == -std::numeric_limits<float>::infinity() ? 0.f : mx;
            float lsum = 0.f;
            std::fill(o, o + d, 0.f);
            for (int64_t c = 0; c < nc; ++c) {
              const float w = std::exp(scale * (part_m[at(c)] - base));
              lsum += w * part_l[at(c)];
              const float* a = part_acc.data() + at(c) * d;
              for (int64_t x = 0; x < d; ++x) o[x] += w * a[x];
            }
            scale_row_out<s_t>(o, 1.f / lsum, d, op + t * os0 + (h * r + i) * os1);
          }
  };

  // -- 2. row tasks
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  const auto lists = deal(tasks, nthreads);
  at::parallel_for(0, nthreads, 1, [&](int64_t b, int64_t e) {
    GemmReleaseAtExit<c_t> release;  // brgemm's per-thread tile state, also when a task throws
    // scratch for this thread's tasks only (sized by their rows; the tiles' only if one takes the
    // tile path): a decode step's call is ~1 ms, where zero-filling and faulting in ~700 KB of
    // unused tile scratch per thread was a tenth of it
    int64_t rows = 1;
    bool tiles = false, direct_tasks = false;
    for (int64_t tid = b; tid < e; ++tid)
      for (int64_t ti : lists[tid]) {
        rows = std::max(rows, tasks[ti].nh * tasks[ti].M);
        (tasks[ti].direct ? direct_tasks : tiles) = true;
      }
    // whole row blocks past the last row, and S and P rows of the AMX tile kernel's strides: it reads
    // and writes them (attn_amx.h; an own sub-block starts at any row, so one block more); the
    // other steps use the first rows at stride KT
    rows = (rows + 2 * kAmxBlockRows - 1) / kAmxBlockRows * kAmxBlockRows;
    scratch<c_t> Q(rows * d), Pm(tiles ? rows * amx_weight_stride(KT) : 0), Kt(tiles ? tile_elems : 0),
        Vt(tiles ? tile_elems : 0);
    scratch<float> S(tiles ? rows * amx_score_stride(KT) : 0), acc(rows * d), m(rows), l(rows);
    scratch<c_t> OwnK, OwnV;  // a piece's own keys, all its tiles
    std::vector<char> finite;
    // the direct path's fp32 q rows (bf16 tasks) and scores
    scratch<float> Qf(direct_tasks && !std::is_same_v<c_t, float> ? rows * d : 0);
    scratch<float> Sd(direct_tasks ? rows * kDirectKeys : 0);
    for (int64_t tid = b; tid < e; ++tid) {
      for (int64_t ti : lists[tid]) {
        const Task& tk = tasks[ti];
        const int64_t g = tk.g, h = tk.h, M = tk.M, nh = tk.nh;
        // Q rows of the task, head-major then token-major: row hh·M + (token, i) = q[token, (h + hh)·r + i];
        // a token's r rows are one copy where its heads lie d apart (a [T, Hq, d] q)
        for (int64_t hh = 0; hh < nh; ++hh)
          for (const Piece& pc : tk.pieces)
            for (int64_t t = pc.t0; t < pc.t1; ++t) {
              const s_t* src = qp + t * qs0 + (h + hh) * r * qs1;
              c_t* dst = Q.data() + (hh * M + pc.m0 + (t - pc.t0) * r) * d;
              if constexpr (std::is_same_v<s_t, c_t>) {
                if (qs1 == d) {
                  std::memcpy(static_cast<void*>(dst), src, sizeof(c_t) * r * d);  // an element loop did not vectorise
                  continue;
                }
              }
              for (int64_t i = 0; i < r; ++i) {
                if constexpr (std::is_same_v<s_t, c_t>)
                  std::memcpy(static_cast<void*>(dst + i * d), src + i * qs1, sizeof(c_t) * d);
                else
                  for (int64_t c = 0; c < d; ++c) dst[i * d + c] = static_cast<c_t>(src[i * qs1 + c]);
              }
            }
        std::fill(m.begin(), m.begin() + nh * M, -std::numeric_limits<float>::infinity());
        std::fill(l.begin(), l.begin() + nh * M, 0.f);
        std::fill(acc.begin(), acc.begin() + nh * M * d, 0.f);
        // out = acc / l, in q's dtype
        auto write_out = [&] {
          for (int64_t hh = 0; hh < nh; ++hh)
            for (const Piece& pc : tk.pieces)
              for (int64_t t = pc.t0; t < pc.t1; ++t)
                for (int64_t i = 0; i < r; ++i) {
                  const int64_t row = hh * M + pc.m0 + (t - pc.t0) * r + i;
                  scale_row_out<s_t>(acc.data() + row * d, 1.f / l[row], d, op + t * os0 + ((h + hh) * r + i) * os1);
                }
        };

        const int64_t P = mt.cp[g + 1] - mt.cp[g];
        const bool in_pbuf = tile0[g + 1] > tile0[g];  // packed in 1
        // a decode-like group (one row block, so nobody packed its keys): straight from the K/V rows
        // (attn_direct_avx512.h)
        if (tk.direct) {
          run_direct_rows<s_t, c_t>(tk, mt, P, scale, Q.data(), Qf.data(), Sd.data(), m.data(), l.data(),
                                    acc.data(), [&](int64_t j) { return pk(g, j, h); },
                                    [&](int64_t j) { return pv(g, j, h); }, pk.st_head, pv.st_head,
                                    [&](int64_t j) { return kp + j * ks0 + h * ks1; },
                                    [&](int64_t j) { return vp + j * vs0 + h * vs1; }, ks1, vs1);
          if (tk.chunk < 0) {
            write_out();
          } else {  // a chunk: its rows' (m, l, acc) for the merge (3.)
            const int64_t p0 = part0[g] + (tk.chunk * Hkv + h) * M;
            std::copy(m.begin(), m.begin() + nh * M, part_m.begin() + p0);
            std::copy(l.begin(), l.begin() + nh * M, part_l.begin() + p0);
            std::copy(acc.begin(), acc.begin() + nh * M * d, part_acc.begin() + p0 * d);
            if (chunks_left[g].fetch_sub(1, std::memory_order_acq_rel) == 1) merge_group(g, acc.data());
          }
          continue;
        }

        // prefix: every row sees every key
        for (int64_t j0 = 0, tile = tile0[g]; j0 < P; j0 += KT, ++tile) {
          const int64_t n = std::min(KT, P - j0);
          const c_t *kt, *vt;
          if (in_pbuf) {
            kt = pbuf + (tile * Hkv + h) * 2 * tile_elems;
            vt = kt + tile_elems;
          } else {
            pack_kv_tile<s_t, c_t>([&](int64_t j) { return pk(g, j0 + j, h); },
                                   [&](int64_t j) { return pv(g, j0 + j, h); }, n, KT, d, Kt.data(), Vt.data());
            kt = Kt.data();
            vt = Vt.data();
          }
          const int64_t nc = gemm_cols<c_t>(n, KT);
#ifdef ACR_HAVE_AMX_CODE
          if constexpr (std::is_same_v<c_t, BFloat16>) {
            if (amx_tiles) {
              tile_amx(M, nc, d, scale, Q.data(), kt, vt, KT, S.data(), Pm.data(), m.data(), l.data(), acc.data(),
                       [n](int64_t) { return n; });
              continue;
            }
          }
#endif
          gemm(M, nc, d, Q.data(), d, kt, KT, S.data(), KT, false);
          softmax_step<c_t>(M, KT, nc, d, scale, S.data(), [n](int64_t) { return n; }, m.data(), l.data(), acc.data(),
                            Pm.data());
          gemm(M, d, nc, Pm.data(), KT, vt, d, acc.data(), d, true);
        }

        // own keys, causally: piece rows (token t, head i) see own keys a_s .. t. The keys come
        // from the shared own pack (1b) or, converted, are packed here once per piece; its rows
        // run in sub-blocks of OWN_ROWS rows, each against the keys up to its last token only, so
        // the causal triangle costs ~(1 + OWN_ROWS / (r·L)) of itself rather than the whole rectangle.
        for (const Piece& pc : tk.pieces) {
          const int64_t a = mt.cs[pc.seg];
          const int64_t ntiles = (pc.t1 - a + KT - 1) / KT;
          const bool in_buf = otile0[pc.seg + 1] > otile0[pc.seg];  // packed in 1b
          auto own_k = [&](int64_t tile) -> const c_t* {
            return in_buf ? obuf + ((otile0[pc.seg] + tile) * Hkv + h) * 2 * tile_elems : OwnK.data() + tile * tile_elems;
          };
          auto own_v = [&](int64_t tile) -> const c_t* {
            return in_buf ? own_k(tile) + tile_elems : OwnV.data() + tile * tile_elems;
          };
          auto own_finite = [&](int64_t tile) -> bool {
            return in_buf ? ofinite[(otile0[pc.seg] + tile) * Hkv + h] != 0 : finite[tile] != 0;
          };
          if (!in_buf) {
            if (static_cast<int64_t>(OwnK.size()) < ntiles * tile_elems) {
              OwnK.resize(ntiles * tile_elems);
              OwnV.resize(ntiles * tile_elems);
            }
            finite.assign(ntiles, 1);
            for (int64_t tile = 0; tile < ntiles; ++tile) {
              const int64_t j0 = a + tile * KT;
              finite[tile] = pack_kv_tile<s_t, c_t>(
                  [&](int64_t j) { return kp + (j0 + j) * ks0 + h * ks1; },
                  [&](int64_t j) { return vp + (j0 + j) * vs0 + h * vs1; }, std::min(KT, pc.t1 - j0), KT, d,
                  OwnK.data() + tile * tile_elems, OwnV.data() + tile * tile_elems);
            }
          }
          // tile-major: each key tile meets every sub-block that sees it (those whose last token is
          // ≥ its first key) while its K and V stay in L2, instead of each sub-block walking all the
          // tiles. A row still gets the same calls with the same arguments in the same tile order,
          // so its output bits are those of the sub-block-major order (docs/cpu.md).
          const int64_t sub_tok = std::max<int64_t>(1, OWN_ROWS / r);
          for (int64_t tile = 0, j0 = a; tile < ntiles; ++tile, j0 += KT) {
            const c_t* kt = own_k(tile);
            const c_t* vt = own_v(tile);
            // first sub-block whose last token u1 - 1 reaches j0
            const int64_t sb0 = j0 > pc.t0 ? (j0 - pc.t0) / sub_tok : 0;
            for (int64_t u0 = pc.t0 + sb0 * sub_tok; u0 < pc.t1; u0 += sub_tok) {
              const int64_t u1 = std::min(pc.t1, u0 + sub_tok);
              const int64_t m0 = pc.m0 + (u0 - pc.t0) * r, Mp = (u1 - u0) * r;
              c_t* Qp = Q.data() + m0 * d;
              float* accp = acc.data() + m0 * d;
              const int64_t n = std::min(KT, u1 - j0);
              // visible columns of sub-block row i: keys j0.. up to its token
              auto cnt = [&](int64_t i) { return std::min(n, u0 + i / r - j0 + 1); };
              const int64_t nc = gemm_cols<c_t>(n, KT);
#ifdef ACR_HAVE_AMX_CODE
              if constexpr (std::is_same_v<c_t, BFloat16>) {
                if (amx_tiles && own_finite(tile)) {  // else the masked P·V below
                  tile_amx(Mp, nc, d, scale, Qp, kt, vt, KT, S.data(), Pm.data(), m.data() + m0, l.data() + m0, accp,
                           cnt);
                  continue;
                }
              }
#endif
              gemm(Mp, nc, d, Qp, d, kt, KT, S.data(), KT, false);
              softmax_step<c_t>(Mp, KT, nc, d, scale, S.data(), cnt, m.data() + m0, l.data() + m0, accp, Pm.data());
              if (own_finite(tile)) {
                gemm(Mp, d, nc, Pm.data(), KT, vt, d, accp, d, true);
              } else {  // a non-finite value: add only the visible columns of each row (masked ones stay out)
                for (int64_t i = 0; i < Mp; ++i)
                  for (int64_t j = 0; j < cnt(i); ++j) {
                    const float p = static_cast<float>(Pm[i * KT + j]);
                    for (int64_t c = 0; c < d; ++c) {
                      const c_t vv = kVnni<c_t> ? vt[((j >> 1) * d + c) * 2 + (j & 1)] : vt[j * d + c];
                      accp[i * d + c] += p * static_cast<float>(vv);
                    }
                  }
              }
            }
          }
        }

        write_out();
      }
    }
    release.now();
  });
}

void check_int32(const at::Tensor& t, const char* name, int64_t dim) {
  ACR_CHECK_CPU(kOp, t, name);
  ACR_CHECK_DTYPE(kOp, t, name, at::kInt);
  ACR_CHECK_DIM(kOp, t, name, dim);
}

// Every check that would otherwise read out of bounds, with the value at fault.
Meta check_and_read(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                    const at::Tensor& kc, const at::Tensor& vc, const std::optional<at::Tensor>& block_table,
                    const at::Tensor& cu_prefix_lens, const at::Tensor& segment_group) {
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&kc, "prefix_k"}, {&vc, "prefix_v"}}) {
    ACR_CHECK_CPU(kOp, *t, name);
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), kOp, ": ", name, " dtype ", t->scalar_type(),
                " differs from q dtype ", q.scalar_type());
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              kOp, ": q dtype ", q.scalar_type(), " is not float32/bfloat16/float16");
  ACR_CHECK_DIM(kOp, q, "q", 3);
  ACR_CHECK_DIM(kOp, k, "k", 3);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2), kOp, ": k ", k.sizes(),
              " / v ", v.sizes(), " must be [T, Hkv, d] like q ", q.sizes());
  Meta mt;
  mt.T = q.size(0), mt.Hq = q.size(1), mt.Hkv = k.size(1), mt.d = q.size(2);
  // no head at all would make the GQA ratio r = Hq / Hkv zero, and the row blocks divide by it
  TORCH_CHECK(mt.Hq > 0 && mt.Hkv > 0, kOp, ": q and k need at least one head each, got ", mt.Hq, " query and ",
              mt.Hkv, " kv heads");
  TORCH_CHECK(mt.Hq % mt.Hkv == 0, kOp, ": query heads ", mt.Hq, " are not a multiple of kv heads ", mt.Hkv);
  TORCH_CHECK(mt.d >= 1 && mt.d <= MAX_HEAD_DIM, kOp, ": head_dim ", mt.d, " is outside [1, ", MAX_HEAD_DIM, "]");
  mt.r = mt.Hq / mt.Hkv;
  check_int32(cu_seqlens, "cu_seqlens", 1);
  check_int32(cu_prefix_lens, "cu_prefix_lens", 1);
  check_int32(segment_group, "segment_group", 1);
  mt.cs = to_host<int32_t>(cu_seqlens);
  mt.cp = to_host<int32_t>(cu_prefix_lens);
  mt.sg = to_host<int32_t>(segment_group);
  const int64_t S = static_cast<int64_t>(mt.sg.size()), G = static_cast<int64_t>(mt.cp.size()) - 1;
  TORCH_CHECK(static_cast<int64_t>(mt.cs.size()) == S + 1, kOp, ": cu_seqlens has ", mt.cs.size(),
              " entries for ", S, " segments");
  TORCH_CHECK(G >= 0, kOp, ": cu_prefix_lens needs at least one entry (0)");
  TORCH_CHECK(mt.cs[0] == 0 && mt.cs[S] == mt.T, kOp, ": cu_seqlens must start at 0 and end at T=", mt.T);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(mt.cs[s + 1] >= mt.cs[s], kOp, ": cu_seqlens decreases at ", s);
    TORCH_CHECK(mt.sg[s] >= 0 && mt.sg[s] < G, kOp, ": segment_group[", s, "] = ", mt.sg[s], " is outside [0, ", G,
                ")");
  }
  TORCH_CHECK(mt.cp[0] == 0, kOp, ": cu_prefix_lens must start at 0");
  for (int64_t g = 0; g < G; ++g)
    TORCH_CHECK(mt.cp[g + 1] >= mt.cp[g], kOp, ": cu_prefix_lens decreases at ", g);
  // the head_dim's stride is read nowhere when it has one element (head_dim 1) or the tensor none:
  // torch calls such a tensor contiguous whatever that stride, so .contiguous() leaves it as it is
  auto unit_last = [](const at::Tensor& t) { return t.stride(-1) == 1 || t.size(-1) == 1 || t.numel() == 0; };
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(unit_last(*t), kOp, ": the head_dim of q/k/v must have stride 1, got strides ", t->strides());
  TORCH_CHECK(kc.sizes() == vc.sizes(), kOp, ": prefix_k ", kc.sizes(), " and prefix_v ", vc.sizes(), " differ");
  if (block_table.has_value()) {
    check_int32(*block_table, "block_table", 2);
    mt.bt_owner = block_table->contiguous();  // a strided view of a larger table: [G, max_blocks] once
    const at::Tensor& bt = mt.bt_owner;
    TORCH_CHECK(kc.dim() == 4 && kc.size(2) == mt.Hkv && kc.size(3) == mt.d, kOp,
                ": k_cache must be [num_blocks, block_size, ", mt.Hkv, ", ", mt.d, "], got ", kc.sizes());
    TORCH_CHECK(unit_last(kc) && unit_last(vc), kOp, ": the head_dim of the caches must have stride 1");
    TORCH_CHECK(bt.size(0) == G, kOp, ": block_table has ", bt.size(0), " rows for ", G, " groups");
    mt.bt = bt.const_data_ptr<int32_t>();
    mt.max_blocks = bt.size(1);
    mt.block_size = kc.size(1);
    const int64_t nb = kc.size(0);
    TORCH_CHECK(mt.block_size >= 1, kOp, ": block_size must be >= 1");
    for (int64_t g = 0; g < G; ++g) {
      const int64_t P = mt.cp[g + 1] - mt.cp[g];
      const int64_t used = (P + mt.block_size - 1) / mt.block_size;
      TORCH_CHECK(used <= mt.max_blocks, kOp, ": group ", g, " has ", P, " prefix tokens, more than its ", mt.max_blocks,
                  " blocks of ", mt.block_size);
      for (int64_t j = 0; j < used; ++j) {
        const int64_t id = mt.bt[g * mt.max_blocks + j];
        TORCH_CHECK(id >= 0 && id < nb, kOp, ": block id ", id, " in block_table[", g, ", ", j,
                    "] is out of range [0, ", nb, ")");
      }
    }
  } else {
    TORCH_CHECK(kc.dim() == 3 && kc.size(1) == mt.Hkv && kc.size(2) == mt.d, kOp, ": prefix_k must be [Ptot, ",
                mt.Hkv, ", ", mt.d, "], got ", kc.sizes());
    TORCH_CHECK(unit_last(kc) && unit_last(vc), kOp, ": the head_dim of prefix_k/v must have stride 1");
    TORCH_CHECK(mt.cp[G] == kc.size(0), kOp, ": cu_prefix_lens ends at ", mt.cp[G], " but prefix_k has ", kc.size(0),
                " rows");
  }
  return mt;
}

at::Tensor prefix_shared_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& cu_seqlens, const at::Tensor& prefix_k,
                                       const at::Tensor& prefix_v, const std::optional<at::Tensor>& block_table,
                                       const at::Tensor& cu_prefix_lens, const at::Tensor& segment_group,
                                       double scale, bool tiles_only) {
  // checked as the fp32 number the tiles use: 1e39 is finite in double but inf in fp32, 1e-50 is 0
  const float sc = static_cast<float>(scale);
  TORCH_CHECK(std::isfinite(sc) && sc > 0, kOp, ": scale must be finite and > 0 in fp32, got ", scale);
  const Meta mt = check_and_read(q, k, v, cu_seqlens, prefix_k, prefix_v, block_table, cu_prefix_lens, segment_group);
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (mt.T == 0) return out;
  switch (q.scalar_type()) {
    case at::kFloat:
      run<float, float>(q, k, v, prefix_k, prefix_v, mt, sc, tiles_only, out);
      break;
    case at::kBFloat16:
      // bf16 tiles where this CPU multiplies bf16 natively (AMX brgemm, or our AVX512_BF16 tiles)
      // and head_dim pairs up for VNNI; else fp32 tiles (without AVX512_BF16, cpublas' bf16 brgemm
      // is a ~0.3 GFLOP/s loop)
      if (std::strcmp(bf16_path(), "fp32-convert") != 0 && mt.d % 2 == 0)
        run<at::BFloat16, at::BFloat16>(q, k, v, prefix_k, prefix_v, mt, sc, tiles_only, out);
      else
        run<at::BFloat16, float>(q, k, v, prefix_k, prefix_v, mt, sc, tiles_only, out);
      break;
    default:
      run<at::Half, float>(q, k, v, prefix_k, prefix_v, mt, sc, tiles_only, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(acarerank, m) {
  m.def("prefix_shared_attention_cpu(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, Tensor prefix_k, "
        "Tensor prefix_v, Tensor? block_table, Tensor cu_prefix_lens, Tensor segment_group, float scale, "
        "bool tiles_only=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(acarerank, CPU, m) {
  m.impl("prefix_shared_attention_cpu", &prefix_shared_attention_cpu);
}
