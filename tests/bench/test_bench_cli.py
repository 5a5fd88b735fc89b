"""``acarerank bench`` end to end on a tiny model, and the pieces its figures rest on.

References: the CSV columns of ``report.COLUMNS``; ``torch.utils.flop_counter`` for the
FLOP model; an explicit causal mask for attended pairs; numpy's percentile; the real
tokenizer for the workload's token counts; the model card path (a) for score agreement.
"""
import csv
import os

import numpy as np
import pytest
import torch

from acarerank.benchmark import report
from acarerank.benchmark.baselines import OfficialTransformers, PrefixCacheTransformers, split_prompt_ids
from acarerank.benchmark.measure import PeakMemory, percentile, time_ms
from acarerank.benchmark.workload import WorkloadSpec, make_workload, token_count
from acarerank.cli import main

TINY = "num_hidden_layers=1,hidden_size=64,intermediate_size=128,num_attention_heads=2,num_key_value_heads=1,head_dim=32"
TINY_KW = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def tiny_model():
    from acarerank.model.default import build_default_model

    m = build_default_model("tiny-cpu", seed=0, **TINY_KW)
    m.set_attn_implementation("sdpa")
    return m


@pytest.fixture(scope="module")
def small_workload(qwen3_tokenizer):
    return make_workload(qwen3_tokenizer, WorkloadSpec(query_tokens=5, question_tokens=7, trace_tokens=30,
                                                       doc_tokens=(3, 17), num_docs=7, seed=1))


