"""Benchmark: one-pass Triton prefix-shared attention vs the alternatives.

Default shape = Qwen3-4B attention (32 query / 8 KV heads, head_dim 128), one 4,096-token
prefix, 100 segments of 512 tokens, bf16, on GPU. Providers, all on the same inputs:

  triton          ours: ``prefix_shared_attention(backend="triton")``, one launch, one pass; its
                  plan (``plan_prefix_shared_attention``: the work list) built once before timing
  flash_cascade   the FlashAttention-2 cascade as a serving stack runs it: its plan (query
                  order, cumulative lengths: ``plan_flash_cascade``) built once before timing,
                  as once per forward for all layers; timed: ``run_flash_cascade`` = prefix
                  pass + own pass + merge, device work only (no host sync, no copies)
  flash_cascade_per_call   ``backend="flash_attn_cascade"`` through the public op: plan + run
                  on every call (one host sync per call) — only with --providers
  flash_unshared  FlashAttention-2 varlen on the 100 *unshared* sequences prefix ++ segment
                  (causal), what a server without prefix sharing runs (its prefix rows are
                  wasted work); inputs packed before timing
  torch           ``backend="torch"``: the PyTorch CPU production path (planned likewise)
  ref             ``prefix_shared_attention_ref`` (per-segment loop; only with --ref or --quick)

FlashAttention-2 is flash-attn's ``flash_attn_varlen_func`` when installed, else PyTorch's
own build of the same kernel (``acarerank.ops.cascade.VARLEN_KERNEL`` says which; printed in
the cascade's note with the backend of its merge: "cuda" = acarerank._C's kernel).

Steps of ``main``: ``make_inputs`` -> ``cascade_kernels`` -> ``build_providers`` ->
``check_correctness`` -> ``time_providers`` -> ``report``.

Correctness first (skip with --no-check): on the first few segments, every provider's
output against the fp32 reference, flash-attn's rule: error <= 2 x the error of plain
PyTorch attention in the same dtype + 2 fp32 rounding steps (fp32 inputs: + 1e-5). A provider that breaks it,
or raises, makes the script exit 1 (after the others ran and the CSV was written).

TFLOP/s are counted on the *shared* FLOPs for every provider (4·Hq·d·Σ_s(L·P + L(L+1)/2)),
so they compare time for the same useful work; at the default shape the unshared form does
4.8x those FLOPs. ``x_triton`` = provider time / triton time (> 1: ours is faster).
GPU targets: x_triton >= 4 for flash_unshared, >= 0.9 for flash_cascade (printed).

Timing: ``acarerank.benchmark.measure.time_ms`` (GPU: triton's do_bench; CPU: a
perf_counter median over a few runs); median and 20/80 % percentiles, ms. ``--quick``:
tiny shapes, fp32, one timed call each, under TRITON_INTERPRET=1 on CPU in seconds
(exercise only, the numbers mean nothing).

    python bench/bench_attention.py                 # GPU, default shape, CSV to results/bench_attention/
    python bench/bench_attention.py --quick         # CPU smoke run (sets TRITON_INTERPRET=1)
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

QUICK = dict(num_heads=4, num_kv_heads=2, head_dim=32, prefix=64, segments=4, seg_len=16, dtype="float32")
FULL = dict(num_heads=32, num_kv_heads=8, head_dim=128, prefix=4096, segments=100, seg_len=512, dtype="bfloat16")
PROVIDERS = ("triton", "flash_cascade", "flash_cascade_per_call", "flash_unshared", "torch", "ref")
TARGETS = {"flash_unshared": 4.0, "flash_cascade": 0.9}   # minimum x_triton on a GPU
CHECK_SEGMENTS = 4                                         # segments compared with the fp32 reference


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
                   help=f"comma list from {', '.join(PROVIDERS)}")
    p.add_argument("--ref", action="store_true", help="also time the per-segment reference loop")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check against the fp32 reference")
    p.add_argument("--require-cuda-merge", action="store_true",
                   help="exit 1 unless the cascade merges with the CUDA kernel of acarerank._C (bench/gpu_check.sh: "
                        "a torch merge would flatter the one-pass kernel)")
    p.add_argument("--csv", type=Path, default=None,
                   help="CSV path (default results/bench_attention/attention[_quick].csv)")
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
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
    args.providers = [x.strip() for x in args.providers.split(",") if x.strip()]
    unknown = set(args.providers) - set(PROVIDERS)
    if unknown:
        p.error(f"unknown providers: {', '.join(sorted(unknown))}; known: {', '.join(PROVIDERS)}")
    if "triton" not in args.providers:
        p.error("the triton provider is required (ratios are relative to it)")
    args.providers = ["triton"] + [x for x in args.providers if x != "triton"]
    if (args.ref or args.quick) and "ref" not in args.providers:
        args.providers.append("ref")
    if args.csv is None:
        args.csv = Path("results") / "bench_attention" / ("attention_quick.csv" if args.quick else "attention.csv")
    return args


def plain_attention(q, k, v, cu, pk, pv, cp, sg, scale):
    """Plain PyTorch attention in the inputs' dtype (no fp32 upcast): the error yardstick."""
    import torch

    out = torch.empty_like(q)
    r = q.shape[1] // k.shape[1]
    cs, cps, sgs = cu.tolist(), cp.tolist(), sg.tolist()
    for s in range(len(sgs)):
        a, b, g = cs[s], cs[s + 1], sgs[s]
        if a == b:
            continue
        P = cps[g + 1] - cps[g]
        keys = torch.cat([pk[cps[g]:cps[g + 1]], k[a:b]]).repeat_interleave(r, 1).transpose(0, 1)
        vals = torch.cat([pv[cps[g]:cps[g + 1]], v[a:b]]).repeat_interleave(r, 1).transpose(0, 1)
        mask = torch.ones(b - a, P + b - a, dtype=torch.bool, device=q.device).tril(diagonal=P)
        s_ = (q[a:b].transpose(0, 1) @ keys.transpose(1, 2)) * scale
        p_ = s_.masked_fill(~mask, float("-inf")).softmax(-1)
        out[a:b] = (p_ @ vals).transpose(0, 1)
    return out


