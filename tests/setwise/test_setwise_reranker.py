"""SetwiseReranker and ``acarerank select`` end to end, against the plain reference decoder.

Reference for one query: the Appendix F prompt (``build_prompt``), then
``greedy_decode_ref`` -- transformers' forward over the whole sequence at every step, the
grammar mask, argmax -- then ``parse_selection``. The reranker (prefix-shared runner, KV
cache, batched decode, 14-row lm_head) must give the same tokens and the same selection.
"""
import json

import pytest
import torch

from acarerank.model import cached_prefill
from acarerank.model.default import NO_MEANING, build_default_model
from acarerank.setwise.selection import parse_selection
from acarerank.setwise import Selection, SetwiseReranker
from acarerank.setwise.decode import greedy_decode_ref
from acarerank.setwise.prompts import build_prompt
from acarerank.tokenizer import TOKEN_IM_END

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, tie_word_embeddings=False)
DOCS = ["Paris is the capital and largest city of France.", "Berlin is the capital of Germany.",
        "The Eiffel Tower is in Paris; it was completed in 1889.", "Lyon is France's third-largest city.",
        "France's capital has been Paris since 987 (with interruptions).", "Bananas are rich in potassium.",
        "Paris hosted the 2024 Summer Olympics.", "Le Monde is a newspaper based in Paris.",
        "The Seine flows through Paris.", "Marseille is a port city.", "Versailles was the seat of power 1682-1789.",
        "Capital cities of Europe: Paris, Berlin, Madrid, Rome."]


@pytest.fixture(scope="module")
def model():
    m = build_default_model("tiny-cpu", seed=7, **TINY)
    with torch.no_grad():  # bias (see test_setwise_decode.py): selections of several entries, not just one
        m.model.embed_tokens.weight[:, 0] = 2.0
        m.lm_head.weight[TOKEN_IM_END, 0] = -0.05
    return m


@pytest.fixture(scope="module")
def reranker(model, qwen3_tokenizer):
    return SetwiseReranker(model=model, tokenizer=qwen3_tokenizer)


def reference(model, tok, query, docs, intent=None, max_select=10, max_length=16000):
    from acarerank.setwise.grammar import IdentifierGrammar

    g = IdentifierGrammar.from_tokenizer(tok)
    p = build_prompt(tok, query, docs, intent, max_select, max_length)
    out = greedy_decode_ref(model, p.input_ids, g, g.start(len(docs), max_select))
    return out, parse_selection(tok.decode(out, skip_special_tokens=True), len(docs), max_select)


# small caps keep the reference (a full forward over ~700 prompt tokens per new token) quick
@pytest.mark.parametrize("intent,max_select", [(None, 4), ("The agent wants the capital, nothing else.", 3)])
def test_select_equals_reference(reranker, model, qwen3_tokenizer, intent, max_select):
    sel = reranker.select("What is the capital of France?", DOCS, intent=intent, max_select=max_select)
    toks, ref = reference(model, qwen3_tokenizer, "What is the capital of France?", DOCS, intent, max_select)
    assert isinstance(sel, Selection)
    assert sel.text == qwen3_tokenizer.decode(toks, skip_special_tokens=True), (sel.text, toks)
    assert sel.ids == ref.ids and sel.valid and ref.valid
    assert sel.indices == [i - 1 for i in sel.ids] and sel.num_tokens == len(toks)
    assert 1 <= len(sel.ids) <= max_select and len(set(sel.ids)) == len(sel.ids)
    assert sel.prompt_tokens == len(build_prompt(qwen3_tokenizer, "What is the capital of France?", DOCS, intent,
                                                 max_select).input_ids)


def test_select_batch_equals_single_selects(reranker):
    queries = ["capital of France?", "Olympics 2024 host?", "x"]
    docs = [DOCS, DOCS[:5], DOCS[:1]]
    intents = [None, "sports", None]
    batch = reranker.select_batch(queries, docs, intents, max_select=4, batch_size=2)
    single = [reranker.select(q, d, intent=i, max_select=4) for q, d, i in zip(queries, docs, intents)]
    assert batch == single
    assert batch[2].ids == [1]                      # a pool of one: the grammar forces "[1]"


def _finish_by_steps(sr, st):
    """The step API's whole run of a started selection: prefill 64 tokens at a time, decode to the
    end, finish; released whatever happens."""
    try:
        while st.prefilling:
            sr.prefill_select(st, 64)
        while not st.done:
            sr.decode_select(st)
        return sr.finish_select(st)
    finally:
        sr.release_select(st)

