"""``ServeConfig``: one place for every serving option; the CLI and the Ray deployment use it.

No server here: the flags round-trip, bad values name their flag, the configuration and the
CLI parser import neither torch nor FastAPI, nothing in the server imports ``acarerank.cli``,
and ``acarerank serve`` without the serving extra says what to install in one line. One test
builds the embedded model: ``--cache-budget`` bounds both of its prefix caches.
"""
import argparse
import ast
import dataclasses
import pathlib
import subprocess
import sys

import pytest

from acarerank.server.config import ServeConfig, _flag

from _repo import ROOT


def test_flags_round_trip_with_the_dataclass_defaults():
    parser = ServeConfig.add_cli_args(argparse.ArgumentParser())
    assert ServeConfig.from_cli_args(parser.parse_args([])) == ServeConfig()
    args = parser.parse_args(["--max-queue", "3", "--trust-cache", "--header-timeout", "1.5", "--dtype", "float32",
                              "--max-batch-tokens", "64", "--model", "/m", "--max-queue-tokens", "50000"])
    config = ServeConfig.from_cli_args(args)
    want = dataclasses.replace(ServeConfig(), max_queue=3, trust_cache=True, header_timeout=1.5, dtype="float32",
                               max_batch_tokens=64, model="/m", max_queue_tokens=50000)
    assert config == want
    flags = {a.dest for a in parser._actions} - {"help"}
    assert flags == {f.name for f in dataclasses.fields(ServeConfig)}


@pytest.mark.parametrize("field,value,flag", [("max_queue", 0, "--max-queue"), ("body_timeout", -1.0, "--body-timeout"),
                                              ("max_connections", True, "--max-connections"),
                                              ("max_salt_chars", 2.5, "--max-salt-chars"), ("port", 70000, "--port"),
                                              ("canary_after_failures", 0, "--canary-after-failures"),
                                              ("max_queue_tokens", 0, "--max-queue-tokens"),
                                              ("max_queue_tokens", 1.5, "--max-queue-tokens"),
                                              ("token_wait_timeout", 0, "--token-wait-timeout"),
                                              ("token_wait_timeout", float("nan"), "--token-wait-timeout"),
                                              ("max_pass_timeout", 0, "--max-pass-timeout"),
                                              ("max_pass_timeout", -1.0, "--max-pass-timeout"),
                                              ("max_pass_timeout", float("nan"), "--max-pass-timeout")])
