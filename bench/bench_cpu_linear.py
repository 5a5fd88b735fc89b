"""Interleaved A/B of the CPU linear layers at the Qwen3-Reranker-0.6B weight shapes: F.linear vs
weights reordered once (oneDNN, as vLLM's CPU linear and inductor's CPU freezing do; MKL packed).

Variants per (shape, rows, dtype), one call of each in turn for ``--rounds`` rounds (a load change
on a shared machine hits all alike), median / min ms, GFLOP/s, speedup over F.linear, and the
max |difference| from F.linear (0 = bitwise the same result):

  F.linear                   torch.nn.functional.linear (MKL sgemm in fp32; oneDNN/emulation in bf16)
  oneDNN reordered weight    torch.ops.mkldnn._reorder_linear_weight once, then
                             torch.ops.mkldnn._linear_pointwise(x, w_packed, None, "none", [], "")
  acarerank linear (onednn)  what the runner runs: acarerank.ops.linear on prepare_linear_weight(w, "onednn")
                             (the same oneDNN call on a weight reordered once for PACK_ROWS_HINT rows)
  MKL packed weight (fp32)   torch.ops.mkl._mkl_reorder_linear_weight once, then torch.ops.mkl._mkl_linear

Shapes (hidden 1024, 16/8 heads of 128, intermediate 3072): qkv 1024→4096, o 2048→1024,
gate_up 1024→6144, down 3072→1024; rows 512 and 2048 (or ``--rows``).

In bf16, the MLP's first half two ways as well (``gate_up+silu``), in turn: what the unfused
runner runs — ``linear`` (onednn) into [rows, 6144], then ``silu_and_mul`` — and
``gate_up_silu`` on its "native" backend (csrc/cpu/gate_up_amx.cpp: AMX tiles, SiLU·up in the
GEMM's epilogue, [rows, 3072] written), with the max |difference| between the two; n/a with the
reason where the kernel cannot run (no AMX tiles).

    python bench/bench_cpu_linear.py [--rounds 5] [--dtype float32|bfloat16|both] [--rows 512,2048] [--quick]

glibc's malloc is tuned first (``--malloc tuned``, as ``acarerank serve`` runs its passes): with
glibc as it is, an output over its mmap threshold (gate_up's [3,996, 6,144] bf16, 49 MB) is a
fresh mapping each call, and its page faults were timed as the GEMM's (gate_up's F.linear 1.37
TFLOP/s at 3,996 rows against 2.47 with the malloc tuned, on the AMX Xeon).

A variant this CPU cannot run (oneDNN's bf16 reorder needs AVX512BW/VL/DQ or AVX_NE_CONVERT)
prints the reason instead of a time. The CPU's flags and torch's version are printed first.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from acarerank import malloc_tuning
from acarerank.benchmark.measure import add_malloc_flag, timed_call
from acarerank.ops import BackendError, PackedGateUpWeight, gate_up_silu, linear, prepare_linear_weight, silu_and_mul

SHAPES = {"qkv": (1024, (16 + 8 + 8) * 128), "o": (2048, 1024), "gate_up": (1024, 2 * 3072), "down": (3072, 1024)}


def variants(x: torch.Tensor, w: torch.Tensor) -> dict:
    """{name: callable or the reason it cannot run here}; weights are reordered here, once."""
    out = {"F.linear": lambda: F.linear(x, w)}
    try:
        wd = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
        out["oneDNN reordered weight"] = lambda: torch.ops.mkldnn._linear_pointwise(x, wd, None, "none", [], "")
    except RuntimeError as e:
        out["oneDNN reordered weight"] = str(e).splitlines()[0]
    try:  # the op the runner uses: packed once with its fixed row hint (PACK_ROWS_HINT), whatever the rows
        pw = prepare_linear_weight(w, "onednn")
        out["acarerank linear (onednn)"] = lambda: linear(x, pw)
    except BackendError as e:
        out["acarerank linear (onednn)"] = str(e).splitlines()[0]
    if x.dtype == torch.float32:
        try:
            wm = torch.ops.mkl._mkl_reorder_linear_weight(w, x.shape[0])
            out["MKL packed weight"] = lambda: torch.ops.mkl._mkl_linear(x, wm, w, None, x.shape[0])
        except (RuntimeError, AttributeError) as e:
            out["MKL packed weight"] = str(e).splitlines()[0]
    return out


def run_case(name: str, k: int, n: int, rows: int, dtype: torch.dtype, rounds: int) -> list:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    vs = variants(x, w)
    runnable = {kk: f for kk, f in vs.items() if callable(f)}
    ref = F.linear(x, w).float()
    diffs = {kk: (f().float() - ref).abs().max().item() for kk, f in runnable.items()}  # also the warm-up
    times = {kk: [] for kk in runnable}
    for _ in range(rounds):
        for kk, f in runnable.items():
            times[kk].append(timed_call(f, "cpu")[1])
    gflop = 2.0 * rows * k * n / 1e9
    base = statistics.median(times["F.linear"])
    print(f"\n{name} {k}->{n}, rows {rows}, {dtype}: {gflop:.2f} GFLOP per call")
    rows_out = []
    for kk, f in vs.items():
        if not callable(f):
            print(f"  {kk:<26} n/a: {f}")
            continue
        med = statistics.median(times[kk])
        print(f"  {kk:<26} median {med * 1e3:8.2f} ms  min {min(times[kk]) * 1e3:8.2f} ms  {gflop / med:7.1f} GFLOP/s"
              f"  {base / med:5.2f}x  max|diff| {diffs[kk]:.1e}")
        rows_out.append((name, rows, str(dtype), kk, med, gflop / med, diffs[kk]))
    return rows_out


def run_gate_up_silu(rows: int, rounds: int) -> None:
    """The MLP's first half at the gate_up shape in bf16: unfused (linear + silu_and_mul) vs fused."""
    k, n = SHAPES["gate_up"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16)
    print(f"\ngate_up+silu {k}->{n}->{n // 2}, rows {rows}, torch.bfloat16: {2.0 * rows * k * n / 1e9:.2f} GFLOP per call")
    try:
        unfused_w, fused_w = prepare_linear_weight(w, "onednn"), PackedGateUpWeight(w)
    except BackendError as e:
        print(f"  n/a: {str(e).splitlines()[0]}")
        return
    fs = {"linear + silu_and_mul": lambda: silu_and_mul(linear(x, unfused_w)),
          "gate_up_silu (fused)": lambda: gate_up_silu(x, fused_w)}
    diff = (fs["gate_up_silu (fused)"]().float() - fs["linear + silu_and_mul"]().float()).abs().max().item()
    times = {kk: [] for kk in fs}
    for _ in range(rounds):
        for kk, f in fs.items():
            times[kk].append(timed_call(f, "cpu")[1])
    base = statistics.median(times["linear + silu_and_mul"])
    for kk in fs:
        med = statistics.median(times[kk])
        print(f"  {kk:<26} median {med * 1e3:8.2f} ms  min {min(times[kk]) * 1e3:8.2f} ms  "
              f"{2.0 * rows * k * n / 1e9 / med:7.1f} GFLOP/s  {base / med:5.2f}x")
    print(f"  max|diff| fused vs unfused {diff:.1e} (the unfused path rounds gate and up to bf16 first)")


