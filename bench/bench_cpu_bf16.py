"""Interleaved A/B runs behind the CPU bf16 choices (docs/cpu.md, "Dtype: fp32 or bf16"): bf16 prefix attention and torch.compile'd layers on CPU.

Every comparison runs its variants in the same process, one call of each in turn, for
``--rounds`` rounds (so a load change on a shared machine hits all variants alike), and
prints median / min ms per variant, the FLOP rate and the speedup over the first variant.

  --what attention   one packed attention call at the default model's M3 shape (2,048
                     segment tokens in 8 segments, 6/2 heads, d 64, 1,650-token prefix), by
                     backend: "torch" (torch's fused flash kernel in fp32) and "native" (the
                     one-kernel CPU path), each in fp32 and bf16 (bench/bench_cpu_attention.py
                     has the paged op at the Qwen3-Reranker shapes beside SDPA and FlexAttention)
  --what layer       one packed runner pass (prefix 1,650 + 2,048 segment tokens) per dtype:
                     layer ops on torch | on the native kernels | torch.compile'd halves
                     (layer_blocks); compile time printed (bench/bench_cpu_layer.py: one layer alone)
  --what e2e         PointwiseReranker.score, M3, depth --depth: fp32 | bf16 with the "torch"
                     attention backend | bf16 with "native" | bf16 native + compiled layers

    python bench/bench_cpu_bf16.py --what attention [--rounds 7]
    python bench/bench_cpu_bf16.py --what layer
    python bench/bench_cpu_bf16.py --what e2e --depth 50
    python bench/bench_cpu_bf16.py --quick      # tiny shapes, every part once (smoke test)

The machine's native bf16 (``acarerank.hardware.native_bf16``) is printed first: on a CPU
without it, bf16 GEMMs are emulated and every bf16 figure here is meaningless.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from acarerank.benchmark.measure import timed_call


def interleaved(variants: dict, rounds: int) -> dict:
    """{name: [seconds per call]}: one warm-up call each, then ``rounds`` rounds of one call each in turn."""
    for fn in variants.values():
        fn()
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            times[k].append(timed_call(fn, "cpu")[1])
    return times


def report(title: str, times: dict, gflop: float = math.nan) -> None:
    print(f"\n{title}")
    base = None
    for k, ts in times.items():
        med = statistics.median(ts)
        base = base or med
        rate = f"{gflop / med:8.1f} GFLOP/s" if gflop == gflop else ""
        print(f"  {k:<44} median {med * 1e3:9.2f} ms  min {min(ts) * 1e3:9.2f} ms  {rate}  {base / med:5.2f}x")


def bench_attention(args) -> None:
    from acarerank.ops import available_backends, prefix_shared_attention

    Tg, Hq, Hkv, d, P = (64, 6, 2, 64, 100) if args.quick else (args.tokens, 6, 2, 64, args.prefix)
    g = torch.Generator().manual_seed(0)
    q32 = torch.randn(Tg, Hq, d, generator=g)
    k32, v32 = torch.randn(Tg, Hkv, d, generator=g), torch.randn(Tg, Hkv, d, generator=g)
    pk32, pv32 = torch.randn(P, Hkv, d, generator=g), torch.randn(P, Hkv, d, generator=g)
    i32 = dict(dtype=torch.int32)
    cu = torch.linspace(0, Tg, 9).round().to(**i32)
    cp, sg = torch.tensor([0, P], **i32), torch.zeros(8, **i32)
    variants = {}
    for backend in available_backends("prefix_shared_attention", "cpu"):
        for dt in (torch.float32, torch.bfloat16):
            t = [x.to(dt) for x in (q32, k32, v32, pk32, pv32)]
            variants[f"{backend} {dt}"] = (lambda t=t, b=backend: prefix_shared_attention(
                t[0], t[1], t[2], cu, t[3], t[4], cp, sg, backend=b))
    flop = 4.0 * Hq * d * sum(L * (P + (L + 1) / 2) for L in (cu[1:] - cu[:-1]).tolist())
    report(f"prefix-shared attention: {Tg} tokens in 8 segments x {Hq}/{Hkv} heads x d {d}, prefix {P}",
           interleaved(variants, args.rounds), gflop=flop / 1e9)


LAYER_OPS = ("rms_norm", "fused_add_rms_norm", "qk_norm_rope", "silu_and_mul")


def _runner_pass(dtype, compile_layers: bool, quick: bool, layers: int, layer_backend=None):
    from acarerank.model import Qwen3Runner
    from acarerank.model.default import build_default_model

    kw = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32) if quick else dict(num_hidden_layers=layers)
    backend = {op: layer_backend for op in LAYER_OPS} if layer_backend else None
    runner = Qwen3Runner.from_hf(build_default_model("tiny-cpu", seed=0, dtype=dtype, **kw),
                                 compile_layers=compile_layers, backend=backend)
    g = torch.Generator().manual_seed(0)
    P, T = (100, 64) if quick else (1650, 2048)
    cache = runner.prefill([torch.randint(0, 100000, (P,), generator=g)])
    segs = [torch.randint(0, 100000, (T // 8,), generator=g) for _ in range(8)]
    return lambda: runner.forward(cache, segs, [0] * 8, output="last")


def bench_layer(args) -> None:
    from acarerank.ops import available_backends

    native = all("native" in available_backends(op, "cpu") for op in LAYER_OPS)
    for dtype in (torch.float32, torch.bfloat16):
        variants = {"eager (torch layer ops)": _runner_pass(dtype, False, args.quick, args.layers, "torch")}
        if native:
            variants["native layer ops"] = _runner_pass(dtype, False, args.quick, args.layers, "native")
        comp = _runner_pass(dtype, True, args.quick, args.layers)
        t0 = time.perf_counter()
        comp()
        print(f"\n{dtype}: torch.compile of the two layer halves took {time.perf_counter() - t0:.1f} s (first pass)")
        variants["torch.compile"] = comp
        report(f"runner pass, {dtype}, layer ops eager / native vs compiled layer halves",
               interleaved(variants, args.rounds))


def bench_e2e(args) -> None:
    from acarerank import PointwiseReranker
    from acarerank.benchmark.workload import WorkloadSpec, make_workload
    from acarerank.model import Qwen3Runner
    from acarerank.model.default import build_default_model
    from acarerank.ops import available_backends
    from acarerank.tokenizer import load_qwen3_tokenizer

    tok = load_qwen3_tokenizer()
    spec = WorkloadSpec(num_docs=args.depth, **(dict(trace_tokens=100, doc_tokens=(10, 30)) if args.quick else {}))
    w = make_workload(tok, spec)
    ctx, docs = w.context("M3"), w.docs(args.depth)
    kw = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32) if args.quick else {}
    m32 = build_default_model("tiny-cpu", seed=0, **kw)
    mbf = build_default_model("tiny-cpu", seed=0, dtype=torch.bfloat16, **kw)

    def scorer(model, attention, compile_layers=False):
        backend = None if attention is None else {"attention": attention, "paged_attention": attention}
        runner = Qwen3Runner.from_hf(model, backend=backend, compile_layers=compile_layers)
        rr = PointwiseReranker(runner=runner, tokenizer=tok)
        return lambda: rr.score(documents=docs, **ctx)

    variants = {"fp32 (CPU defaults)": scorer(m32, None), "bf16, torch attention": scorer(mbf, "torch")}
    if "native" in available_backends("prefix_shared_attention", "cpu"):
        variants["bf16, native attention"] = scorer(mbf, "native")
        variants["bf16, native attention + compiled layers"] = scorer(mbf, "native", True)
        t0 = time.perf_counter()
        variants["bf16, native attention + compiled layers"]()
        print(f"compile + first call: {time.perf_counter() - t0:.1f} s")
    report(f"PointwiseReranker.score M3 depth {args.depth}", interleaved(variants, args.rounds))


def main() -> None:
    from acarerank.hardware import native_bf16

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("attention", "layer", "e2e", "all"), default="all")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=2048, help="segment tokens of the attention pass")
    ap.add_argument("--prefix", type=int, default=1650, help="prefix tokens of the attention pass")
    ap.add_argument("--layers", type=int, default=6, help="layers of the runner pass (--what layer)")
    ap.add_argument("--depth", type=int, default=50, help="documents (--what e2e)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds: a smoke test")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.depth = 2, 4
    ok, why = native_bf16()
    print(f"native bf16: {ok} ({why}); torch {torch.__version__}, {torch.get_num_threads()} threads")
    for part, fn in (("attention", bench_attention), ("layer", bench_layer), ("e2e", bench_e2e)):
        if args.what in (part, "all"):
            fn(args)


if __name__ == "__main__":
    main()