def test_selections_without_a_prefix_cache_never_grow_their_pool(model, qwen3_tokenizer, monkeypatch):
    """Without a prefix cache each selection's prompt is prefilled into a private pool with room
    for max_new_tokens more (select_batch, and the server's start/prefill/decode_select steps):
    no page copy mid-decode; the selections equal the cached reranker's."""
    from acarerank.model import block_pool

    grown = []
    real = block_pool.BlockPool._grow
    monkeypatch.setattr(block_pool.BlockPool, "_grow", lambda self, extra: (grown.append(extra), real(self, extra)))
    sr = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, prefix_cache=False)
    queries, docs = ["capital of France?", "Olympics 2024 host?"], [DOCS, DOCS[:5]]
    batch = sr.select_batch(queries, docs, max_select=4)
    stepped = _finish_by_steps(sr, sr.start_select(sr.encode_select(queries[0], docs[0], max_select=4)))
    assert grown == [], f"a private pool grew by {grown} blocks"
    cached = SetwiseReranker(runner=sr.runner, tokenizer=qwen3_tokenizer)
    assert batch == [cached.select(q, d, max_select=4) for q, d in zip(queries, docs)] and stepped == batch[0]


def test_unconstrained_is_free_decoding_parsed_leniently(model, qwen3_tokenizer):
    sr = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_new_tokens=24)
    sel = sr.select("capital?", DOCS[:4], constrained=False)
    p = build_prompt(qwen3_tokenizer, "capital?", DOCS[:4])
    toks = model.generate(torch.tensor([p.input_ids]), do_sample=False, max_new_tokens=24, eos_token_id=TOKEN_IM_END,
                          pad_token_id=TOKEN_IM_END)[0, len(p.input_ids):].tolist()
    assert sel.num_tokens == len(toks) and sel.text == qwen3_tokenizer.decode(toks, skip_special_tokens=True)
    lenient = parse_selection(sel.text, 4, 10, strict=False)
    assert sel.ids == lenient.ids and sel.valid == lenient.valid


def test_unconstrained_stops_at_endoftext_as_generate_does(model, qwen3_tokenizer):
    """A Qwen3 checkpoint's generation config stops generate() at <|im_end|> and <|endoftext|>:
    free decoding stops at both (it went on to max_new_tokens past <|endoftext|>, and the lenient
    parse read whatever followed); constrained decoding never allows <|endoftext|>."""
    import copy

    eot = qwen3_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    m = copy.deepcopy(model)
    with torch.no_grad():
        m.lm_head.weight[eot] = m.lm_head.weight[TOKEN_IM_END] * 0
        m.lm_head.weight[eot, 0] = 5.0  # with embed column 0 at 2.0: <|endoftext|> is every step's argmax
    sr = SetwiseReranker(model=m, tokenizer=qwen3_tokenizer, max_new_tokens=24)
    p = build_prompt(qwen3_tokenizer, "capital?", DOCS[:4])
    toks = m.generate(torch.tensor([p.input_ids]), do_sample=False, max_new_tokens=24,
                      eos_token_id=[TOKEN_IM_END, eot], pad_token_id=TOKEN_IM_END)[0, len(p.input_ids):].tolist()
    assert toks == [eot], toks
    sel = sr.select("capital?", DOCS[:4], constrained=False)
    assert sel.num_tokens == 1 and sel.ids == [] and not sel.valid, sel
    assert sr.select_batch(["capital?"], [DOCS[:4]], constrained=False)[0] == sel
    constrained = sr.select("capital?", DOCS[:4], max_select=2)
    assert constrained.valid and 1 <= len(constrained.ids) <= 2, constrained


def test_long_pool_is_truncated_not_dropped(reranker, qwen3_tokenizer):
    docs = [f"Document {i}: " + "filler words here " * (20 + 7 * i) for i in range(30)]
    sr = SetwiseReranker(runner=reranker.runner, tokenizer=qwen3_tokenizer, max_length=1200)
    sel = sr.select("which?", docs)
    p = build_prompt(qwen3_tokenizer, "which?", docs, max_length=1200)
    assert sel.prompt_tokens == len(p.input_ids) <= 1200
    assert all(f"[{i}] Document {i - 1}:" in p.text for i in range(1, 31)) and any(p.truncated)
    # the decode over that prompt is the one test_setwise_decode.py checks against the reference
    assert sel == reranker._select_prompts([p], 10, True)[0] and sel.valid and 1 <= len(sel.ids) <= 10