@dataclass
class Inputs:
    """One benchmark problem: a single group (one prefix) and S segments of L tokens."""
    q: object
    k: object
    v: object
    cu: object
    pk: object
    pv: object
    cp: object
    sg: object
    rnd: object          # rnd(*shape) -> random tensor in the benchmark dtype on the device
    scale: float
    shared_flops: int

    @property
    def packed(self):
        return (self.q, self.k, self.v, self.cu, self.pk, self.pv, self.cp, self.sg)


def make_inputs(args, dev: str) -> Inputs:
    """Random q/k/v and one prefix of args.prefix tokens shared by args.segments segments."""
    import torch

    from acarerank.kernels.prefix_shared_attention import flops

    dtype = getattr(torch, args.dtype)
    Hq, Hkv, d, P, S, L = args.num_heads, args.num_kv_heads, args.head_dim, args.prefix, args.segments, args.seg_len
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)  # noqa: E731
    q, k, v = rnd(S * L, Hq, d), rnd(S * L, Hkv, d), rnd(S * L, Hkv, d)
    pk, pv = rnd(P, Hkv, d), rnd(P, Hkv, d)
    cu = torch.arange(0, S * L + 1, L, dtype=torch.int32, device=dev)
    cp = torch.tensor([0, P], dtype=torch.int32, device=dev)
    sg = torch.zeros(S, dtype=torch.int32, device=dev)
    return Inputs(q, k, v, cu, pk, pv, cp, sg, rnd, d ** -0.5, flops(cu, cp, sg, Hq, d))


def cascade_kernels(on_gpu: bool, dtype) -> tuple:
    """(cascade module or None, note naming the FlashAttention-2 kernel and the merge backend,
    why the flash providers cannot run or None)."""
    import torch

    from acarerank.ops import available_backends

    try:
        from acarerank.ops import cascade
    except ImportError as e:
        return None, "", f"no FlashAttention-2 kernel: {e}"
    if not on_gpu or dtype == torch.float32:
        return cascade, cascade.VARLEN_KERNEL, "needs CUDA and fp16/bf16"
    # the cascade's merge runs the op's device default: the CUDA kernel of acarerank._C when built
    merge = available_backends("merge_attention_states", "cuda")[0]
    return cascade, f"{cascade.VARLEN_KERNEL}; merge: {merge}", None


