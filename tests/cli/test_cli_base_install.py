"""The command line on a base install (no extras): every subcommand but ``serve`` works without the
serve stack, ``serve`` says in one line which extra to install, ``acarerank --help`` imports no
torch. The optional packages are hidden from a subprocess (tests/hide_modules)."""
import json

import pytest

from _hidden import OPTIONAL_MODULES, run_hidden

CLI = ["python", "-m", "acarerank.cli"]
TINY = ("num_hidden_layers=1,hidden_size=64,intermediate_size=128,num_attention_heads=2,num_key_value_heads=1,"
        "head_dim=32")
SERVE_EXTRAS = ("fastapi", "uvicorn", "starlette", "pydantic", "prometheus_client", "httpx")


def test_top_level_help_imports_no_torch_and_no_server():
    r = run_hidden(["python", "-X", "importtime", "-m", "acarerank.cli", "--help"])
    assert r.returncode == 0, r.stderr
    for name in ("score", "select", "bench", "serve"):
        assert f"    {name}" in r.stdout, f"{name} missing from the top-level help:\n{r.stdout}"
    # -X importtime writes "import time: ... | <module>" lines on stderr, one per imported module
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert imported, f"no import-time lines: {r.stderr[:500]}"
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "transformers", "fastapi", "numpy", "triton"))
    assert not heavy, f"`acarerank --help` imported {heavy[:10]}"


@pytest.mark.parametrize("command", ["score", "select", "bench"])
def test_subcommand_help_without_optional_packages(command):
    r = run_hidden(CLI + [command, "--help"])
    assert r.returncode == 0, f"`acarerank {command} --help` exit {r.returncode}:\n{r.stderr[-2000:]}"
    assert f"usage: acarerank {command}" in r.stdout, r.stdout[:300]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("argv", [["serve"], ["serve", "--port", "0"]])
def test_serve_without_the_extras_is_one_line_naming_the_extra(argv):
    r = run_hidden(CLI + argv, hide=SERVE_EXTRAS)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, f"exit {r.returncode}, stderr:\n{r.stderr[-2000:]}"
    assert len(lines) == 1 and "pip install 'acarerank[serve]'" in lines[0], r.stderr[-2000:]
    assert lines[0].startswith("acarerank serve: error: "), lines[0]


def test_serve_help_without_the_extras():
    """The serving options are stdlib-only (ServeConfig), so their help needs no extra."""
    r = run_hidden(CLI + ["serve", "--help"], hide=SERVE_EXTRAS)
    assert r.returncode == 0, f"exit {r.returncode}, stderr:\n{r.stderr[-2000:]}"
    assert "usage: acarerank serve" in r.stdout and "--drain-timeout" in r.stdout, r.stdout[:300]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


def test_score_runs_without_optional_packages(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in
                              enumerate(["Paris is the capital of France.", "Bananas are yellow.", ""])) + "\n")
    r = run_hidden(CLI + ["score", "--query", "capital of France", "--docs", str(docs), "--dtype", "float32"])
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["index"] for row in rows] == [0, 1, 2] and [row["id"] for row in rows] == [0, 1, 2], rows
    assert all(0.0 <= row["score"] <= 1.0 for row in rows), rows


def test_hidden_modules_are_really_hidden():
    """The check above means something only if the hider hides: importing any of them fails."""
    code = ("import importlib, importlib.util, sys\n"
            "for m in sys.argv[1:]:\n"
            "    assert importlib.util.find_spec(m.split('.')[0]) is None or '.' in m, m\n"
            "    try:\n        importlib.import_module(m)\n    except ModuleNotFoundError:\n        continue\n"
            "    raise SystemExit(f'{m} imported although hidden')\n")
    r = run_hidden(["python", "-c", code, *OPTIONAL_MODULES])
    assert r.returncode == 0, r.stderr + r.stdout


def test_bench_quick_runs_without_the_bench_extras(tmp_path):
    """No matplotlib (no PNG, said so), no scipy (Kendall tau reported as n/a): the timings and the
    score check still run and the exit status is 0. Two dtypes, as the rank agreement needs; the
    model is the 1-layer shape of tests/bench/test_bench_cli.py (what is missing does not depend on it)."""
    out = tmp_path / "bench"
    r = run_hidden(CLI + ["bench", "--quick", "--depths", "2", "--modes", "M0", "--dtype", "float32,bfloat16",
                          "--override", TINY, "--output", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "bench.csv").is_file() and (out / "bench.txt").is_file()
    report = r.stdout + r.stderr
    assert "scores agree" in report, report[-2000:]
    assert "Kendall tau n/a (needs scipy" in report, report[-2000:]
