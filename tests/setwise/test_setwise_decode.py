"""KV-cached greedy decoding (ours, batched, one cache group per prompt) against transformers.

* free decoding == ``transformers`` ``generate(do_sample=False)``, token for token;
* constrained decoding == ``greedy_decode_ref`` (a transformers forward over the whole
  sequence at every step + the same grammar mask + argmax), token for token, and every output
  parses strictly -- over random models, pool sizes 1..50 and caps 1..10.

Random tiny Qwen3s (real vocabulary, real tokenizer) rarely pick bracket tokens on their own,
and under the grammar they would mostly stop after one entry, so the models are biased:
coordinate 0 of every token embedding is set to 2.0, which makes the final-normed hidden
state carry a large near-constant coordinate 0 (about 8), so ``lm_head[t, 0]`` acts as a
per-token logit bias. Both decoders run the same biased weights; agreement is the point.
"""
import pytest
import torch
from _hypothesis import given, settings, st  # hypothesis, or skips where absent

from acarerank.model import Qwen3Runner
from acarerank.model.default import build_default_model
from acarerank.setwise.selection import parse_selection
from acarerank.setwise.decode import GrammarLogitsProcessor, greedy_decode, greedy_decode_ref
from acarerank.setwise.grammar import IdentifierGrammar
from acarerank.tokenizer import TOKEN_IM_END

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, tie_word_embeddings=False)


def tiny_model(seed, token_bias=None):
    """Random tiny Qwen3 (fp32); ``token_bias``: {token id: lm_head[t, 0]} after the embedding shift."""
    m = build_default_model("tiny-cpu", seed=seed, **TINY)
    if token_bias is not None:
        with torch.no_grad():
            m.model.embed_tokens.weight[:, 0] = 2.0
            for t, b in token_bias.items():
                m.lm_head.weight[t, 0] = b
    return m


@pytest.fixture(scope="module")
def grammar(qwen3_tokenizer):
    return IdentifierGrammar.from_tokenizer(qwen3_tokenizer)


def _prompts(tok, texts):
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def _generate(model, prompt, max_new_tokens=64, **kw):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=TOKEN_IM_END, pad_token_id=TOKEN_IM_END, **kw)
    return out[0, len(prompt):].tolist()


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


TEXTS = ["Which passages answer the question? [1] Paris is the capital of France.", "x",
         "<think>\n\n</think>\n\n[3] 日本語 passages, 1999: 13–3 record."]


def test_free_decoding_equals_generate(qwen3_tokenizer):
    model = tiny_model(seed=0)
    runner = Qwen3Runner.from_hf(model, prefill_chunk=8)    # small chunks: the prefill runs in several passes
    prompts = _prompts(qwen3_tokenizer, TEXTS)
    # 24 new tokens, not the serving cap of 64: each generate step reads the whole 151,669-row
    # lm_head (~40 ms here), and the constrained tests below run whole selections
    ours = greedy_decode(runner, prompts, max_new_tokens=24)
    for p, o in zip(prompts, ours):
        ref = _generate(model, p, max_new_tokens=24)
        assert len(o) == 24
        assert o == ref, f"first mismatch at new token {_first_diff(o, ref)}: ours {o[:8]}... ref {ref[:8]}..."


def test_free_decoding_stops_at_end_of_turn(qwen3_tokenizer):
    # a strong bias on <|im_end|>: the sequences stop within a few tokens
    model = tiny_model(seed=3, token_bias={TOKEN_IM_END: 0.09})
    prompts = _prompts(qwen3_tokenizer, TEXTS)
    ours = greedy_decode(Qwen3Runner.from_hf(model), prompts)
    refs = [_generate(model, p) for p in prompts]
    assert ours == refs
    assert all(o[-1] == TOKEN_IM_END and o.count(TOKEN_IM_END) == 1 for o in ours), ours


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000),
       jobs=st.lists(st.tuples(st.integers(1, 50), st.integers(1, 10), st.integers(1, 2)), min_size=1, max_size=2),
       end_bias=st.floats(-0.08, 0.02), digit_spread=st.floats(0.0, 0.08))
