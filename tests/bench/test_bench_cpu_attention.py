"""bench/bench_cpu_attention.py --quick runs, checks every provider against the fp32 oracle and
writes its CSV; its check can fail (a provider that drops the prefix is caught)."""
import csv
import importlib.util
from pathlib import Path

import pytest
import torch

from _ext import needs_native

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_cpu_attention.py"


def _load():
    spec = importlib.util.spec_from_file_location("acarerank_bench_cpu_attention", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _quick_rows(tmp_path, capsys, *extra) -> list:
    """A --quick run of native, torch and SDPA (plus ``extra`` flags): it must pass its own output
    check and write a row per provider and dtype; the rows."""
    out = tmp_path / "out.csv"
    rc = _load().main(["--quick", *extra, "--providers", "native", "torch", "sdpa", "--csv", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.out + printed.err
    rows = list(csv.DictReader(out.open()))
    assert {(r["provider"], r["dtype"]) for r in rows} == {(p, d) for p in ("native", "torch", "sdpa")
                                                          for d in ("float32", "bfloat16")}, rows
    return rows


@needs_native
def test_quick_run_checks_and_writes_its_csv(tmp_path, capsys):
    rows = _quick_rows(tmp_path, capsys)
    for r in rows:
        assert float(r["ms"]) > 0 and float(r["tflops"]) > 0 and r["flags"] and r["torch"], r


def test_check_fails_on_a_wrong_result(tmp_path, monkeypatch, capsys):
    mod = _load()
    real = mod.provider_sdpa

    def broken(args, lens):
        q, k, v, cu, kc, vc, bt, pl, sg = args
        return real((q, k, v, cu, kc, vc, bt, pl.clone().fill_(1), sg), lens)   # reads one prefix token

    monkeypatch.setattr(mod, "provider_sdpa", broken)
    rc = mod.main(["--quick", "--providers", "sdpa", "--dtypes", "float32"])
    assert rc == 1 and "MISMATCH" in capsys.readouterr().err


@needs_native
def test_quick_decode_run_checks_and_writes_its_csv(tmp_path, capsys):
    rows = _quick_rows(tmp_path, capsys, "--workload", "decode")
    for r in rows:
        assert int(r["groups"]) == 2 and int(r["layers"]) == 2, r
        assert float(r["ms"]) > 0 and float(r["gb_per_s"]) > 0, r


def test_decode_layers_fill_the_kv_budget_up_to_the_model_depth():
    """Each timed decode call cycles over enough layers' caches to read --kv-mb (not one cache the L3
    holds), never more layers than the 0.6B model has."""
    mod = _load()
    args = mod.argparse.Namespace(quick=False, kv_mb=256.0)
    assert mod.decode_layers(args, 48_000_000) == 6                # ceil(256 / 48)
    assert mod.decode_layers(args, 300_000_000) == 1
    assert mod.decode_layers(args, 1_000) == mod.MAX_LAYERS == 28
    ran = []
    call = mod.every_layer([lambda i=i: ran.append(i) or i for i in range(3)])
    assert call() == 0 and ran == [0, 1, 2]


@pytest.mark.parametrize("flags, named", [(["--prefixes", "2048"], "--prefixes"),
                                          (["--workload", "decode", "--prefixes", "0"], "--prefixes"),
                                          (["--workload", "decode", "--kv-mb", "0"], "--kv-mb"),
                                          # ignored without a word / math.ceil's OverflowError after the set-up
                                          (["--quick", "--workload", "decode", "--prefixes", "2048"], "--prefixes"),
                                          (["--workload", "decode", "--kv-mb", "inf"], "--kv-mb"),
                                          (["--segment-tokens", "0"], "--segment-tokens"),
                                          (["--workload", "decode", "--segment-tokens", "64"], "--segment-tokens"),
                                          (["--quick", "--segment-tokens", "64"], "--segment-tokens"),
                                          # a traceback once the set-up had run
                                          (["--rounds", "0"], "--rounds")])
def test_bad_decode_flags_are_refused(flags, named, capsys):
    with pytest.raises(SystemExit) as e:
        _load().main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: {named}" in err, err


def test_a_setwise_pass_is_one_causal_segment_after_the_prefix():
    """--segment-tokens N: one group, one segment of N tokens after the prefix (a setwise prefill
    pass), whatever --depths says; its FLOP count is the causal one."""
    mod = _load()
    (q, k, v, cu, kc, vc, bt, pl, sg), lens, flop = mod.make_case(4, 2, 64, 48, 20, torch.float32, segment_tokens=70)
    assert lens == [70] and cu.tolist() == [0, 70] and sg.tolist() == [0] and pl.tolist() == [48]
    assert q.shape == (70, 4, 64) and bt.shape == (1, 3)
    assert flop == 4 * 64 * 4 * 70 * (48 + 71 / 2)


def test_decode_check_fails_on_a_wrong_result(monkeypatch, capsys):
    mod = _load()
    real = mod.provider_sdpa_decode

    def broken(args):
        q, k, v, cu, kc, vc, bt, pl, sg = args
        return real((q, k, v, cu, kc, vc, bt.flip(0), pl, sg))   # each group reads another's prefix

    monkeypatch.setattr(mod, "provider_sdpa_decode", broken)
    rc = mod.main(["--quick", "--workload", "decode", "--providers", "sdpa", "--dtypes", "float32"])
    assert rc == 1 and "MISMATCH" in capsys.readouterr().err
