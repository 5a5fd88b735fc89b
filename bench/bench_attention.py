"""Benchmark: one-pass Triton prefix-shared attention vs the alternatives (issue 3, "Speed").

Default shape = Qwen3-4B attention (32 query / 8 KV heads, head_dim 128), one 4,096-token
prefix, 100 segments of 512 tokens, bf16, on GPU. Providers, all on the same inputs:

  triton          ours: ``prefix_shared_attention(backend="triton")``, one launch, one pass
  flash_cascade   ``backend="flash_attn_cascade"``: flash-attn prefix pass + own pass + merge
  flash_unshared  flash-attn varlen on the 100 *unshared* sequences prefix ++ segment (causal),
                  what a server without prefix sharing runs (its prefix rows are wasted work)
  torch           ``backend="torch"``: the PyTorch CPU production path
  ref             ``prefix_shared_attention_ref`` (per-segment loop; only with --ref or --quick)

TFLOP/s are counted on the *shared* FLOPs for every provider (4·Hq·d·Σ_s(L·P + L(L+1)/2)),
so they compare time for the same useful work; at the default shape the unshared form does
4.8x those FLOPs. ``x_triton`` = provider time / triton time (> 1: ours is faster).
GPU issue targets: x_triton >= 4 for flash_unshared, >= 0.9 for flash_cascade.

Timing: ``triton.testing.do_bench`` on GPU (median, 20/80% quantiles, ms); on CPU a
perf_counter median over a few runs. ``--quick``: tiny shapes, fp32, runs under
TRITON_INTERPRET=1 on CPU in seconds (exercise only, the numbers mean nothing).

    python bench/bench_attention.py                 # GPU, issue shape, CSV to results/bench_attention/
    python bench/bench_attention.py --quick         # CPU smoke run (sets TRITON_INTERPRET=1)
"""
from __future__ import annotations

import argparse
import csv
import os
import platform
import sys
from pathlib import Path

from _timing import time_ms  # bench/ is on sys.path when a script here runs

