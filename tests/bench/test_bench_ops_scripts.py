"""The per-op benchmark scripts run (--quick, tiny shapes) and hold their own correctness check:
each compares every provider with the op's reference and exits 1 on a mismatch."""
import csv
import importlib.util
import os
from pathlib import Path

import pytest

from _repo import ROOT

BENCH = ROOT / "bench"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"acarerank_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name, providers", [
    ("bench_paged_attention", {"paged", "packed", "ref"}),
    ("bench_merge_states", {"torch", "ref"}),
    ("bench_topk_merge", {"torch", "ref"}),
])
def test_quick_run_checks_and_writes_its_csv(name, providers, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))  # the script may set it
    out = tmp_path / "out.csv"
    rc = _load(name).main(["--quick", "--csv", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.out + printed.err
    rows = list(csv.DictReader(out.open()))
    assert providers <= {r["provider"] for r in rows}, rows
    for r in rows:
        assert float(r["median_ms"]) > 0, r


def test_paged_bench_fails_on_a_wrong_result(tmp_path, monkeypatch, capsys):
    """The check can fail: a paged op that drops the prefix's last page is caught."""
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    mod = _load("bench_paged_attention")
    real = mod.make_inputs

    def broken(*a, **k):
        x = real(*a, **k)
        x["prefix_lens"] = x["prefix_lens"] - 5  # paged and ref read 5 rows fewer; packed does not
        return x

    monkeypatch.setattr(mod, "make_inputs", broken)
    assert mod.main(["--quick", "--csv", str(tmp_path / "x.csv")]) == 1
    assert "FAILED" in capsys.readouterr().err
