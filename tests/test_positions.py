"""The model's maximum context length (``max_position_embeddings``, scaled by its RoPE) bounds
every entry point: a cap past it is refused where it is set, naming both numbers; a default cap
is clamped to it; a sequence exactly at it scores as transformers' forward (docs/input-safety.md,
"Positions"). Past it RoPE rotates by angles the model never saw: a plausible score, no error —
vLLM refuses such input ("maximum context length is N tokens").

One 1-layer random Qwen3 of 1,024 positions (the real vocabulary and tokenizer), built once.
"""
import pytest
import torch
from _tiny import random_qwen3

from acarerank import PointwiseReranker, ScoreRequest, SetwiseReranker
from acarerank.ato import RescoreQuery, rescore, sample_rollouts
from acarerank.model import ContextLengthError, Qwen3Runner
from acarerank.model.arch import Qwen3Arch
from acarerank.prompts import official_input_ids, official_scores
from acarerank.setwise.decode import greedy_decode, greedy_decode_ref

LIMIT = 1024                                                  # a setwise prompt's template alone is ~640
LONG_DOC = "retrieval augmented generation " * 500          # ~2,000 tokens: always cut


@pytest.fixture(scope="module")
def model():
    return random_qwen3(seed=3, spread_yes_no=40, max_position_embeddings=LIMIT)


@pytest.fixture(scope="module")
def runner(model):
    return Qwen3Runner.from_hf(model)


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 5000, (n,), generator=g).tolist()


def _config(**kw):
    return dict(model_type="qwen3", vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=1, num_key_value_heads=1, head_dim=8, **kw)


@pytest.mark.parametrize("config, want", [
    ({}, 32768),                                                  # Qwen3Config's default
    ({"max_position_embeddings": 40960}, 40960),                  # Qwen3's own
    # Qwen3's card for 131,072 tokens: YaRN factor 4 over 32,768, max_position_embeddings left at 40,960
    ({"max_position_embeddings": 40960, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32768}}, 131072),
    # transformers 5.x's own form: factor null = max_position_embeddings / original
    ({"max_position_embeddings": 1024, "rope_parameters": {"rope_type": "yarn", "factor": None,
                                                           "original_max_position_embeddings": 256,
                                                           "rope_theta": 1e6}}, 1024),
    ({"max_position_embeddings": 2048, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 4096),
    # Llama 3.1's form: max_position_embeddings is already the scaled length
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                          "original_max_position_embeddings": 8192,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0}}, 131072),
    # llama3 never scales max_position_embeddings (vLLM's rule): 8,192 × 8 is no licence past 8,192
    ({"max_position_embeddings": 8192, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                        "original_max_position_embeddings": 8192,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0}}, 8192),
])
def test_the_limit_is_max_position_embeddings_scaled_by_the_rope(config, want):
    assert Qwen3Arch.from_config(_config(**config)).max_positions == want


@pytest.mark.parametrize("bad", [0, -5, 1.5, "4096", True])
def test_a_bad_max_position_embeddings_is_named(bad):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Qwen3Arch.from_config(_config(max_position_embeddings=bad))


def test_the_runner_exposes_the_limit_and_refuses_a_pass_past_it(model, runner):
    """At the limit the prefill's last hidden state is transformers'; one token more is refused
    before any pass (the last line of defence behind every entry point's own check)."""
    assert runner.max_positions == LIMIT
    ids = _ids(LIMIT)
    cache = runner.prefill([ids[:-1]])
    try:
        hidden = runner.final_norm(runner.forward(cache, [ids[-1:]], [0], output="last"))
    finally:
        cache.free()
    with torch.no_grad():
        want = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
    torch.testing.assert_close(hidden[0], want, rtol=0, atol=1e-5)  # fp32: 1.8e-7 measured
    with pytest.raises(ContextLengthError, match=f"{LIMIT + 1:,} tokens, more than the model's maximum context length of "
                                                 f"{LIMIT:,} tokens"):
        runner.prefill([_ids(LIMIT + 1)])
    cache = runner.prefill([ids[:-1]])
    try:
        with pytest.raises(ContextLengthError, match=rf"{LIMIT - 1:,} cached \+ 2 new"):
            runner.forward(cache, [[1, 2]], [0], output="last", append=True)
    finally:
        cache.free()


