"""``sample_rollouts`` (acarerank/ato/rollouts.py): G samples of π_old per prompt over one prefill.

* the returned log-probs are transformers' teacher-forced log_softmax(logits / T) at the sampled
  tokens (over the allowed tokens under the grammar), and ``rescore``'s ``logp_old``;
* the same seed gives the same rollouts, another seed others; T → 0 is ``greedy_decode``;
* under the grammar every rollout parses strictly; free rollouts stop at a stop id or the cap;
* on a vocabulary of 8 the first tokens' frequencies follow softmax(logits / T) (chi-square);
* each prompt is computed once, not G times;
* bad input is a named error.
"""
import numpy as np
import pytest
import torch

from acarerank.ato import RescoreQuery, Rollouts, rescore, sample_rollouts
from acarerank.ato.rollouts import DEFAULT_STOP_IDS
from acarerank.model import Qwen3Runner
from acarerank.setwise.decode import greedy_decode
from acarerank.setwise.grammar import IdentifierGrammar, walk
from acarerank.setwise.selection import parse_selection
from acarerank.tokenizer import TOKEN_IM_END
from tests._tiny import random_qwen3

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16)


def biased(seed, token_bias, dtype=torch.float32, **shape):
    """A random tiny Qwen3 whose lm_head[t, 0] acts as a logit bias of token t (coordinate 0 of every
    embedding is 2.0, so the final-normed hidden state carries a large near-constant coordinate 0;
    tests/setwise/test_setwise_decode.py's trick)."""
    m = random_qwen3(seed=seed, **(shape or SHAPE))
    with torch.no_grad():
        m.model.embed_tokens.weight[:, 0] = 2.0
        for t, b in token_bias.items():
            m.lm_head.weight[t, 0] = b
    return m.to(dtype)


@pytest.fixture(scope="module")
def grammar(qwen3_tokenizer):
    return IdentifierGrammar.from_tokenizer(qwen3_tokenizer)


@pytest.fixture(scope="module")
def prompts(qwen3_tokenizer):
    # 35 and 1 tokens: a prompt ending mid-page (its last page copied on write per rollout) and one
    # whose shared part is empty
    return [qwen3_tokenizer.encode("Select the passages that answer the question. [1] Paris. [2] 1889. " * 2,
                                   add_special_tokens=False), [42]]


def _teacher_forced(model, prompt, y, temperature, allowed=None):
    """log_softmax(logits / T)[y_l] of transformers' forward over prompt ++ y ([len(y)], fp32); with
    ``allowed`` (per position, the grammar's tokens) over those tokens only."""
    logits = model(input_ids=torch.tensor([prompt + y])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(y)].float()
    z = logits / temperature
    if allowed is not None:
        keep = torch.zeros_like(z, dtype=torch.bool)
        for l, toks in enumerate(allowed):
            keep[l, toks] = True
        z = z.masked_fill(~keep, float("-inf"))
    return z.log_softmax(-1).gather(1, torch.tensor(y)[:, None])[:, 0]


