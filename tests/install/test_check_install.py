"""scripts/setup.sh ends with scripts/check_install.py: pip -q hides a successful build's output,
so whether acarerank._C and acarerank._cpu load is said there, one line each where they do not
(docs/install.md, "Build prerequisites": the C++ CPU part always builds, so a missing _C fails)."""
import re

from _ext import needs_ext
from _hidden import run_hidden
from _repo import ROOT

CHECK = ["python", "scripts/check_install.py"]


def test_setup_sh_runs_the_check_after_the_install():
    lines = (ROOT / "scripts" / "setup.sh").read_text().splitlines()
    install = next(i for i, ln in enumerate(lines) if re.search(r"pip install .*--no-build-isolation -e", ln))
    assert "python scripts/check_install.py" in lines[install + 1:], lines[install:]


def test_missing_c_ext_fails_in_one_line():
    r = run_hidden(CHECK, hide=("acarerank._C",), timeout=120)
    assert r.returncode == 1, f"rc {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-2000:]}"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "acarerank._C does not import" in lines[0], r.stderr[-2000:]
    assert "installed" not in r.stdout, r.stdout


@needs_ext  # the check stops at a missing _C first
def test_missing_cpu_ext_is_one_line_naming_why():
    from acarerank.ops import _native

    r = run_hidden(CHECK, hide=("acarerank._cpu",), timeout=120, ACARERANK_NO_CPU_EXT="")
    assert r.returncode == 0, f"rc {r.returncode}\nstderr:\n{r.stderr[-2000:]}"
    warning = [ln for ln in r.stderr.splitlines() if "acarerank._cpu" in ln]
    assert warning == [f"scripts/setup.sh: warning: {_native.NOT_BUILT}; the ops run their torch backends"], \
        r.stderr[-2000:]
    assert r.stdout.startswith("acarerank ") and r.stdout.strip().endswith(" installed"), r.stdout


@needs_ext
def test_a_skipped_cpu_ext_on_request_is_quiet():
    r = run_hidden(CHECK, hide=("acarerank._cpu",), timeout=120, ACARERANK_NO_CPU_EXT="1")
    assert r.returncode == 0 and "acarerank._cpu" not in r.stderr, r.stderr[-2000:]