def test_pointwise_refuses_a_cap_past_the_limit_and_clamps_its_default(model, runner, qwen3_tokenizer):
    """max_length past the model's 1,024 positions is refused at construction, naming both numbers;
    the default (8,192) becomes 1,024; a document cut to exactly 1,024 tokens scores as transformers."""
    tok = qwen3_tokenizer
    for cap in (LIMIT + 1, 8192):
        with pytest.raises(ContextLengthError, match=f"max_length={cap:,} is {cap:,} tokens, more than the model's "
                                                     f"maximum context length of {LIMIT:,} tokens"):
            PointwiseReranker(runner=runner, tokenizer=tok, max_length=cap)
    rr = PointwiseReranker(runner=runner, tokenizer=tok)
    assert rr.max_length == LIMIT
    docs = [LONG_DOC, "a short document"]
    enc = rr.encode(ScoreRequest("q", docs))
    assert len(enc.input_ids(0)) == LIMIT
    ids = [official_input_ids(tok, "q", d, max_length=LIMIT) for d in docs]
    assert ids[0] == enc.input_ids(0)
    want = official_scores(model, tok, ids, batch_size=1)
    torch.testing.assert_close(torch.tensor(rr.score("q", docs)), torch.tensor(want), rtol=0, atol=1e-5)
    assert PointwiseReranker(runner=runner, tokenizer=tok, max_length=LIMIT).max_length == LIMIT


def test_setwise_bounds_prompt_plus_new_tokens(model, runner, qwen3_tokenizer):
    """max_length + max_new_tokens past the limit is refused at construction (the new tokens take
    positions after the prompt); the default (16,000) becomes limit − max_new_tokens;
    max_length=None (no cap, nothing cut) refuses each call whose prompt does not leave room."""
    tok = qwen3_tokenizer
    with pytest.raises(ContextLengthError, match=rf"max_length=1,000 \+ max_new_tokens=64 is 1,064 tokens, more "
                                                 rf"than the model's maximum context length of {LIMIT:,} tokens"):
        SetwiseReranker(runner=runner, tokenizer=tok, max_length=1000)
    with pytest.raises(ContextLengthError, match=f"max_new_tokens=1,024 leaves no room for a prompt in the model's "
                                                 f"maximum context length of {LIMIT:,} tokens"):
        SetwiseReranker(runner=runner, tokenizer=tok, max_new_tokens=LIMIT)
    sr = SetwiseReranker(runner=runner, tokenizer=tok, max_new_tokens=16)
    assert sr.max_length == LIMIT - 16
    docs = [LONG_DOC, LONG_DOC[::-1], "short"]
    enc = sr.encode_select("q", docs, max_select=2, constrained=False)
    assert LIMIT - 16 - 3 <= len(enc.prompt.input_ids) <= LIMIT - 16
    got = sr.select("q", docs, max_select=2, constrained=False)
    assert got.text == tok.decode(greedy_decode_ref(model, enc.prompt.input_ids, max_new_tokens=16,
                                                    eos_id=sr.free_stop_ids))
    free = SetwiseReranker(runner=runner, tokenizer=tok, max_length=None, max_new_tokens=16)
    n = len(free.encode_select("q", ["short"]).prompt.input_ids)
    with pytest.raises(ContextLengthError, match=rf"the query's prompt of [\d,]+ tokens \+ max_new_tokens=16"):
        free.select("q", docs)
    with pytest.raises(ContextLengthError, match=r"query 1 of the batch's prompt"):
        free.select_batch(["q", "q"], [["short"], docs])
    assert free.select("q", ["short"]).prompt_tokens == n


def test_greedy_decoding_at_the_limit_is_transformers_and_past_it_is_refused(model, runner):
    prompt = _ids(LIMIT - 8, seed=1)
    got = greedy_decode(runner, [prompt], max_new_tokens=8)
    assert got[0] == greedy_decode_ref(model, prompt, max_new_tokens=8)
    with pytest.raises(ContextLengthError, match=rf"prompt 1 \({LIMIT - 7:,} tokens\) \+ max_new_tokens=8 is {LIMIT + 1:,} tokens"):
        greedy_decode(runner, [prompt, prompt + [5]], max_new_tokens=8)


