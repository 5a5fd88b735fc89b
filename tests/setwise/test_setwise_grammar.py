"""The identifier state machine against the format it must enforce.

Reference: the set of valid selections of a pool (ordered, distinct ids in 1..n, 1..cap of
them), tokenized by the real Qwen3 tokenizer, plus ``parse_selection(strict=True)``. The
machine must accept exactly those token sequences (soundness and completeness, checked by
enumeration on small pools) and never dead-end (random walks on large pools).
"""
import itertools
import random
import re

import pytest
import torch
from _hypothesis import given, settings, st  # hypothesis, or skips where absent

from acarerank.setwise.selection import parse_selection
from acarerank.setwise.grammar import IdentifierGrammar, IdentifierTokens, walk
from acarerank.tokenizer import TOKEN_IM_END


@pytest.fixture(scope="module")
def grammar(qwen3_tokenizer):
    return IdentifierGrammar.from_tokenizer(qwen3_tokenizer)


def test_tokens_are_the_tokenizers_split(qwen3_tokenizer, grammar):
    t = grammar.tokens
    # docs/ARCHITECTURE.md, "Setwise facts": "[4] [2] [7]" -> '[', '4', ']', ' [', '2', ']', ' [', '7', ']'
    pieces = qwen3_tokenizer.convert_ids_to_tokens(qwen3_tokenizer.encode("[4] [2] [7]", add_special_tokens=False))
    assert pieces == ["[", "4", "]", "Ġ[", "2", "]", "Ġ[", "7", "]"]
    assert qwen3_tokenizer.convert_ids_to_tokens([t.open, t.sep, t.close]) == ["[", "Ġ[", "]"]
    assert qwen3_tokenizer.convert_ids_to_tokens(list(t.digits)) == [str(k) for k in range(10)]
    assert t.end == TOKEN_IM_END
    assert list(t.vocab) == sorted(t.vocab) and len(set(t.vocab)) == 14
    for ids in ([4, 2, 7], [1, 12], [100, 9, 10]):
        text = " ".join(f"[{i}]" for i in ids)
        assert t.encode_ids(ids) == qwen3_tokenizer.encode(text, add_special_tokens=False) + [TOKEN_IM_END]


def valid_selections(n, cap):
    for k in range(1, min(n, cap) + 1):
        yield from itertools.permutations(range(1, n + 1), k)


def accepted_sequences(grammar, n, cap):
    """Every complete token sequence the machine accepts (DFS over allowed tokens)."""
    out = []

    def dfs(seq):
        st_ = walk(grammar, n, cap, seq)
        assert st_ is not None
        if st_.done:
            out.append(tuple(seq))
            return
        allowed = st_.allowed()
        assert allowed, f"dead end after {seq}"
        for tok in allowed:
            dfs(seq + [tok])

    dfs([])
    return out


@pytest.mark.parametrize("n,cap", [(1, 1), (1, 10), (2, 2), (3, 2), (4, 3), (9, 1), (10, 1), (11, 2), (12, 2),
                                   (20, 1), (100, 1)])
def test_accepts_exactly_the_valid_selections(qwen3_tokenizer, grammar, n, cap):
    want = {tuple(qwen3_tokenizer.encode(" ".join(f"[{i}]" for i in sel), add_special_tokens=False) + [TOKEN_IM_END])
            for sel in valid_selections(n, cap)}
    got = accepted_sequences(grammar, n, cap)
    assert len(got) == len(set(got))
    assert set(got) == want, (sorted(set(got) - want)[:3], sorted(want - set(got))[:3])
    for seq in got[:200]:
        text = qwen3_tokenizer.decode(seq, skip_special_tokens=True)
        assert parse_selection(text, n, cap).valid, text


def test_rejects_invalid_selections(qwen3_tokenizer, grammar):
    def toks(text):
        return qwen3_tokenizer.encode(text, add_special_tokens=False) + [TOKEN_IM_END]

    for text, n, cap in [("[0]", 5, 10), ("[6]", 5, 10), ("[05]", 5, 10), ("[1] [1]", 5, 10), ("[1] [2]", 5, 1),
                         ("[10]", 9, 10), ("[1] [12]", 11, 10), ("[1]  [2]", 5, 10), ("", 5, 10),
                         ("[4][2]", 5, 10), ("[1] [2] [3]", 3, 2)]:
        assert walk(grammar, n, cap, toks(text)) is None, text
        assert not parse_selection(text, n, cap).valid, text
    # the canonical form only: no leading space (the strict parse tolerates surrounding whitespace)
    assert walk(grammar, 5, 10, toks(" [1]")) is None


def _allowed_after(grammar, n, cap, text, qwen3_tokenizer):
    st_ = walk(grammar, n, cap, qwen3_tokenizer.encode(text, add_special_tokens=False))
    assert st_ is not None, text
    return set(qwen3_tokenizer.convert_ids_to_tokens(st_.allowed()))