def test_bench_quick_run_writes_csv_png_and_checks_scores(tmp_path, capsys):
    rc = main(["bench", "--quick", "--depths", "2,3,4", "--dtype", "float32", "--override", TINY, "--output", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    with open(tmp_path / "bench.csv") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == report.COLUMNS
        rows = list(reader)
    # every backend preference that runs here: "cpp" runs the head's C++ twin end to end (attention
    # keeps its device default), "native" the CPU's default path, "triton" is left out on CPU
    # (interpreter only)
    from acarerank.ops import available_backends
    ours = {f"acarerank-{b}" for b in ("torch", "cpp") if b in available_backends("yes_no", "cpu")}
    if "native" in available_backends("prefix_shared_attention", "cpu"):
        ours.add("acarerank-native")
    providers = {"transformers", "transformers+prefix-cache"} | ours
    assert {r["provider"] for r in rows} == providers
    cells = {(r["mode"], int(r["depth"]), r["provider"]) for r in rows}
    assert cells == {(m, d, p) for m in ("M0", "M3") for d in (2, 3, 4) for p in providers}, sorted(cells)
    for r in rows:
        for col in ("median_ms", "p10_ms", "p90_ms", "docs_per_s", "tokens_per_s", "flop_bound_speedup", "gflop"):
            assert float(r[col]) > 0, (col, r)
        assert float(r["p10_ms"]) <= float(r["median_ms"]) <= float(r["p90_ms"]), r
        assert float(r["max_abs_score_diff"]) <= 1e-4, r
        assert r["random_weights"] == "True" and r["device"] == "cpu" and r["dtype"] == "float32"
        # docs/s and tokens/s are the counts over the median latency
        assert float(r["docs_per_s"]) == pytest.approx(int(r["depth"]) / float(r["median_ms"]) * 1e3, rel=1e-4)
        assert int(r["workload_tokens"]) == int(r["shared_tokens"]) * int(r["depth"]) + int(r["doc_tokens"])
        if r["provider"] == "transformers":
            assert float(r["speedup_vs_transformers"]) == 1.0 and float(r["flop_bound_speedup"]) == 1.0
    with open(tmp_path / "bench.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "scores agree: max |score - score[transformers]|" in out
    assert "depth scaling M3 acarerank-torch" in out and "RANDOM-weight" in out
    # a smoke run's one cold call per cell is not judged: no "NOT within 15%" / "NOT met" noise
    assert "within 15%" not in out and "target M3 depth 50" not in out, out
    assert "targets: not judged in a --quick run" in out, out
    assert (tmp_path / "bench.txt").read_text().strip() == out.strip()


def test_bench_bad_arguments_are_clear_errors(capsys):
    assert main(["bench", "--quick", "--modes", "M9", "--output", "/nonexistent/never"]) == 2
    assert "unknown context mode(s) ['M9']" in capsys.readouterr().err
    assert main(["bench", "--quick", "--depths", "0,2"]) == 2
    assert "depths must be positive ints" in capsys.readouterr().err
    assert main(["bench", "--quick", "--override", "hidden_size"]) == 2
    assert "--override expects key=value" in capsys.readouterr().err
    for bad in ("nan", "-1"):
        assert main(["bench", "--quick", "--max-cell-seconds", bad]) == 2
        assert "max_cell_seconds must be a number >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("flags, needle", [
    (["--depths", "10000000"], "depths must be at most 1,000"),
    (["--depths", "2", "--dtype", "float32,bfloat16", "--extra-dtype-depths", "1001"], "depths must be at most 1,000"),
    (["--trace-tokens", "100000000"], "trace_tokens must be at most 32,768"),
    (["--doc-tokens", "5-99999999"], "doc_tokens must be at most 32,768"),
    (["--workload", "agent", "--docs-per-call", "100000"], "AgentSpec.docs must be at most 1,000"),
    (["--workload", "agent", "--steps", "1000000"], "steps x trace_step_tokens must be at most 32,768"),
    (["--workload", "agent", "--subqueries", "0"], "AgentSpec.subqueries must be a positive int"),
    (["--warmup", "99999999999999999999999"], "warmup must be at most 1,000 (the cap on a count)"),
    (["--repeats", "1001"], "repeats must be at most 1,000 (the cap on a count)"),
    (["--seed", str(2 ** 64)], "seed must be in [-2**63, 2**64), torch.manual_seed's range"),
    (["--workload", "agent", "--seed", str(-2 ** 63 - 1)], "seed must be in [-2**63, 2**64)"),
    # torch's 'negative dimension', transformers' StrictDataclassFieldValidationError, a ZeroDivisionError
    # in the RoPE set-up: exit 1 after the set-up, now the config checks of a checkpoint
    (["--override", "hidden_size=-1"], "config field 'hidden_size' must be a positive int, got -1"),
    (["--override", "hidden_size=nan"], "config field 'hidden_size' must be a positive int, got nan"),
    (["--workload", "agent", "--override", "head_dim=0"], "config field 'head_dim' must be a positive int, got 0"),
    # transformers' StrictDataclassClassValidationError after the set-up (exit 1)
    (["--override", "head_dim=7"], "config field 'head_dim' must be even (RoPE rotates a head's two halves), got 7"),
    # Qwen3Config kept an unknown keyword as an unread attribute: the preset ran unchanged
    (["--override", "num_hidden_layer=1"], "unknown Qwen3Config field(s) in the overrides: 'num_hidden_layer' "
                                           "(did you mean 'num_hidden_layers'?)"),
    (["--workload", "agent", "--override", "bogus_field=3"], "unknown Qwen3Config field(s) in the overrides: 'bogus_field'"),
    # allocated until the host ran out (hidden_size=10**6: 665 GiB of fp32 weights); 10**8 passes no host's memory
    (["--override", "hidden_size=100000000"], "has 17,856,200,000,768 parameters: 6.652e+04 GiB as the float32 weights "
                                             "it is built with, more than the"),
    (["--workload", "agent", "--override", "hidden_size=100000000"], "has 17,856,200,000,768 parameters"),
    # was an IndexError once the set-up had run; now the flag's own usage error, as --providers ''
    (["--backends", ""], "argument --backends: expected comma-separated names, got ''"),
    (["--workload", "agent", "--backends", ","], "argument --backends: expected comma-separated names, got ','"),
    # the agent workload ran without reading these (no peer, one backend, its own repeat count)
    (["--workload", "agent", "--providers", "acarerank"], "--providers is not read by --workload agent"),
    (["--workload", "agent", "--peer", "vllm=http://127.0.0.1:9"], "--peer is not read by --workload agent"),
    (["--workload", "agent", "--backends", "torch,native"], "--backends: --workload agent runs one backend, got "
                                                            "torch,native"),
    (["--workload", "agent", "--repeats", "7"], "--repeats is not read by --workload agent"),
    (["--workload", "agent", "--compile-layers"], "--compile-layers is not read by --workload agent"),
    (["--workload", "agent", "--warmup", "2"], "--warmup is not read by --workload agent"),
    (["--workload", "agent", "--depths", "4"], "--depths is not read by --workload agent"),
    (["--workload", "agent", "--modes", "M0"], "--modes is not read by --workload agent"),
    (["--workload", "agent", "--max-cell-seconds", "20"], "--max-cell-seconds is not read by --workload agent"),
    (["--workload", "agent", "--trace-tokens", "100"], "--trace-tokens is not read by --workload agent"),
    (["--workload", "agent", "--extra-dtype-depths", "4"], "--extra-dtype-depths is not read by --workload agent"),
    (["--steps", "2"], "--steps is not read by --workload depth"),
    (["--subqueries", "1"], "--subqueries is not read by --workload depth"),
    (["--trace-step-tokens", "60"], "--trace-step-tokens is not read by --workload depth"),
    (["--docs-per-call", "3"], "--docs-per-call is not read by --workload depth"),
])
def test_bench_sizes_past_the_caps_are_usage_errors_before_loading(capsys, monkeypatch, flags, needle):
    """Every document and text of the workload is built in memory: a huge depth or length is refused
    (exit 2) before the model loads or the workload is built."""
    from acarerank.benchmark import harness

    def boom(*a, **kw):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(harness, "load_model", boom)
    assert main(["bench", "--quick"] + flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_a_bench_config_with_no_backend_is_refused():
    """The API's own check, now that the command line refuses an empty --backends first."""
    from acarerank.benchmark.harness import BenchConfig

    with pytest.raises(ValueError, match="backends names no backend"):
        BenchConfig(backends=()).validate()


def test_the_automatic_backends_on_a_cpu_leave_cuda_out_in_plain_words():
    """A CPU run leaves the GPU-only backends out with one line each saying why, not the probe's
    "BackendError: yes_no_score: backend 'cuda' needs CUDA tensors" (read as a failure in a
    newcomer's `bash scripts/main.sh --quick`)."""
    from acarerank.benchmark.harness import BenchConfig, pick_backends
    from acarerank.ops import available_backends

    said = []
    chosen = pick_backends(BenchConfig(), torch.device("cpu"), said.append)
    assert "cuda" not in chosen and "triton" not in chosen
    want = {b for b in ("torch", "cpp") if b in available_backends("yes_no", "cpu")}
    if "native" in available_backends("prefix_shared_attention", "cpu"):
        want.add("native")   # the CPU's default path, timed under its own name
    assert set(chosen) == want, chosen
    assert "backend cuda: left out on cpu (it runs on CUDA devices only)" in said, said
    assert not any("Error" in s for s in said), said


@pytest.mark.parametrize("kw", [
    dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    dict(vocab_size=59, hidden_size=48, intermediate_size=7, num_hidden_layers=3, num_attention_heads=6,
         num_key_value_heads=3, head_dim=10, tie_word_embeddings=False, attention_bias=True),
    dict(vocab_size=7, hidden_size=8, intermediate_size=1, num_hidden_layers=1, num_attention_heads=1,
         num_key_value_heads=1, head_dim=2, tie_word_embeddings=False),
])
def test_num_parameters_counts_transformers_parameters(kw):
    """Qwen3Arch.num_parameters (the size check's count, computed before building) is the number of
    parameters transformers' Qwen3ForCausalLM allocates: tied / untied head, attention bias, GQA."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from acarerank.model.arch import Qwen3Arch

    config = Qwen3Config(**kw)
    assert Qwen3Arch.from_config(config).num_parameters() == sum(p.numel() for p in Qwen3ForCausalLM(config).parameters())


def test_bench_override_whose_weights_pass_the_devices_memory_is_a_usage_error(capsys, monkeypatch):
    """bench --override hidden_size=10**6 built a 665 GiB model until the host ran out: the float32
    weights the model is built with are checked against the device's memory before the set-up.
    At exactly the memory the run goes on to load the model; one byte less is exit 2, one line."""
    from transformers import Qwen3ForCausalLM

    from acarerank.benchmark import harness
    from acarerank.model import cached_prefill
    from acarerank.model.default import qwen3_config

    overrides = dict(kv.split("=") for kv in TINY.split(","))
    weights = 4 * sum(p.numel() for p in Qwen3ForCausalLM(qwen3_config("tiny-cpu", **{k: int(v) for k, v in
                                                                                       overrides.items()})).parameters())

    def loaded(*a, **kw):
        raise RuntimeError("load_model reached")

    monkeypatch.setattr(harness, "load_model", loaded)
    monkeypatch.setattr(cached_prefill, "device_memory_bytes", lambda device: weights)
    assert main(["bench", "--quick", "--override", TINY]) == 1  # the set-up ran: the stand-in's error
    assert "load_model reached" in capsys.readouterr().err
    monkeypatch.setattr(cached_prefill, "device_memory_bytes", lambda device: weights - 1)
    assert main(["bench", "--quick", "--override", TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{weights / 4:,.0f} parameters" in err[0] and "of cpu memory" in err[0], err


@pytest.mark.parametrize("name, workload", [("config.json", "depth"), ("config.json", "agent"),
                                            ("model.safetensors.index.json", "depth"), ("tokenizer.json", "depth"),
                                            ("vocab.json", "depth"), ("merges.txt", "agent")])
def test_bench_model_files_over_the_caps_are_refused_before_transformers_reads_them(
        tiny_model, tmp_path, capsys, monkeypatch, name, workload):
    """``bench --model`` loads through transformers, which reads config.json, the safetensors index
    and the tokenizer files whole: each over our loader's cap (a sparse file: no disk, no read) is a
    usage error naming the file, its size and the cap, before transformers opens the folder."""
    import transformers

    from acarerank.model.weights import MAX_CONFIG_BYTES
    from acarerank.tokenizer import MAX_TOKENIZER_BYTES

    ckpt = tmp_path / "ckpt"
    tiny_model.save_pretrained(ckpt)
    capsys.readouterr()  # save_pretrained's progress bar
    cap = MAX_CONFIG_BYTES if name.endswith("json") and name not in ("tokenizer.json", "vocab.json") \
        else MAX_TOKENIZER_BYTES
    with open(ckpt / name, "wb") as f:
        f.truncate(cap + 1)

    def boom(*a, **kw):
        raise AssertionError("transformers read the folder")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", boom)
    rc = main(["bench", "--quick", "--workload", workload, "--model", str(ckpt), "--dtype", "float32",
               "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, (rc, err)
    assert err[0].startswith(f"acarerank bench: error: {ckpt / name}: {cap + 1:,} bytes, more than the "
                             f"{cap:,}-byte cap on {name} (Qwen3's is "), err
    assert err[0].endswith("); not read"), err


def test_a_provider_failing_mid_table_leaves_its_cell_marked_in_the_csv(tmp_path, capsys, monkeypatch):
    """The provider raises at depth 3: exit 1 with one line naming it, and bench.csv holds the cells
    measured before it, then the failing cell with its ``error`` set and no figures."""
    from acarerank.benchmark.harness import AcarerankProvider

    real = AcarerankProvider.score

    def score(self, query, documents, **kw):
        if len(documents) == 3:
            raise RuntimeError("boom\nat depth 3")
        return real(self, query, documents, **kw)

    monkeypatch.setattr(AcarerankProvider, "score", score)
    rc = main(["bench", "--quick", "--depths", "2,3,4", "--modes", "M0", "--dtype", "float32", "--override", TINY,
               "--providers", "transformers,acarerank", "--backends", "torch", "--output", str(tmp_path)])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("acarerank bench:")]
    assert rc == 1 and err == ["acarerank bench: runtime error: ProviderFailed: acarerank-torch: RuntimeError: boom "
                               "at depth 3"], (rc, err)
    with open(tmp_path / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], r["depth"], r["provider"], r["error"]) for r in rows] == [
        ("M0", "2", "transformers", ""), ("M0", "2", "acarerank-torch", ""),
        ("M0", "3", "acarerank-torch", "RuntimeError: boom at depth 3")], rows
    assert rows[-1]["median_ms"] == "" and rows[-1]["dtype"] == "float32", rows[-1]


@pytest.mark.parametrize("exc, rc", [(RuntimeError("boom\nat step 2"), 1), (KeyboardInterrupt(), 130)])
def test_agent_workload_leaves_its_measured_steps_in_the_csv_when_a_step_fails(tmp_path, capsys, monkeypatch,
                                                                               exc, rc):
    """agent.csv was written only at the very end: a provider raising in the second session (or a
    Ctrl-C there) left nothing of the first. Now it is rewritten after every step, as bench.csv after
    every cell, and a failing step gets a last row with its ``error`` set and no figures."""
    from acarerank.benchmark.agent import COLUMNS
    from acarerank.benchmark.baselines import PrefixCacheTransformers

    real, calls = PrefixCacheTransformers.score, []

    def score(self, *a, **kw):
        # --subqueries 1: warm-up + 1 call per step (calls 1-3); --subqueries 2: warm-up (4),
        # step 1 (5, 6), step 2 (7): raise there
        calls.append(1)
        if len(calls) == 7:
            raise exc
        return real(self, *a, **kw)

    monkeypatch.setattr(PrefixCacheTransformers, "score", score)
    got = main(["bench", "--quick", "--workload", "agent", "--subqueries", "1,2", "--steps", "2",
                "--trace-step-tokens", "20", "--docs-per-call", "2", "--dtype", "float32", "--override", TINY,
                "--backends", "torch", "--output", str(tmp_path)])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("acarerank bench:")]
    want_err = ("acarerank bench: runtime error: ProviderFailed: transformers+prefix-cache: RuntimeError: boom "
                "at step 2" if rc == 1 else "acarerank bench: interrupted")
    assert got == rc and err == [want_err], (got, err)
    with open(tmp_path / "agent.csv") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == COLUMNS
        rows = list(reader)
    provs = ("acarerank+cache", "acarerank", "transformers+prefix-cache")
    want = [("1", p, str(k), "") for p in provs for k in (1, 2)] + \
           [("2", p, str(k), "") for p in provs[:2] for k in (1, 2)] + [("2", provs[2], "1", "")]
    if rc == 1:
        want.append(("2", provs[2], "2", "RuntimeError: boom at step 2"))
    assert [(r["subqueries"], r["provider"], r["step"], r["error"]) for r in rows] == want, rows
    for r in rows:
        assert int(r["trace_tokens"]) == 20 * int(r["step"]), r
        if not r["error"]:
            assert float(r["latency_s"]) > 0 and int(r["tokens_computed"]) > 0, r
    if rc == 1:
        assert rows[-1]["latency_s"] == rows[-1]["tokens_computed"] == "", rows[-1]


def test_workload_token_counts_are_exact(qwen3_tokenizer):
    spec = WorkloadSpec(query_tokens=11, question_tokens=23, trace_tokens=157, doc_tokens=(5, 41), num_docs=12, seed=3)
    w = make_workload(qwen3_tokenizer, spec)
    got = [token_count(qwen3_tokenizer, t) for t in (w.query, w.question, w.trace)]
    assert got == [11, 23, 157]
    counts = [token_count(qwen3_tokenizer, d) for d in w.documents]
    assert counts == w.doc_token_counts and all(5 <= n <= 41 for n in counts), counts
    assert make_workload(qwen3_tokenizer, spec).documents == w.documents  # seeded
    assert w.context("M0") == dict(query=w.query, question=None, trace=None)
    assert w.context("M3") == dict(query=w.query, question=w.question, trace=w.trace)


def test_split_prompt_ids_is_the_official_tokenization(qwen3_tokenizer, small_workload):
    """(b)'s shared + segment ids equal the model card's full prompt ids for each document."""
    from acarerank.prompts import joint_input_ids

    w = small_workload
    for mode in ("M0", "M3"):
        ctx = w.context(mode)
        shared, segs = split_prompt_ids(qwen3_tokenizer, documents=w.docs(7), **ctx)
        for d, seg in zip(w.docs(7), segs):
            assert shared + seg == joint_input_ids(qwen3_tokenizer, ctx["query"], d, question=ctx["question"],
                                                   trace=ctx["trace"]), (mode, d)


@pytest.mark.parametrize("plan,make", [
    ("full_padded", lambda m, t: OfficialTransformers(m, t, batch_size=4)),
    ("prefix_padded", lambda m, t: PrefixCacheTransformers(m, t, batch_size=3)),
    ("prefix_packed", None),
])
def test_flop_model_matches_torch_flop_counter(plan, make, tiny_model, qwen3_tokenizer, small_workload):
    """Linear + head FLOPs of each plan equal what FlopCounterMode counts in the real forward.

    FlopCounterMode counts the matrix products (aten.mm) and sees no attention here (CPU
    SDPA; acarerank's attention and yes/no head are custom ops), so it checks the linear
    layers, the padding each plan pays and the head; attention pairs are checked below.
    acarerank's linear layers run on F.linear here (``{"linear": "torch"}``): the counter does not
    see oneDNN's packed-weight product, which does the same multiply-adds.
    """
    from torch.utils.flop_counter import FlopCounterMode

    from acarerank import PointwiseReranker

    w = small_workload
    ctx, docs = w.context("M3"), w.docs(7)
    if make is None:
        prov = PointwiseReranker(model=tiny_model, tokenizer=qwen3_tokenizer, backend={"linear": "torch"})
        batch, counted_parts = 0, ("linear",)
    else:
        prov = make(tiny_model, qwen3_tokenizer)
        batch, counted_parts = prov.batch_size, ("linear", "head")
    shared, segs = split_prompt_ids(qwen3_tokenizer, documents=docs, **ctx)
    fc = FlopCounterMode(display=False)
    with fc:
        prov.score(documents=docs, **ctx)
    counted = sum(fc.get_flop_counts()["Global"].values())
    parts = report.plan_flop_parts(plan, report.Shapes.from_config(tiny_model.config), len(shared),
                                   [len(s) for s in segs], batch)
    assert counted == sum(parts[k] for k in counted_parts), (plan, counted, parts)


@pytest.mark.parametrize("n,cached", [(1, 0), (7, 0), (5, 13), (1, 97), (59, 1)])
def test_attended_pairs_count_the_causal_mask(n, cached):
    mask = torch.ones(n, cached + n, dtype=torch.bool).tril(cached)  # query i sees keys 0..cached+i
    assert report.attended_pairs(n, cached) == int(mask.sum())


def test_percentile_matches_numpy():
    xs = [5.0, 1.0, 4.0, 2.5, 9.0, 7.0, 3.0]
    for q in (0, 10, 50, 90, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), abs=1e-12), q
    assert percentile([3.0], 10) == 3.0
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile(xs, 0.5 - 1)


def test_time_ms_on_cpu_keeps_every_call():
    calls = []
    t = time_ms(lambda: calls.append(1) or len(calls), "cpu", repeats=4, warmup=2)
    assert len(calls) == 6 and t.result == 6 and len(t.times_ms) == len(t.cpu_ms) == 4
    assert min(t.times_ms) <= t.p(20) <= t.median <= t.p(80) <= max(t.times_ms)


def test_score_check_flags_disagreement_and_nan():
    rows = [dict(mode="M3", depth=2, provider="transformers", max_abs_score_diff=0.0),
            dict(mode="M3", depth=2, provider="acarerank-torch", max_abs_score_diff=3e-3)]
    ok, line = report.score_check(rows, 1e-4)
    assert not ok and "SCORES DISAGREE" in line and "acarerank-torch" in line
    rows[1]["max_abs_score_diff"] = float("nan")
    assert not report.score_check(rows, 1e-4)[0]
    rows[1]["max_abs_score_diff"] = 5e-5
    assert report.score_check(rows, 1e-4)[0]


def test_agent_score_check_fails_on_nan_and_missing_scores():
    """The agent session's agreement check (``agent.check``): a NaN score anywhere, or a provider
    that returned fewer steps, requests or documents, is a failure, never agreement."""
    from acarerank.benchmark.agent import check, max_score_diff

    a = [[[0.5, 0.25]], [[0.125, 0.75]]]  # 2 steps x 1 request x 2 documents
    assert max_score_diff(a, a) == 0.0
    nan_later = [[[0.5, 0.25]], [[0.125, float("nan")]]]
    shorter = [[[0.5, 0.25]], [[0.125]]]
    for b in (nan_later, shorter, a[:1], [[[0.5, 0.25]], []]):
        assert max_score_diff(a, b) != max_score_diff(a, b), b  # NaN
        assert not check({"scores": {"acarerank+cache": a, "acarerank": a, "transformers+prefix-cache": b}}), b
        assert not check({"scores": {"acarerank+cache": a, "acarerank": b}}), b


def test_depth_scaling_figure():
    """Marginal ms/doc between the first and second-largest depth vs the last two (docs/benchmarks.md's depth-scaling figure)."""
    t = {10: 100.0, 20: 150.0, 50: 300.0, 100: 560.0}  # 5 ms/doc then 5.2 ms/doc
    rows = [dict(mode="M3", provider="p", depth=d, median_ms=v, doc_tokens=d * 100) for d, v in t.items()]
    (s,) = report.depth_scaling(rows)
    assert s["depths"] == (10, 50, 100)
    assert s["ms_per_doc_low"] == pytest.approx(5.0) and s["ms_per_doc_high"] == pytest.approx(5.2)
    assert s["ratio"] == pytest.approx(1.04) and s["within_target"]
    assert "ratio 1.04 (within 15%)" in report.format_scaling([s])
    assert "ratio 1.04;" in report.format_scaling([s], judge=False)


def test_depth_scaling_line_of_a_falling_latency_reads_n_a():
    """A cold first call (--quick: no warm-up) can make the shallow slope negative: its ratio is
    n/a, not "nan"."""
    rows = [dict(mode="M0", provider="p", depth=d, median_ms=v, doc_tokens=d * 40)
            for d, v in ((2, 625.7), (4, 211.8), (8, 184.0))]
    (s,) = report.depth_scaling(rows)
    assert s["ms_per_doc_low"] < 0 and s["ratio"] != s["ratio"]
    line = report.format_scaling([s])
    assert "ratio n/a (NOT within 15%)" in line and "nan" not in line, line


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="RSS high-water reset needs Linux /proc")
def test_peak_memory_sees_a_cpu_tensor():
    meter = PeakMemory(torch.device("cpu"))
    meter.start()
    x = torch.ones(64 * 2**20 // 4)  # 64 MB, written so every page is resident
    del x
    peak = meter.stop()
    assert meter.kind == "rss_hwm" and 60 <= peak < 200, peak


def test_row_targets_are_speedups_over_each_baseline():
    rows = [dict(mode="M3", depth=50, provider=p, median_ms=v)
            for p, v in (("transformers", 600.0), ("transformers+prefix-cache", 200.0), ("acarerank-torch", 100.0))]
    text = report.format_targets(rows)
    assert "acarerank-torch is 6.00x transformers (target >= 5x: met)" in text, text
    assert "acarerank-torch is 2.00x transformers+prefix-cache (target >= 1.6x: met)" in text, text
    rows[2]["median_ms"] = 150.0
    assert "1.33x transformers+prefix-cache (target >= 1.6x: NOT met)" in report.format_targets(rows)
    assert "not measured" in report.format_targets(rows, depth=20)


# -- dtypes side by side ----------------------------------------------------------------
def test_kendall_tau_counts_concordant_pairs():
    a = [0.9, 0.1, 0.5, 0.7, 0.3]
    b = [0.8, 0.2, 0.3, 0.9, 0.4]  # pairs: 10; discordant (0,3) and (2,4): tau = (8 - 2) / 10
    assert report.kendall_tau(a, b) == pytest.approx(0.6)
    assert report.kendall_tau(a, a) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="5 vs 2"):
        report.kendall_tau(a, b[:2])


def test_rank_agreement_and_dtype_targets():
    def row(dt, prov, ms, frac):
        return dict(mode="M3", depth=50, provider=prov, dtype=dt, median_ms=ms, peak_fraction=frac,
                    achieved_gflops=frac * 100, gemm_peak_gflops=100.0, kendall_tau_vs_float32=float("nan"))
    rows = [row("float32", "acarerank-torch", 1000.0, 0.87), row("bfloat16", "acarerank-torch", 600.0, 0.60)]
    scores = {("float32", "M3", 50, "acarerank-torch"): [0.1, 0.2, 0.3],
              ("bfloat16", "M3", 50, "acarerank-torch"): [0.1, 0.3, 0.2]}
    agree = report.rank_agreement(rows, scores)
    assert [a["tau"] for a in agree] == [pytest.approx(1 / 3)] and rows[1]["kendall_tau_vs_float32"] == agree[0]["tau"]
    text = report.format_dtype_targets(rows)
    assert "float32 at 87.0% of the float32 GEMM peak" in text and "target >= 85%: met" in text, text
    assert "bfloat16 at 60.0%" in text and "target >= 65%: NOT met" in text, text
    assert "bfloat16 is 1.67x float32 (target >= 1.6x: met)" in text, text


def test_gemm_peak_shapes_are_the_model_linears(tiny_model):
    """The peak is measured at the weight shapes of the model's own linear layers."""
    from acarerank.benchmark.gemm_peak import gemm_peak, linear_shapes

    sh = report.Shapes.from_config(tiny_model.config)
    L = tiny_model.model.layers[0]
    ref = {"qkv": (L.self_attn.q_proj.in_features, sum(m.out_features for m in
                                                       (L.self_attn.q_proj, L.self_attn.k_proj, L.self_attn.v_proj))),
           "o": (L.self_attn.o_proj.in_features, L.self_attn.o_proj.out_features),
           "gate_up": (L.mlp.gate_proj.in_features, L.mlp.gate_proj.out_features + L.mlp.up_proj.out_features),
           "down": (L.mlp.down_proj.in_features, L.mlp.down_proj.out_features)}
    assert linear_shapes(sh) == ref
    pk = gemm_peak(sh, torch.float32, rows=64, repeats=2)
    assert pk["peak_gflops"] == max(pk["per_shape"].values()) > 0 and set(pk["per_shape"]) == set(ref)


def test_gemm_peak_best_of_keeps_each_shapes_fastest_measurement():
    """A peak measured while something else ran (lower rates) never lowers the merged one."""
    from acarerank.benchmark.gemm_peak import best_of

    first = dict(dtype="float32", rows=2048, per_shape=dict(qkv=79.0, o=368.0, gate_up=72.0, down=364.0),
                 peak_gflops=368.0)
    second = dict(first, per_shape=dict(qkv=317.0, o=358.0, gate_up=316.0, down=370.0), peak_gflops=370.0)
    merged = best_of(first, second)
    assert merged["per_shape"] == dict(qkv=317.0, o=368.0, gate_up=316.0, down=370.0)
    assert merged["peak_gflops"] == 370.0 and best_of(first) == first
    with pytest.raises(ValueError, match="one dtype and row count"):
        best_of(first, dict(second, dtype="bfloat16"))
    with pytest.raises(ValueError):
        best_of()


def test_bench_two_dtypes_side_by_side(tmp_path, capsys):
    rc = main(["bench", "--quick", "--depths", "2,3", "--modes", "M3", "--dtype", "float32,bfloat16,float32",
               "--providers", "transformers+prefix-cache,acarerank", "--backends", "torch", "--override", TINY,
               "--output", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    with open(tmp_path / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["dtype"], int(r["depth"]), r["provider"]) for r in rows] == [
        (dt, d, p) for dt in ("float32", "bfloat16") for d in (2, 3) for p in ("transformers+prefix-cache",
                                                                                 "acarerank-torch")]
    for r in rows:
        assert float(r["peak_fraction"]) == pytest.approx(
            float(r["gflop"]) / (float(r["median_ms"]) / 1e3) / float(r["gemm_peak_gflops"]), rel=1e-4)
        if r["dtype"] == "float32":
            assert r["kendall_tau_vs_float32"] == "nan", r
        else:
            assert -1.0 <= float(r["kendall_tau_vs_float32"]) <= 1.0, r
    assert "[bench] dtype bfloat16: asked for explicitly" in captured.err
    assert "dtype bfloat16 (asked for explicitly); GEMM peak" in captured.out
    assert "rank agreement M3 depth 3 acarerank-torch" in captured.out
    assert "--dtype float32,bfloat16 --extra-dtype-depths 2,3" in captured.out


def test_no_timed_call_runs_on_a_freshly_trimmed_heap(monkeypatch):
    """The memory meter trims glibc's heap (malloc_trim) at its start; it ran before every timed
    call, so each one page-faulted the heap `--malloc tuned` keeps again (~41,500 faults a call,
    2-12 % slower). Now each provider's peak comes from one untimed call before the timed ones, and
    every provider runs once more, untimed, after the last trim (the later providers' trims took
    the heap an earlier one had grown: its first timed call faulted ~50,000 pages again)."""
    from acarerank.benchmark import harness

    events = []

    class Meter(PeakMemory):
        def start(self):  # the CPU meter's start trims the heap
            events.append(("trim",))
            super().start()

    real_timed = harness.timed_call

    def timed_call(fn, device):
        events.append(("timed",))
        return real_timed(fn, device)

    monkeypatch.setattr(harness, "timed_call", timed_call)

    class Fake:
        def __init__(self, name):
            self.name = name

        def score(self, query, documents, **kw):
            events.append(("call", self.name))
            x = torch.ones(8 * 2**20 // 4)  # 8 MB touched: a peak the meter sees
            return [float(x[0])] * len(documents)

    cfg = harness.BenchConfig(repeats=3, max_cell_seconds=100.0)
    providers = [Fake("a"), Fake("b")]
    times, scores, peaks = harness._time_cell(cfg, providers, ["d1", "d2"], dict(query="q"),
                                              Meter("cpu"), "cpu")
    assert {n: len(t) for n, t in times.items()} == {"a": 3, "b": 3}, times
    assert scores == {"a": [1.0, 1.0], "b": [1.0, 1.0]}, scores
    first_timed = events.index(("timed",))
    assert ("trim",) not in events[first_timed:], events
    assert events[:first_timed] == [("trim",), ("call", "a"), ("trim",), ("call", "b"), ("call", "a")], events
    if os.path.exists("/proc/self/clear_refs"):  # the RSS meter sees each call's 8 MB
        assert all(v >= 4 for v in peaks.values()), peaks


def test_agent_workload_in_bf16_is_judged_by_the_bf16_tolerance(tmp_path, capsys):
    """The agent session's check held every dtype to fp32's 1e-5 against transformers, so a bf16
    run (`--dtype auto` on a CPU with native bf16) always exited 1, with no line saying why. Now
    the dtype's tolerance (the depth workload's SCORE_TOLERANCE in bf16), on a PASS/FAIL line."""
    from acarerank.benchmark.harness import SCORE_TOLERANCE

    rc = main(["bench", "--quick", "--workload", "agent", "--subqueries", "1", "--steps", "2",
               "--trace-step-tokens", "60", "--docs-per-call", "3", "--dtype", "bfloat16", "--override", TINY,
               "--backends", "torch", "--output", str(tmp_path)])
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("score check:")]
    assert rc == 0 and len(lines) == 1, (rc, out[-2000:])
    tol = SCORE_TOLERANCE["bfloat16"]
    assert lines[0].startswith("score check: PASS:") and f"(tolerance {tol:g})" in lines[0] \
        and lines[0].endswith("[bfloat16]"), lines[0]
    with open(tmp_path / "agent.txt") as f:
        assert lines[0] in f.read().splitlines()


def test_agent_score_check_line_names_the_worst_difference_and_the_tolerance():
    from acarerank.benchmark.agent import check_line, tolerance

    a, b = [[[0.5, 0.25]]], [[[0.5, 0.28]]]
    ok, line = check_line({"scores": {"acarerank+cache": a, "acarerank": a, "transformers+prefix-cache": b}},
                          tolerance("float32"))
    assert not ok and line == ("score check: FAIL: acarerank+cache vs acarerank: max |diff| 0.00e+00 (tolerance "
                               "1e-06); acarerank+cache vs transformers+prefix-cache: max |diff| 3.00e-02 "
                               "(tolerance 1e-05)"), line
    assert check_line({"scores": {"acarerank+cache": a, "transformers+prefix-cache": b}}, tolerance("bfloat16"))[0]


def test_agent_cache_check_in_16_bit_is_the_dtypes_tolerance():
    """Cache on against off was held to fp32's 1e-6 in every dtype: a bf16 session (1.5e-3 apart,
    the context computed in pieces or whole) still failed with exit 1."""
    from acarerank.benchmark.agent import CACHE_TOLERANCE, cache_tolerance, check_line, tolerance
    from acarerank.benchmark.harness import SCORE_TOLERANCE

    a, b = [[[0.5, 0.25]]], [[[0.5, 0.2515]]]
    res = {"scores": {"acarerank+cache": a, "acarerank": b, "transformers+prefix-cache": b}}
    assert cache_tolerance("float32") == CACHE_TOLERANCE and cache_tolerance("bfloat16") == SCORE_TOLERANCE["bfloat16"]
    assert check_line(res, tolerance("bfloat16"), cache_tolerance("bfloat16"))[0]
    assert not check_line(res, tolerance("float32"), cache_tolerance("float32"))[0]


def test_a_mode_or_provider_given_twice_runs_once():
    """--modes M0,M0 ran every M0 cell twice (and a provider named twice took two turns under one
    name); depths were already deduplicated. Now duplicates are dropped, the order kept."""
    from acarerank.benchmark.harness import BenchConfig

    cfg = BenchConfig(depths=(4, 2, 4), modes=("M3", "M0", "M3"),
                      providers=("acarerank", "transformers", "acarerank"),
                      backends=("torch", "native", "torch")).validate()
    assert (cfg.depths, cfg.modes, cfg.providers, cfg.backends) == (
        (2, 4), ("M3", "M0"), ("acarerank", "transformers"), ("torch", "native")), cfg


def test_an_agent_trace_cut_on_a_newline_keeps_its_token_count(qwen3_tokenizer):
    """A trace whose n-th token was the newline between two steps came out one token short (the
    cut was right-stripped), so ``--workload agent --steps 2 --trace-step-tokens 30`` stopped with
    'internal: text of 59 tokens is shorter than the 60 wanted' (exit 2). Every trace now has its
    token count exactly."""
    import random

    from acarerank.benchmark.agent import AgentSpec, make_session
    from acarerank.benchmark.workload import _trace, vocab_words

    session = make_session(qwen3_tokenizer, AgentSpec(steps=2, trace_step_tokens=30, question_tokens=30,
                                                      query_tokens=10, docs=3, doc_tokens=(20, 60)))
    assert [token_count(qwen3_tokenizer, step[0].trace) for step in session] == [30, 60]
    words = vocab_words(qwen3_tokenizer)
    got = {seed: token_count(qwen3_tokenizer, _trace(qwen3_tokenizer, random.Random(seed), words, 60))
           for seed in range(170, 180)}  # seed 175's 60th token is a newline
    assert got == dict.fromkeys(range(170, 180), 60), got
