"""Benchmark: top-k truncated teacher log-probs (``topk_logprobs``) vs the materialised-logits path and a bare GEMM.

Default shape: one query's ATO re-scoring on CPU — 8 rollouts × 64 tokens = 512 rows,
hidden 1,024, vocabulary 151,669, k = 128, fp32. On a GPU: 16 queries (8,192 rows), hidden
4,096, bf16. Providers, on the same inputs in one run:

  gemm          ``hidden @ weight.T`` and nothing else — the time yardstick (target: ≤ 1.2×)
  materialised  logits = hidden @ weight.T, then topk, logsumexp and gathers on [T, V] — the
                memory yardstick (target: peak extra memory ≤ 5 %)
  torch, native, cpp, triton, cuda
                ``topk_logprobs(backend=...)`` (native on CPU where acarerank._cpu is built: on
                bf16 its chunk GEMM is csrc/cpu/logits_gemm.cpp where the CPU has AVX512_BF16,
                and after the first chunk csrc/cpu/topk_gemm_update.cpp: GEMM and merge per L2 block;
                triton/cuda on GPU; triton on CPU only in --quick mode, under TRITON_INTERPRET=1)

Time (``acarerank.benchmark.measure.time_ms``): median / 20 % / 80 % wall-clock ms of
--repeats runs after a warm-up, and the median CPU time of the process over the same runs
(less sensitive to other load on a shared machine). GPU: ``triton.testing.do_bench``.

Memory ("peak extra" = bytes live at the peak of the call minus bytes live before it; the
inputs are not counted, the outputs are; ``measure``), measured two ways on CPU:
  alloc  torch's own allocation events (``torch.profiler`` with profile_memory=True, CPU
         tensors included), summed in time order: exact tensor bytes, no allocator caching;
  rss    each provider in a fresh subprocess: peak resident set (VmHWM, reset through
         /proc/self/clear_refs once the inputs exist) minus the RSS before the call — what
         the OS sees, malloc's own overheads included (--no-rss skips it).
GPU: torch.cuda.max_memory_allocated() − memory_allocated() before the call.

CSV (one row per provider, with machine and versions) and a printed table with the two
target ratios: time / gemm time, peak extra / materialised peak extra.

    python bench/bench_topk_logprobs.py            # the default CPU shape (~1–2 min on 2 cores)
    python bench/bench_topk_logprobs.py --quick    # tiny shapes, seconds
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

QUICK = dict(rows=32, hidden=64, vocab=4099, k=16, dtype="float32", repeats=2)
CPU_FULL = dict(rows=512, hidden=1024, vocab=151669, k=128, dtype="float32", repeats=3)
GPU_FULL = dict(rows=8192, hidden=4096, vocab=151669, k=128, dtype="bfloat16", repeats=0)
TIME_TARGET, MEM_TARGET = 1.2, 0.05
COLUMNS = ["provider", "rows", "hidden", "vocab", "k", "dtype", "device", "threads", "median_ms", "p20_ms", "p80_ms",
           "cpu_ms", "time_vs_gemm", "alloc_extra_mb", "rss_extra_mb", "alloc_vs_materialised",
           "rss_vs_materialised", "max_abs_logprob_diff", "ids_equal", "note", "device_name", "python", "torch",
           "triton", "transformers", "acarerank", "machine"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (smoke run)")
    for name in ("rows", "hidden", "vocab", "k", "repeats"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--providers", default=None, help="comma list (default: all that run here)")
    p.add_argument("--no-rss", action="store_true", help="skip the per-provider subprocess RSS measurement")
    p.add_argument("--csv", type=Path, default=None)
    p.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _fill_defaults(args, on_gpu):
    base = QUICK if args.quick else (GPU_FULL if on_gpu else CPU_FULL)
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.csv is None:
        args.csv = Path("results") / "bench_topk_logprobs" / ("topk_logprobs_quick.csv" if args.quick else "topk_logprobs.csv")
    return args


# ----------------------------------------------------------------------------- providers
def providers(names, k, temperature):
    import torch

    from acarerank.ops import topk_logprobs

    def gemm(h, w, tg):
        return h @ w.T

    def materialised(h, w, tg):
        z = (h @ w.T).float()
        if temperature != 1.0:
            z.div_(temperature)
        top = z.topk(k, dim=1)
        lse = torch.logsumexp(z, dim=1)
        lse_k = torch.logsumexp(top.values, dim=1)
        tz = z.gather(1, tg[:, None]).squeeze(1)
        inside = (top.indices == tg[:, None]).any(1)
        return torch.where(inside, tz - lse_k, torch.full_like(tz, -20.0)), top.indices, lse

    table = {"gemm": gemm, "materialised": materialised}
    for b in ("torch", "native", "cpp", "triton", "cuda"):
        table[b] = (lambda b: lambda h, w, tg: topk_logprobs(h, w, tg, k=k, temperature=temperature, backend=b))(b)
    return {n: table[n] for n in names}


def default_provider_names(on_gpu, quick):
    names = ["gemm", "materialised", "torch"]
    from acarerank.ops import _native

    if not on_gpu and _native.available():
        names.append("native")
    try:
        import acarerank._C  # noqa: F401
        names.append("cpp" if not on_gpu else "cuda")
    except ImportError:
        pass
    if on_gpu or quick:
        names.append("triton")
    return names


def child_main(args):
    """--rss-child PROVIDER: build the inputs, warm up on a tiny shape, measure one call."""
    import torch

    from acarerank.benchmark.measure import rss_peak_extra_mb
    from acarerank.benchmark.projection import make_inputs

    if args.threads:
        torch.set_num_threads(args.threads)
    fn = providers([args.rss_child], args.k, args.temperature)[args.rss_child]
    dtype = getattr(torch, args.dtype)
    small = make_inputs(8, args.hidden, max(args.k, 256), dtype, "cpu")
    fn(*small)  # one-time allocations (thread pools, lazy imports) happen here, not in the measurement
    h, w, tg = make_inputs(args.rows, args.hidden, args.vocab, dtype, "cpu")
    print(json.dumps({"rss_extra_mb": rss_peak_extra_mb(lambda: fn(h, w, tg))}))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from acarerank.benchmark.measure import kernel_bench_device

    on_gpu = kernel_bench_device(args.quick, cpu_default_shape=True) == "cuda"
    _fill_defaults(args, on_gpu)
    if args.rss_child:
        return child_main(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    from acarerank.benchmark.measure import PeakMemory, alloc_peak_extra, machine_info, rss_in_subprocess, time_ms
    from acarerank.benchmark.projection import add_ratios, make_inputs
    from acarerank.benchmark.report import write_csv

    device = "cuda" if on_gpu else "cpu"
    dtype = getattr(torch, args.dtype)
    names = args.providers.split(",") if args.providers else default_provider_names(on_gpu, args.quick)
    fns = providers(names, args.k, args.temperature)
    h, w, tg = make_inputs(args.rows, args.hidden, args.vocab, dtype, device)
    info = machine_info(device)
    print(f"topk_logprobs: T={args.rows} H={args.hidden} V={args.vocab} k={args.k} {args.dtype} on {device} "
          f"({info['device_name']}), threads={torch.get_num_threads()}", flush=True)

    results, ref = {}, None
    for name in names:
        fn = fns[name]
        row = dict(provider=name, note="")
        try:
            if on_gpu:
                meter = PeakMemory(device)
                meter.start()
                out = fn(h, w, tg)
                row["alloc_extra_mb"] = meter.stop()
                t = time_ms(lambda: fn(h, w, tg), device)
                row.update(median_ms=t.median, p20_ms=t.p(20), p80_ms=t.p(80), cpu_ms="")
            else:
                out, peak = alloc_peak_extra(lambda: fn(h, w, tg))
                row["alloc_extra_mb"] = peak / 2 ** 20
                t = time_ms(lambda: fn(h, w, tg), device, repeats=args.repeats)
                row.update(median_ms=t.median, p20_ms=t.p(20), p80_ms=t.p(80), cpu_ms=t.cpu_median)
                if not args.no_rss and name != "triton":  # the interpreter's numpy buffers are not the op's
                    child = ["--rss-child", name, "--rows", str(args.rows), "--hidden", str(args.hidden), "--vocab",
                             str(args.vocab), "--k", str(args.k), "--dtype", args.dtype,
                             "--temperature", str(args.temperature)] + (["--threads", str(args.threads)] if args.threads else [])
                    row["rss_extra_mb"] = rss_in_subprocess(os.path.abspath(__file__), child)
        except Exception as e:  # a provider that cannot run here is reported, not fatal
            row["note"] = f"skipped: {type(e).__name__}: {str(e)[:120]}"
            results[name] = row
            print(f"  {name:12s} {row['note']}", flush=True)
            continue
        if name == "materialised":
            ref = out
        elif name != "gemm" and ref is not None:
            row["max_abs_logprob_diff"] = float((out.target_logprob.float() - ref[0].float()).abs().max())
            row["ids_equal"] = bool(torch.equal(out.topk_ids.cpu(), ref[1].cpu()))
        results[name] = row
        print(f"  {name:12s} {row['median_ms']:10.1f} ms  cpu {row.get('cpu_ms') or 0:10.1f} ms  "
              f"alloc +{row['alloc_extra_mb']:9.1f} MB  rss +{row.get('rss_extra_mb', float('nan')):9.1f} MB", flush=True)

    add_ratios(results, "gemm", "time_vs_gemm", "{kind}_vs_materialised")
    common = dict(rows=args.rows, hidden=args.hidden, vocab=args.vocab, k=args.k, dtype=args.dtype, device=device,
                  threads=torch.get_num_threads(), **info)
    write_csv([{**row, **common} for row in results.values()], args.csv, COLUMNS)
    print(f"\n{'provider':12s} {'time/gemm':>10s} {'alloc/mat':>10s} {'rss/mat':>10s}   targets: time ≤ {TIME_TARGET}×, "
          f"memory ≤ {MEM_TARGET:.0%}")
    for name, row in results.items():
        def fmt(v, pct=False):
            return "" if v in (None, "") else (f"{v:.1%}" if pct else f"{v:.2f}")
        print(f"{name:12s} {fmt(row.get('time_vs_gemm')):>10s} {fmt(row.get('alloc_vs_materialised'), True):>10s} "
              f"{fmt(row.get('rss_vs_materialised'), True):>10s}  {row.get('note', '')}")
    print(f"CSV: {args.csv}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
