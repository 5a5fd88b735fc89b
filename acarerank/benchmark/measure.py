"""How every benchmark measures: time, percentiles, peak memory, and the machine it ran on.

One rule for all of them (``acarerank bench`` and every ``bench/*.py``):

* ``timed_call(fn, device)``: one call between two device synchronisations, wall clock
  (``time.perf_counter``) — what an end-to-end caller waits for.
* ``time_ms(fn, device, repeats, warmup)`` -> ``Timing``: a kernel or op timed on its own.
  CUDA: ``triton.testing.do_bench`` (25 ms warm-up, ~100 ms of calls, L2 flushed between
  calls; CUDA events), every call's time kept. CPU: ``warmup`` untimed calls, then
  ``repeats`` ``timed_call`` s, with the process CPU time of each too (less sensitive to
  other load on a shared machine).
* ``percentile(values, q)``: q in [0, 100], linear interpolation (numpy's default). Every
  reported median / p10 / p20 / p80 / p90 comes from it.
* ``machine_info(device)``: device name, versions, host — the same keys in every CSV.
* ``wait_for_quiet_cpu()``: before a round of a peer comparison, wait (bounded) until the
  machine's CPUs are idle, so no provider starts while the other's server still finishes work.
* ``kernel_bench_device(quick)``: a kernel benchmark's start-up (device; the Triton
  interpreter on for a quick CPU run).
* ``add_malloc_flag(parser)``: ``--malloc`` for a benchmark that times CPU GEMMs alone, so their
  outputs' page faults are not timed with them (the caller applies it: ``malloc_tuning.apply``).
* ``PeakMemory`` (one call's peak above its start: CUDA allocator or Linux RSS high-water),
  ``alloc_peak_extra`` (torch's CPU allocation events) and ``rss_in_subprocess`` (a fresh
  process per measurement).
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from .. import malloc_tuning
from .._triton_env import enable_interpreter


# -- time ---------------------------------------------------------------------------------
def sync(device) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], Any], device) -> tuple:
    """(fn's result, wall seconds of the call), the device synchronised on both sides."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must lie in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Timing:
    """Times of one measured function, in ms. ``result``: what one of its calls returned."""
    times_ms: list
    cpu_ms: list = field(default_factory=list)   # process CPU time per call (CPU timing only)
    result: Any = None
    method: str = "perf_counter"

    @property
    def median(self) -> float:
        return percentile(self.times_ms, 50)

    def p(self, q: float) -> float:
        return percentile(self.times_ms, q)

    @property
    def cpu_median(self) -> float:
        return percentile(self.cpu_ms, 50) if self.cpu_ms else math.nan


def time_ms(fn: Callable[[], Any], device, repeats: int = 5, warmup: int = 1) -> Timing:
    """Time ``fn`` (see the module docstring). ``repeats``/``warmup`` apply to CPU timing;
    on CUDA do_bench sizes its own run and one untimed call comes first (compilation, result)."""
    device = torch.device(device)
    if device.type == "cuda":
        out = fn()
        sync(device)
        try:
            from triton.testing import do_bench
        except ImportError:  # no Triton: CUDA events around each of 20 calls
            return Timing(_cuda_event_times(fn, 20), result=out, method="cuda_events")
        try:
            times = do_bench(fn, warmup=25, rep=100, return_mode="all")
        except (AssertionError, TypeError, ValueError):  # a Triton without return_mode="all"
            return Timing(_cuda_event_times(fn, 20), result=out, method="cuda_events")
        return Timing(list(times), result=out, method="triton.do_bench")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    out = None
    for _ in range(warmup):
        out = fn()
    wall, cpu = [], []
    for _ in range(repeats):
        c = time.process_time()
        out, dt = timed_call(fn, device)
        cpu.append((time.process_time() - c) * 1e3)
        wall.append(dt * 1e3)
    return Timing(wall, cpu, out)


def _cuda_event_times(fn, n):
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def kernel_bench_device(quick: bool, cpu_default_shape: bool = False) -> Optional[str]:
    """The start-up of every kernel benchmark: the device it runs on, with the Triton
    interpreter switched on where a CPU run needs it.

    "cuda" when there is one. Else "cpu" for a ``--quick`` smoke run — and then
    TRITON_INTERPRET=1 is set (unless the environment says otherwise), so call this before
    ``acarerank.kernels`` is imported: ``triton.jit`` reads it at import — or for a full run
    of a benchmark whose default shape is a CPU one (``cpu_default_shape``). Else None, after
    saying why on stderr (a GPU shape on a CPU means nothing)."""
    if torch.cuda.is_available():
        return "cuda"
    if not (quick or cpu_default_shape):
        print("no CUDA device: the default shape is for a GPU; run with --quick on CPU", file=sys.stderr)
        return None
    if quick:
        enable_interpreter()
    return "cpu"


# -- machine --------------------------------------------------------------------------------
def add_malloc_flag(parser) -> None:
    """``--malloc {tuned,default}`` (default tuned) on an argparse parser of a CPU GEMM benchmark."""
    parser.add_argument("--malloc", choices=malloc_tuning.CHOICES, default="tuned",
                        help="glibc's malloc here, as acarerank serve's --malloc (default tuned: freed blocks kept, "
                             "as the server's passes run; default: glibc as it is, where an output over its mmap "
                             "threshold is a fresh mapping each call and its page faults are timed with the GEMM)")


def fill_bench_args(args, shapes: dict, positive: Sequence[str], csv_name: str):
    """A kernel benchmark's flags completed: every unset flag from ``shapes`` (its QUICK, GPU or
    CPU default shape, as the caller picked), each of ``positive`` checked >= 1 (one line naming
    the flag, exit 2), and ``args.csv`` defaulting to results/<csv_name>/{quick,<op>}.csv."""
    from pathlib import Path

    for key, value in shapes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for name in positive:
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.csv is None:
        op = csv_name[len("bench_"):] if csv_name.startswith("bench_") else csv_name
        args.csv = Path("results") / csv_name / ("quick.csv" if args.quick else f"{op}.csv")
    return args


def _version(name: str) -> str:
    try:
        import importlib.metadata as md
        return md.version(name)
    except Exception:  # not installed: an empty cell, not a failed benchmark
        return ""


def machine_info(device) -> dict:
    """Where a benchmark ran: device_name (GPU name, or CPU model and torch threads), host, versions."""
    import acarerank

    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
        name = f"{name} ({torch.get_num_threads()} threads)"
    return {"device_name": name, "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
            "python": platform.python_version(), "torch": torch.__version__, "triton": _version("triton"),
            "transformers": _version("transformers"), "acarerank": acarerank.__version__}


def _cpu_jiffies() -> Optional[tuple]:
    """(busy, total) jiffies of all CPUs together, from /proc/stat's first line; None off Linux."""
    try:
        with open("/proc/stat") as f:
            return _jiffies_of(f.readline())
    except (OSError, ValueError):
        return None


def _jiffies_of(line: str) -> tuple:
    """(busy, total) of a /proc/stat "cpu" line: user nice system idle iowait irq softirq steal
    [guest guest_nice]. guest and guest_nice are left out: the kernel already counts them in user
    and nice (proc(5)), so summing every field counted a VM host's guest time twice as busy."""
    fields = [int(x) for x in line.split()[1:9]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)          # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_for_quiet_cpu(max_wait_s: float = 5.0, busy_below: float = 0.15, window_s: float = 0.25,
                       sample: Callable[[], Optional[tuple]] = _cpu_jiffies) -> tuple:
    """Wait until one ``window_s`` window sees the machine's CPUs less than ``busy_below`` busy
    (all cores together, from /proc/stat), at most ``max_wait_s``: (seconds waited, quiet?).

    Why: a server keeps working after it answers (vLLM's CPU build keeps a core busy for ~1 s
    after a request), so the next provider's round, started at once, shares the cores with it.
    Not quiet within the bound (other jobs on the machine) returns False for the caller to log;
    no /proc/stat returns (0.0, True) at once. The caller's own process must be idle meanwhile."""
    t0 = time.perf_counter()
    before = sample()
    if before is None:
        return 0.0, True
    while True:
        time.sleep(window_s)
        after = sample()
        if after is None:
            return time.perf_counter() - t0, True
        busy, total = after[0] - before[0], after[1] - before[1]
        waited = time.perf_counter() - t0
        if total > 0 and busy / total < busy_below:
            return waited, True
        if waited >= max_wait_s:
            return waited, False
        before = after


