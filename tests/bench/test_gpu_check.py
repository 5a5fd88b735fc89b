"""bench/gpu_check.sh on CPU: the plan fits its deadline, the steps run in order (correctness
before speed, the extension built before what needs it), each step's result file is written as
it finishes, and the cuda tests collect with the optional packages hidden (no serve stack, no
hypothesis, no cohere, no acarerank._C): what CI can check of the one command a GPU machine runs."""
import os
import re
import subprocess
import sys

from _hidden import hidden_env
import _repo

ROOT = str(_repo.ROOT)
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.sh")
DEFAULT_ORDER = ["env", "build", "pytest", "attention", "bench"]
DEADLINE = 540  # the script's bound for a fresh H200 with a cold Triton cache


def _plan(*args, **env):
    r = subprocess.run(["bash", SCRIPT, "--plan", *args], env=dict(os.environ, PYTHON=sys.executable, **env),
                       capture_output=True, text=True, timeout=120)
    m = re.search(r"plan: (.*) = (\d+)s of the (\d+)s deadline", r.stderr)
    assert m, r.stderr
    steps = [(name, int(limit)) for name, limit in (part.split() for part in m.group(1).split(", "))]
    return r.returncode, steps, int(m.group(2)), int(m.group(3))


def test_default_plan_fits_the_deadline_in_the_order_of_value(tmp_path):
    rc, steps, budget, deadline = _plan(OUT=str(tmp_path))
    assert rc == 0 and deadline == DEADLINE, (rc, deadline)
    assert [name for name, _ in steps] == DEFAULT_ORDER, steps
    assert sum(limit for _, limit in steps) == budget <= deadline, steps


def test_a_plan_over_the_deadline_is_refused_before_anything_runs(tmp_path):
    rc, steps, budget, deadline = _plan("--also", "kernels,agent", OUT=str(tmp_path))
    assert rc == 2 and budget > deadline, (rc, budget, deadline)
    assert "FAILED  plan: step limits" in (tmp_path / "summary.txt").read_text()
    assert not (tmp_path / "steps").exists() or not os.listdir(tmp_path / "steps"), "a step ran"


def test_dry_run_with_the_optional_packages_hidden(tmp_path):
    """Order, result files as each step finishes, and `pytest -m cuda` collecting without error.
    bench is skipped here (its CLI has its own tests; a skipped step still shows in the order);
    kernels is added with a missing script: a failure logged at its step, not fatal to the run."""
    env = hidden_env(OUT=str(tmp_path), PYTHON=sys.executable, GPU_CHECK_KEEP_STEPS="1",
                     GPU_CHECK_KERNEL_BENCHES="bench/bench_does_not_exist.py")
    proc = subprocess.run(["bash", SCRIPT, "--dry-run", "--skip", "bench", "--also", "kernels", "--deadline", "700"],
                          env=env, capture_output=True, text=True, timeout=600)
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.returncode == 1, proc.stderr[-3000:]  # the missing script is a failure, reported at the end
    order = DEFAULT_ORDER + ["kernels"]
    steps = sorted(os.listdir(tmp_path / "steps"))
    assert steps == [f"{i + 1:02d}-{name}.txt" for i, name in enumerate(order)], steps
    times = []
    for name in steps:
        text = (tmp_path / "steps" / name).read_text()
        fields = dict(kv.split("=") for kv in text.splitlines()[1].split())
        times.append((float(fields["started_at"]), float(fields["finished_at"]),
                      os.stat(tmp_path / "steps" / name).st_mtime))
    for (s0, f0, m0), (s1, _, _) in zip(times, times[1:]):
        assert s0 <= f0 <= s1 and m0 <= s1 + 0.01, (steps, times)  # written before the next step began
    status = [line.split()[:2] for line in summary.splitlines() if line[:1].isupper() and not line.startswith(" ")]
    assert [s[1].rstrip(":") for s in status[:len(order)]] == order, summary
    for want in ("OK      env", "OK      build", "OK      pytest", "OK      attention", "SKIPPED bench",
                 "FAILED  kernels", "MISSING bench/bench_does_not_exist.py", "correctness triton",
                 "target: triton >= 4x flash_unshared", "flash-attn", "driver vs runtime", "triton >= 3.5"):
        assert want in summary, (want, summary)
    collected = re.search(r"(\d+)/(\d+) tests collected \((\d+) deselected\) in", summary)
    assert collected and int(collected.group(1)) > 0, summary  # the cuda tests, no collection error
    files = set(os.listdir(tmp_path)) - {"steps"}
    assert {"gpu_check.log", "summary.txt", "attention.csv", "details.tar.gz"} <= files and len(files) <= 8, files