def test_constrained_equals_reference(qwen3_tokenizer, grammar, seed, jobs, end_bias, digit_spread):
    gen = torch.Generator().manual_seed(seed)
    bias = {int(t): float(b) for t, b in zip(grammar.vocab, torch.randn(14, generator=gen) * digit_spread)}
    bias[TOKEN_IM_END] = end_bias
    model = tiny_model(seed, bias)
    runner = Qwen3Runner.from_hf(model)
    prompts = [qwen3_tokenizer.encode(f"Select from {n} passages, at most {cap}. " * rep, add_special_tokens=False)
               for n, cap, rep in jobs]
    states = [grammar.start(n, cap) for n, cap, _ in jobs]
    ours = greedy_decode(runner, prompts, grammar, states)        # all prompts in the same decode steps
    for (n, cap, _), p, o, s in zip(jobs, prompts, ours, states):
        ref_state = grammar.start(n, cap)
        ref = greedy_decode_ref(model, p, grammar, ref_state)
        assert o == ref, (f"pool {n} cap {cap}: first mismatch at {_first_diff(o, ref)}: "
                          f"ours {qwen3_tokenizer.decode(o)!r} ref {qwen3_tokenizer.decode(ref)!r}")
        assert s.done and o[-1] == TOKEN_IM_END
        text = qwen3_tokenizer.decode(o, skip_special_tokens=True)
        parsed = parse_selection(text, n, cap, strict=True)
        assert parsed.valid and parsed.ids == s.used == ref_state.used, (text, parsed)


def test_constrained_long_selection_and_generate_processor(qwen3_tokenizer, grammar):
    # END strongly disfavoured: the selection runs to the cap (10 entries, two-digit ids)
    model = tiny_model(seed=1, token_bias={TOKEN_IM_END: -0.3})
    prompt = qwen3_tokenizer.encode("Pick the passages.", add_special_tokens=False)
    ours = greedy_decode(Qwen3Runner.from_hf(model), [prompt], grammar, [grammar.start(50, 10)])[0]
    ref = greedy_decode_ref(model, prompt, grammar, grammar.start(50, 10))
    assert ours == ref
    assert parse_selection(qwen3_tokenizer.decode(ours, skip_special_tokens=True), 50, 10).ids.__len__() == 10
    # the bench's baseline: generate() with the grammar as a logits processor gives the same tokens
    proc = GrammarLogitsProcessor(grammar, [50], 10, prompt_len=len(prompt))
    assert _generate(model, prompt, logits_processor=[proc]) == ref


def test_forced_tokens_skip_steps(qwen3_tokenizer, grammar):
    # pool of 1: '[' '1' ']' END are all forced -- no decode step at all; pool 9: every ']' is forced
    model = tiny_model(seed=2, token_bias={TOKEN_IM_END: -0.3})
    runner = Qwen3Runner.from_hf(model)
    calls = []
    forward = runner.forward

    def counting_forward(cache, segs, groups, **kw):
        calls.append([len(s) for s in segs])
        return forward(cache, segs, groups, **kw)

    runner.forward = counting_forward
    prompt = qwen3_tokenizer.encode("Pick.", add_special_tokens=False)
    out = greedy_decode(runner, [prompt], grammar, [grammar.start(1, 10)])[0]
    assert out == grammar.tokens.encode_ids([1]) == greedy_decode_ref(model, prompt, grammar, grammar.start(1, 10))
    assert calls == []
    out = greedy_decode(runner, [prompt], grammar, [grammar.start(9, 3)])[0]
    assert out == greedy_decode_ref(model, prompt, grammar, grammar.start(9, 3))
    assert len(out) == 10 and out[-1] == TOKEN_IM_END           # "[a] [b] [c]" + END (cap reached: END forced)
    # segments sent: (last prompt token, '[') -> a; (a, ']') -> ' ['; (' [') -> b; (b, ']') -> ' ['; (' [') -> c,
    # then ']' and END (cap reached) are forced: 5 steps for 10 tokens
    assert calls == [[2], [2], [1], [2], [1]], calls


