"""Paged prefix-shared attention on CPU: the native kernel against what else runs there.

One layer's attention of one group (one prefix in scattered 16-token pages, ``depth`` segments of
60-390 tokens, seeded), at the Qwen3-Reranker shapes:

  0.6b  Hq 16 / Hkv 8, d 128          4b  Hq 32 / Hkv 8, d 128
  M0    prefix  80 tokens (sub-query only)    M3  prefix 1,600 tokens (+ trace and question)

Providers, interleaved one call each per round (a load change on a shared machine hits all alike):
  native   prefix_shared_attention_paged(backend="native"): one kernel call (csrc/cpu/prefix_attention.cpp)
  torch    the "torch" backend (torch's fused CPU flash kernel per group + one per segment + lse merge)
  sdpa     what a user writes without us: the prefix gathered from its pages, then
           F.scaled_dot_product_attention once per segment over [prefix; own] (GQA, causal offset mask)
  flex     FlexAttention (torch.compile'd, inductor's CPU template) over the packed [prefix; segments]
           with the prefix-shared mask_mod: key in the prefix, or same segment and not in the future
  gemm     an n x n x n GEMM in the same dtype (n 2048; 1024 for bf16 on a CPU without native
           bf16, where torch's bf16 GEMM is an emulation at well under 1 GFLOP/s), the faster of
           F.linear and the weight reordered once for oneDNN: the GEMM peak the others are a % of

Decode (``--workload decode``): one setwise decoding step of ``--groups`` prompts at once — each
group its own prefix of the mode's length in scattered pages and one one-token segment — as a
batched decode sends it. That is a GEMV per row, bound by reading K/V: the figure is GB/s of
prefix K/V read (G·P·Hkv·d·2·bytes per call) and % of a streaming read measured in the same run
(``stream``: a sum over 256 MB of fp32), where the prefill table gives % of the GEMM peak. flex
is not run there (one compiled block mask per batch shape is not what a decode step can afford).
A decode step reads every layer's K/V, far more than the L3 holds, so each timed call runs over
several layers' caches (different seeds; as many as make ``--kv-mb``, 256 MB by default, at most
28, the 0.6B model's layer count) and the ms are per layer: one cache reused would be timed from
the L3. ``--prefixes`` replaces the modes' prefix lengths (a long agent context: 5,291 keys is
setwise's pool-20 prompt); prefixes over 1,024 keys are where the kernel splits the keys
(``ACARERANK_CPU_DIRECT_CHUNK``; 0 runs them unsplit, for an A/B in two processes).

A setwise prefill pass (``--segment-tokens N``): one causal segment of N tokens after the prefix
in place of the depth segments — a long prompt's 2,048-row prefill pass over the keys before it
(``--prefixes``, e.g. 8,192), where the softmax between the tiles, not the tiles, sets the time.

Check: every provider's output against the fp32 oracle (--quick) or the torch backend's (full
shapes), max |diff| ≤ 2e-4 fp32 / 4e-2 bf16; a mismatch is printed and the exit status is 1.

Output: median ms, TFLOP/s (4·d·Hq·Σ_s L_s·(P + (L_s+1)/2) per call) and % of the GEMM peak, one
CSV row each (``--csv``), with the CPU model, its flags (AVX2 / AVX512 / AMX / bf16), threads,
torch and the date.

    python bench/bench_cpu_attention.py --quick                 # tiny shapes, every provider once
    python bench/bench_cpu_attention.py                         # the full table (slow on 2 cores)
    python bench/bench_cpu_attention.py --models 0.6b --modes M3 --depths 20 --dtypes float32 bfloat16
    python bench/bench_cpu_attention.py --workload decode --groups 1 16 --modes M3 --dtypes float32 bfloat16
    python bench/bench_cpu_attention.py --workload decode --groups 1 --prefixes 2048 5291 11684 --providers native
    python bench/bench_cpu_attention.py --segment-tokens 2048 --prefixes 1600 8192 --models 0.6b --dtypes bfloat16
"""
from __future__ import annotations

import argparse
import csv
import datetime
import math
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

MODELS = {"0.6b": (16, 8, 128), "4b": (32, 8, 128)}
MODES = {"M0": 80, "M3": 1600}
BLOCK = 16


def cpu_info() -> dict:
    """CPU model and the flags that decide the kernels' path, from /proc/cpuinfo."""
    model, flags = platform.processor() or "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("?", "x86_64", ""):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    keep = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return {"cpu": model, "flags": " ".join(keep) or "none of avx2/avx512/amx"}