def test_bad_values_name_their_flag(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        ServeConfig(**{field: value})


@pytest.mark.parametrize("field", ["max_queue", "max_documents", "tokenize_workers", "max_body_bytes",
                                   "token_wait_timeout", "dtype"])
def test_none_is_refused_where_a_field_has_no_off(field):
    """None passed the check of every field, so build_app(max_queue=None) failed on its own arithmetic
    (TypeError: NoneType + int) and build_app(max_documents=None) deployed, each replica then failing
    to start; only the Optional fields (max_queue_tokens, cache_budget, ...) take None."""
    with pytest.raises(ValueError, match=rf"^{_flag(field)} must be set \(None is not a value of it"):
        ServeConfig(**{field: None})
    assert ServeConfig(max_queue_tokens=None, cache_budget=None, request_timeout=None).max_queue_tokens is None


def test_select_max_new_tokens_is_capped_at_startup_as_every_select_is():
    """A server with --select-max-new-tokens past the setwise cap started, then answered every
    /v1/select of up to 1,000 documents with a 400 naming that cap: it is a flag error now, the
    same number as the reranker's per-call cap."""
    from acarerank.server.config import MAX_SELECT_NEW_TOKENS
    from acarerank.setwise.grammar import max_new_tokens_cap

    assert MAX_SELECT_NEW_TOKENS == max_new_tokens_cap(1) == max_new_tokens_cap(1000) == 6001
    assert ServeConfig(select_max_new_tokens=6001).select_max_new_tokens == 6001
    with pytest.raises(ValueError, match=r"^--select-max-new-tokens must be at most 6,001 .*got 6,002$"):
        ServeConfig(select_max_new_tokens=6002)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("value, max_pass_s, timeout", [
    # value: (accepted by /health's max_pass_s, accepted as a --*-timeout)
    (NAN, False, False), (-1.0, False, False), (0, True, False), (0.0, True, False), (0.25, True, True),
    (1e30, True, True), (INF, False, True), (-INF, False, False), pytest.param(10 ** 400, False, True, id="10**400"),
    (True, False, False), ("5", False, False)])
def test_the_duration_checks_are_one_rule(value, max_pass_s, timeout):
    """/health's max_pass_s, RerankService's request_timeout and ServeConfig's durations were three
    hand-written checks; now one (``acarerank._validate.check_seconds``): NaN never, inf only as a
    timeout (no limit), 0 only as a health bound, each message naming its field or flag."""
    from acarerank.server.probes import check_max_pass_s

    if max_pass_s:
        check_max_pass_s(value)
    else:
        with pytest.raises(ValueError, match=r"^max_pass_s must be a finite number >= 0 \(seconds\) or None, got "):
            check_max_pass_s(value)
    for field in ("request_timeout", "header_timeout", "body_timeout", "keepalive_timeout", "send_timeout",
                  "drain_timeout"):
        flag = "--" + field.replace("_", "-")
        if timeout:
            got = getattr(ServeConfig(**{field: value}), field)
            # the float the timers are given: an int past a float's range is no limit, not an OverflowError
            # in loop.time() + timeout when the first request arrives
            assert type(got) is float and got == (INF if value == 10 ** 400 else value), (field, got)
        elif isinstance(value, str) or isinstance(value, bool):
            with pytest.raises(ValueError, match=rf"^{flag} must be a number, got "):
                ServeConfig(**{field: value})
        else:
            with pytest.raises(ValueError, match=rf"^{flag} must be a number > 0 \(seconds; inf: no limit\), got "):
                ServeConfig(**{field: value})


def test_cli_parser_imports_neither_torch_nor_fastapi():
    code = ("import sys, argparse; from acarerank.cli import serve; p = argparse.ArgumentParser(); "
            "sub = p.add_subparsers(); serve.add_parser(sub); p.parse_args(['serve', '--max-queue', '2']); "
            "print(sorted(m for m in ('torch', 'fastapi', 'uvicorn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_server_never_imports_the_cli():
    """Nothing under acarerank/server imports acarerank.cli (counting imports inside functions)."""
    offenders = []
    for path in (ROOT / "acarerank" / "server").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = ("." * node.level) + (node.module or "")
                if mod in ("..cli", "acarerank.cli") or mod.startswith(("..cli.", "acarerank.cli.")):
                    offenders.append(f"{path.name}:{node.lineno} from {mod}")
            elif isinstance(node, ast.Import):
                offenders += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                              if a.name.startswith("acarerank.cli")]
    assert not offenders, offenders


def test_serve_without_the_extra_says_what_to_install():
    blocker = ("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('fastapi', 'uvicorn'):\n"
               "            raise ImportError(name + ' blocked by the test')\n"
               "sys.meta_path.insert(0, Block())\n"
               "from acarerank.cli import main\n"
               "sys.exit(main(['serve']))\n")
    out = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'acarerank[serve]'" in lines[0], out.stderr[-2000:]
    assert "fastapi" in lines[0] and "uvicorn" in lines[0]


def test_cache_budget_bounds_the_select_cache_too():
    """The setwise reranker behind /v1/select keeps its own prompt cache: --cache-budget sizes it
    too, else the first selection allocates the device default (8 GiB on a GPU) beyond the budget."""
    pytest.importorskip("torch")
    from acarerank.server.build import build_rerankers

    rr, sr = build_rerankers(ServeConfig(cache_budget=256, dtype="float32"))
    assert rr.cache_stats()["budget_tokens"] == sr.cache_stats()["budget_tokens"] == 256


def test_a_cache_budget_under_one_page_stops_the_start_up(tmp_path):
    """--cache-budget under one page of the prefix cache (16 tokens) held nothing and ran every
    request alone (its pinned-token window was one request), silently: acarerank serve now stops
    before it listens, one line naming the flag, the page and the least budget, exit 2."""
    pytest.importorskip("torch")
    from serve_util import tiny_model

    tiny_model().save_pretrained(tmp_path)
    # a child process: a server that started would serve until the timeout, never return
    cmd = [sys.executable, "-c", "import sys; from acarerank.cli import main; sys.exit(main())", "serve",
           "--model", str(tmp_path), "--dtype", "float32", "--port", "0", "--cache-budget", "8"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=90)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"acarerank serve --cache-budget 8 started: {e.stderr}") from None
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and err, (out.returncode, out.stderr[-2000:])
    assert "cache_budget_tokens=8 (serve --cache-budget) is under one page of the prefix cache (16 tokens)" in err[-1]
    assert "give at least 16" in err[-1], err


