"""Token-level state machine for AdaTutoRank's bracketed identifier output (docs/ARCHITECTURE.md, "Setwise facts").

The Qwen3 tokenizer splits ``"[4] [12] [7]"`` into ``'['  '4'  ']'  ' ['  '1'  '2'  ']'  ' ['
'7'  ']'`` -- every digit is its own token -- so a selection is a word over 14 tokens:

    OPEN  = '['            first entry only
    SEP   = ' ['           every later entry (the single space is part of the token)
    DIGIT = '0' .. '9'
    CLOSE = ']'
    END   = '<|im_end|>'   end of the assistant turn

and the language of valid selections of a pool of ``n`` candidates with cap ``max_select`` is

    OPEN id CLOSE (SEP id CLOSE){0, max_select-1} END,   id in 1..n, no id twice,
    id written in decimal without a leading zero.

``GrammarState.allowed()`` returns the tokens that keep the output inside that language, so
masking everything else at every step makes any decoder's output parse strictly
(``acarerank.setwise.selection.parse_selection``). A digit is allowed only if some *unused* id in
``1..n`` starts with the digits so far plus it (so ``[1`` stays open for ``[12]`` after ``[1]``
was used, and is masked when 1 and 10..19 are all used or out of range); ``CLOSE`` only if the
digits so far are an unused id; ``SEP`` only below the cap and while an unused id remains;
``END`` only after at least one entry. Every allowed set is non-empty, so the machine never
dead-ends.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

import torch

from .._validate import positive_int
from ..limits import DEFAULT_MAX_DOCUMENTS  # one request's document cap

# Phases of the machine.
_START, _NUMBER, _AFTER_CLOSE, _DONE = range(4)


def max_output_tokens(n: int, max_select: int) -> int:
    """Longest constrained output for a pool of ``n`` and ``max_select`` ids, END included: each
    entry is 2 + digits(id) tokens, bounded by the widest id (e.g. pool 20, cap 16: 16·4 + 1 = 65)."""
    return min(max_select, n) * (2 + len(str(n))) + 1


def max_new_tokens_cap(n: int) -> int:
    """The most ``max_new_tokens`` a selection over ``n`` documents may ask for: the longest
    selection of ``max(1000, n)`` documents (``max_output_tokens``; 6,001 tokens up to 1,000,
    1,000 being the server's ``--max-documents``). Free decoding reserves ``max_new_tokens + 1``
    KV rows per prompt up front and runs until the model stops; past any selection the pool allows,
    its output is no selection (docs/api.md, "Setwise")."""
    m = max(DEFAULT_MAX_DOCUMENTS, n)
    return max_output_tokens(m, m)


@dataclass(frozen=True)
class IdentifierTokens:
    """Token ids of the 14 pieces of a selection. ``vocab``: all 14, ascending (mask column order)."""

    open: int
    sep: int
    digits: Tuple[int, ...]          # digits[k] is the token of the digit k
    close: int
    end: int

    @property
    def vocab(self) -> Tuple[int, ...]:
        return tuple(sorted((self.open, self.sep, self.close, self.end, *self.digits)))

    @classmethod
    def from_tokenizer(cls, tokenizer, end_token: str = "<|im_end|>") -> "IdentifierTokens":
        """Look the pieces up in ``tokenizer`` and check that selections split into them.

        Raises ValueError when a piece is not a single token or the tokenizer merges the
        pieces of a selection differently (the grammar would then describe text that the
        model never sees as these tokens).
        """
        def single(text: str) -> int:
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) != 1:
                raise ValueError(f"{text!r} is {len(ids)} tokens {ids} in this tokenizer; the identifier grammar "
                                 "needs it to be exactly one")
            return ids[0]

        end = tokenizer.convert_tokens_to_ids(end_token)
        if end is None or end == getattr(tokenizer, "unk_token_id", None):
            raise ValueError(f"end-of-turn token {end_token!r} is not in this tokenizer's vocabulary")
        toks = cls(open=single("["), sep=single(" ["), digits=tuple(single(str(k)) for k in range(10)),
                   close=single("]"), end=int(end))
        if len(set(toks.vocab)) != 14:
            raise ValueError(f"identifier pieces share token ids: {toks}")
        for sample in ("[4] [2] [7]", "[10] [1] [100]", "[9] [30] [58] [66]"):
            got = tokenizer.encode(sample, add_special_tokens=False)
            want = toks.encode_ids(int(x.strip("[]")) for x in sample.split(" "))[:-1]
            if got != want:
                raise ValueError(f"this tokenizer splits {sample!r} as {got}, not digit by digit as {want}; "
                                 "the identifier grammar assumes the Qwen3 split")
        return toks

    def encode_ids(self, ids: Iterable[int]) -> List[int]:
        """Canonical token sequence of a selection, END included: ``[4, 12]`` -> ``[ 4 ]  [ 1 2 ] END``."""
        out: List[int] = []
        for k, i in enumerate(ids):
            out.append(self.open if k == 0 else self.sep)
            out.extend(self.digits[int(c)] for c in str(int(i)))
            out.append(self.close)
        out.append(self.end)
        return out


class GrammarState:
    """One sequence's position in the machine. ``allowed()``, then ``advance(token)`` with one of them."""

    __slots__ = ("tokens", "n", "max_select", "used", "prefix", "phase", "_digit_of")

    def __init__(self, tokens: IdentifierTokens, n: int, max_select: int):
        n = positive_int("the pool size n", n)
        max_select = positive_int("max_select", max_select)
        self.tokens = tokens
        self.n = n
        self.max_select = max_select
        self.used: List[int] = []            # ids emitted so far, in order
        self.prefix = 0                      # digits of the id being written (0: none yet)
        self.phase = _START
        self._digit_of = {t: k for k, t in enumerate(tokens.digits)}

    # -- queries --------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.phase == _DONE

    def max_tokens(self) -> int:
        """Longest output the machine allows, END included: each entry is 2 + digits(id) tokens."""
        return max_output_tokens(self.n, self.max_select)

    def _has_free(self, prefix: int) -> bool:
        """Is some unused id in 1..n written as ``prefix`` followed by zero or more digits?"""
        scale = 1
        while prefix * scale <= self.n:
            lo, hi = prefix * scale, min((prefix + 1) * scale - 1, self.n)
            if sum(lo <= u <= hi for u in self.used) < hi - lo + 1:
                return True
            scale *= 10
        return False

    def allowed(self) -> List[int]:
        """Token ids that keep the output a valid (prefix of a) selection; ascending."""
        t = self.tokens
        if self.phase == _START:
            return [t.open]
        if self.phase == _NUMBER:
            first = 1 if self.prefix == 0 else 0            # no leading zero
            out = [t.digits[k] for k in range(first, 10) if self._has_free(self.prefix * 10 + k)]
            if self.prefix and self.prefix <= self.n and self.prefix not in self.used:
                out.append(t.close)
            return sorted(out)
        if self.phase == _AFTER_CLOSE:
            out = [t.end]
            if len(self.used) < min(self.max_select, self.n):
                out.append(t.sep)
            return sorted(out)
        return []

    # -- transitions ----------------------------------------------------------------------
    def advance(self, token: int) -> None:
        """Consume ``token``; ValueError if the machine does not allow it here."""
        token = int(token)
        if token not in self.allowed():
            raise ValueError(f"token {token} is not allowed after ids {self.used} (phase {self.phase}, "
                             f"digits so far {self.prefix or ''}); allowed: {self.allowed()}")
        t = self.tokens
        if token in (t.open, t.sep):
            self.phase, self.prefix = _NUMBER, 0
        elif token == t.close:
            self.used.append(self.prefix)
            self.phase, self.prefix = _AFTER_CLOSE, 0
        elif token == t.end:
            self.phase = _DONE
        else:
            self.prefix = self.prefix * 10 + self._digit_of[token]


class IdentifierGrammar:
    """Built once per tokenizer; hands out a fresh ``GrammarState`` per sequence."""

    def __init__(self, tokens: IdentifierTokens):
        self.tokens = tokens
        self.vocab = torch.tensor(tokens.vocab, dtype=torch.long, device="cpu")          # [14] mask columns
        self._col = {tok: c for c, tok in enumerate(tokens.vocab)}

    @classmethod
    def from_tokenizer(cls, tokenizer, end_token: str = "<|im_end|>") -> "IdentifierGrammar":
        return cls(IdentifierTokens.from_tokenizer(tokenizer, end_token))

    def start(self, n: int, max_select: int = 10) -> GrammarState:
        return GrammarState(self.tokens, n, max_select)

    def mask(self, states: List[GrammarState]) -> torch.Tensor:
        """Bool [S, 14]: ``mask[s, c]`` is True when ``self.vocab[c]`` is allowed for ``states[s]``."""
        m = torch.zeros(len(states), len(self.vocab), dtype=torch.bool, device="cpu")  # filled on the host
        for s, st in enumerate(states):
            for tok in st.allowed():
                m[s, self._col[tok]] = True
        return m

    def mask_full(self, state: GrammarState, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ([V] or [B, V]) with every token the state does not allow set to -inf (a copy)."""
        out = torch.full_like(logits, float("-inf"))
        allowed = torch.tensor(state.allowed(), dtype=torch.long, device=logits.device)
        out[..., allowed] = logits[..., allowed]
        return out


def walk(grammar: IdentifierGrammar, n: int, max_select: int, token_ids: Iterable[int]) -> Optional[GrammarState]:
    """Advance a fresh state through ``token_ids``; the final state, or None if a token is rejected."""
    st = grammar.start(n, max_select)
    try:
        for tok in token_ids:
            st.advance(tok)
    except ValueError:
        return None
    return st