QUICK = dict(num_heads=4, num_kv_heads=2, head_dim=32, prefix=64, segments=4, seg_len=16, dtype="float32")
ISSUE = dict(num_heads=32, num_kv_heads=8, head_dim=128, prefix=4096, segments=100, seg_len=512, dtype="bfloat16")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, CPU interpreter allowed (smoke run)")
    p.add_argument("--num-heads", type=int)
    p.add_argument("--num-kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--prefix", type=int, help="prefix tokens (one group)")
    p.add_argument("--segments", type=int, help="segments sharing the prefix")
    p.add_argument("--seg-len", type=int, help="tokens per segment")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--providers", default="triton,flash_cascade,flash_unshared,torch",
                   help="comma list from triton, flash_cascade, flash_unshared, torch, ref")
    p.add_argument("--ref", action="store_true", help="also time the per-segment reference loop")
    p.add_argument("--csv", type=Path, default=None,
                   help="CSV path (default results/bench_attention/attention[_quick].csv)")
    args = p.parse_args(argv)
    base = QUICK if args.quick else ISSUE
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.num_heads % args.num_kv_heads:
        p.error(f"--num-heads {args.num_heads} is not a multiple of --num-kv-heads {args.num_kv_heads}")
    for name in ("num_heads", "num_kv_heads", "head_dim", "segments", "seg_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.prefix < 0:
        p.error("--prefix must be >= 0")
    if args.csv is None:
        args.csv = Path("results") / "bench_attention" / ("attention_quick.csv" if args.quick else "attention.csv")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        if not args.quick:
            print("no CUDA device: the issue shape needs a GPU; run with --quick on CPU", file=sys.stderr)
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before acarerank.kernels is imported
    import triton

    from acarerank.kernels.prefix_shared_attention import flops
    from acarerank.ops import BackendError, prefix_shared_attention, prefix_shared_attention_ref

    dev = "cuda" if on_gpu else "cpu"
    dtype = getattr(torch, args.dtype)
    Hq, Hkv, d, P, S, L = args.num_heads, args.num_kv_heads, args.head_dim, args.prefix, args.segments, args.seg_len
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)  # noqa: E731
    q, k, v = rnd(S * L, Hq, d), rnd(S * L, Hkv, d), rnd(S * L, Hkv, d)
    pk, pv = rnd(P, Hkv, d), rnd(P, Hkv, d)
    cu = torch.arange(0, S * L + 1, L, dtype=torch.int32, device=dev)
    cp = torch.tensor([0, P], dtype=torch.int32, device=dev)
    sg = torch.zeros(S, dtype=torch.int32, device=dev)
    args_shared = (q, k, v, cu, pk, pv, cp, sg)
    shared_flops = flops(cu, cp, sg, Hq, d)

    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    if (args.ref or args.quick) and "ref" not in providers:
        providers.append("ref")
    unknown = set(providers) - {"triton", "flash_cascade", "flash_unshared", "torch", "ref"}
    if unknown:
        print(f"unknown providers: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2

    def unshared_fn():
        """flash-attn varlen over prefix ++ segment for every segment (None if flash-attn is missing)."""
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError:
            return None, "flash-attn not installed"
        if not on_gpu or dtype == torch.float32:
            return None, "needs CUDA and fp16/bf16"
        cat = lambda pre, own: torch.cat([torch.cat([pre, own[s * L:(s + 1) * L]]) for s in range(S)])  # noqa: E731
        uq = cat(rnd(P, Hq, d), q)
        uk, uv = cat(pk, k), cat(pv, v)
        ucu = torch.arange(0, S * (P + L) + 1, P + L, dtype=torch.int32, device=dev)
        scale = d ** -0.5
        fn = lambda: flash_attn_varlen_func(uq, uk, uv, ucu, ucu, P + L, P + L, softmax_scale=scale, causal=True)  # noqa: E731
        # rows P.. of each sequence are the segment's: compare them with ours below
        rows = torch.cat([torch.arange(s * (P + L) + P, (s + 1) * (P + L), device=dev) for s in range(S)])
        return (fn, lambda out: out[rows]), None

    fns, notes = {}, {}
    for name in providers:
        if name == "triton":
            fns[name] = (lambda: prefix_shared_attention(*args_shared, backend="triton", validate=False), None)
        elif name == "torch":
            fns[name] = (lambda: prefix_shared_attention(*args_shared, backend="torch", validate=False), None)
        elif name == "ref":
            fns[name] = (lambda: prefix_shared_attention_ref(*args_shared), None)
        elif name == "flash_cascade":
            try:
                prefix_shared_attention(*args_shared, backend="flash_attn_cascade", validate=False)
                fns[name] = (lambda: prefix_shared_attention(*args_shared, backend="flash_attn_cascade",
                                                             validate=False), None)
            except BackendError as e:
                notes[name] = str(e)
        elif name == "flash_unshared":
            pair, why = unshared_fn()
            if pair is None:
                notes[name] = why
            else:
                fns[name] = pair

    if "triton" not in fns:
        print("the triton provider is required (ratios are relative to it)", file=sys.stderr)
        return 2
    ours = fns["triton"][0]().float()
    rows = []
    for name in providers:
        if name not in fns:
            rows.append(dict(provider=name, note=notes.get(name, "")))
            continue
        fn, pick = fns[name]
        out = fn()
        out = (pick(out) if pick else out).float()
        med, lo, hi = time_ms(fn, on_gpu, runs=3 if args.quick else 5)
        rows.append(dict(provider=name, ms=med, ms_p20=lo, ms_p80=hi, shared_tflops=shared_flops / med / 1e9,
                         max_abs_diff_vs_triton=(out - ours).abs().max().item(), note=""))
        if on_gpu:
            torch.cuda.empty_cache()
    t_ours = next(r["ms"] for r in rows if r["provider"] == "triton")
    for r in rows:
        if "ms" in r:
            r["x_triton"] = r["ms"] / t_ours

    machine = torch.cuda.get_device_name() if on_gpu else f"CPU {platform.processor() or platform.machine()} (TRITON_INTERPRET=1)"
    meta = dict(machine=machine, torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                dtype=args.dtype, num_heads=Hq, num_kv_heads=Hkv, head_dim=d, prefix=P, segments=S, seg_len=L,
                shared_gflop=shared_flops / 1e9, unshared_flop_ratio=(S * (P + L) * (P + L + 1) / 2) / (S * (L * P + L * (L + 1) / 2)))
    cols = ["provider", "ms", "ms_p20", "ms_p80", "shared_tflops", "x_triton", "max_abs_diff_vs_triton", "note"]
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols + list(meta))
        w.writeheader()
        for r in rows:
            w.writerow({**{c: r.get(c, "") for c in cols}, **meta})

    print(f"# {machine}; torch {torch.__version__}, triton {triton.__version__}; {args.dtype}; Hq={Hq} Hkv={Hkv} d={d} "
          f"prefix={P} segments={S}x{L}; shared {shared_flops / 1e9:.1f} GFLOP (unshared {meta['unshared_flop_ratio']:.2f}x)")
    print(f"{'provider':<15}{'ms':>10}{'p20':>10}{'p80':>10}{'TFLOP/s':>10}{'x_triton':>10}{'max|diff|':>11}  note")
    for r in rows:
        if "ms" in r:
            print(f"{r['provider']:<15}{r['ms']:>10.3f}{r['ms_p20']:>10.3f}{r['ms_p80']:>10.3f}{r['shared_tflops']:>10.3f}"
                  f"{r['x_triton']:>10.2f}{r['max_abs_diff_vs_triton']:>11.2e}")
        else:
            print(f"{r['provider']:<15}{'n/a':>10}{'':>50}  {r['note']}")
    print(f"CSV: {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