# -- memory ---------------------------------------------------------------------------------
def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux)
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    """glibc's ``malloc_trim(0)``: freed heap pages go back to the OS (nothing off glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the RSS may include freed pages
        pass


class PeakMemory:
    """Peak memory of a measured stretch (one call) above its starting point, in MB.

    ``start()`` on the CPU trims the heap, so the call it measures page-faults every buffer it
    touches again: measure an untimed call, never a timed one (``--malloc tuned`` keeps freed
    blocks so that timed calls do not fault; docs/benchmarks.md, "Latency vs reranking depth").

    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what
    was allocated at the start (the weights) — kind "cuda_max_allocated".
    CPU (Linux): the process's resident-set high-water mark (VmHWM) reset at the start by
    writing 5 to /proc/self/clear_refs, minus the RSS at the start, after ``malloc_trim``
    returns freed heap pages — kind "rss_hwm". It counts what the process really touched
    (torch's CPU allocator has no peak counter; tracemalloc does not see its buffers).
    Elsewhere: NaN, kind "n/a".
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.kind = ("cuda_max_allocated" if self.device.type == "cuda"
                     else ("rss_hwm" if _reset_rss_peak() else "n/a"))
        self._base = 0

    def start(self) -> None:
        if self.kind == "cuda_max_allocated":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        elif self.kind == "rss_hwm":
            _malloc_trim()
            _reset_rss_peak()
            self._base = _status_kb("VmRSS") * 1024

    def stop(self) -> float:
        if self.kind == "cuda_max_allocated":
            torch.cuda.synchronize(self.device)
            return (torch.cuda.max_memory_allocated(self.device) - self._base) / 2**20
        if self.kind == "rss_hwm":
            return (_status_kb("VmHWM") * 1024 - self._base) / 2**20
        return math.nan


def rss_peak_extra_mb(fn: Callable[[], Any]) -> float:
    """Peak RSS during fn() minus the RSS before it, MB (Linux; ``PeakMemory`` on the CPU)."""
    import gc

    gc.collect()
    meter = PeakMemory("cpu")
    if meter.kind != "rss_hwm":
        raise RuntimeError("the RSS high-water reset needs Linux /proc/self/clear_refs")
    meter.start()
    fn()
    return meter.stop()


def alloc_peak_extra(fn: Callable[[], Any]) -> tuple:
    """(fn's result, peak extra bytes) from torch's own allocation events (CPU tensors): the
    bytes live at the peak of the call minus those live before it, no allocator caching."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    evs = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                 key=lambda e: e.start_ns())
    cur = peak = 0
    for e in evs:
        cur += e.nbytes()
        peak = max(peak, cur)
    return out, peak


def rss_in_subprocess(script: str, child_args: list, env: Optional[dict] = None) -> float:
    """Run ``script`` + ``child_args`` in a fresh interpreter; its last stdout line is
    ``{"rss_extra_mb": x}`` (from ``rss_peak_extra_mb``). Returns x."""
    out = subprocess.run([sys.executable, script] + child_args, capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"rss child failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["rss_extra_mb"]