def test_sample_rollouts_bounds_prompt_plus_new_tokens(model, runner):
    """A prompt + max_new_tokens past the limit is refused before any pass; at the limit the sampled
    tokens' log-probs are transformers' on prompt ++ rollout."""
    prompt = _ids(LIMIT - 6, seed=2)
    with pytest.raises(ContextLengthError, match=rf"sample_rollouts: prompt 0 \({LIMIT - 6:,} tokens\) \+ max_new_tokens=7 "
                                                 rf"is {LIMIT + 1:,} tokens"):
        sample_rollouts(runner, [prompt], 2, max_new_tokens=7, seed=0)
    r = sample_rollouts(runner, [prompt], 2, max_new_tokens=6, stop_ids=[0], seed=0)
    for n, y in enumerate(r.tokens):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + y])).logits[0, len(prompt) - 1:-1].float()
        want = torch.log_softmax(logits, -1)[torch.arange(len(y)), torch.tensor(y)]
        torch.testing.assert_close(r.logprobs[n, :len(y)], want, rtol=0, atol=1e-5)  # fp32: 9.5e-7 measured


def test_rescore_refuses_a_sequence_past_either_models_limit(model, runner):
    """The snapshot reads prompt ++ rollout[:-1], the teacher prompt ++ hint ++ rollout[:-1]: each is
    checked against its own model's limit before either runs; exactly at it, logp_old is transformers'."""
    head, tail = _ids(LIMIT - 56, seed=3), _ids(6, seed=4)
    y = _ids(51, seed=5)                                  # snapshot sequence: exactly LIMIT
    wide = Qwen3Runner.from_hf(random_qwen3(seed=3, spread_yes_no=40, max_position_embeddings=4 * LIMIT))
    res = rescore(runner, wide, [RescoreQuery(head, tail, [y], [[]])])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([head + tail + y])).logits[0, len(head + tail) - 1:-1].float()
    want = torch.log_softmax(logits, -1)[torch.arange(len(y)), torch.tensor(y)]
    torch.testing.assert_close(res.logp_old[0], want, rtol=0, atol=1e-5)  # fp32: 9.5e-7 measured
    with pytest.raises(ContextLengthError, match=rf"query 0 rollout 1's snapshot sequence .* is {LIMIT + 1:,} tokens"):
        rescore(runner, wide, [RescoreQuery(head, tail, [y, y + [7]], [[], []])])
    with pytest.raises(ContextLengthError, match=rf"query 0 rollout 0's teacher sequence .* is {LIMIT + 3:,} tokens"):
        rescore(wide, runner, [RescoreQuery(head, tail, [y], [[1, 2, 3]])])


@pytest.fixture(scope="module")
def checkpoint(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("positions") / "ckpt"
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("command, flags, needle", [
    ("score", ["--max-length", "1025"], "--max-length: max_length=1,025 is 1,025 tokens"),
    ("select", ["--max-length", "1000"], r"--max-length / --max-new-tokens: max_length=1,000 \+ max_new_tokens=64 "
                                         r"is 1,064 tokens"),
    ("select", ["--max-new-tokens", "1024", "--unconstrained"],
     "--max-length / --max-new-tokens: max_new_tokens=1,024 leaves no room for a prompt in the model's"),
])
def test_the_cli_refuses_a_cap_past_the_limit_in_one_line(capsys, checkpoint, tmp_path, command, flags, needle):
    import re

    from acarerank.cli import main

    docs = tmp_path / "docs.jsonl"
    docs.write_text('"a document"\n')
    rc = main([command, "--model", str(checkpoint), "--dtype", "float32", "--query", "q", "--docs", str(docs),
               *flags])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and not x.startswith(("NOTE:", "dtype:"))]
    assert rc == 2 and len(err) == 1, err
    assert re.search(needle, err[0]) and f"maximum context length of {LIMIT:,} tokens" in err[0], err[0]