def main() -> None:
    from acarerank.hardware import native_bf16

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="both")
    ap.add_argument("--rows", default="512,2048", help="comma-separated row counts (default 512,2048)")
    ap.add_argument("--quick", action="store_true", help="rows 64 only, 2 rounds: a smoke test")
    add_malloc_flag(ap)
    args = ap.parse_args()
    try:
        rows_list = tuple(int(r) for r in args.rows.split(","))
    except ValueError:
        rows_list = ()
    if not rows_list or min(rows_list) < 1:  # 0 rows or no round: a traceback after the set-up
        ap.error(f"--rows must be comma-separated counts >= 1, got {args.rows!r}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    ok, why = native_bf16()
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = {w for line in f if line.startswith("flags") for w in line.split()[2:]}
    except OSError:
        pass
    shown = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; native bf16: {ok} ({why}); "
          f"CPU flags: {' '.join(shown) or 'unknown'}")
    print(f"malloc: {malloc_tuning.apply(args.malloc)}")
    dtypes = {"float32": [torch.float32], "bfloat16": [torch.bfloat16],
              "both": [torch.float32, torch.bfloat16]}[args.dtype]
    rows_list, rounds = ((64,), 2) if args.quick else (rows_list, args.rounds)
    for dtype in dtypes:
        for rows in rows_list:
            for name, (k, n) in SHAPES.items():
                run_case(name, k, n, rows, dtype, rounds)
            if dtype == torch.bfloat16:
                run_gate_up_silu(rows, rounds)


if __name__ == "__main__":
    main()