def _allowed_along(grammar, n, cap, y):
    st = grammar.start(n, cap)
    out = []
    for t in y:
        out.append(st.allowed())
        st.advance(t)
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_free_logprobs_are_teacher_forced_log_softmax_and_rescores_logp_old(prompts, temperature):
    # p(<|im_end|>) ~ 0.07 a step at either temperature: some rollouts stop, some run to the cap
    model = biased(0, {TOKEN_IM_END: 1.2 * temperature})
    runner = Qwen3Runner.from_hf(model)
    ro = sample_rollouts(runner, prompts, 3, temperature=temperature, max_new_tokens=8, seed=1)
    assert isinstance(ro, Rollouts) and len(ro.tokens) == 6 and ro.query_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert ro.logprobs.shape == ro.response_mask.shape == (6, max(ro.lengths))
    assert ro.logprobs.dtype == torch.float32 and not ro.logprobs.requires_grad
    assert any(y[-1] == TOKEN_IM_END for y in ro.tokens) and any(len(y) == 8 for y in ro.tokens), ro.tokens
    with torch.no_grad():
        for n, y in enumerate(ro.tokens):
            want = _teacher_forced(model, prompts[n // 3], y, temperature)
            got = ro.logprobs[n, :len(y)]
            err = (got - want).abs().max().item()
            assert err <= 1e-5, f"rollout {n}: max |sampled - teacher-forced| {err:.3e}"
            assert (ro.logprobs[n, len(y):] == 0).all() and ro.response_mask[n].sum() == len(y)
    # rescore's logp_old, at the same temperature: the same numbers within fp32 rounding (not bitwise)
    queries = [RescoreQuery(p[:1], p[1:], ro.of_query(q), [[]] * 3) for q, p in enumerate(prompts)]
    res = rescore(runner, runner, queries, temperature=temperature)
    assert torch.equal(res.response_mask, ro.response_mask)
    assert (res.logp_old - ro.logprobs).abs().max() <= 1e-5


def test_constrained_logprobs_are_over_the_allowed_tokens(qwen3_tokenizer, prompts, grammar):
    """Each draw's log-prob is log_softmax(logits / T) renormalised over the tokens the grammar allows
    there (0 for a forced one: '[' first, ']' after a digit that no unused id extends); every rollout
    parses strictly."""
    model = biased(1, {TOKEN_IM_END: -0.05})
    pools = [(12, 4), (3, 3)]
    ro = sample_rollouts(Qwen3Runner.from_hf(model), prompts, 4, temperature=0.8, grammar=grammar, pools=pools,
                         seed=3)
    with torch.no_grad():
        for n, y in enumerate(ro.tokens):
            n_cand, cap = pools[n // 4]
            st = walk(grammar, n_cand, cap, y)
            assert st is not None and st.done and y[-1] == TOKEN_IM_END
            text = qwen3_tokenizer.decode(y, skip_special_tokens=True)
            parsed = parse_selection(text, n_cand, cap, strict=True)
            assert parsed.valid and parsed.ids == st.used, (text, parsed)
            allowed = _allowed_along(grammar, n_cand, cap, y)
            want = _teacher_forced(model, prompts[n // 4], y, 0.8, allowed)
            forced = torch.tensor([len(a) == 1 for a in allowed])
            assert (want[forced] == 0).all() and (ro.logprobs[n, :len(y)][forced] == 0).all()
            err = (ro.logprobs[n, :len(y)] - want).abs().max().item()
            assert err <= 1e-5, f"rollout {n} ({text!r}): max |sampled - teacher-forced masked| {err:.3e}"
    assert len({tuple(y) for y in ro.tokens}) > 2  # sampled, not one greedy answer


def test_bf16_logprobs_within_twice_transformers_bf16_error(prompts):
    """The package's bf16 rule (tests/model/test_runner.py): against the fp32 model's teacher-forced
    log-probs, a bf16 runner's sampled log-probs err at most 2x transformers-bf16's own (+ 1e-2)."""
    f32 = biased(2, {TOKEN_IM_END: 0.05})
    b16 = biased(2, {TOKEN_IM_END: 0.05}, dtype=torch.bfloat16)
    ro = sample_rollouts(Qwen3Runner.from_hf(b16), prompts, 2, max_new_tokens=6, seed=0)
    ours = theirs = 0.0
    with torch.no_grad():
        for n, y in enumerate(ro.tokens):
            ref = _teacher_forced(f32, prompts[n // 2], y, 1.0)
            ours = max(ours, (ro.logprobs[n, :len(y)] - ref).abs().max().item())
            theirs = max(theirs, (_teacher_forced(b16, prompts[n // 2], y, 1.0) - ref).abs().max().item())
    assert ours <= 2 * theirs + 1e-2, f"bf16 error {ours:.3e} vs transformers-bf16 {theirs:.3e}"


def test_seeds_reproduce_and_differ(prompts):
    runner = Qwen3Runner.from_hf(biased(0, {TOKEN_IM_END: 0.05}))
    a = sample_rollouts(runner, prompts, 4, max_new_tokens=6, seed=7)
    b = sample_rollouts(runner, prompts, 4, max_new_tokens=6, generator=torch.Generator().manual_seed(7))
    assert a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs)
    torch.manual_seed(7)   # neither: torch's global generator
    c = sample_rollouts(runner, prompts, 4, max_new_tokens=6)
    assert c.tokens == a.tokens
    d = sample_rollouts(runner, prompts, 4, max_new_tokens=6, seed=8)
    assert d.tokens != a.tokens
    assert len({tuple(y) for y in a.of_query(0)}) == 4  # the G rollouts of one prompt differ from each other


def test_a_tiny_temperature_is_greedy_decoding(prompts, grammar):
    """T = 1e-4: the argmax's probability is 1 to fp32 unless two logits are within ~1e-3 (none here),
    so the draws are greedy_decode's tokens, each with log-prob 0 (or within 1e-6 of it)."""
    model = biased(4, {TOKEN_IM_END: 0.05})
    runner = Qwen3Runner.from_hf(model)
    ro = sample_rollouts(runner, prompts, 2, temperature=1e-4, max_new_tokens=10, seed=0)
    greedy = greedy_decode(runner, prompts, max_new_tokens=10, eos_id=list(DEFAULT_STOP_IDS))
    assert ro.tokens == [g for g in greedy for _ in range(2)]
    assert ro.logprobs.abs().max() <= 1e-6
    pools = [(20, 5), (4, 2)]
    ro = sample_rollouts(runner, prompts, 2, temperature=1e-4, grammar=grammar, pools=pools, seed=0)
    greedy = greedy_decode(runner, prompts, grammar, [grammar.start(n, c) for n, c in pools])
    assert ro.tokens == [g for g in greedy for _ in range(2)]


def test_free_rollouts_stop_at_a_stop_id_or_the_cap(prompts):
    model = biased(5, {TOKEN_IM_END: 1.3, 100: 1.3})   # each ~0.13 a step
    runner = Qwen3Runner.from_hf(model)
    ro = sample_rollouts(runner, prompts, 6, max_new_tokens=5, stop_ids=[TOKEN_IM_END, 100], seed=2)
    stopped = [y for y in ro.tokens if len(y) < 5]
    assert stopped and any(len(y) == 5 for y in ro.tokens), ro.tokens
    for y in ro.tokens:
        assert 1 <= len(y) <= 5 and not {TOKEN_IM_END, 100} & set(y[:-1]), y
    assert all(y[-1] in (TOKEN_IM_END, 100) for y in stopped)
    assert {y[-1] for y in stopped} == {TOKEN_IM_END, 100}, ro.tokens
    one = sample_rollouts(runner, prompts, 3, max_new_tokens=1, seed=2)
    assert one.lengths == [1] * 6


# chi-square critical value, 7 degrees of freedom (8 tokens), upper tail 1e-3:
# scipy.stats.chi2.ppf(1 - 1e-3, 7) = 24.32. A correct sampler exceeds it for one seed in a thousand;
# the seed is fixed, so the test is deterministic. N = 3,000 draws: every expected count is >= 5
# (the smallest probability below is 0.006: 18 draws), chi-square's rule for its approximation.
CHI2_7DF_1E3 = 24.32
DRAWS = 3000


def test_first_token_frequencies_follow_softmax_over_temperature():
    """Vocabulary of 8: 3,000 rollouts of one token each; their counts against N·softmax(z / T) from
    transformers' forward pass the chi-square test at T = 0.7 and fail it at T = 1.0 and T = 0.5 (the
    statistic is 6x and 16x the bound there: the test is sharp enough to catch a temperature applied wrong
    or not at all)."""
    model = random_qwen3(seed=11, vocab=8, hidden=32, intermediate=48, layers=1, heads=2, kv_heads=1, head_dim=16)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)   # logits spread over ~4 nats: the temperature matters
    prompt = [3, 1, 4, 1, 5]
    T = 0.7
    ro = sample_rollouts(Qwen3Runner.from_hf(model), [prompt], DRAWS, temperature=T, max_new_tokens=1,
                         stop_ids=[7], seed=12345)
    counts = torch.bincount(torch.tensor([y[0] for y in ro.tokens]), minlength=8).double()
    with torch.no_grad():
        z = model(input_ids=torch.tensor([prompt])).logits[0, -1].double()

    def chi2(t):
        expected = DRAWS * torch.softmax(z / t, -1)
        return (((counts - expected) ** 2) / expected).sum().item()

    assert DRAWS * torch.softmax(z / T, -1).min() >= 5
    assert chi2(T) < CHI2_7DF_1E3, f"chi-square {chi2(T):.1f} at the sampling temperature; counts {counts.tolist()}"
    for wrong in (1.0, 0.5):
        assert chi2(wrong) > 4 * CHI2_7DF_1E3, f"T={wrong} is not told apart: chi-square {chi2(wrong):.1f}"


def test_each_prompt_is_computed_once_not_g_times(prompts, monkeypatch):
    """Counted at the runner's packed pass: the prefill computes Σ (P_q − 1) tokens once for all G
    rollouts (G full prefills would be G times that), and every later pass is a decode step of
    one-token segments, one per running rollout. The pool is sized for every rollout's rows up front:
    it never grows (a doubling copies every page)."""
    from acarerank.model import block_pool

    grown = []
    grow = block_pool.BlockPool._grow
    monkeypatch.setattr(block_pool.BlockPool, "_grow", lambda self, extra: (grown.append(extra), grow(self, extra)))
    runner = Qwen3Runner.from_hf(biased(0, {TOKEN_IM_END: 0.05}))
    passes = []
    real = runner._forward

    def counting(cache, ids, groups, output, append):
        passes.append((output, [t.numel() for t in ids]))
        return real(cache, ids, groups, output, append)

    monkeypatch.setattr(runner, "_forward", counting)
    G = 8
    ro = sample_rollouts(runner, prompts, G, max_new_tokens=6, seed=0)
    prefill = [p for p in passes if p[0] == "none"]
    steps = [p for p in passes if p[0] == "last"]
    assert len(prefill) == 1 and prefill[0][1] == [len(prompts[0]) - 1], prefill   # prompt 1 has no shared part
    assert len(steps) + 1 == len(passes) and len(steps) == max(ro.lengths)
    assert steps[0][1] == [1] * (G * len(prompts)) and all(set(s[1]) == {1} for s in steps)
    # tokens computed: each prompt once, then one per sampled token but the last of each rollout
    assert sum(sum(n) for _, n in passes) == sum(len(p) - 1 for p in prompts) + sum(ro.lengths)
    assert grown == [] and max(ro.lengths) == 6, (grown, ro.lengths)


def test_bad_input_is_named(prompts, grammar, monkeypatch):
    """Each refused before any model pass (no prompt computed for a call that cannot run)."""
    runner = Qwen3Runner.from_hf(random_qwen3(seed=0, **SHAPE))
    V = runner.arch.vocab_size
    passes = []
    real = runner._forward
    monkeypatch.setattr(runner, "_forward", lambda *a, **k: (passes.append(a), real(*a, **k))[1])
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        sample_rollouts(runner, prompts, 0)
    for t in (0, 0.0):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0.*greedy_decode"):
            sample_rollouts(runner, prompts, 2, temperature=t)
    for t in (-1.0, float("nan"), float("inf"), 1e-50, True):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            sample_rollouts(runner, prompts, 2, temperature=t)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sample_rollouts(runner, [[1, 2], []], 2)
    with pytest.raises(ValueError, match="no prompts"):
        sample_rollouts(runner, [], 2)
    with pytest.raises(ValueError, match=f"prompt 0 has token id {V} outside"):
        sample_rollouts(runner, [[1, V]], 2)
    with pytest.raises(ValueError, match="prompt 1 has token id -1 outside"):
        sample_rollouts(runner, [[1], [-1, 2]], 2)
    with pytest.raises(TypeError, match="wrap a single prompt in a list"):
        sample_rollouts(runner, [1, 2, 3], 2)
    with pytest.raises(TypeError, match="prompt 0: token ids must be integers"):
        sample_rollouts(runner, [[1.5, 2]], 2)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        sample_rollouts(runner, prompts, 2, max_new_tokens=0)
    with pytest.raises(ValueError, match="both grammar and pools"):
        sample_rollouts(runner, prompts, 2, grammar=grammar)
    with pytest.raises(ValueError, match="2 pools .* for 1 prompts"):
        sample_rollouts(runner, prompts[:1], 2, grammar=grammar, pools=[(3, 2), (3, 2)])
    with pytest.raises(ValueError, match="max_new_tokens"):   # ten five-digit ids need 71 tokens
        sample_rollouts(runner, prompts[:1], 2, grammar=grammar, pools=[(10_000, 10)])
    with pytest.raises(ValueError, match="grammar ends on token"):
        sample_rollouts(runner, prompts[:1], 2, grammar=grammar, pools=[(3, 2)], stop_ids=[5])
    with pytest.raises(ValueError, match="a generator or a seed, not both"):
        sample_rollouts(runner, prompts, 2, seed=1, generator=torch.Generator())
    for bad in ("<|im_end|>", [], torch.tensor([1, 2])):
        with pytest.raises(TypeError, match="stop_ids must be a token id or a non-empty"):
            sample_rollouts(runner, prompts, 2, stop_ids=bad)
    for bad, first in (([TOKEN_IM_END, V], V), (-1, -1)):
        with pytest.raises(ValueError, match=rf"stop id {first} is outside the vocabulary \[0, {V}\)"):
            sample_rollouts(runner, prompts, 2, stop_ids=bad)
    small = Qwen3Runner.from_hf(random_qwen3(seed=0, vocab=8, **SHAPE))
    with pytest.raises(ValueError, match=r"stop id 151643 is outside the vocabulary \[0, 8\).*pass stop_ids="):
        sample_rollouts(small, [[1, 2]], 2)   # Qwen3's default stop ids on a vocabulary of 8
    with pytest.raises(ValueError, match=r"seed must be in \[-2\*\*63, 2\*\*64\)"):
        sample_rollouts(runner, prompts, 2, seed=2 ** 64)
    assert passes == []
    assert sample_rollouts(runner, prompts, 2, max_new_tokens=2, seed=0).lengths == [2] * 4


def test_of_query_is_indexed_like_a_list(prompts):
    """of_query(q) is prompt q's G rollouts for q in [-Q, Q); past the end it was [] with no word."""
    runner = Qwen3Runner.from_hf(random_qwen3(seed=0, **SHAPE))
    r = sample_rollouts(runner, prompts, 3, max_new_tokens=2, seed=0)
    assert r.of_query(0) == r.tokens[:3] and r.of_query(1) == r.tokens[3:] == r.of_query(-1)
    for q in (2, 5, -3):
        with pytest.raises(IndexError, match=f"of_query: prompt {q} out of range for 2 prompt"):
            r.of_query(q)
    with pytest.raises(TypeError, match="of_query: q must be an int"):
        r.of_query(1.0)
    # the ids Rollouts holds: query_index's items (0-d int64 tensors), numpy ints; they were "q must be
    # an int, got tensor(0)"; a bool or a float one is still refused
    for q in r.query_index.unique():
        assert r.of_query(q) == r.of_query(int(q)), int(q)
    assert r.of_query(torch.tensor(-1, dtype=torch.int32)) == r.of_query(np.int64(1)) == r.of_query(np.array(1)) \
        == r.tokens[3:]
    for q in (True, torch.tensor(True), np.True_, torch.tensor(1.0), np.float64(1.0), torch.tensor([1])):
        with pytest.raises(TypeError, match="of_query: q must be an int"):
            r.of_query(q)


def test_numpy_seeds_and_prompts(prompts):
    """A numpy integer seed is the int it holds and a numpy array of ids a prompt (as rescore reads
    both; acarerank._validate's one integer rule): seed=np.int64(0) was "seed must be an int", and
    [np.array(P)] "prompt 0 is a ndarray (wrap a single prompt in a list)". A bool seed and a
    numpy float prompt stay refused."""
    np = pytest.importorskip("numpy")
    runner = Qwen3Runner.from_hf(biased(0, {TOKEN_IM_END: 0.05}))
    want = sample_rollouts(runner, prompts, 2, max_new_tokens=3, seed=3)
    for got in (sample_rollouts(runner, prompts, 2, max_new_tokens=3, seed=np.int64(3)),
                sample_rollouts(runner, [np.array(p) for p in prompts], 2, max_new_tokens=3, seed=3)):
        assert got.tokens == want.tokens and torch.equal(got.logprobs, want.logprobs)
    with pytest.raises(TypeError, match=r"seed must be an int, got (np\.)?True"):
        sample_rollouts(runner, prompts, 2, seed=np.bool_(True))
    with pytest.raises(TypeError, match="prompt 0: token ids must be integers"):
        sample_rollouts(runner, [np.array([1.5, 2.0])], 2)
    with pytest.raises(TypeError, match="wrap a single prompt in a list"):
        sample_rollouts(runner, np.array(prompts[0]).tolist(), 2)
    with pytest.raises(TypeError, match="wrap a single prompt in a list"):
        sample_rollouts(runner, [np.int64(1), np.int64(2)], 2)


def test_a_steps_logits_are_computed_in_bounded_row_chunks(prompts, monkeypatch):
    """40 running rollouts at V = 151,669: each step's [rows, V] logits hold at most
    SAMPLE_LOGITS_ELEMENTS numbers (27 rows), not all 40 rows at once (64 prompts × 8 held 296 MiB per
    [S, V] tensor, three of them), and the chunked draws' log-probs are still rescore's logp_old."""
    from acarerank.ato.rollouts import SAMPLE_LOGITS_ELEMENTS

    runner = Qwen3Runner.from_hf(biased(0, {TOKEN_IM_END: 0.05}))
    V = runner.arch.vocab_size
    rows = []
    real = runner.logits
    monkeypatch.setattr(runner, "logits", lambda h: (rows.append(h.shape[0]), real(h))[1])
    G = 20
    ro = sample_rollouts(runner, prompts, G, max_new_tokens=3, seed=5)
    assert max(rows) == SAMPLE_LOGITS_ELEMENTS // V == 27 and sum(rows[:2]) == 2 * G, rows
    queries = [RescoreQuery(p[:1], p[1:], ro.of_query(q), [[]] * G) for q, p in enumerate(prompts)]
    res = rescore(runner, runner, queries)
    assert torch.equal(res.response_mask, ro.response_mask)
    assert (res.logp_old - ro.logprobs).abs().max() <= 1e-5
    assert len({tuple(y) for y in ro.tokens}) > G  # the chunks draw on, not repeat one another


def test_the_pool_reserved_up_front_is_bounded(prompts, monkeypatch):
    """max_new_tokens = all the model's positions leave (32,768 − the longest prompt; 10⁶ is refused
    since docs/input-safety.md, "Positions") with G = 8: the pool made up front holds the prompts'
    pages and at most ROLLOUT_RESERVE_ROWS rows for the rollouts (not 8 × ~32,700 rows: 16,000
    pages and their free list before the first token; 10⁶ asked for 500,000); a call past the
    reserve grows the pool as its rollouts reach it and gives rescore's log-probs."""
    from acarerank.ato import rollouts as R
    from acarerank.model import block_pool

    runner = Qwen3Runner.from_hf(biased(0, {TOKEN_IM_END: 40.0}))   # p(<|im_end|>) ~ 1: one token each
    made = []
    new_pool = runner.new_pool
    monkeypatch.setattr(runner, "new_pool", lambda n, growable=False: (made.append(n), new_pool(n, growable))[1])
    most = runner.max_positions - max(map(len, prompts))
    assert 8 * most > 2 * R.ROLLOUT_RESERVE_ROWS
    ro = sample_rollouts(runner, prompts, 8, max_new_tokens=most, seed=0)
    assert ro.lengths == [1] * 16
    bs = runner.block_size
    prompt_pages = sum(-(-(len(p) - 1) // bs) for p in prompts)
    assert made == [prompt_pages + R.ROLLOUT_RESERVE_ROWS // bs], made

    runner = Qwen3Runner.from_hf(biased(0, {TOKEN_IM_END: 0.05}))
    grown = []
    real_grow = block_pool.BlockPool._grow
    monkeypatch.setattr(block_pool.BlockPool, "_grow", lambda self, extra: (grown.append(extra), real_grow(self, extra)))
    monkeypatch.setattr(R, "ROLLOUT_RESERVE_ROWS", 2 * bs)
    ro = sample_rollouts(runner, prompts, 4, max_new_tokens=20, seed=0)
    assert grown, ro.lengths   # 8 rollouts past 2 pages of reserve
    queries = [RescoreQuery(p[:1], p[1:], ro.of_query(q), [[]] * 4) for q, p in enumerate(prompts)]
    res = rescore(runner, runner, queries)
    assert torch.equal(res.response_mask, ro.response_mask)
    assert (res.logp_old - ro.logprobs).abs().max() <= 1e-5


def test_every_page_is_given_back_and_threads_sample_as_alone(prompts, monkeypatch):
    """Each call samples in a pool of its own: after 100 calls, a KeyboardInterrupt from the draw
    and NaN logits mid-sampling, every page of every call's pool is free and no pool outlives its
    call; the runner then samples as a fresh one. Two threads on one runner get what each gets alone
    (docs/api.md, "Threads")."""
    import gc
    import threading
    import weakref

    from acarerank.ato import rollouts as R
    from acarerank.model.numerics import NonFiniteOutputError

    model = biased(0, {TOKEN_IM_END: 0.05})
    runner = Qwen3Runner.from_hf(model)
    pools = []
    new_pool = runner.new_pool
    monkeypatch.setattr(runner, "new_pool", lambda *a, **k: (pools.append(new_pool(*a, **k)), pools[-1])[1])

    def all_free():
        return all(p.num_free == p.num_blocks and not any(p.refcount) for p in pools)

    for i in range(100):
        sample_rollouts(runner, prompts, 2, max_new_tokens=2, seed=i)
    assert len(pools) == 100 and all_free()
    choose, calls = R._SampleStepper._choose, []

    def interrupted(self, logits, running):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return choose(self, logits, running)

    monkeypatch.setattr(R._SampleStepper, "_choose", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sample_rollouts(runner, prompts, 3, max_new_tokens=6, seed=0)
    monkeypatch.setattr(R._SampleStepper, "_choose", choose)
    logits = runner.logits
    monkeypatch.setattr(runner, "logits", lambda h: logits(h).fill_(float("nan")))
    with pytest.raises(NonFiniteOutputError, match="sampling of prompt"):
        sample_rollouts(runner, prompts, 3, max_new_tokens=6, seed=0)
    monkeypatch.setattr(runner, "logits", logits)
    assert len(pools) == 102 and all_free()
    refs = [weakref.ref(p) for p in pools]
    pools.clear()
    gc.collect()
    assert not any(r() for r in refs)

    fresh = Qwen3Runner.from_hf(model)
    want = {s: sample_rollouts(fresh, prompts, 3, max_new_tokens=8, seed=s) for s in (0, 1)}
    got = {}
    threads = [threading.Thread(target=lambda s=s: got.__setitem__(s, sample_rollouts(runner, prompts, 3,
                                                                                      max_new_tokens=8, seed=s)))
               for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in (0, 1):
        assert got[s].tokens == want[s].tokens and torch.equal(got[s].logprobs, want[s].logprobs)
    assert all_free()


def test_page_edges_and_mixed_lengths_in_one_call():
    """Prompts whose shared part (all but the last token) is 0, 15, 16, 17 and 32 tokens — inside,
    at and past a 16-token page edge, where a rollout's first write copies the shared last page or
    opens its own — in one call, G = 1 and G = 3: every log-prob is transformers' teacher-forced one
    and rescore's logp_old, and max_new_tokens = 1 gives one token each."""
    model = biased(6, {TOKEN_IM_END: 1.2})
    runner = Qwen3Runner.from_hf(model)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (1, 16, 17, 18, 33)]
    assert runner.block_size == 16
    for G, new in ((1, 1), (3, 20)):
        ro = sample_rollouts(runner, prompts, G, max_new_tokens=new, seed=G)
        assert len(ro.tokens) == 5 * G and (new > 1 or ro.lengths == [1] * (5 * G))
        with torch.no_grad():
            for n, y in enumerate(ro.tokens):
                err = (ro.logprobs[n, :len(y)] - _teacher_forced(model, prompts[n // G], y, 1.0)).abs().max()
                assert err <= 1e-5, (n, len(prompts[n // G]), err.item())
        queries = [RescoreQuery(p[:1], p[1:], ro.of_query(q), [[]] * G) for q, p in enumerate(prompts)]
        res = rescore(runner, runner, queries)
        assert torch.equal(res.response_mask, ro.response_mask)
        assert (res.logp_old - ro.logprobs).abs().max() <= 1e-5