def test_serve_refuses_a_cap_past_the_limit_at_start_up_and_clamps_its_defaults(checkpoint):
    """--max-length, --select-max-length (+ --select-max-new-tokens) past the model's positions stop
    the start-up (build_rerankers: the CLI's and the Ray replicas' one builder); unset, they are
    clamped to the model, so no request can reach a position past it."""
    from acarerank.server.build import build_rerankers
    from acarerank.server.config import ServeConfig

    base = dict(model=str(checkpoint), dtype="float32", cache_budget=256)
    with pytest.raises(ContextLengthError, match=f"^--max-length: max_length=1,025 is 1,025 tokens, more than the "
                                                 f"model's maximum context length of {LIMIT:,} tokens"):
        build_rerankers(ServeConfig(max_length=LIMIT + 1, **base))
    with pytest.raises(ContextLengthError, match=r"^--select-max-length / --select-max-new-tokens: max_length=1,000 "
                                                 r"\+ max_new_tokens=64 is 1,064 tokens"):
        build_rerankers(ServeConfig(select_max_length=1000, **base))
    rr, sr = build_rerankers(ServeConfig(**base))
    assert (rr.max_length, sr.max_length, sr.max_new_tokens) == (LIMIT, LIMIT - 64, 64)


def test_serve_names_a_model_too_short_for_its_warm_up_request(qwen3_tokenizer):
    """A model of 128 positions clamps the pointwise cap to 128, under its template, a query and
    min_doc_tokens: the start-up names the model's limit (the encoder's own advice, "shorten the
    query", is a client's) and stops the model thread, as a failed warm-up does."""
    from acarerank.server.model_thread import ModelThread
    from acarerank.server.service import RerankService

    mt = ModelThread()
    rr = mt.call(PointwiseReranker, model=random_qwen3(seed=0, max_position_embeddings=128), tokenizer=qwen3_tokenizer)
    assert rr.max_length == 128
    svc = RerankService(rr, "short", model_thread=mt)
    with pytest.raises(ValueError, match=r"^the server cannot score its own warm-up request .* under max_length="
                                         r"128 \(the model's maximum context length is 128 tokens\): no request "
                                         r"could be served; serve a model of more positions"):
        svc.start()
    with pytest.raises(RuntimeError, match="shutdown"):
        mt.submit(int)


@pytest.mark.parametrize("bad", ["AUTO", "8192", True, 8192.0, None])
def test_a_max_length_of_the_wrong_type_names_auto(runner, qwen3_tokenizer, bad):
    """A bool, a float or a string other than "auto" is a TypeError that names every accepted form
    (None too where it is one: setwise's "no cap"); 0 stays a ValueError."""
    for cls, forms in ((PointwiseReranker, "an int, or 'auto'"), (SetwiseReranker, "an int, None, or 'auto'")):
        if bad is None and cls is SetwiseReranker:
            continue
        with pytest.raises(TypeError, match=rf"^max_length must be {forms}, got {bad!r}"):
            cls(runner=runner, tokenizer=qwen3_tokenizer, max_length=bad)


def test_a_prompt_over_a_clamped_cap_says_the_cap_is_the_models(runner, qwen3_tokenizer):
    """The prompt builders' "raise max_length" cannot be followed where "auto" took the model's
    positions: the error adds what set the cap and what to change (setwise: max_new_tokens);
    a cap the caller set keeps the builder's words alone."""
    tok = qwen3_tokenizer
    long_query = "what is the thing " * 300                       # ~1,200 tokens: over any cap here
    note = rf"\(max_length=1,024 is this model's maximum context length \(the default cap here\): use a model"
    with pytest.raises(ValueError, match=rf"raise max_length.* {note}"):
        PointwiseReranker(runner=runner, tokenizer=tok).encode(ScoreRequest(long_query, ["d"]))
    with pytest.raises(ValueError, match="raise max_length") as given:
        PointwiseReranker(runner=runner, tokenizer=tok, max_length=1000).encode(ScoreRequest(long_query, ["d"]))
    assert "default cap" not in str(given.value)
    sr = SetwiseReranker(runner=runner, tokenizer=tok, max_new_tokens=1000)   # the template alone is ~640
    note = (r"\(max_length=24 is this model's maximum context length of 1,024 tokens less max_new_tokens=1,000 "
            r"\(the default cap here\): lower max_new_tokens")
    with pytest.raises(ValueError, match=rf"raise max_length {note}"):
        sr.encode_select("q", ["a", "b"], constrained=False)
    with pytest.raises(ValueError, match=rf"raise max_length {note}"):
        sr.select_batch(["q"], [["a", "b"]], constrained=False)


