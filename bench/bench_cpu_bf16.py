"""Interleaved A/B runs behind the CPU bf16 choices (docs/cpu.md, "Dtype: fp32 or bf16"): bf16 prefix attention and torch.compile'd layers on CPU.

Every comparison runs its variants in the same process, one call of each in turn, for
``--rounds`` rounds (so a load change on a shared machine hits all variants alike), and
prints median / min ms per variant, the FLOP rate and the speedup over the first variant.

  --what attention   the prefix part of one packed pass at the default model's M3 shape
                     (2,048 segment tokens, 6/2 heads, d 64, 1,650-token prefix):
                     fp32 fused flash kernel (today's fp32 path) | bf16 inputs through the
                     same kernel (today's bf16 path: fp32 copy of the prefix) | bf16 blocked
                     GEMMs (cpu_attention_bf16) at a few row-block × key-tile sizes, with
                     the tile softmax eager or torch.compile'd (COMPILE_SOFTMAX)
  --what layer       one packed runner pass (prefix 1,650 + 2,048 segment tokens) per dtype:
                     eager layer halves | torch.compile'd (layer_blocks); compile time printed
  --what e2e         PointwiseReranker.score, M3, depth --depth, bf16: old prefix path | new
                     prefix path | new path + compiled layers; fp32 beside them

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
    import acarerank.ops.attention as att
    import acarerank.ops.cpu_attention_bf16 as bf16_attn
    from acarerank.ops.cpu_attention_bf16 import prefix_attention_bf16

    Tg, Hq, Hkv, d, P = (64, 6, 2, 64, 100) if args.quick else (args.tokens, 6, 2, 64, args.prefix)
    g = torch.Generator().manual_seed(0)
    q32 = torch.randn(Tg, Hq, d, generator=g)
    k32, v32 = torch.randn(P, Hkv, d, generator=g), torch.randn(P, Hkv, d, generator=g)
    qb, kb, vb = q32.bfloat16(), k32.bfloat16(), v32.bfloat16()
    scale = d ** -0.5
    variants = {
        "fp32: fused flash kernel (today)": lambda: att._prefix_part(q32, k32, v32, scale),
        "bf16 in: fp32 copy + fused flash kernel (today)": lambda: att._prefix_part(qb.float(), kb, vb, scale),
    }
    def blocked(rb, kt, fused):
        def call():
            bf16_attn.COMPILE_SOFTMAX = fused
            return prefix_attention_bf16(qb, kb, vb, scale, row_block=rb, key_tile=kt)
        return call

    for rb, kt, fused in ((512, 2048, False), (512, 2048, True), (128, 2048, False), (128, 2048, True),
                          (256, 2048, False), (1024, 2048, False), (512, 512, False), (256, 512, True)):
        variants[f"bf16: blocked GEMMs rows {rb} keys {kt}{' +compiled softmax' if fused else ''}"] = \
            blocked(rb, kt, fused)
    ref, _ = att._prefix_part(q32, k32, v32, scale)
    o, _ = prefix_attention_bf16(qb, kb, vb, scale)
    print(f"bf16 blocked vs fp32: max |diff| {(o - ref).abs().max().item():.2e}")
    try:
        report(f"prefix attention: {Tg} tokens x {Hq}/{Hkv} heads x d {d} against {P} keys",
               interleaved(variants, args.rounds), gflop=4.0 * Tg * Hq * d * P / 1e9)
    finally:
        bf16_attn.COMPILE_SOFTMAX = False


def _runner_pass(dtype, compile_layers: bool, quick: bool, layers: int):
    from acarerank.model import Qwen3Runner
    from acarerank.model.default import build_default_model

    kw = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32) if quick else dict(num_hidden_layers=layers)
    runner = Qwen3Runner.from_hf(build_default_model("tiny-cpu", seed=0, dtype=dtype, **kw),
                                 compile_layers=compile_layers)
    g = torch.Generator().manual_seed(0)
    P, T = (100, 64) if quick else (1650, 2048)
    cache = runner.prefill([torch.randint(0, 100000, (P,), generator=g)])
    segs = [torch.randint(0, 100000, (T // 8,), generator=g) for _ in range(8)]
    return lambda: runner.forward(cache, segs, [0] * 8, output="last")


def bench_layer(args) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        eager = _runner_pass(dtype, False, args.quick, args.layers)
        comp = _runner_pass(dtype, True, args.quick, args.layers)
        t0 = time.perf_counter()
        comp()
        print(f"\n{dtype}: torch.compile of the two layer halves took {time.perf_counter() - t0:.1f} s (first pass)")
        report(f"runner pass, {dtype}, eager vs compiled layer halves",
               interleaved({"eager": eager, "torch.compile": comp}, args.rounds))


def bench_e2e(args) -> None:
    import acarerank.ops.cpu_attention_bf16 as bf16_attn
    from acarerank import PointwiseReranker
    from acarerank.benchmark.workload import WorkloadSpec, make_workload
    from acarerank.model import Qwen3Runner
    from acarerank.model.default import build_default_model
    from acarerank.tokenizer import load_qwen3_tokenizer

    tok = load_qwen3_tokenizer()
    spec = WorkloadSpec(num_docs=args.depth, **(dict(trace_tokens=100, doc_tokens=(10, 30)) if args.quick else {}))
    w = make_workload(tok, spec)
    ctx, docs = w.context("M3"), w.docs(args.depth)
    kw = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32) if args.quick else {}
    m32 = build_default_model("tiny-cpu", seed=0, **kw)
    mbf = build_default_model("tiny-cpu", seed=0, dtype=torch.bfloat16, **kw)

    def scorer(model, enabled, compile_layers=False):
        rr = PointwiseReranker(runner=Qwen3Runner.from_hf(model, compile_layers=compile_layers), tokenizer=tok)

        def call():
            bf16_attn.ENABLED = enabled
            return rr.score(documents=docs, **ctx)
        return call

    variants = {"fp32": scorer(m32, None), "bf16, fp32 prefix attention (old)": scorer(mbf, False),
                "bf16, bf16 blocked prefix attention": scorer(mbf, True),
                "bf16, bf16 attention + compiled layers": scorer(mbf, True, True)}
    t0 = time.perf_counter()
    variants["bf16, bf16 attention + compiled layers"]()
    print(f"compile + first call: {time.perf_counter() - t0:.1f} s")
    try:
        report(f"PointwiseReranker.score M3 depth {args.depth}", interleaved(variants, args.rounds))
    finally:
        bf16_attn.ENABLED = None


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