def make_case(Hq, Hkv, d, P, depth, dtype, seed=0, segment_tokens=None):
    """One group: pages at shuffled ids, ``depth`` segments of 60-390 tokens (or one of
    ``segment_tokens``)."""
    g = torch.Generator().manual_seed(seed)
    lens = [segment_tokens] if segment_tokens else torch.randint(60, 391, (depth,), generator=g).tolist()
    depth = len(lens)
    T = sum(lens)
    nb = -(-P // BLOCK)
    num_blocks = nb + 8
    kc = torch.randn(num_blocks, BLOCK, Hkv, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, BLOCK, Hkv, d, generator=g).to(dtype)
    bt = torch.randperm(num_blocks, generator=g)[:max(nb, 1)].to(torch.int32)[None]
    q = torch.randn(T, Hq, d, generator=g).to(dtype)
    k = torch.randn(T, Hkv, d, generator=g).to(dtype)
    v = torch.randn(T, Hkv, d, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    sg = torch.zeros(depth, dtype=torch.int32)
    pl = torch.tensor([P], dtype=torch.int32)
    flop = 4 * d * Hq * sum(L * (P + (L + 1) / 2) for L in lens)
    return (q, k, v, cu, kc, vc, bt, pl, sg), lens, flop


def make_decode_case(Hq, Hkv, d, P, G, dtype, seed=0):
    """``G`` groups of prefix ``P`` each (pages at shuffled ids), one one-token segment per group."""
    g = torch.Generator().manual_seed(seed)
    nb = max(-(-P // BLOCK), 1)
    num_blocks = G * nb + 8
    kc = torch.randn(num_blocks, BLOCK, Hkv, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, BLOCK, Hkv, d, generator=g).to(dtype)
    bt = torch.randperm(num_blocks, generator=g)[:G * nb].to(torch.int32).view(G, nb)
    q = torch.randn(G, Hq, d, generator=g).to(dtype)
    k = torch.randn(G, Hkv, d, generator=g).to(dtype)
    v = torch.randn(G, Hkv, d, generator=g).to(dtype)
    cu = torch.arange(G + 1, dtype=torch.int32)
    sg = torch.arange(G, dtype=torch.int32)
    pl = torch.full((G,), P, dtype=torch.int32)
    kv_bytes = 2 * G * P * Hkv * d * kc.element_size()
    return (q, k, v, cu, kc, vc, bt, pl, sg), kv_bytes


def provider_sdpa_decode(args):
    """Per group: its prefix gathered from its pages, then SDPA of its one token over [prefix; own]."""
    q, k, v, cu, kc, vc, bt, pl, sg = args
    P = int(pl[0])
    idx = torch.arange(P)

    def call():
        out = torch.empty_like(q)
        for gi in range(q.shape[0]):
            blk = bt[gi].long()[idx // BLOCK]
            keys = torch.cat([kc[blk, idx % BLOCK], k[gi:gi + 1]]).transpose(0, 1)  # [Hkv, P+1, d]
            vals = torch.cat([vc[blk, idx % BLOCK], v[gi:gi + 1]]).transpose(0, 1)
            out[gi] = F.scaled_dot_product_attention(q[gi][:, None], keys, vals, enable_gqa=True)[:, 0]
        return out
    return call


def provider_stream(n_bytes=256 << 20):
    x = torch.randn(n_bytes // 4)
    return (lambda: x.sum()), n_bytes


def provider_ours(args, backend):
    from acarerank.ops import plan_prefix_shared_attention_paged, prefix_shared_attention_paged

    q, k, v, cu, kc, vc, bt, pl, sg = args
    plan = plan_prefix_shared_attention_paged(cu, bt, pl, sg, num_heads=q.shape[1], num_kv_heads=k.shape[1],
                                              head_dim=q.shape[2], block_size=BLOCK, num_blocks=kc.shape[0],
                                              dtype=q.dtype, backend=backend)
    return lambda: prefix_shared_attention_paged(q, k, v, cu, kc, vc, bt, pl, sg, plan=plan)


def _gather_prefix(kc, vc, bt, P):
    idx = torch.arange(P)
    blk = bt[0].long()[idx // BLOCK]
    return kc[blk, idx % BLOCK], vc[blk, idx % BLOCK]       # [P, Hkv, d]


def provider_sdpa(args, lens):
    q, k, v, cu, kc, vc, bt, pl, sg = args
    P = int(pl[0])
    cs = cu.tolist()
    masks = {L: torch.ones(L, P + L, dtype=torch.bool).tril(diagonal=P) for L in set(lens)}

    def call():
        pk, pv = _gather_prefix(kc, vc, bt, P)
        out = torch.empty_like(q)
        for s in range(len(lens)):
            a, b = cs[s], cs[s + 1]
            keys = torch.cat([pk, k[a:b]]).transpose(0, 1)   # [Hkv, P+L, d]
            vals = torch.cat([pv, v[a:b]]).transpose(0, 1)
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), keys, vals, attn_mask=masks[b - a],
                                               enable_gqa=True)
            out[a:b] = o.transpose(0, 1)
        return out
    return call


def provider_flex(args, lens):
    """FlexAttention over [prefix; all segments] with the prefix-shared mask_mod (compiled once)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v, cu, kc, vc, bt, pl, sg = args
    P, T = int(pl[0]), q.shape[0]
    seg_of = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))

    def mask_mod(b, h, q_idx, kv_idx):
        own = kv_idx - P
        same = seg_of[q_idx] == seg_of[own.clamp(min=0)]
        return (kv_idx < P) | ((own >= 0) & same & (own <= q_idx))

    block_mask = create_block_mask(mask_mod, None, None, T, P + T, device="cpu")
    fa = torch.compile(flex_attention, dynamic=False)

    def call():
        pk, pv = _gather_prefix(kc, vc, bt, P)
        keys = torch.cat([pk, k]).transpose(0, 1)[None]          # [1, Hkv, P+T, d]
        vals = torch.cat([pv, v]).transpose(0, 1)[None]
        return fa(q.transpose(0, 1)[None], keys, vals, block_mask=block_mask, enable_gqa=True)
    return call


def provider_gemm(dtype, n=4096):
    """({name: call}, flop per call): the n x n x n GEMM each way this CPU offers in ``dtype`` --
    ``F.linear``, and the weight reordered once for oneDNN (``acarerank.ops.linear``, what the
    runner's linear layers use) where it can be. The peak is the faster of them, so no provider
    reads as above it just because ``F.linear`` is the slower way here (fp32 on Zen 4: 0.14 vs
    0.21 TFLOP/s)."""
    from acarerank.ops.linear import linear, onednn_why_unavailable, prepare_linear_weight

    a, w = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    ways = {"gemm": lambda: F.linear(a, w)}
    if not onednn_why_unavailable(dtype):
        packed = prepare_linear_weight(w, "onednn")
        ways["gemm_onednn"] = lambda: linear(a, packed)
    return ways, 2.0 * n ** 3


def interleaved(variants: dict, rounds: int):
    """({name: [seconds]}, {name: output of the warm-up call}): one call of each in turn per round."""
    times = {name: [] for name in variants}
    outs = {name: fn() for name, fn in variants.items()}  # warm-up (and compile for flex)
    for _ in range(rounds):
        for name, fn in variants.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times, outs


def as_rows(name, out):
    """Every provider's output as [T, Hq, d] fp32 (flex returns [1, Hq, T, d])."""
    return (out[0].transpose(0, 1) if name == "flex" else out).float()


TOL = {torch.float32: 2e-4, torch.bfloat16: 4e-2}  # max |diff| against the check's reference

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--depths", nargs="+", type=int, default=[20, 100])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--providers", nargs="+", default=["native", "torch", "sdpa", "flex"],
                    choices=["native", "torch", "sdpa", "flex"])
    ap.add_argument("--workload", choices=["prefill", "decode"], default="prefill",
                    help="prefill: one group, depth segments; decode: --groups groups of one token each")
    ap.add_argument("--groups", nargs="+", type=int, default=[1, 16], help="decode: groups per call")
    ap.add_argument("--segment-tokens", type=int, default=None,
                    help="prefill: one causal segment of this many tokens instead of --depths' segments")
    ap.add_argument("--prefixes", nargs="+", type=int, default=None,
                    help="decode: these prefix lengths instead of the modes' (80 and 1,600)")
    ap.add_argument("--kv-mb", type=float, default=256.0,
                    help="decode: each call runs over enough layers' caches to read this much K/V (≤ 28 layers)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--csv", default=None, help="write the rows here too")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (Hq 4 / Hkv 2, d 64, prefix 40, depth 3), one round")
    a = ap.parse_args(argv)
    long_pass = a.segment_tokens is not None
    if a.prefixes is not None and (not (a.workload == "decode" or long_pass) or min(a.prefixes) < 1 or a.quick):
        # --quick has its own prefix (40): the lengths were dropped without a word
        ap.error("--prefixes: positive prefix lengths, with --workload decode or --segment-tokens, not with --quick")
    if long_pass and (a.workload != "prefill" or a.segment_tokens < 1 or a.quick):
        ap.error("--segment-tokens: a positive token count, with --workload prefill, not with --quick")
    if not 0 < a.kv_mb < math.inf:   # inf: math.ceil's OverflowError in decode_layers, after the set-up
        ap.error(f"--kv-mb must be finite and > 0, got {a.kv_mb}")
    if a.rounds < 1:  # no round: a traceback (median of no times) after the set-up
        ap.error(f"--rounds must be >= 1, got {a.rounds}")

    info = cpu_info()
    from acarerank.ops import _native

    native_ok = _native.available()
    bf16_path = _native.bf16_attention_path() if native_ok else "n/a"
    if native_ok and _native.amx_tiles_kernel():
        bf16_path += " + AMX tile kernel"
    head = (f"# {datetime.date.today()}  {info['cpu']}  flags: {info['flags']}  threads {torch.get_num_threads()}  "
            f"torch {torch.__version__}  python {platform.python_version()}  "
            f"native {'built' if native_ok else 'unavailable: ' + _native.why_unavailable()}  "
            f"bf16 tiles: {bf16_path}")
    print(head)
    if not native_ok and "native" in a.providers:
        a.providers.remove("native")
    models = {"quick": (4, 2, 64)} if a.quick else {m: MODELS[m] for m in a.models}
    modes = {"quick": 40} if a.quick else {m: MODES[m] for m in a.modes}
    if a.prefixes and not a.quick:
        modes = {f"P{P}": P for P in a.prefixes}
    depths = [3] if a.quick else [1] if long_pass else a.depths
    rounds = 1 if a.quick else a.rounds
    if a.workload == "decode":
        rows, failed = run_decode(a, info, models, modes, rounds)
    else:
        rows, failed = run_prefill(a, info, models, modes, depths, rounds)
    if a.csv and rows:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 1 if failed else 0


def check_outputs(a, outs, args, dtype, label):
    """Every provider's output against the fp32 oracle (--quick) or the torch backend's: True if any
    is off by more than TOL (printed)."""
    if a.quick:
        from acarerank.ops import prefix_shared_attention_paged_ref

        want = prefix_shared_attention_paged_ref(*[t.float() if t.is_floating_point() else t for t in args])
    else:
        want = as_rows("torch", outs["torch"]) if "torch" in outs else None
    failed = False
    for p in a.providers:
        if p in outs and want is not None:
            err = (as_rows(p, outs[p]) - want).abs().max().item()
            if not err <= TOL[dtype]:
                print(f"MISMATCH {label}: {p} max |diff| {err:.3g} > {TOL[dtype]}", file=sys.stderr)
                failed = True
    return failed


def _machine(info) -> dict:
    """The CSV columns every row starts with: date, CPU, its flags, threads, torch."""
    return dict(date=str(datetime.date.today()), cpu=info["cpu"], flags=info["flags"],
                threads=torch.get_num_threads(), torch=torch.__version__)


def run_decode(a, info, models, modes, rounds):
    rows, failed = [], False
    groups = [2] if a.quick else a.groups
    stream_fn, stream_bytes = provider_stream(16 << 20 if a.quick else 256 << 20)
    for dt_name in a.dtypes:
        dtype = getattr(torch, dt_name)
        for model, (Hq, Hkv, d) in models.items():
            for mode, P in modes.items():
                for G in groups:
                    layers = decode_layers(a, make_decode_case(Hq, Hkv, d, P, G, dtype)[1])
                    cases = [make_decode_case(Hq, Hkv, d, P, G, dtype, seed=i) for i in range(layers)]
                    args, kv_bytes = cases[0]
                    variants = {"stream": stream_fn}
                    for p in a.providers:
                        if p in ("native", "torch"):
                            variants[p] = every_layer([provider_ours(c, p) for c, _ in cases])
                        elif p == "sdpa":
                            variants[p] = every_layer([provider_sdpa_decode(c) for c, _ in cases])
                    times, outs = interleaved(variants, rounds)
                    label = f"decode {dt_name} {model} {mode} groups {G}"
                    failed |= check_outputs(a, outs, args, dtype, label)
                    bw = stream_bytes / statistics.median(times["stream"])
                    print(f"\n{dt_name} {model} (Hq {Hq}/Hkv {Hkv}, d {d}) decode {mode} prefix {P} groups {G} "
                          f"({kv_bytes / 1e6:.1f} MB of K/V a layer, {layers} layers a call)  "
                          f"streaming read {bw / 1e9:.1f} GB/s")
                    for p in a.providers:
                        if p not in times:
                            print(f"  {p:7s} not run: {'no decode case' if p == 'flex' else 'unavailable'}")
                            continue
                        med = statistics.median(times[p]) / layers
                        gbs = kv_bytes / med
                        print(f"  {p:7s} {med * 1e3:10.2f} ms  {gbs / 1e9:7.2f} GB/s  {100 * gbs / bw:5.1f} % of streaming read")
                        # rates in 4 significant digits, not fixed decimals: --quick's tiny K/V on a busy machine
                        # rounded to 0.000 GB/s
                        rows.append(dict(_machine(info), dtype=dt_name, model=model, mode=mode, prefix=P, groups=G,
                                         kv_mb=_sig(kv_bytes / 1e6), layers=layers, provider=p, ms=round(med * 1e3, 3),
                                         gb_per_s=_sig(gbs / 1e9), pct_stream=_sig(100 * gbs / bw),
                                         stream_gb_per_s=_sig(bw / 1e9)))
    return rows, failed


MAX_LAYERS = 28   # Qwen3-0.6B's: a decode step never reads more layers' K/V than the model has


def decode_layers(a, kv_bytes: int) -> int:
    """How many layers' caches one timed decode call runs over: enough that their K/V together is at
    least ``--kv-mb`` (so the L3 cannot hold them, as it cannot hold a real decode step's), at most
    MAX_LAYERS; 2 with --quick (the cycling runs, in no time)."""
    if a.quick:
        return 2
    return max(1, min(MAX_LAYERS, math.ceil(a.kv_mb * 1e6 / kv_bytes)))


def every_layer(calls: list):
    """One call that runs each layer's call in turn (a decode step's attention over every layer);
    it returns the first layer's output, the one the check compares."""
    def call():
        first = calls[0]()
        for c in calls[1:]:
            c()
        return first
    return call


def _sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits."""
    return float(f"{x:.{digits}g}")


def run_prefill(a, info, models, modes, depths, rounds):
    rows, failed = [], False
    for dt_name in a.dtypes:
        dtype = getattr(torch, dt_name)
        from acarerank.hardware import native_bf16

        n = 256 if a.quick else (1024 if dtype == torch.bfloat16 and not native_bf16()[0] else 2048)
        gemm_ways, gemm_flop = provider_gemm(dtype, n)
        for model, (Hq, Hkv, d) in models.items():
            for mode, P in modes.items():
                for depth in depths:
                    args, lens, flop = make_case(Hq, Hkv, d, P, depth, dtype, segment_tokens=a.segment_tokens)
                    variants = dict(gemm_ways)
                    notes = {}
                    for p in a.providers:
                        try:
                            if p in ("native", "torch"):
                                variants[p] = provider_ours(args, p)
                            elif p == "sdpa":
                                variants[p] = provider_sdpa(args, lens)
                            else:
                                variants[p] = provider_flex(args, lens)
                                variants[p]()  # compile now: a failure is reported, not fatal
                        except Exception as e:  # report why a provider cannot run here, keep the others
                            variants.pop(p, None)
                            notes[p] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    times, outs = interleaved(variants, rounds)
                    failed |= check_outputs(a, outs, args, dtype, f"{dt_name} {model} {mode} depth {depth}")
                    peak = max(gemm_flop / statistics.median(times[g]) for g in gemm_ways)
                    print(f"\n{dt_name} {model} (Hq {Hq}/Hkv {Hkv}, d {d}) {mode} prefix {P} depth {depth} "
                          f"({sum(lens)} segment tokens, {flop / 1e9:.1f} GFLOP)  GEMM peak {peak / 1e12:.3f} TFLOP/s")
                    for p in a.providers:
                        if p not in times:
                            print(f"  {p:7s} not run: {notes.get(p, '?')}")
                            continue
                        med = statistics.median(times[p])
                        tf = flop / med
                        print(f"  {p:7s} {med * 1e3:10.1f} ms  {tf / 1e12:7.3f} TFLOP/s  {100 * tf / peak:5.1f} % of GEMM peak")
                        rows.append(dict(_machine(info), dtype=dt_name, model=model, mode=mode, prefix=P,
                                         depth=depth, tokens=sum(lens),
                                         provider=p, ms=round(med * 1e3, 2), tflops=_sig(tf / 1e12),
                                         pct_gemm_peak=_sig(100 * tf / peak),
                                         gemm_peak_tflops=_sig(peak / 1e12)))
    return rows, failed


if __name__ == "__main__":
    sys.exit(main())