def test_a_cap_clamped_by_the_model_is_noted_where_the_run_is_watched(capsys, checkpoint, tmp_path):
    """acarerank score / select and serve's start-up with the caps left out: one NOTE line each on
    stderr says the cap is the model's, not the documented default; none once a cap is given."""
    from acarerank.cli import main
    from acarerank.server.build import build_rerankers
    from acarerank.server.config import ServeConfig

    docs = tmp_path / "docs.jsonl"
    docs.write_text('"a document"\n')
    common = ["--model", str(checkpoint), "--dtype", "float32", "--query", "q", "--docs", str(docs)]
    point = (f"NOTE: --max-length left out: the cap is {LIMIT:,} tokens, this model's maximum context length "
             f"(the default 8,192 is past it)")
    assert main(["score", *common]) == 0
    assert point in capsys.readouterr().err.splitlines()
    assert main(["select", *common, "--max-new-tokens", "32"]) == 0
    assert (f"NOTE: --max-length left out: the cap is {LIMIT - 32:,} tokens, this model's maximum context length "
            f"less --max-new-tokens (the default 16,000 is past it)") in capsys.readouterr().err.splitlines()
    assert main(["score", *common, "--max-length", "512"]) == 0
    assert "NOTE: --max-length" not in capsys.readouterr().err
    build_rerankers(ServeConfig(model=str(checkpoint), dtype="float32", cache_budget=256))
    err = capsys.readouterr().err.splitlines()
    assert point in err and (f"NOTE: --select-max-length left out: the cap is {LIMIT - 64:,} tokens, this model's "
                             f"maximum context length less --select-max-new-tokens (the default 16,000 is past "
                             f"it)") in err