def test_select_caps_reach_the_setwise_reranker():
    """--select-max-length / --select-max-new-tokens are the setwise reranker's; unset, the caps
    are the paper's (the rerankers' constants: config.py imports nothing of the model), bounded by
    the model's positions (the embedded model's 40,960 leave them; tests/test_positions.py)."""
    pytest.importorskip("torch")
    from acarerank.prompts.pointwise import DEFAULT_MAX_LENGTH as POINTWISE_MAX_LENGTH
    from acarerank.server.build import build_rerankers
    from acarerank.setwise.decode import MAX_NEW_TOKENS
    from acarerank.setwise.prompts import DEFAULT_MAX_LENGTH

    default = ServeConfig(dtype="float32", cache_budget=256)
    assert (default.max_length, default.select_max_length, default.select_max_new_tokens) == (None, None,
                                                                                              MAX_NEW_TOKENS)
    rr, sr = build_rerankers(default)
    assert (rr.max_length, sr.max_length) == (POINTWISE_MAX_LENGTH, DEFAULT_MAX_LENGTH)
    _, sr = build_rerankers(ServeConfig(select_max_length=3000, select_max_new_tokens=200, dtype="float32",
                                        cache_budget=256))
    assert (sr.max_length, sr.max_new_tokens) == (3000, 200)


def test_canary_after_failures_reaches_the_engine():
    """``--canary-after-failures`` is the engine's ``canary_after``; the canary is the warm-up request,
    encoded at start by the reranker that serves. ``--max-queue-tokens`` and ``--token-wait-timeout``
    reach the service (the Ray replicas build theirs from the same config); unset, no token budget.
    ``--max-pass-timeout`` is the engine's ``max_pass_s`` (its default, inf: no bound)."""
    pytest.importorskip("torch")
    from acarerank.server.build import build_service
    from acarerank.server.service import CANARY

    assert ServeConfig().max_queue_tokens is None and ServeConfig().token_wait_timeout == 30.0
    svc = build_service(ServeConfig(canary_after_failures=5, dtype="float32", cache_budget=256,
                                    max_queue_tokens=4096, token_wait_timeout=2.5, max_pass_timeout=7.5))
    try:
        assert svc.engine.canary_after == 5 and svc.engine.canary is None
        assert svc.max_queue_tokens == 4096 and svc.token_wait_timeout == 2.5
        assert svc.engine.max_pass_s == 7.5 and ServeConfig().max_pass_timeout == float("inf")
        svc.start(warmup=False)
        assert svc.engine.canary.segment_ids == svc.reranker.encode(CANARY).segment_ids
    finally:
        svc.stop()


def test_the_api_key_is_not_in_the_configs_repr():
    """A log line or traceback that shows the config must not show the key."""
    config = ServeConfig(api_key="s3cret-key-42")
    assert "s3cret" not in repr(config) and "api_key" not in repr(config), repr(config)
    assert config.api_key == "s3cret-key-42"
