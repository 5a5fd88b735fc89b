"""bench/bench_setwise.py --quick --batch 2 runs: two prompts decoded together by acarerank and by
transformers' batched generate (left-padded) give the same tokens (the script exits 1 if not), and
its CSV carries the batch and both providers."""
import csv
import importlib.util

from _repo import ROOT


def _load():
    spec = importlib.util.spec_from_file_location("acarerank_bench_setwise", ROOT / "bench" / "bench_setwise.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quick_batched_run_agrees_with_transformers(tmp_path, capsys):
    rc = _load().main(["--quick", "--batch", "2", "--output", str(tmp_path)])
    printed = capsys.readouterr()
    assert rc == 0, printed.out + printed.err
    rows = list(csv.DictReader((tmp_path / "bench_setwise.csv").open()))
    assert {(r["pool"], r["provider"]) for r in rows} == {(p, v) for p in ("10", "20")
                                                          for v in ("acarerank", "transformers")}, rows
    for r in rows:
        assert r["batch"] == "2" and r["tokens_agree"] == "True" and int(r["new_tokens"]) > 0, r