def build_providers(args, inp: Inputs, dev: str, cascade, kernel_note: str, cascade_why) -> tuple:
    """({provider: (fn, pick)}, {provider: note}); pick maps a provider's output to our rows (or None)."""
    import torch

    from acarerank.ops import (BackendError, plan_prefix_shared_attention, prefix_shared_attention,
                               prefix_shared_attention_ref)

    dtype = getattr(torch, args.dtype)
    Hq, Hkv, d, P, S, L = args.num_heads, args.num_kv_heads, args.head_dim, args.prefix, args.segments, args.seg_len
    q, k, v, cu, pk, pv, cp, sg = inp.packed
    fns, notes = {}, {}
    for name in args.providers:
        if name in ("flash_cascade", "flash_cascade_per_call", "flash_unshared") and cascade_why:
            notes[name] = cascade_why
        elif name in ("triton", "torch"):  # planned once, before timing, as once per forward for all layers
            plan_ours = plan_prefix_shared_attention(cu, cp, sg, num_tokens=S * L, num_q_heads=Hq, num_kv_heads=Hkv,
                                                     head_dim=d, dtype=dtype, backend=name)
            fns[name] = ((lambda p=plan_ours: prefix_shared_attention(q, k, v, prefix_k=pk, prefix_v=pv, plan=p)),
                         None)
        elif name == "ref":
            fns[name] = (lambda: prefix_shared_attention_ref(*inp.packed), None)
        elif name == "flash_cascade":
            plan = cascade.plan_flash_cascade(cu, cp, sg, q.shape[0])   # once, before timing
            fns[name] = (lambda: cascade.run_flash_cascade(plan, q, k, v, pk, pv, inp.scale), None)
            notes[name] = kernel_note
        elif name == "flash_cascade_per_call":
            try:
                prefix_shared_attention(*inp.packed, backend="flash_attn_cascade", validate=False)
            except BackendError as e:
                notes[name] = str(e)
                continue
            fns[name] = (lambda: prefix_shared_attention(*inp.packed, backend="flash_attn_cascade",
                                                         validate=False), None)
            notes[name] = kernel_note
        elif name == "flash_unshared":
            # packed before timing: every sequence is prefix ++ segment; rows P.. are the segment's
            cat = lambda pre, own: torch.cat([torch.cat([pre, own[s * L:(s + 1) * L]]) for s in range(S)])  # noqa: E731
            uq, uk, uv = cat(inp.rnd(P, Hq, d), q), cat(pk, k), cat(pv, v)
            ucu = torch.arange(0, S * (P + L) + 1, P + L, dtype=torch.int32, device=dev)
            rows = torch.cat([torch.arange(s * (P + L) + P, (s + 1) * (P + L), device=dev) for s in range(S)])
            fns[name] = ((lambda: cascade.varlen_attention(uq, uk, uv, ucu, ucu, P + L, P + L, inp.scale,
                                                           causal=True)[0]),
                         (lambda out: out[rows]))
            notes[name] = kernel_note
    return fns, notes


