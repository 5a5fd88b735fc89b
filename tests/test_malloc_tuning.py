"""acarerank.malloc_tuning: glibc's thresholds raised for acarerank's own processes (serve, bench, score, select),
never on import, never over the environment's own; the CPU pass default that follows them.

The tuning is process-wide and cannot be undone, so every test that tunes runs in a child process
(tests/conftest.py keeps the pytest process's malloc as it is)."""
import json
import os
import subprocess
import sys

import pytest

from acarerank import malloc_tuning
from acarerank.server.config import ServeConfig

HERE = os.path.dirname(os.path.abspath(__file__))
GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")

# Minor page faults of allocating, touching and freeing a 48 MB tensor (above glibc's largest
# adaptive mmap threshold, 32 MB, so by default each one is a fresh mmap), before and after tuning.
CHILD = r"""
import json, resource, torch
from acarerank import malloc_tuning as mt

def faults_per_round(rounds=6):
    for _ in range(12):  # warm: the heap takes a few rounds to settle (7 on glibc 2.36) before it reuses the block
        torch.empty(12 << 20, dtype=torch.float32).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        torch.empty(12 << 20, dtype=torch.float32).fill_(1.0)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / rounds

out = {"before": faults_per_round(), "status_before": mt.status(), "tokens_before": mt.cpu_batch_tokens()}
out["tune"] = mt.tune_malloc()
out["again"] = mt.tune_malloc()
out["after"] = faults_per_round()
out.update(keeps=mt.keeps_freed_blocks(), tokens_after=mt.cpu_batch_tokens())
print(json.dumps(out))
"""


def _child(env_extra=None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in malloc_tuning.ENV_VARIABLES}
    env.update(env_extra or {})
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300, cwd=HERE)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="mallopt's thresholds are glibc's")
def test_tuning_keeps_freed_blocks_and_doubles_the_cpu_pass():
    got = _child()
    page_count = (48 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert got["status_before"].startswith("default"), got
    assert got["tokens_before"] == malloc_tuning.CPU_BATCH_TOKENS == 2048, got
    # by default every round maps (and faults in) the whole block anew; tuned, the heap keeps it
    assert got["before"] > page_count / 2, f"default malloc should fault the 48 MB block in each round: {got}"
    assert got["tune"].startswith("tuned (mmap threshold 512 MB, trim threshold 1024 MB)"), got
    assert got["again"] == got["tune"], got
    assert got["after"] < page_count / 20, f"tuned malloc still faults the block in each round: {got}"
    assert got["keeps"] and got["tokens_after"] == malloc_tuning.CPU_BATCH_TOKENS_KEPT == 4096, got


@pytest.mark.parametrize("threshold, keeps", [("134217728", True), ("0x10000000", True), ("1048576", False),
                                               ("lots", False)])
def test_the_environments_own_thresholds_win(threshold, keeps):
    got = _child({"MALLOC_MMAP_THRESHOLD_": threshold})
    assert got["tune"] == got["status_before"] == f"environment (MALLOC_MMAP_THRESHOLD_={threshold})", got
    assert got["keeps"] is keeps, got
    assert got["tokens_after"] == (4096 if keeps else 2048), got


def test_importing_acarerank_changes_no_threshold():
    code = "import acarerank, acarerank.pointwise, acarerank.server.config; " \
           "from acarerank import malloc_tuning as mt; print(mt.status(), mt.cpu_batch_tokens())"
    env = {k: v for k, v in os.environ.items() if k not in malloc_tuning.ENV_VARIABLES}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "default (glibc's adaptive thresholds) 2048", (r.stdout, r.stderr)


def test_bad_choices_name_the_flag():
    with pytest.raises(ValueError, match="--malloc must be one of tuned, default, got 'fast'"):
        malloc_tuning.apply("fast")
    with pytest.raises(ValueError, match="--malloc must be one of tuned, default, got 'fast'"):
        ServeConfig(malloc="fast")
    assert malloc_tuning.apply("default") == malloc_tuning.status()


def test_the_pointwise_cpu_default_follows_the_process(monkeypatch):
    from _tiny import tiny_causal
    from acarerank import PointwiseReranker

    for name in malloc_tuning.ENV_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    model = tiny_causal(seed=3)
    assert PointwiseReranker(model=model).max_batch_tokens == 2048
    monkeypatch.setattr(malloc_tuning, "_tuned", True)
    assert PointwiseReranker(model=model).max_batch_tokens == 4096
    assert PointwiseReranker(model=model, max_batch_tokens=300).max_batch_tokens == 300


@pytest.mark.parametrize("command", ["score", "select"])
def test_score_and_select_apply_malloc_before_the_model_loads(command, monkeypatch, capsys):
    """acarerank score / select take serve's --malloc (default tuned) and apply it before the model's
    first allocation; a choice that is not one is a usage error naming the flag."""
    import acarerank.loading as loading
    from acarerank.cli import build_parser, common

    events = []
    monkeypatch.setattr(malloc_tuning, "apply", lambda choice: events.append(("malloc", choice)) or choice)

    class Loaded:
        def default_cap_line(self, *flags):
            return ""

    monkeypatch.setattr(loading, "load_reranker", lambda cls, **kw: events.append(("load", cls)) or Loaded())
    for flags, want in (([], "tuned"), (["--malloc", "default"], "default"), (["--malloc", "tuned"], "tuned")):
        events.clear()
        args = build_parser(command).parse_args([command, "--query", "q", "--docs", "d.jsonl", *flags])
        common.load_reranker(dict, args)
        assert events == [("malloc", want), ("load", dict)], (flags, events)
    with pytest.raises(SystemExit) as e:
        build_parser(command).parse_args([command, "--query", "q", "--docs", "d.jsonl", "--malloc", "fast"])
    assert e.value.code == 2
    assert "--malloc: invalid choice: 'fast'" in capsys.readouterr().err
