"""bench/bench_setwise_peer.py without a vLLM: its arguments, the completion body it sends for a
prompt and the check of vLLM's answer, the least work it credits a round with (the common head of
a batch once), and vllm_cpu.sh's generate runner from its dry run.

References: hand-written bodies and answers of vLLM's /v1/completions (prompt as token ids,
usage.prompt_tokens / completion_tokens); ``report.least_work_select_flops`` (hand-counted in
test_bench_flop_hand_counts.py) per prompt; the script's commands printed by ``--dry-run``.
"""
import os
import subprocess
import sys

import pytest

import _repo
from acarerank.benchmark import report

ROOT = str(_repo.ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
SH = report.Shapes(hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=50)


@pytest.fixture()
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_arguments_and_their_defaults(model_dir):
    from bench_setwise_peer import parse_args

    a = parse_args(["--model", model_dir, "--peer", "http://127.0.0.1:8001/"])
    assert (a.pools, a.batches, a.dtype, a.repeats, a.doc_tokens) == ([20, 50], [1, 8], "float32", 3, [60, 380])
    assert a.peer == "http://127.0.0.1:8001" and a.end_bias == -0.3 and a.settle_s == 5.0
    a = parse_args(["--model", model_dir, "--peer", "http://x:1", "--pools", "10", "--batches", "2,4",
                    "--dtype", "bfloat16", "--end-bias", "nan"])
    assert (a.pools, a.batches, a.dtype) == ([10], [2, 4], "bfloat16") and a.end_bias != a.end_bias


@pytest.mark.parametrize("flags, needle", [
    (["--pools", "1"], "--pools values must be in [2, 1000]"), (["--pools", "a"], "comma-separated ints"),
    (["--batches", "0"], "--batches values must be in [1, 64]"), (["--repeats", "0"], "--repeats must be in"),
    (["--doc-tokens", "380,60"], "low <= high"), (["--doc-tokens", "60"], "low,high"),
    (["--dtype", "float16"], "invalid choice"), (["--peer", "127.0.0.1:8001"], "--peer must be an http(s) URL"),
    (["--model", "/nowhere"], "has no config.json"), (["--settle-s", "-1"], "--settle-s must be in [0, 60]")])
def test_bad_arguments_are_usage_errors(model_dir, capsys, flags, needle):
    from bench_setwise_peer import parse_args

    with pytest.raises(SystemExit) as e:  # a flag given twice: argparse keeps the last
        parse_args(["--model", model_dir, "--peer", "http://127.0.0.1:8001"] + flags)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_the_completion_body_asks_for_the_same_work():
    from bench_setwise_peer import check_completion, completion_body

    body = completion_body("m", [151644, 8948, 198], 7, "salt")
    assert body == {"model": "m", "prompt": [151644, 8948, 198], "max_tokens": 7, "temperature": 0.0,
                    "ignore_eos": True, "stream": False, "cache_salt": "salt"}
    for bad in (([], 7), ([1], 0)):
        with pytest.raises(ValueError, match="max_tokens >= 1"):
            completion_body("m", *bad, "salt")
    answer = {"choices": [{"text": " [3] [1]", "finish_reason": "length"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}}
    check_completion(answer, 3, 7)
    for usage in ({"prompt_tokens": 3, "completion_tokens": 2}, {"prompt_tokens": 2, "completion_tokens": 7}, {}):
        with pytest.raises(ValueError, match="other work than asked"):  # stopped early, cut prompt, no usage
            check_completion(dict(answer, usage=usage), 3, 7)


def test_a_round_is_credited_with_its_common_head_once():
    from bench_setwise_peer import batch_flops

    one = report.least_work_select_flops
    assert batch_flops(SH, [[1, 2, 3, 4, 5]], [3], 14) == one(SH, 5, 3, 14)
    # two prompts sharing [1, 2]: the second's 2 head tokens are cached
    two = batch_flops(SH, [[1, 2, 3, 4, 5], [1, 2, 9, 9]], [3, 2], 14)
    assert two == one(SH, 5, 3, 14) + one(SH, 4, 2, 14, cached=2)
    # identical prompts: all but the last token is common (the last is fed, it makes the first new token)
    assert batch_flops(SH, [[1, 2, 3], [1, 2, 3]], [1, 1], 14) == one(SH, 3, 1, 14) + one(SH, 3, 1, 14, cached=2)


def test_vllm_script_serves_the_causal_lm_for_generate(tmp_path):
    path = os.path.join(ROOT, "bench", "peers", "vllm_cpu.sh")
    env = dict(os.environ, PYTHON=sys.executable, ACARERANK_PEERS_CACHE=str(tmp_path / "cache"))

    def run(*a):
        return subprocess.run(["bash", path, *a], env=env, capture_output=True, text=True, timeout=60)

    d = run("--dry-run", "--port", "18999", "--runner", "generate", "--dtype", "bfloat16", "--preset",
            "qwen3-reranker-0.6b")
    assert d.returncode == 0 and d.stdout.strip() == "http://127.0.0.1:18999", d.stderr
    serve = [line for line in d.stderr.splitlines() if "api_server" in line]
    assert len(serve) == 1, d.stderr
    for want in ("--runner generate", "--max-model-len 16384", "--dtype bfloat16",
                 "models/qwen3-reranker-0.6b-seed0 --served-model-name qwen3-reranker-0.6b-seed0"):
        assert want in serve[0], (want, serve[0])
    for pooling_only in ("--hf-overrides", "--chat-template", "--runner pooling"):
        assert pooling_only not in serve[0], serve[0]
    # the same folder as the reranker's: prepare_model writes the preset's Qwen3ForCausalLM once
    assert "prepare_model.py --out " + str(tmp_path / "cache" / "models" / "qwen3-reranker-0.6b-seed0") in d.stderr
    assert "--max-model-len 4096" in run("--dry-run", "--runner", "generate", "--max-model-len", "4096").stderr
    assert "--max-model-len 8192" in run("--dry-run").stderr  # pooling keeps its length
    for bad, needle in ((["--runner", "score"], "--runner must be pooling or generate"),
                        (["--max-model-len", "0"], "--max-model-len must be a positive number"),
                        (["--max-model-len", "x"], "--max-model-len must be a positive number")):
        p = run("--dry-run", *bad)
        assert p.returncode == 2 and needle in p.stderr, p.stderr
    assert "--runner R" in run("--help").stdout


def test_a_round_posts_every_body_and_refuses_other_work():
    """``vllm_round`` against a stand-in for vLLM's /v1/completions (a local HTTP server answering
    with the usage a body asks for, or one token short: an early stop, which is other work)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from bench_setwise_peer import completion_body, vllm_round

    seen, short = [], [0]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, body))
            usage = dict(prompt_tokens=len(body["prompt"]), completion_tokens=body["max_tokens"] - short[0])
            out = json.dumps(dict(choices=[dict(text="x")], usage=usage)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        bodies = [completion_body("m", list(range(1, 4 + i)), 2 + i, "s") for i in range(8)]
        assert vllm_round(url, bodies) > 0
        assert sorted(b["max_tokens"] for _, b in seen) == list(range(2, 10)) and {p for p, _ in seen} == {
            "/v1/completions"}
        short[0] = 1
        with pytest.raises(ValueError, match="other work than asked"):
            vllm_round(url, bodies[:1])
    finally:
        server.shutdown()
        server.server_close()


def test_the_settle_wait_ends_at_the_first_quiet_window_or_at_its_bound():
    """wait_for_quiet_cpu: busy windows keep it waiting, the first window under the threshold ends
    it (quiet), a machine busy throughout ends it at the bound (not quiet); no /proc/stat: no wait."""
    from acarerank.benchmark.measure import wait_for_quiet_cpu

    def sampler(busy_fractions):   # (busy, total) jiffies: each window adds 100 with this busy share
        state = {"busy": 0, "total": 0, "i": 0}

        def sample():
            if state["i"]:
                state["busy"] += round(100 * busy_fractions[min(state["i"] - 1, len(busy_fractions) - 1)])
                state["total"] += 100
            state["i"] += 1
            return state["busy"], state["total"]
        return sample, state

    sample, state = sampler([0.9, 0.6, 0.05])
    waited, quiet = wait_for_quiet_cpu(max_wait_s=5.0, window_s=0.01, sample=sample)
    assert quiet and state["i"] == 4 and waited < 5.0, (waited, state)
    sample, state = sampler([0.5])
    waited, quiet = wait_for_quiet_cpu(max_wait_s=0.05, window_s=0.01, sample=sample)
    assert not quiet and waited >= 0.05, waited
    assert wait_for_quiet_cpu(sample=lambda: None) == (0.0, True)


def test_the_settle_wait_reads_proc_stat_without_counting_guest_time_twice():
    """/proc/stat's guest and guest_nice are already inside user and nice (proc(5)): a VM host's
    line 100 busy of 1,000 is 10 % busy, not (100 + 400 guest) / 1,400 = 36 % (over the 15 %
    threshold: the wait never ended quiet on such a host)."""
    from acarerank.benchmark.measure import _jiffies_of

    # user nice system idle iowait irq softirq steal guest guest_nice
    assert _jiffies_of("cpu  80 0 20 850 50 0 0 0 400 0") == (100, 1000)
    assert _jiffies_of("cpu  80 0 20 850 50 0 0 0") == (100, 1000)   # a kernel without the guest fields
    assert _jiffies_of("cpu  80 0 20 900") == (100, 1000)           # nor iowait onwards


def test_malloc_env_runs_each_variant_in_its_own_child_and_a_failed_child_fails_the_bench(
        tmp_path, model_dir, monkeypatch, capsys):
    """--malloc-env end to end on a 1-layer random model (real vocabulary, saved as a folder), this
    process the parent: each variant's child (the worker thread, as serve runs its model; 1 pass,
    1 round) gives a row per (pool, B) with a positive time and fault count, the variant's MALLOC_*
    settings (the caller's MALLOC_ARENA_MAX dropped: the child checks what it started with), the
    ratio to default (1 for default itself); the txt's JSON line names the variants. A child that
    fails (a folder whose config.json is ``{}``: from_pretrained raises in the child) makes the
    bench return 1 with the child's traceback, and no CSV."""
    import csv
    import json

    from _tiny import random_qwen3

    from bench_setwise_peer import MALLOC_VARIANTS, main

    random_qwen3(layers=1).save_pretrained(str(tmp_path / "model"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")   # "default" must not pass the caller's on

    def run(model, out):
        return main(["--model", model, "--pools", "4", "--batches", "1,2", "--doc-tokens", "20,40", "--repeats", "1",
                     "--settle-s", "0", "--malloc-passes", "1", "--malloc-threads", "worker",
                     "--malloc-env", "default,thresholds", "--out", str(out)])

    assert run(str(tmp_path / "model"), tmp_path / "out") == 0, capsys.readouterr().err[-3000:]
    with open(tmp_path / "out" / "setwise_malloc.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["thread"], r["variant"], r["pool"], r["batch"]) for r in rows] == [
        ("worker", v, "4", b) for v in ("default", "thresholds") for b in ("1", "2")]
    for r in rows:
        assert float(r["ms_per_selection"]) > 0 and float(r["minflt_per_selection"]) > 0, r
        assert float(r["peak_rss_mb"]) > 0 and r["repeats"] == "1" and float(r["s_per_selection_all"]) >= 0, r
        assert r["malloc_env"] == " ".join(f"{k}={v}" for k, v in MALLOC_VARIANTS[r["variant"]].items()), r
        assert int(r["new_tokens"]) >= int(r["batch"]) and int(r["prompt_tokens"]) > 0, r
    assert all(float(r["x_default"]) == 1.0 for r in rows if r["variant"] == "default")
    assert all(float(r["x_default"]) > 0 for r in rows)
    head = json.loads((tmp_path / "out" / "setwise_malloc.txt").read_text().splitlines()[0])
    assert head["variants"] == {v: MALLOC_VARIANTS[v] for v in ("default", "thresholds")}
    capsys.readouterr()

    assert run(model_dir, tmp_path / "broken") == 1
    err = capsys.readouterr().err
    assert "the default child (worker thread, pass 1) failed (exit 1)" in err and "Traceback" in err, err
    assert not (tmp_path / "broken" / "setwise_malloc.csv").exists()


@pytest.mark.parametrize("flags, needle", [
    (["--malloc-env", "thresholds"], "needs default among its variants"),
    (["--malloc-env", "default,tcmalloc"], "distinct names of default, thresholds, arena1"),
    (["--malloc-env", "default,default"], "distinct names"),
    (["--malloc-env", "default", "--malloc-threads", "io"], "distinct names of main, worker"),
    (["--malloc-env", "default", "--malloc-passes", "0"], "--malloc-passes must be in [1, 20]"),
    (["--malloc-env", "default", "--peer", "http://x:1"], "drop --peer"), ([], "--peer is required"),
    # without --malloc-env they were ignored: the run timed vLLM instead
    (["--peer", "http://x:1", "--malloc-passes", "3"], "--malloc-passes only apply with --malloc-env"),
    (["--peer", "http://x:1", "--malloc-threads", "main"], "--malloc-threads only apply with --malloc-env"),
    # inherited by the children, they made "default" something other than glibc's own allocator
    (["--malloc-env", "default", "LD_PRELOAD=/usr/lib/libtcmalloc.so"], "unset LD_PRELOAD first"),
    (["--malloc-env", "default", "GLIBC_TUNABLES=glibc.malloc.arena_max=1"], "unset GLIBC_TUNABLES first")])
def test_bad_malloc_flags_are_usage_errors(model_dir, capsys, monkeypatch, flags, needle):
    from bench_setwise_peer import parse_args

    for f in [f for f in flags if "=" in f and not f.startswith("-")]:   # an environment variable, not a flag
        monkeypatch.setenv(*f.split("=", 1))
        flags = [x for x in flags if x != f]
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", model_dir] + flags)
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("end_bias", ["-0.3", "-1e-05", "-inf", "2.5e-07"])
def test_a_malloc_child_gets_the_parents_arguments(model_dir, end_bias):
    """A --malloc-env child parses back the parent's workload: its argv through parse_args gives the
    same values (a child started with "--end-bias -1e-05" exited 2, 'expected one argument': argparse
    takes a negative in exponent form for a flag)."""
    from bench_setwise_peer import _child_argv, parse_args

    parent = parse_args(["--model", model_dir, "--malloc-env", "default", "--end-bias=" + end_bias, "--pools", "4,6",
                         "--batches", "1,2", "--doc-tokens", "20,40", "--repeats", "2", "--settle-s", "0.5"])
    child = parse_args(_child_argv(parent, "worker")[2:])
    assert child._child == "worker" and child.malloc_env is None
    for name in ("model", "dtype", "pools", "batches", "doc_tokens", "repeats", "end_bias", "settle_s"):
        assert getattr(child, name) == getattr(parent, name), name