def test_edge_cases(qwen3_tokenizer, grammar):
    a = lambda n, cap, text: _allowed_after(grammar, n, cap, text, qwen3_tokenizer)  # noqa: E731
    assert a(1, 10, "") == {"["}                                   # must open; END needs an entry first
    assert a(1, 10, "[") == {"1"}
    assert a(1, 10, "[1") == {"]"}
    assert a(1, 10, "[1]") == {"<|im_end|>"}                       # pool exhausted: no separator
    assert a(9, 10, "[") == {str(k) for k in range(1, 10)}        # no leading zero
    assert a(9, 10, "[1") == {"]"}                                 # 10 > 9
    assert a(10, 10, "[1") == {"]", "0"}                           # n = 10: two-digit ids appear
    assert a(10, 10, "[1] [") == {str(k) for k in range(1, 10)}   # '1' still leads to 10
    assert a(10, 10, "[1] [1") == {"0"}                           # only 10 is left under '1'
    assert a(10, 10, "[1] [10] [") == {str(k) for k in range(2, 10)}
    assert a(12, 10, "[1] [1") == {"0", "1", "2"}                 # [1] vs [12]: '1' only as a prefix now
    assert a(12, 10, "[12] [1") == {"]", "0", "1"}
    assert a(100, 10, "[1") == {"]"} | {str(k) for k in range(10)}
    assert a(100, 10, "[10") == {"]", "0"}                        # 100
    assert a(100, 10, "[100") == {"]"}
    assert a(100, 10, "[2") == {"]"} | {str(k) for k in range(10)}
    assert a(100, 10, "[20") == {"]"}                             # 200 > 100
    assert a(100, 1, "[7]") == {"<|im_end|>"}                     # max_select = 1
    assert a(100, 2, "[7]") == {"<|im_end|>", "Ġ["}
    assert a(100, 2, "[7] [8]") == {"<|im_end|>"}
    # every id of 1..9 used: the first digit '1' survives only through 10..12
    used = " ".join(f"[{i}]" for i in range(1, 10))
    assert a(12, 20, used + " [") == {"1"}


def test_mask_matches_allowed(grammar):
    states = [grammar.start(n, cap) for n, cap in [(1, 1), (12, 3), (100, 10)]]
    for st_, tok in zip(states, [grammar.tokens.open] * 3):
        st_.advance(tok)
    m = grammar.mask(states)
    assert m.shape == (3, 14) and m.dtype == torch.bool
    for row, st_ in zip(m, states):
        assert grammar.vocab[row].tolist() == st_.allowed()
    logits = torch.randn(2, 151669)
    masked = grammar.mask_full(states[1], logits)
    keep = torch.zeros(151669, dtype=torch.bool)
    keep[states[1].allowed()] = True
    assert torch.equal(masked[:, keep], logits[:, keep]) and bool((masked[:, ~keep] == float("-inf")).all())


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 120), cap=st.integers(1, 10), seed=st.integers(0, 2**31 - 1))
def test_random_walks_end_valid(qwen3_tokenizer, grammar, n, cap, seed):
    rng = random.Random(seed)
    st_ = grammar.start(n, cap)
    seq = []
    while not st_.done:
        allowed = st_.allowed()
        assert allowed, f"dead end after {seq}"
        tok = rng.choice(allowed)
        st_.advance(tok)
        seq.append(tok)
        assert len(seq) <= st_.max_tokens()
    text = qwen3_tokenizer.decode(seq, skip_special_tokens=True)
    parsed = parse_selection(text, n, cap)
    assert parsed.valid and parsed.ids == st_.used, (text, parsed)
    # the machine's tokens are exactly how the tokenizer writes that text
    assert qwen3_tokenizer.encode(text, add_special_tokens=False) + [TOKEN_IM_END] == seq


def test_advance_rejects_and_bad_args(grammar):
    st_ = grammar.start(5, 2)
    with pytest.raises(ValueError, match="not allowed"):
        st_.advance(grammar.tokens.end)
    with pytest.raises(ValueError, match="pool size"):
        grammar.start(0, 2)
    with pytest.raises(ValueError, match="max_select"):
        grammar.start(5, 0)


def test_tokenizer_that_merges_digits_is_refused():
    class MergingTokenizer:  # a tokenizer writing "10" as one token: the grammar would not describe it
        def encode(self, text, add_special_tokens=False):
            out = []
            for piece in re.findall(r" \[|\[|\]|[0-9]+", text):
                out.append({"[": 1, " [": 2, "]": 3}[piece] if piece in ("[", " [", "]") else 100 + int(piece))
            return out

        def convert_tokens_to_ids(self, token):
            return 99

    with pytest.raises(ValueError, match="digit by digit"):
        IdentifierTokens.from_tokenizer(MergingTokenizer())