def test_constrained_decoding_reserves_only_the_grammars_longest_output(qwen3_tokenizer, grammar, monkeypatch):
    """The prompts' pool reserves min(max_new_tokens, the grammar's longest output) + 1 rows per
    sequence: pool 50 with cap 10 is at most 10·(2 + 2) + 1 = 41 tokens (pool 7: 22), so 42 rows,
    not max_new_tokens + 1 = 65 (3 pages of 16 per prompt here, not 5). Selections that run to
    the cap (END disfavoured) never grow the pool, and give the tokens decoded over the 65-row
    reservation and the reference's."""
    from acarerank.model import block_pool

    grown, reserved = [], []
    real = block_pool.BlockPool._grow
    monkeypatch.setattr(block_pool.BlockPool, "_grow", lambda self, extra: (grown.append(extra), real(self, extra)))
    model = tiny_model(seed=1, token_bias={TOKEN_IM_END: -0.3})
    runner = Qwen3Runner.from_hf(model)
    prefill = runner.prefill

    def spy(prefixes, chunk_tokens=None, reserve_tokens=1):
        reserved.append(reserve_tokens)
        cache = prefill(prefixes, chunk_tokens, reserve_tokens)
        reserved.append(cache.pool.num_blocks)
        return cache

    monkeypatch.setattr(runner, "prefill", spy)
    prompts = _prompts(qwen3_tokenizer, ["Pick the passages.", "x"])
    jobs = [(50, 10), (7, 10)]
    ours = greedy_decode(runner, prompts, grammar, [grammar.start(n, c) for n, c in jobs])
    blocks = sum(-(-(len(p) - 1 + 42) // runner.block_size) for p in prompts)
    assert reserved == [42, blocks] and grown == [], (reserved, grown)
    old_cache = prefill([p[:-1] for p in prompts], reserve_tokens=65)
    assert blocks == 6 and old_cache.pool.num_blocks == 10
    old = greedy_decode(runner, prompts, grammar, [grammar.start(n, c) for n, c in jobs], cache=old_cache)
    old_cache.free()
    assert ours == old
    for (n, c), p, o in zip(jobs, prompts, ours):
        assert o == greedy_decode_ref(model, p, grammar, grammar.start(n, c))
        assert len(parse_selection(qwen3_tokenizer.decode(o, skip_special_tokens=True), n, c).ids) == min(n, c)


def test_decode_argument_errors(qwen3_tokenizer, grammar):
    runner = Qwen3Runner.from_hf(tiny_model(seed=0))
    p = [[1, 2, 3]]
    with pytest.raises(ValueError, match="both grammar and states"):
        greedy_decode(runner, p, grammar=grammar)
    with pytest.raises(ValueError, match="empty"):
        greedy_decode(runner, [[]])
    with pytest.raises(ValueError, match="no prompts"):
        greedy_decode(runner, [])
    with pytest.raises(ValueError, match="states for"):
        greedy_decode(runner, p, grammar, [grammar.start(3, 2)] * 2)
    with pytest.raises(ValueError, match="eos_id"):
        greedy_decode(runner, p, grammar, [grammar.start(3, 2)], eos_id=0)
    for bad in ("<|im_end|>", [], [1.0], True, None):
        with pytest.raises(TypeError, match="eos_id must be a token id"):
            greedy_decode(runner, p, eos_id=bad)
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy_decode(runner, p, grammar, [grammar.start(10_000, 10)])   # 10 five-digit ids need 71 tokens
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy_decode(runner, p, max_new_tokens=0)


def test_decoding_never_grows_the_prompts_pool(qwen3_tokenizer, monkeypatch):
    """The prefill leaves room for every new token (max_new_tokens + the prompt's last), so the
    private pool is never doubled mid-decode (a copy of every page: a quarter of a batched decode
    loop at the default shape, and twice the cache's memory); outputs as generate's. A
    reserve_tokens that is not a positive int is an error naming it."""
    from acarerank.model import block_pool

    grown = []
    real = block_pool.BlockPool._grow
    monkeypatch.setattr(block_pool.BlockPool, "_grow", lambda self, extra: (grown.append(extra), real(self, extra)))
    model = tiny_model(seed=0)
    runner = Qwen3Runner.from_hf(model)
    prompts = _prompts(qwen3_tokenizer, TEXTS)          # 14-33 tokens: 40 more cross two 16-token pages
    ours = greedy_decode(runner, prompts, max_new_tokens=40)
    assert all(len(o) == 40 for o in ours) and grown == [], f"the pool grew by {grown} blocks mid-decode"
    assert ours[1] == _generate(model, prompts[1], max_new_tokens=40)
    with pytest.raises(ValueError, match="reserve_tokens must be a positive int"):
        runner.prefill(prompts, reserve_tokens=0)


def test_free_steps_choose_in_bounded_row_chunks(qwen3_tokenizer, monkeypatch):
    """An unconstrained step over 60 prompts at V = 151,669 computes its logits in row chunks of at
    most LOGITS_CHUNK_ELEMENTS (27 rows), not [60, V] at once (SetwiseReranker sends a whole
    select_batch to one decode: 256 prompts held 148 MiB per step), and chooses the very tokens the
    unchunked argmax chooses."""
    from acarerank.setwise import decode

    runner = Qwen3Runner.from_hf(tiny_model(seed=0))
    V = runner.lm_head.shape[0]
    prompts = _prompts(qwen3_tokenizer, [f"{i}: {TEXTS[i % 3]}" for i in range(60)])
    rows = []
    real = runner.logits
    monkeypatch.setattr(runner, "logits", lambda h, *a: (rows.append(h.shape[0]), real(h, *a))[1])
    ours = greedy_decode(runner, prompts, max_new_tokens=3)
    assert decode.LOGITS_CHUNK_ELEMENTS // V == 27 and rows[:3] == [27, 27, 6], rows
    rows.clear()
    monkeypatch.setattr(decode, "LOGITS_CHUNK_ELEMENTS", 1 << 40)
    whole = greedy_decode(runner, prompts, max_new_tokens=3)
    assert rows[0] == 60, rows
    bad = [i for i, (a, b) in enumerate(zip(ours, whole)) if a != b]
    assert not bad, f"prompt {bad[0]}: chunked {ours[bad[0]]}, whole [S, V] {whole[bad[0]]}"
    assert len({tuple(o) for o in ours}) > 1  # the rows differ: a chunk mixed up with another would show


def test_batch_invariant_free_steps_chunk_in_whole_tiles(qwen3_tokenizer, monkeypatch):
    """In batch-invariant mode the logits run on zero-padded tiles of INVARIANT_ROWS rows: chunks of
    27 rows paid for 64 each (free decoding 2.2x slower); they are whole tiles, the same tokens."""
    from acarerank.model.runner import INVARIANT_ROWS

    runner = Qwen3Runner.from_hf(tiny_model(seed=0), batch_invariant=True)
    prompts = _prompts(qwen3_tokenizer, [f"{i}: {TEXTS[i % 3]}" for i in range(2 * INVARIANT_ROWS + 2)])
    rows = []
    real = runner.logits
    monkeypatch.setattr(runner, "logits", lambda h, *a: (rows.append(h.shape[0]), real(h, *a))[1])
    ours = greedy_decode(runner, prompts, max_new_tokens=2)
    assert rows[:3] == [INVARIANT_ROWS, INVARIANT_ROWS, 2], rows
    alone = [greedy_decode(runner, [p], max_new_tokens=2)[0] for p in prompts[::43]]
    assert alone == ours[::43], (alone, ours[::43])   # batch-invariant: a prompt decodes alone as in the batch


_GREEDY_PEAK = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from _tiny import random_qwen3
from acarerank.model import Qwen3Runner
from acarerank.setwise.decode import greedy_decode

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) / 1024 for l in f if l.startswith(key))

runner = Qwen3Runner.from_hf(random_qwen3(seed=0))   # V = 151,669, one layer
S = 192
prompts = [[1 + i, 2, 3, 4] for i in range(S)]
greedy_decode(runner, prompts[:2], max_new_tokens=2)  # first-call set-up out of the count
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                                     # VmHWM := VmRSS
base = status("VmRSS:")
greedy_decode(runner, prompts, max_new_tokens=2)
print(json.dumps({"grew": status("VmHWM:") - base, "svx4": S * runner.lm_head.shape[0] * 4 / 2**20}))
"""


def test_free_decoding_peak_memory_does_not_grow_with_the_prompts():
    """Peak RSS (VmHWM) of a free greedy decode of 192 prompts at V = 151,669, in a fresh process:
    at most three 16 MiB logit chunks (LOGITS_CHUNK_ELEMENTS), not [S, V] fp32 (111 MiB; 256
    prompts grew the peak by 151 MiB before the steps were chunked, 19 MiB after)."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, for _tiny
    run = subprocess.run([sys.executable, "-c", _GREEDY_PEAK, here], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["grew"] <= 48, f"peak RSS grew {got['grew']:.0f} MiB in one decode ([S, V] fp32: {got['svx4']:.0f} MiB)"