def test_a_model_too_short_for_the_setwise_template_serves_reranks_and_refuses_selections(tmp_path, capfd):
    """A model of 650 positions leaves /v1/select a cap of 650 - 64 = 586 prompt tokens, under
    the 631 its template alone takes: serve started silently and answered every selection with the
    prompt builder's 400, as if the request were too long. Now the start-up says it once (one NOTE
    line, not the cap's), each /v1/select is a 400 naming the model's limit and what the template
    needs, and reranks serve (/ready 200); a --select-max-length under the template stops the start-up."""
    for name in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(name)
    import httpx
    from acarerank.server.app import create_app
    from acarerank.server.build import build_rerankers, build_service
    from acarerank.server.config import ServeConfig
    from serve_util import thread_server

    random_qwen3(seed=3, spread_yes_no=40, max_position_embeddings=650).save_pretrained(tmp_path)
    config = ServeConfig(model=str(tmp_path), dtype="float32", cache_budget=256, max_batch_tokens=256)
    service = build_service(config)
    need = service.setwise.min_prompt_tokens()
    assert service.setwise.max_length == 586 < need
    notes = [ln for ln in capfd.readouterr().err.splitlines() if "select" in ln]
    assert notes == [f"NOTE: /v1/select is unavailable: the setwise prompt cap of 586 tokens (this model's maximum "
                     f"context length of 650 tokens less --select-max-new-tokens=64; a --select-max-new-tokens of at "
                     f"most {650 - need} leaves the template room) is under the {need} tokens the setwise prompt's template alone "
                     f"takes (an empty query, one empty document), so no selection fits; each /v1/select is answered "
                     f"400 (context_length), /v1/rerank and /score are served"], notes
    try:
        service.start()
        with thread_server(create_app(service, config)) as base:
            assert httpx.get(base + "/ready", timeout=30).status_code == 200
            r = httpx.post(base + "/v1/rerank", json=dict(query="q", documents=["a", "b"]), timeout=60)
            assert r.status_code == 200 and len(r.json()["results"]) == 2, r.text
            r = httpx.post(base + "/v1/select", json=dict(query="q", documents=["a", "b"]), timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "context_length" and err["code"] == 400, err
            assert err["message"].startswith("this server's model cannot serve /v1/select at all: the setwise prompt "
                                             "cap of 586 tokens (this model's maximum context length of 650"), err
            assert f"under the {need} tokens the setwise prompt's template alone takes" in err["message"], err
    finally:
        service.stop()
    with pytest.raises(ValueError, match=rf"^--select-max-length 500: the setwise prompt cap of 500 tokens "
                                         rf"\(--select-max-length\) is under the {need} tokens .* give at least {need}"):
        build_rerankers(config.replace(select_max_length=500))


def test_a_model_with_little_room_beyond_the_setwise_template_is_noted_and_served(tmp_path, capfd, checkpoint):
    """A model of 720 positions leaves /v1/select a cap of 720 - 64 = 656 tokens, 25 past the 631
    its template alone takes: serve started with only the cap's NOTE ("the cap is 656 tokens") and
    fit selections of a few words. Now the start-up says how many tokens a selection may hold (one
    NOTE, in place of the cap's) whenever that room is under SELECT_MIN_ROOM, for a cap left to the
    model or set by the operator; selections are served as before."""
    for name in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(name)
    import httpx
    from acarerank.server.app import create_app
    from acarerank.server.build import build_rerankers, build_service
    from acarerank.server.config import ServeConfig
    from acarerank.server.request_checks import SELECT_MIN_ROOM
    from serve_util import thread_server

    random_qwen3(seed=3, spread_yes_no=40, max_position_embeddings=720).save_pretrained(tmp_path)
    config = ServeConfig(model=str(tmp_path), dtype="float32", cache_budget=256, max_batch_tokens=256)
    service = build_service(config)
    sr = service.setwise
    need = sr.min_prompt_tokens()
    room = 656 - need
    assert sr.max_length == 656 and 0 < room < SELECT_MIN_ROOM
    notes = [ln for ln in capfd.readouterr().err.splitlines() if "select" in ln]
    assert notes == [f"NOTE: /v1/select has room for {room} tokens of query and documents: the setwise prompt cap of "
                     f"656 tokens (this model's maximum context length of 720 tokens less --select-max-new-tokens=64) "
                     f"less the {need} tokens of the setwise prompt's template alone (an empty query, one empty "
                     f"document); the query is in the prompt twice and each document past the first adds its "
                     f"identifier's tokens, so longer documents are cut to fit and a pool that cannot fit is a 400; a "
                     f"smaller --select-max-new-tokens or a model of more positions leaves more"], notes
    # the room is what a query and one document get: a long document is cut to it, within a seam's token
    enc = sr.encode_select("q", ["word " * 1000], max_select=1)
    assert 656 - 1 <= len(enc.prompt.input_ids) <= 656, len(enc.prompt.input_ids)
    try:
        service.start()
        with thread_server(create_app(service, config)) as base:
            r = httpx.post(base + "/v1/select", json=dict(query="q", documents=["a", "b"], max_select=1), timeout=60)
            assert r.status_code == 200 and r.json()["indices"][0] in (0, 1), r.text
    finally:
        service.stop()
    # an operator's cap: the same NOTE naming the flag, under SELECT_MIN_ROOM only (the 1,024-position model)
    build_rerankers(ServeConfig(model=str(checkpoint), dtype="float32", cache_budget=256,
                                select_max_length=need + SELECT_MIN_ROOM - 1))
    notes = [ln for ln in capfd.readouterr().err.splitlines() if "select" in ln]
    assert len(notes) == 1 and notes[0].startswith(
        f"NOTE: /v1/select has room for {SELECT_MIN_ROOM - 1} tokens of query and documents: the setwise prompt cap "
        f"of {need + SELECT_MIN_ROOM - 1:,} tokens (--select-max-length) less the {need} tokens"), notes
    build_rerankers(ServeConfig(model=str(checkpoint), dtype="float32", cache_budget=256,
                                select_max_length=need + SELECT_MIN_ROOM))
    assert "select" not in capfd.readouterr().err