@pytest.mark.parametrize("call,err,msg", [
    (lambda sr: sr.select(None, ["a"]), TypeError, "query"),
    (lambda sr: sr.select("q", []), ValueError, "empty"),
    (lambda sr: sr.select("q", ["a", None]), TypeError, r"documents\[1\]"),
    (lambda sr: sr.select("q", "a single string"), TypeError, "documents"),
    (lambda sr: sr.select("q", ["a"], max_select=0), ValueError, "max_select"),
    (lambda sr: sr.select("q", ["a"], intent=3), TypeError, "intent"),
    (lambda sr: sr.select("q", ["a"], cache_salt=3), TypeError, "cache_salt"),
    (lambda sr: sr.select_batch(["q"], [["a"], ["b"]]), ValueError, "one document list per query"),
    (lambda sr: sr.select_batch([], []), ValueError, "non-empty"),
    (lambda sr: sr.select_batch(["q"], [["a"]], cache_salt=b"t"), TypeError, "cache_salt"),
    # the batch's query named: "documents[1]" alone pointed at the second query's whole list
    (lambda sr: sr.select_batch(["q", "r"], [["a"], ["b", None]]), TypeError, r"^query 1 of the batch: documents\[1\]"),
    (lambda sr: sr.select_batch(["q", "r"], [["a"], "b"]), TypeError, "^query 1 of the batch: documents must be"),
    (lambda sr: sr.select_batch(["q", 3], [["a"], ["b"]]), TypeError, "^query 1 of the batch: query must be a str"),
    (lambda sr: sr.select_batch(["q"], [["a"]], intents=iter([None])), ValueError, "intents"),  # was len() of it
    (lambda sr: sr.select_batch(["q"], [["a"]], intents={0: None}), ValueError, "intents"),  # was its keys
])
def test_bad_input(reranker, call, err, msg):
    with pytest.raises(err, match=msg):
        call(reranker)


def test_constructor_errors(model, tmp_path):
    with pytest.raises(TypeError, match="exactly one"):
        SetwiseReranker()
    with pytest.raises(ValueError, match="max_length"):
        SetwiseReranker(model=model, max_length=0)
    with pytest.raises(TypeError, match="dtype"):
        SetwiseReranker.from_pretrained(str(tmp_path), dtype=torch.int32)
    with pytest.raises(FileNotFoundError):
        SetwiseReranker.from_pretrained(str(tmp_path / "missing"))


def test_from_pretrained_and_cli(model, reranker, qwen3_tokenizer, tmp_path, capsys):
    from acarerank.cli import main

    model.save_pretrained(tmp_path / "ckpt")
    sr = SetwiseReranker.from_pretrained(str(tmp_path / "ckpt"), dtype=torch.float32)  # the fp32 reference's dtype
    want = reranker.select("capital of France?", DOCS, max_select=5)
    assert sr.select("capital of France?", DOCS, max_select=5) == want

    docs_file = tmp_path / "docs.jsonl"
    # a corpus id numbered like the model's identifiers, in another order: it must come back as it was
    lines = [json.dumps({"text": d, "url": f"u{i}", "id": len(DOCS) - i}) if i % 2 == 0 else json.dumps(d)
             for i, d in enumerate(DOCS)]
    docs_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["select", "--model", str(tmp_path / "ckpt"), "--query", "capital of France?", "--docs",
                 str(docs_file), "--max-select", "5", "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in rows] == want.indices and [r["index"] + 1 for r in rows] == want.ids
    assert all(r.get("id") == (len(DOCS) - r["index"] if r["index"] % 2 == 0 else None) for r in rows), rows
    assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    assert all(r["text"] == DOCS[r["index"]] for r in rows)
    assert all(("url" in r) == (r["index"] % 2 == 0) for r in rows)
    assert repr(want.text) in err and "dtype: float32 (asked for explicitly)" in err

    # bad input: one clear line, exit code 2
    ckpt = str(tmp_path / "ckpt")
    assert main(["select", "--model", ckpt, "--query", "q", "--docs", str(tmp_path / "no.jsonl")]) == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    assert main(["select", "--model", str(tmp_path / "ckpt"), "--query", "q", "--docs", str(empty)]) == 2
    assert "no documents" in capsys.readouterr().err


def test_cli_default_model_says_it_means_nothing(tmp_path, capsys, monkeypatch):
    from acarerank.cli import main
    from acarerank.model import default

    # the embedded default's architecture, made tiny so the test stays fast; the message is what is checked
    monkeypatch.setattr(default, "build_default_model",
                        lambda *a, **kw: build_default_model("tiny-cpu", seed=0, **{**TINY, **kw}))
    docs_file = tmp_path / "docs.jsonl"
    docs_file.write_text('"alpha"\n"beta"\n', encoding="utf-8")
    assert main(["select", "--query", "q", "--docs", str(docs_file), "--max-select", "1"]) == 0
    out, err = capsys.readouterr()
    assert NO_MEANING.format(preset=default.DEFAULT_PRESET) in err
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 1 and rows[0]["text"] in ("alpha", "beta")


def test_select_batch_cache_salt_keeps_prompts_apart(model, qwen3_tokenizer):
    """A batch under a salt reuses only prompts cached under that salt (as select's cache_salt),
    and the selections are the same whatever the cache served."""
    sr = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer)
    queries, docs = ["tutoring rerankers", "bread"], [[f"document {i} about tutors" for i in range(12)]] * 2

    def hits(**kw):
        before = sr.cache_stats()["hit_tokens"]
        out = sr.select_batch(queries, docs, **kw)
        return sr.cache_stats()["hit_tokens"] - before, [s.ids for s in out]

    cold, want = hits(cache_salt="tenant-a")
    assert cold == 0
    other, got = hits(cache_salt="tenant-b")
    assert other == 0 and got == want, f"tenant-b was served {other} tokens cached under tenant-a"
    same, got = hits(cache_salt="tenant-a")
    assert same > 0 and got == want
    unsalted, got = hits()
    assert unsalted == 0 and got == want, f"an unsalted batch was served {unsalted} salted tokens"


