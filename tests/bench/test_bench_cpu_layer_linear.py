"""bench/bench_cpu_layer.py and bench/bench_cpu_linear.py run their --quick smoke tests and print
one line per variant (the figures themselves are not asserted: wall clock never is)."""
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _run(script, *args):
    run = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run.stdout


@pytest.mark.slow
def test_bench_cpu_layer_quick():
    out = _run("bench_cpu_layer.py", "--quick")
    for dtype in ("torch.float32", "torch.bfloat16"):
        assert f"one layer (GEMMs + element-wise), {dtype}, 7 rows" in out, out
        assert f"element-wise ops alone, {dtype}, 7 rows" in out, out
    assert out.count("eager (torch references)") == 4, out


@pytest.mark.slow
def test_bench_cpu_linear_quick():
    """Both dtypes in one run (one process start); bf16 adds the fused gate/up against the unfused."""
    out = _run("bench_cpu_linear.py", "--quick", "--dtype", "both")
    for name in ("qkv 1024->4096", "o 2048->1024", "gate_up 1024->6144", "down 3072->1024"):
        assert f"{name}, rows 64, torch.float32" in out, out
        assert f"{name}, rows 64, torch.bfloat16" in out, out
    assert out.count("F.linear ") == 8 and "max|diff|" in out, out
    assert "gate_up+silu 1024->6144->3072, rows 64, torch.bfloat16" in out, out
    from acarerank.ops import _native

    if _native.available() and _native.amx_tiles_kernel():
        assert "gate_up_silu (fused)" in out and "max|diff| fused vs unfused" in out, out
    else:
        assert "n/a:" in out, out


@pytest.mark.parametrize("script, args, named", [
    ("bench_cpu_linear.py", ["--rounds", "0"], "--rounds"), ("bench_cpu_linear.py", ["--rows", "0"], "--rows"),
    ("bench_cpu_linear.py", ["--rows", "a"], "--rows"), ("bench_cpu_layer.py", ["--rounds", "0"], "--rounds"),
    ("bench_cpu_layer.py", ["--rows", "0"], "--rows")])
def test_no_round_or_no_row_is_a_usage_error(script, args, named):
    """--rounds 0 or --rows 0 ran the set-up, then stopped with a traceback (no time to take a
    median of, or a GEMM of no rows): now the parser's usage error, exit 2, naming the flag."""
    run = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 2 and f"error: {named}" in run.stderr and "Traceback" not in run.stderr, \
        (run.returncode, run.stderr[-2000:])