def check_correctness(args, inp: Inputs, fns: dict, notes: dict, on_gpu: bool) -> tuple:
    """The first CHECK_SEGMENTS segments of every provider against the fp32 reference (flash-attn's
    2x rule). Drops providers that raise. Returns ({provider: max error}, [failed providers])."""
    import torch

    from acarerank.ops import prefix_shared_attention_ref

    dtype = getattr(torch, args.dtype)
    q, k, v, cu, pk, pv, cp, sg = inp.packed
    n_seg = min(args.segments, CHECK_SEGMENTS)
    n_chk = n_seg * args.seg_len
    sub = (q[:n_chk], k[:n_chk], v[:n_chk], cu[:n_seg + 1], pk, pv, cp, sg[:n_seg])
    want = prefix_shared_attention_ref(*(t.float() if t.is_floating_point() else t for t in sub))
    err_plain = (plain_attention(*sub, inp.scale).float() - want).abs().max().item()
    # half precision: 2 fp32 rounding steps near the outputs; fp32 (plain == reference): the 1e-5 contract
    atol = 2 * (want + 0.3 - 0.3 - want).abs().max().item() if dtype != torch.float32 else 1e-5
    bound = 2 * err_plain + atol
    errors, failed = {}, []
    for name, (fn, pick) in list(fns.items()):
        try:
            out = fn()
        except Exception as e:  # one provider's failure must not hide the others' figures
            print(f"correctness {name:<23} FAILED: {type(e).__name__}: {e}", flush=True)
            failed.append(name)
            notes[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
            del fns[name]
            continue
        out = (pick(out) if pick else out)[:n_chk].float()
        errors[name] = err = (out - want).abs().max().item()
        ok = err <= bound and math.isfinite(err)
        print(f"correctness {name:<23} max|err| {err:.3e} vs bound {bound:.3e} "
              f"(2 x plain {args.dtype} {err_plain:.3e} + {atol:.1e}): {'OK' if ok else 'FAILED'}", flush=True)
        if not ok:
            failed.append(name)
    if on_gpu:
        torch.cuda.empty_cache()
    return errors, failed


def time_providers(args, inp: Inputs, fns: dict, notes: dict, errors: dict, dev: str) -> tuple:
    """One row per provider (triton first: the others are compared with its output); ([rows], [failed])."""
    import torch

    from acarerank.benchmark.measure import time_ms

    rows, failed, ours = [], [], None
    for name in args.providers:
        if name not in fns:
            rows.append(dict(provider=name, note=notes.get(name, "")))
            continue
        fn, pick = fns[name]
        try:
            t = time_ms(fn, dev, repeats=1 if args.quick else 5, warmup=0 if args.quick else 1)
        except Exception as e:  # reported in its row; the run goes on
            failed.append(name)
            rows.append(dict(provider=name, note=f"error: {type(e).__name__}: {str(e)[:200]}"))
            continue
        out = (pick(t.result) if pick else t.result).float()
        if name == "triton":
            ours = out
        med = t.median
        rows.append(dict(provider=name, ms=med, ms_p20=t.p(20), ms_p80=t.p(80),
                         shared_tflops=inp.shared_flops / med / 1e9,
                         max_abs_diff_vs_triton=(out - ours).abs().max().item() if ours is not None else math.nan,
                         max_abs_err_vs_fp32_ref=errors.get(name, ""), note=notes.get(name, "")))
        del out, t
        if dev == "cuda":
            torch.cuda.empty_cache()
    t_ours = next((r["ms"] for r in rows if r["provider"] == "triton" and "ms" in r), math.nan)
    for r in rows:
        if "ms" in r:
            r["x_triton"] = r["ms"] / t_ours
    return rows, failed


def report(args, inp: Inputs, rows: list, dev: str) -> None:
    """The CSV (with the machine and the shape on every row), the table and the target lines."""
    from acarerank.benchmark.measure import machine_info
    from acarerank.benchmark.report import write_csv

    on_gpu = dev == "cuda"
    Hq, Hkv, d, P, S, L = args.num_heads, args.num_kv_heads, args.head_dim, args.prefix, args.segments, args.seg_len
    info = machine_info(dev)
    if not on_gpu:
        info["device_name"] += " (TRITON_INTERPRET=1)"
    meta = dict(info, dtype=args.dtype, num_heads=Hq, num_kv_heads=Hkv, head_dim=d, prefix=P, segments=S, seg_len=L,
                shared_gflop=inp.shared_flops / 1e9,
                unshared_flop_ratio=(S * (P + L) * (P + L + 1) / 2) / (S * (L * P + L * (L + 1) / 2)))
    cols = ["provider", "ms", "ms_p20", "ms_p80", "shared_tflops", "x_triton", "max_abs_diff_vs_triton",
            "max_abs_err_vs_fp32_ref", "note"]
    write_csv([{**r, **meta} for r in rows], args.csv, cols + list(meta))

    print(f"# {info['device_name']}; torch {info['torch']}, triton {info['triton']}; {args.dtype}; Hq={Hq} Hkv={Hkv} "
          f"d={d} prefix={P} segments={S}x{L}; shared {inp.shared_flops / 1e9:.1f} GFLOP "
          f"(unshared {meta['unshared_flop_ratio']:.2f}x)")
    print(f"{'provider':<24}{'ms':>10}{'p20':>10}{'p80':>10}{'TFLOP/s':>10}{'x_triton':>10}{'max|diff|':>11}  note")
    for r in rows:
        if "ms" in r:
            print(f"{r['provider']:<24}{r['ms']:>10.3f}{r['ms_p20']:>10.3f}{r['ms_p80']:>10.3f}{r['shared_tflops']:>10.3f}"
                  f"{r['x_triton']:>10.2f}{r['max_abs_diff_vs_triton']:>11.2e}  {r['note']}")
        else:
            print(f"{r['provider']:<24}{'n/a':>10}{'':>50}  {r['note']}")
    for name, target in TARGETS.items():
        r = next((r for r in rows if r["provider"] == name and "ms" in r), None)
        verdict = ("not measured" if r is None else
                   f"{r['x_triton']:.2f}x: {'met' if r['x_triton'] >= target else 'NOT met'}")
        print(f"target: triton >= {target:g}x {name}: {verdict}{'' if on_gpu else ' (CPU: no meaning)'}")
    print(f"CSV: {args.csv}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from acarerank.benchmark.measure import kernel_bench_device

    dev = kernel_bench_device(args.quick)
    if dev is None:
        return 2
    if dev != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before acarerank.kernels is imported
    inp = make_inputs(args, dev)
    cascade, kernel_note, cascade_why = cascade_kernels(dev == "cuda", getattr(torch, args.dtype))
    failed = []
    if args.require_cuda_merge and "merge: cuda" not in kernel_note:
        print(f"FAILED: --require-cuda-merge but the cascade would merge with: {kernel_note or cascade_why}",
              file=sys.stderr)
        failed.append("flash_cascade (merge backend)")
    fns, notes = build_providers(args, inp, dev, cascade, kernel_note, cascade_why)
    errors = {}
    if not args.no_check:
        errors, bad = check_correctness(args, inp, fns, notes, dev == "cuda")
        failed += bad
    rows, bad = time_providers(args, inp, fns, notes, errors, dev)
    failed += bad
    report(args, inp, rows, dev)
    if failed:
        print(f"FAILED (correctness or run): {', '.join(dict.fromkeys(failed))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