def test_private_pools_reserve_only_the_grammars_longest_output(model, qwen3_tokenizer, monkeypatch):
    """Without a prefix cache, a constrained selection's private pool reserves min(max_new_tokens,
    the grammar's longest output) + 1 rows per prompt (select_batch over pools of 12 and 5 with
    max_select 4: at most 4·(2 + 2) + 1 = 17 tokens, so 18 rows; the step API over the pool of 5:
    4·3 + 1 + 1 = 14), not max_new_tokens + 1 = 65; free decoding keeps 65. No pool grows, and
    the selections equal those decoded over the 65-row reservation."""
    from acarerank.model import block_pool
    from acarerank.setwise import reranker as reranker_module

    grown, reserved = [], []
    real = block_pool.BlockPool._grow
    monkeypatch.setattr(block_pool.BlockPool, "_grow", lambda self, extra: (grown.append(extra), real(self, extra)))
    sr = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, prefix_cache=False)
    prefill = sr.runner.prefill
    monkeypatch.setattr(sr.runner, "prefill", lambda prefixes, chunk_tokens=None, reserve_tokens=1: (
        reserved.append(reserve_tokens), prefill(prefixes, chunk_tokens, reserve_tokens))[1])
    queries, docs = ["capital of France?", "Olympics 2024 host?"], [DOCS, DOCS[:5]]

    def run():
        batch = sr.select_batch(queries, docs, max_select=4)
        st = sr.start_select(sr.encode_select(queries[1], docs[1], max_select=4))
        return batch, _finish_by_steps(sr, st), st.prefill.reserve_tokens

    batch, stepped, step_reserve = run()
    assert reserved == [18] and step_reserve == 14 and grown == [], (reserved, step_reserve, grown)
    free = sr.start_select(sr.encode_select(queries[1], docs[1], max_select=4, constrained=False))
    assert free.prefill.reserve_tokens == 65
    sr.release_select(free)
    monkeypatch.setattr(reranker_module, "decode_reserve", lambda max_new_tokens, longest=None: max_new_tokens + 1)
    old_batch, old_stepped, old_reserve = run()
    assert reserved[1:] == [65] and old_reserve == 65
    assert batch == old_batch and stepped == old_stepped == batch[1]
    assert all(1 <= len(s.ids) <= 4 for s in batch)


def test_release_from_another_thread_waits_for_the_running_step(model, qwen3_tokenizer, monkeypatch):
    """release_select from another thread while decode_select runs: the pages went back to the pool
    mid-step, another request was given them, and the step then wrote its new K/V row into that
    request's page (no error; its KV, or the prefix tree's, silently wrong). The release now waits
    for the step (one forward); the pages are free once it is done, and the state is dead."""
    import threading

    from acarerank.model import runner as runner_module

    sr = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer)
    st = sr.start_select(sr.encode_select("capital of France?", DOCS[:5], max_select=3))
    sr.prefill_select(st, st.prompt_tokens_left)
    pool = sr._cache_slot.get().pool
    attention, released, taken = runner_module.prefix_shared_attention_paged, threading.Event(), []

    def release():
        sr.release_select(st)
        released.set()

    def attention_of_the_step(*args, **kw):  # layer 0 of the step: its new rows' pages are reserved
        if not taken:
            taken.append(threading.Thread(target=release))
            taken[0].start()
            if released.wait(0.5):  # released mid-step: another request takes every free page
                taken.extend(pool.allocate(pool.num_free))
                for t in pool.k + pool.v:
                    t[taken[1:]] = 7.0
        return attention(*args, **kw)

    monkeypatch.setattr(runner_module, "prefix_shared_attention_paged", attention_of_the_step)
    sr.decode_select(st)
    monkeypatch.undo()
    taken[0].join()
    written = [b for b in taken[1:] if not all(bool((t[b] == 7.0).all()) for t in pool.k + pool.v)]
    assert not written, f"the step wrote into page(s) {written} after the release had handed them out"
    assert len(taken) == 1, "the release did not wait for the step"
    assert st.released and all(c <= 1 for c in pool.refcount), "the selection's pages were not given back"
    with pytest.raises(ValueError, match="this selection was released"):
        sr.decode_select(st)
    with pytest.raises(TypeError, match="expected a SelectState"):
        sr.release_select(None)


