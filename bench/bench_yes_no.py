"""Benchmark: the fused yes/no head vs the torch backend vs the full-logits head it replaces.

Default shape = Qwen3-4B (hidden 2,560, vocabulary 151,669), 100 segments (depth 100), bf16,
on GPU. Providers, on the same last hidden states:

  triton       ``yes_no_score(backend="triton")``: RMSNorm + one dot with w_yes − w_no + sigmoid, one kernel
  torch        ``yes_no_score(backend="torch")``: the same formula in a few PyTorch ops
  full_logits  final RMSNorm + lm_head over the whole vocabulary + softmax over [no, yes]
               (the transformers / model-card path: [S, V] logits)

Reported (``acarerank.benchmark.measure.time_ms``): median / 20% / 80% ms, GB/s of the bytes each provider must read at least
(hidden states + the weight rows it touches), ``x_triton`` = provider time / triton time,
and the max |score − triton score|. ``--quick``: tiny shapes, fp32, CPU under
TRITON_INTERPRET=1 (exercise only). CSV with machine and versions.

    python bench/bench_yes_no.py            # GPU
    python bench/bench_yes_no.py --quick    # CPU smoke run
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

QUICK = dict(segments=8, hidden=64, vocab=1000, dtype="float32")
FULL = dict(segments=100, hidden=2560, vocab=151669, dtype="bfloat16")
YES, NO = 9693, 2152


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, CPU interpreter allowed (smoke run)")
    p.add_argument("--segments", type=int, help="rows scored (documents)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--csv", type=Path, default=None, help="CSV path (default results/bench_yes_no/yes_no[_quick].csv)")
    args = p.parse_args(argv)
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for name in ("segments", "hidden", "vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.csv is None:
        args.csv = Path("results") / "bench_yes_no" / ("yes_no_quick.csv" if args.quick else "yes_no.csv")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from acarerank.benchmark.measure import kernel_bench_device, machine_info, time_ms
    from acarerank.benchmark.report import write_csv

    dev = kernel_bench_device(args.quick)  # before acarerank.kernels is imported: sets TRITON_INTERPRET on CPU
    if dev is None:
        return 2
    on_gpu = dev == "cuda"
    from acarerank.ops import yes_no_score

    dtype = getattr(torch, args.dtype)
    S, H, V = args.segments, args.hidden, args.vocab
    yes, no = (YES, NO) if V > YES else (V - 1, V - 2)
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(S, H, generator=gen, device=dev).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(H, generator=gen, device=dev)).to(dtype)
    lm_head = (0.02 * torch.randn(V, H, generator=gen, device=dev)).to(dtype)
    eps = 1e-6
    w_yes, w_no = lm_head[yes], lm_head[no]

    def full_logits():
        h = hidden.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype) * norm_w  # transformers' Qwen3RMSNorm
        logits = h @ lm_head.T  # [S, V]
        return torch.stack([logits[:, no], logits[:, yes]], -1).float().softmax(-1)[:, 1]

    esz = hidden.element_size()
    providers = {
        "triton": (lambda: yes_no_score(hidden, norm_w, w_yes, w_no, eps=eps, backend="triton")[0], (S * H + 3 * H) * esz),
        "torch": (lambda: yes_no_score(hidden, norm_w, w_yes, w_no, eps=eps, backend="torch")[0], (S * H + 3 * H) * esz),
        "full_logits": (full_logits, (S * H + H + V * H) * esz),
    }
    ours = providers["triton"][0]()
    rows = []
    for name, (fn, nbytes) in providers.items():
        t = time_ms(fn, dev)
        rows.append(dict(provider=name, ms=t.median, ms_p20=t.p(20), ms_p80=t.p(80), gb_per_s=nbytes / t.median / 1e6,
                         max_abs_score_diff_vs_triton=(t.result.float() - ours).abs().max().item()))
    for r in rows:
        r["x_triton"] = r["ms"] / rows[0]["ms"]

    info = machine_info(dev)
    if not on_gpu:
        info["device_name"] += " (TRITON_INTERPRET=1)"
    meta = dict(info, dtype=args.dtype, segments=S, hidden=H, vocab=V)
    cols = ["provider", "ms", "ms_p20", "ms_p80", "gb_per_s", "x_triton", "max_abs_score_diff_vs_triton"]
    write_csv([{**r, **meta} for r in rows], args.csv, cols + list(meta))
    print(f"# {info['device_name']}; torch {info['torch']}, triton {info['triton']}; {args.dtype}; S={S} H={H} V={V}")
    print(f"{'provider':<13}{'ms':>10}{'p20':>10}{'p80':>10}{'GB/s':>10}{'x_triton':>10}{'max|Δscore|':>13}")
    for r in rows:
        print(f"{r['provider']:<13}{r['ms']:>10.4f}{r['ms_p20']:>10.4f}{r['ms_p80']:>10.4f}{r['gb_per_s']:>10.2f}"
              f"{r['x_triton']:>10.2f}{r['max_abs_score_diff_vs_triton']:>13.2e}")
    print(f"CSV: {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