def test_steps_refuse_a_selection_another_reranker_started(model, qwen3_tokenizer):
    """A SelectState stepped by another SetwiseReranker: its prompt's KV came from the first
    reranker's weights and the second one's decoded over it — a different selection than either
    model makes, with no error. Each step (and finish) refuses it by name, leaving it untouched:
    the reranker that started it still finishes it as select does."""
    from _tiny import tiny_causal

    a = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer)
    b = SetwiseReranker(model=tiny_causal(seed=9), tokenizer=qwen3_tokenizer)
    want = a.select("capital of France?", DOCS[:6], max_select=3)
    st = a.start_select(a.encode_select("capital of France?", DOCS[:6], max_select=3))
    try:
        with pytest.raises(ValueError, match="started by another SetwiseReranker"):
            b.prefill_select(st, 10_000)
        a.prefill_select(st, st.prompt_tokens_left)
        with pytest.raises(ValueError, match="started by another SetwiseReranker"):
            b.decode_select(st)
        while not st.done:
            a.decode_select(st)
        with pytest.raises(ValueError, match="started by another SetwiseReranker"):
            b.finish_select(st)
        assert a.finish_select(st) == want
    finally:
        a.release_select(st)


def test_max_new_tokens_past_its_cap_is_refused_before_any_kv_is_reserved(model, qwen3_tokenizer, monkeypatch):
    """Free decoding reserves max_new_tokens + 1 KV rows per prompt up front, so an uncapped
    max_new_tokens was an allocation of any size (10**9: the private pool asked for ~10**9 rows).
    The cap is ``acarerank select --max-new-tokens``'s: the longest selection of max(1,000, n)
    documents (6,001 up to 1,000). A call past it is a ValueError naming the value and the cap
    before any pool is made (select, select_batch naming its query, start_select); the
    constructor refuses what no prompt of max_length tokens could use (one token per candidate), and
    with max_length=None a value that leaves no prompt room in the model's positions (10**9 here:
    docs/input-safety.md, "Positions"), so the per-call cap is shown with 10**4."""
    from acarerank.setwise.grammar import max_new_tokens_cap, max_output_tokens

    assert max_new_tokens_cap(12) == max_new_tokens_cap(1000) == max_output_tokens(1000, 1000) == 6001
    assert max_new_tokens_cap(1001) == max_output_tokens(1001, 1001) == 6007
    for value, max_length in ((10**22, 16000), (max_new_tokens_cap(1200) + 1, 1200)):
        with pytest.raises(ValueError, match=f"^max_new_tokens must be at most {max_new_tokens_cap(max_length):,}, "
                                             f"the longest selection of max_length={max_length:,} documents "
                                             rf"\(more cannot fit a prompt\), got {value:,}$"):
            SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_new_tokens=value, max_length=max_length)
    SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_new_tokens=max_new_tokens_cap(1200), max_length=1200)

    with pytest.raises(ValueError, match="^max_new_tokens=1,000,000,000 leaves no room for a prompt in the model's "
                                         "maximum context length of 40,960 tokens"):
        SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_new_tokens=10**9, max_length=None)
    # the default cap is what the positions leave (40,960 − 40,000 = 960), and bounds it the same way
    with pytest.raises(ValueError, match="^max_new_tokens must be at most 6,001, the longest selection of "
                                         "max_length=960 documents"):
        SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_new_tokens=40000)
    made = []
    sr = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_new_tokens=10**4, max_length=None,
                         prefix_cache=False)
    for name in ("prefill", "new_pool"):
        real = getattr(sr.runner, name)
        monkeypatch.setattr(sr.runner, name, lambda *a, _real=real, _name=name, **k: (made.append(_name),
                                                                                    _real(*a, **k))[1])
    at_cap = SetwiseReranker(runner=sr.runner, tokenizer=qwen3_tokenizer, max_new_tokens=6001, max_length=None,
                             prefix_cache=False)
    msg = "^max_new_tokens must be at most 6,001 for {n} documents{q}, the longest selection of 1,000 documents, " \
          "got 10,000$"
    for constrained in (True, False):
        with pytest.raises(ValueError, match=msg.format(n=12, q="")):
            sr.select("capital of France?", DOCS, max_select=2, constrained=constrained)
        with pytest.raises(ValueError, match=msg.format(n=12, q=r" \(query 0\)")):
            sr.select_batch(["a", "b"], [DOCS, DOCS[:5]], max_select=2, constrained=constrained)
        with pytest.raises(ValueError, match=msg.format(n=5, q="")):  # an encoding the capped reranker made
            sr.start_select(at_cap.encode_select("capital of France?", DOCS[:5], max_select=2,
                                                 constrained=constrained))
    assert made == []
    # a pool past 1,000 documents has its own longest selection as its cap
    many = [f"d{i}" for i in range(1001)]
    big = SetwiseReranker(runner=sr.runner, tokenizer=qwen3_tokenizer, max_new_tokens=6008, max_length=None)
    with pytest.raises(ValueError, match="^max_new_tokens must be at most 6,007 for 1,001 documents, the longest "
                                         "selection of 1,001 documents, got 6,008$"):
        big.encode_select("q", many, max_select=1001)
    big.max_new_tokens = 6007
    assert big.encode_select("q", many, max_select=1001).prompt.n_candidates == 1001
    # at the cap a selection runs (constrained: the grammar bounds its reservation)
    assert at_cap.select("capital of France?", DOCS, max_select=2) == SetwiseReranker(
        runner=sr.runner, tokenizer=qwen3_tokenizer, max_new_tokens=64).select("capital of France?", DOCS,
                                                                               max_select=2)


def _steps_until_done(sr, st):
    """The server engine's loop: a prefill chunk while the selection is prefilling (again, after a
    decode step that restarted it in a private pool), else a decode step."""
    try:
        while not st.done:
            if st.prefilling:
                sr.prefill_select(st, 64)
            else:
                sr.decode_select(st)
        return sr.finish_select(st)
    finally:
        sr.release_select(st)


RESTARTS = {"select": lambda sr, q, docs: sr.select(q, docs, max_select=12),
            "select_batch": lambda sr, q, docs: sr.select_batch([q], [docs], max_select=12)[0],
            "steps": lambda sr, q, docs: _steps_until_done(sr, sr.start_select(sr.encode_select(q, docs,
                                                                                             max_select=12)))}


@pytest.mark.parametrize("how", RESTARTS)
def test_a_selection_restarted_privately_counts_its_recomputed_prompt(model, qwen3_tokenizer, how, monkeypatch):
    """A prefix cache of exactly the prompt's pages, the fit check off (as when another request
    pins pages after it): the prompt prefills there, and the decode's
    first new page finds every page pinned (PoolExhausted), so the selection restarts in a private
    pool (select_batch; select and the step API in decode_select) with the result a reranker
    without a prefix cache gives. The restart computes the whole prompt again; those tokens count
    as computed (the counters read the same with the cache or without it, docs/ARCHITECTURE.md
    "Paged KV and the prefix cache"): they went uncounted, so computed_tokens said 889 after a
    call that ran 1,778 prompt tokens through the model. The restart is another lookup: counted
    as computed alone, hit + computed passed lookup by the prompt."""
    monkeypatch.setattr(cached_prefill, "_fits", lambda *a: True)
    docs, q = [f"doc {i} about {i % 5}" for i in range(23)], "which?"
    plain = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, prefix_cache=False)
    want = plain.select(q, docs, max_select=12)
    prompt = want.prompt_tokens - 1  # the last prompt token is the decode's first segment
    assert plain.cache_stats()["computed_tokens"] == prompt
    bs = plain.runner.block_size
    assert prompt % bs == 9, "the decode's rows must need a page the prompt's pages leave no room for"
    sr = SetwiseReranker(runner=plain.runner, tokenizer=qwen3_tokenizer, cache_budget_tokens=-(-prompt // bs) * bs)
    assert RESTARTS[how](sr, q, docs) == want
    stats = sr.cache_stats()
    assert stats["hit_tokens"] == 0 and stats["computed_tokens"] == 2 * prompt, stats  # cached, then private
    # the restart is another lookup, served by no cache: hit + computed never passes lookup
    assert stats["lookup_tokens"] == 2 * prompt, stats
    assert all(c <= 1 for c in sr._cache_slot.get().pool.refcount), "a page is still pinned"  # the tree's only


@pytest.mark.parametrize("how", RESTARTS)
@pytest.mark.parametrize("room", ["prompt", "half"])
def test_a_prompt_that_cannot_fit_the_cache_is_computed_privately_once(model, qwen3_tokenizer, how, room):
    """A prompt whose pages and decode rows cannot fit the cache's pool (after evicting all it
    can) goes to a private pool before any pass: tried in the cache, it was computed up to where
    the pool ran out (a chunk of 64 in the steps' case, half the prompt, or all of it and then the
    decode's first page) and then all over again — select_batch of 8 pool-50 prompts over the
    default budget computed 154k rows for 93k tokens (docs/ARCHITECTURE.md, "Prefix cache")."""
    docs, q = [f"doc {i} about {i % 5}" for i in range(23)], "which?"
    plain = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, prefix_cache=False)
    want = plain.select(q, docs, max_select=12)
    prompt = want.prompt_tokens - 1
    bs = plain.runner.block_size
    budget = -(-prompt // bs) * bs if room == "prompt" else (prompt // 2) // bs * bs
    sr = SetwiseReranker(runner=plain.runner, tokenizer=qwen3_tokenizer, cache_budget_tokens=budget)
    rows = []
    real = type(sr.runner)._forward

    def counting(self, cache, ids, groups, output, append):
        if output == "none":
            rows.append(sum(t.numel() for t in ids))
        return real(self, cache, ids, groups, output, append)

    mp = pytest.MonkeyPatch()
    mp.setattr(type(sr.runner), "_forward", counting)
    try:
        assert RESTARTS[how](sr, q, docs) == want
    finally:
        mp.undo()
    assert sum(rows) == prompt, rows  # every prompt token computed once
    stats = sr.cache_stats()
    assert stats["computed_tokens"] == prompt and stats["lookup_tokens"] == prompt, stats
    assert all(c <= 1 for c in sr._cache_slot.get().pool.refcount), "a page is still pinned"


FREE = {"select": lambda sr, q, docs: sr.select(q, docs, max_select=3, constrained=False),
        "select_batch": lambda sr, q, docs: sr.select_batch([q], [docs], max_select=3, constrained=False)[0],
        "steps": lambda sr, q, docs: _steps_until_done(sr, sr.start_select(sr.encode_select(q, docs, max_select=3,
                                                                                            constrained=False)))}


@pytest.mark.parametrize("how", FREE)
def test_a_batch_invariant_match_cut_to_the_alignment_leaves_no_page_stuck(model, qwen3_tokenizer, how):
    """batch_invariant=True: the second prompt shares 491 tokens (30 pages) with the first, under
    prefix_align (512), so its match is cut to nothing and it computes its own copies of those
    pages. The tree kept its old copies, above the new prompt's pinned pages where eviction never
    reaches, though the fit check had counted them as free: with a budget of exactly the pages the
    check asks for, the decode ran out of pages and the whole prompt was computed again (751 tokens
    twice, hit + computed 751 over lookup). Now the tree adopts the new copies (the same bits,
    docs/ARCHITECTURE.md "Prefix cache": checked here against the old copies), every prompt token is
    computed once, and the selections are those of a reranker without a cache."""
    from acarerank.model.runner import Qwen3Runner

    runner = Qwen3Runner.from_hf(model, batch_invariant=True)
    plain = SetwiseReranker(runner=runner, tokenizer=qwen3_tokenizer, prefix_cache=False, max_new_tokens=16)
    q = "which one one one one one?"
    calls = [(q, DOCS[:4]), (q, DOCS[:8])]
    want = [FREE[how](plain, *c) for c in calls]
    first, second = (plain.encode_select(qq, d, max_select=3, constrained=False).prompt for qq, d in calls)
    shared = next(i for i, (a, b) in enumerate(zip(first.input_ids, second.input_ids)) if a != b)
    bs, prompt = runner.block_size, len(second.input_ids) - 1
    assert bs <= shared < runner.prefix_align, (shared, runner.prefix_align)  # the match is cut to 0
    need = -(-(prompt + plain._reserve([second], 3, False) - 1) // bs)  # the fit check's pages
    assert prompt % bs == bs - 1, "the decode's second row must need a page past the prefill's"
    sr = SetwiseReranker(runner=runner, tokenizer=qwen3_tokenizer, cache_budget_tokens=need * bs, max_new_tokens=16)
    assert FREE[how](sr, *calls[0]) == want[0]
    pc = sr._cache_slot.get()
    keys = [tuple(first.input_ids[i:i + bs]) for i in range(0, shared - bs + 1, bs)]
    old = {p: [t[b].clone() for t in pc.pool.k + pc.pool.v] for (_, p), b in pc.paths().items()
           if p == tuple(keys[:len(p)])}
    assert len(old) == shared // bs, (len(old), shared // bs)
    rows = []
    real = type(runner)._forward

    def counting(self, cache, ids, groups, output, append):
        if output == "none":
            rows.append(sum(t.numel() for t in ids))
        return real(self, cache, ids, groups, output, append)

    mp = pytest.MonkeyPatch()
    mp.setattr(type(runner), "_forward", counting)
    try:
        assert FREE[how](sr, *calls[1]) == want[1]
    finally:
        mp.undo()
    assert sum(rows) == prompt, f"{sum(rows)} prompt rows computed for a {prompt}-token prompt: {rows}"
    stats = sr.cache_stats()
    assert stats["hit_tokens"] + stats["computed_tokens"] <= stats["lookup_tokens"], stats
    assert stats["computed_tokens"] == len(first.input_ids) - 1 + prompt, stats
    now = {p: b for (_, p), b in pc.paths().items()}
    assert all(p in now for p in old), "the new prompt's pages are all in the tree"
    bad = [len(p) for p, kv in old.items()
           if not all(torch.equal(t[now[p]], c) for t, c in zip(pc.pool.k + pc.pool.v, kv))]
    assert not bad, f"the shared pages {bad} computed again differ from the tree's old copies"
    assert all(c <= 1 for c in pc.pool.refcount), "a page is still pinned"


@pytest.mark.parametrize("constrained", [True, False])
def test_batch_invariant_step_logits_the_same_alone_and_in_a_batch(model, qwen3_tokenizer, monkeypatch, constrained):
    """A runner with batch_invariant=True: every decode step's logits of a query are bitwise the
    same from ``select`` (a GreedyStepper of 1 group) and from ``select_batch`` beside two other
    queries (one GreedyStepper of 3 groups), constrained (the 14-row head) and free (the whole
    vocabulary). The step's hidden rows were already so; the head's GEMM picked its kernel by the
    rows beside a row (fp32, 1 vs 3 rows: up to 6e-8 constrained, 3e-7 free), so a near-tie could pick another token
    by what the query was batched with. The logits are read through GreedyStepper._next_logits."""
    from acarerank.model.runner import Qwen3Runner
    from acarerank.setwise.decode import GreedyStepper

    runner = Qwen3Runner.from_hf(model, batch_invariant=True)
    rr = SetwiseReranker(runner=runner, tokenizer=qwen3_tokenizer, prefix_cache=False, max_new_tokens=12)
    steps = []
    plain = GreedyStepper._next_logits

    def record(self, hidden, running):
        out = plain(self, hidden, running)
        steps.append((list(running), out.clone()))
        return out

    monkeypatch.setattr(GreedyStepper, "_next_logits", record)
    queries = ["What is the capital of France?", "Which city is a port?", "Where is the Seine?"]
    docs = [DOCS[:6], DOCS[3:9], DOCS[6:]]
    alone = rr.select(queries[0], docs[0], max_select=3, constrained=constrained)
    want = [logits[0] for _, logits in steps]
    steps.clear()
    batch = rr.select_batch(queries, docs, max_select=3, constrained=constrained)
    got = [logits[running.index(0)] for running, logits in steps if 0 in running]
    assert batch[0].text == alone.text and len(got) == len(want) > 0, (batch[0].text, alone.text, len(got), len(want))
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    assert not bad, (f"steps {bad} of query 0 differ alone and in a batch of 3 (constrained={constrained}): max "
                     f"{max((got[i] - want[i]).nan_to_num().abs().max().item() for i in bad):.2e}")


@pytest.mark.parametrize("where", ["choice", "pass end"])
@pytest.mark.parametrize("constrained", [True, False])
def test_a_decode_step_whose_choice_raised_is_retried_exactly(model, qwen3_tokenizer, monkeypatch, constrained,
                                                              where):
    """A decode step that raised once its pass had computed the rows — in its choice (an
    out-of-memory [S, V] logits tensor; non-finite logits) or at the pass's end (the last rows'
    checks) — then retried: the retry chooses from that pass's rows, or writes them again. Its
    tokens were in the cache already, so the retry fed them again at the next positions and the
    selection came out different from a fresh reranker's, with no error."""
    from acarerank.model.layer_ops import OpsLayers

    sr = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_new_tokens=24)
    fresh = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_new_tokens=24, prefix_cache=False)
    args = ("capital of France?", DOCS[:6], None, 3, constrained)
    st = sr.start_select(sr.encode_select(*args))
    while st.prefilling:
        sr.prefill_select(st, 10_000)
    sr.decode_select(st)
    owner, name = (sr.runner, "logits") if where == "choice" else (OpsLayers, "end")
    real = getattr(owner, name)

    def out_of_memory(*a, **k):
        raise torch.OutOfMemoryError(f"injected: {where}")

    monkeypatch.setattr(owner, name, out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        sr.decode_select(st)
    monkeypatch.setattr(owner, name, real)
    sr.decode_select(st)
    dec = st.decoder   # the cache holds the prompt but its last token, then every token fed: the outputs
    assert dec.cache.lengths[0] == len(st.encoding.prompt.input_ids) - 1 + len(dec.outputs[0]), \
        f"{dec.cache.lengths[0]} rows cached for a {len(st.encoding.prompt.input_ids)}-token prompt and " \
        f"{len(dec.outputs[0])} outputs"
    while not st.done:
        sr.decode_select(st)
    got, want = sr.finish_select(st), fresh.select(*args)
    assert (got.text, got.indices) == (want.text, want.indices), f"{got} after a retried step, {want} fresh"


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-5, ValueError), (True, TypeError), (float("nan"), TypeError),
                                        (2.5, TypeError), (None, TypeError), ("4", TypeError)])
def test_prefill_select_refuses_a_budget_that_is_not_a_positive_int(model, qwen3_tokenizer, bad, error):
    """0, -5, True and nan each computed one token a call (a scheduler's budget of 0 still ran a
    pass); 2.5 or None failed deep in the step with a slicing or comparison error."""
    sr = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer)
    st = sr.start_select(sr.encode_select("capital of France?", DOCS[:3], max_select=2))
    try:
        left = st.prompt_tokens_left
        with pytest.raises(error, match="prefill_select: max_tokens must be"):
            sr.prefill_select(st, bad)
        assert st.prompt_tokens_left == left   # nothing computed
    finally:
        sr.release_select(st)
