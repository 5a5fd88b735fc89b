"""Greedy decoding through the runner's KV cache, optionally under the identifier grammar.

One group per prompt (docs/ARCHITECTURE.md, "The one primitive", "greedy decode": 1 segment of 1 token per sequence):

1. ``runner.prefill`` all prompts but their last token, one group each (chunked inside);
2. step: one 1-token segment per still-running group -- the last prompt token first, then
   each sequence's previous output -- with ``append=True``, so the cache grows by one row;
3. next token = argmax of the step's logits, masked by the sequence's ``GrammarState``
   when constrained; a sequence stops at ``eos_id`` (one id or several) or after ``max_new_tokens``.
   Tokens the grammar forces (a single allowed token) are emitted without a step of their
   own and sent along with the next step's segment (``_force``), so a segment may hold a
   few tokens; the output is unchanged.

All prompts advance in the same steps; a finished one just stops sending segments.

Constrained steps read only the 14 grammar tokens' rows of ``lm_head``: the mask sets every
other logit to -inf, so the argmax over those 14 equals the argmax over the full masked
vocabulary (ties go to the lower token id either way: the columns are in ascending id
order and ``torch.argmax`` returns the first maximum). For the embedded default model
(V = 151,669, H = 384) that replaces a 58-MFLOP GEMV per row and step with a 5-kFLOP one.
Unconstrained steps use ``runner.logits`` (full vocabulary), in row chunks of at most
``LOGITS_CHUNK_ELEMENTS`` logits (``GreedyStepper._next_tokens``): the whole [S, V] of a batch of
256 prompts was 148 MiB more peak memory per step.

``greedy_decode_ref`` is the plain oracle: a transformers forward over the whole sequence
at every step, the same mask, argmax.
"""
from __future__ import annotations

import numbers
from typing import FrozenSet, List, Optional, Sequence, Union

import torch

from .._validate import positive_int
from ..model.numerics import NonFiniteHiddenError, NonFiniteOutputError, nonfinite_rows
from ..model.runner import INVARIANT_ROWS, position_limit_error
from ..tokenizer import TOKEN_IM_END
from .grammar import GrammarState, IdentifierGrammar

MAX_NEW_TOKENS = 64     # AdaTutoRank (2026), Appendix C.4: maximum response length
#: fp32 logits per row chunk of a step (4 Mi: 16 MiB; 27 rows at V = 151,669, all rows under the
#: grammar's 14 columns): a step's [rows, V] tensors are bounded by it, not by the prompts of a batch
LOGITS_CHUNK_ELEMENTS = 1 << 22


def stop_ids(eos_id: Union[int, Sequence[int]]) -> FrozenSet[int]:
    """The token ids a sequence stops at: ``eos_id`` is one id or several (free decoding of a Qwen3
    checkpoint stops at ``<|im_end|>`` and ``<|endoftext|>``, as its generation config says)."""
    def is_id(x):
        return isinstance(x, numbers.Integral) and not isinstance(x, bool)

    ids = [eos_id] if is_id(eos_id) else list(eos_id) if isinstance(eos_id, (list, tuple, set, frozenset)) else []
    if not ids or not all(is_id(i) for i in ids):
        raise TypeError(f"eos_id must be a token id or a non-empty sequence of them, got {eos_id!r}")
    return frozenset(int(i) for i in ids)


def decode_reserve(max_new_tokens: int, longest: Optional[int] = None) -> int:
    """KV rows to reserve per sequence before a greedy decode, so its pool never grows mid-decode:
    the prompt's last token and every new token (+1 spare): ``max_new_tokens``, or ``longest``
    when a grammar bounds the output below it (``grammar.max_output_tokens``: pool 20, cap 10
    is 41 tokens, not 64)."""
    return min(max_new_tokens, max_new_tokens if longest is None else longest) + 1


def _check(prompts, states, max_new_tokens):
    if len(prompts) == 0:
        raise ValueError("no prompts to decode")
    for i, p in enumerate(prompts):
        if len(p) < 1:
            raise ValueError(f"prompt {i} is empty; greedy decoding needs at least one prompt token")
    positive_int("max_new_tokens", max_new_tokens)
    if states is not None:
        if len(states) != len(prompts):
            raise ValueError(f"{len(states)} grammar states for {len(prompts)} prompts")
        for i, st in enumerate(states):
            if st.max_tokens() > max_new_tokens:
                raise ValueError(f"prompt {i}: up to {min(st.max_select, st.n)} ids of pool {st.n} may need "
                                 f"{st.max_tokens()} tokens, more than max_new_tokens={max_new_tokens}")


def check_positions(runner, prompts, max_new_tokens: int, who: str = "prompt") -> None:
    """ContextLengthError (a ValueError) naming the first prompt whose length + ``max_new_tokens``
    is past the model's maximum context length (``runner.max_positions``; vLLM's rule for a
    prompt and its ``max_tokens``): the new tokens take the positions after the prompt."""
    limit = runner.max_positions
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens > limit:
            raise position_limit_error(f"{who} {i} ({len(p):,} tokens) + max_new_tokens={max_new_tokens:,}",
                                       len(p) + max_new_tokens, limit, "shorten the prompt or lower max_new_tokens")


def greedy_decode(runner, prompts: Sequence[Sequence[int]], grammar: Optional[IdentifierGrammar] = None,
                  states: Optional[Sequence[GrammarState]] = None, max_new_tokens: int = MAX_NEW_TOKENS,
                  eos_id: Union[int, Sequence[int]] = TOKEN_IM_END, cache=None) -> List[List[int]]:
    """Greedy continuation of each prompt; returns the new token ids (the stop token included when emitted).

    runner: ``acarerank.model.Qwen3Runner``. prompts: token-id lists (>= 1 token each).
    grammar + states: constrained decoding, one fresh ``GrammarState`` per prompt (advanced
    in place); both None: free decoding. The grammar's END must be ``eos_id`` (or one of them).
    cache: a cache already holding every prompt but its last token, group g = prompt g (e.g.
    from ``acarerank.model.cached_prefill.prefill_cached``); the caller frees it. None: prefilled here.
    """
    dec = GreedyStepper(runner, prompts, grammar, states, max_new_tokens, eos_id, cache)
    while not dec.done:
        dec.step()
    return dec.outputs


class GreedyStepper:
    """``greedy_decode`` one step at a time, for a scheduler that interleaves steps with other work.

    Same arguments as ``greedy_decode``; ``step()`` runs one forward of every running sequence
    (one segment each: its previous output plus any forced tokens) and returns the tokens it
    fed; ``done`` once every sequence has stopped; ``outputs`` holds the new tokens so far.
    Subclasses change how a token is picked from the step's logits (``_choose``;
    ``acarerank.ato.rollouts`` samples).
    """

    _kind = "greedy decoding"  # what errors call the loop

    @torch.inference_mode()
    def __init__(self, runner, prompts: Sequence[Sequence[int]], grammar: Optional[IdentifierGrammar] = None,
                 states: Optional[Sequence[GrammarState]] = None, max_new_tokens: int = MAX_NEW_TOKENS,
                 eos_id: Union[int, Sequence[int]] = TOKEN_IM_END, cache=None):
        if (grammar is None) != (states is None):
            raise ValueError("pass both grammar and states (constrained) or neither (free decoding)")
        stops = stop_ids(eos_id)
        if grammar is not None and grammar.tokens.end not in stops:
            raise ValueError(f"the grammar ends on token {grammar.tokens.end} but eos_id is {eos_id}")
        _check(prompts, states, max_new_tokens)
        check_positions(runner, prompts, max_new_tokens)
        prompts = [list(map(int, p)) for p in prompts]
        if cache is None:
            # room for the last prompt token and every new token the grammar (or the cap) allows
            longest = None if states is None else max(st.max_tokens() for st in states)
            cache = runner.prefill([p[:-1] for p in prompts], reserve_tokens=decode_reserve(max_new_tokens, longest))
        elif cache.lengths != [len(p) - 1 for p in prompts]:
            raise ValueError(f"cache holds {cache.lengths} tokens per group; the prompts need "
                             f"{[len(p) - 1 for p in prompts]}")
        self.runner, self.cache, self.grammar, self.states = runner, cache, grammar, states
        self.max_new_tokens, self.stop_ids = max_new_tokens, stops
        if grammar is not None:
            self.vocab = grammar.vocab.to(runner.device)
            self.head = runner.lm_head[self.vocab]                     # [14, H]: the only rows a mask lets through
        self.outputs: List[List[int]] = [[] for _ in prompts]
        self.feed = [[p[-1]] for p in prompts]                        # tokens each group sends in the next step
        self._fed_rows: Optional[torch.Tensor] = None                 # [S, H] of a step whose choice raised
        self.running = [g for g in range(len(prompts))
                        if not _force(g, states, self.outputs, self.feed, max_new_tokens)]

    @property
    def done(self) -> bool:
        return not self.running

    @torch.inference_mode()
    def step(self) -> int:
        """One forward of every running sequence; returns the tokens fed (0 when done)."""
        running, feed, states, outputs = self.running, self.feed, self.states, self.outputs
        if not running:
            return 0
        fed = sum(len(feed[g]) for g in running)
        # the fed tokens are in the cache once the pass returns: a step whose choice then raised (an
        # out-of-memory [S, V], non-finite logits) keeps the pass's rows, so a retried step chooses
        # from them instead of feeding those tokens again at the next positions (which it did: a
        # different selection, no error)
        if self._fed_rows is None:
            try:
                self._fed_rows = self.runner.forward(self.cache, [feed[g] for g in running], running, output="last",
                                                     append=True)                          # [S, H]
            except NonFiniteHiddenError as e:
                # the pass's rows are the running sequences, not the prompts: once one stopped, row 1
                # could be prompt 3; name the prompts, as _check_finite does
                rows = [running[i] for i in e.rows]
                err = NonFiniteHiddenError(f"{self._kind} of prompt(s) {rows[:5]}: {e}", rows)
                err.reason = str(e)  # select_batch names its queries with it
                raise err from None
        nxt = self._next_tokens(self._fed_rows, running)
        self._fed_rows = None
        still = []
        for g, tok in zip(running, nxt):
            outputs[g].append(tok)
            feed[g] = [tok]
            if states is not None:
                states[g].advance(tok)
            if tok not in self.stop_ids and len(outputs[g]) < self.max_new_tokens and not _force(
                    g, states, outputs, feed, self.max_new_tokens):
                still.append(g)
        self.running = still
        return fed

    def _next_tokens(self, hidden: torch.Tensor, running) -> List[int]:
        """The next token of each running sequence from the step's hidden rows [S, H], in row chunks
        of at most ``LOGITS_CHUNK_ELEMENTS`` logits, so a step never holds [S, V]. A row's logits
        and choice do not depend on the other rows of its chunk, and the chunks follow one another in
        row order (a seeded draw, ``acarerank.ato.rollouts``, draws the same sequence)."""
        width = self.runner.lm_head.shape[0] if self.grammar is None else len(self.vocab)
        rows = max(1, LOGITS_CHUNK_ELEMENTS // width)
        if getattr(self.runner, "batch_invariant", False):
            # its logits run on zero-padded tiles of INVARIANT_ROWS rows: a chunk of 27 paid for 64
            # (free decoding 2.2x slower); whole tiles, 39 MiB at V = 151,669
            rows = max(INVARIANT_ROWS, rows - rows % INVARIANT_ROWS)
        out: List[int] = []
        for i in range(0, len(running), rows):
            part = running[i:i + rows]
            out += self._choose(self._next_logits(hidden[i:i + rows], part), part)
        return out

    def _next_logits(self, hidden: torch.Tensor, running) -> torch.Tensor:
        """fp32 next-token logits of the running sequences: [S, V] free, or [S, 14] (the grammar's
        columns, ``self.vocab`` order) with every token the grammar does not allow at -inf."""
        if self.grammar is None:
            logits = self.runner.logits(hidden)                                # [S, V]
        else:
            logits = self.runner.logits(hidden, self.head)                     # [S, 14]
            mask = self.grammar.mask([self.states[g] for g in running]).to(logits.device)
            logits = logits.masked_fill(~mask, float("-inf"))
        self._check_finite(logits.amax(-1), running)
        return logits

    def _choose(self, logits: torch.Tensor, running) -> List[int]:
        """The next token of each running sequence from ``_next_logits``: the argmax (ties to the lower id)."""
        cols = logits.argmax(-1).tolist()
        return cols if self.grammar is None else [int(self.vocab[c]) for c in cols]

    def _check_finite(self, best, running) -> None:
        """``best`` [S]: each running sequence's largest (allowed) logit. NaN propagates through
        the max, so a NaN among the tokens the step chooses from — which argmax would pick, or
        the grammar's first allowed token — shows up here, as does an inf; S numbers, one sync."""
        bad = nonfinite_rows(best)
        if bad:
            rows = [running[i] for i in bad]
            where = "allowed by the grammar" if self.grammar is not None else "of the vocabulary"
            reason = (f"the largest next-token logit {where} is {best[bad[0]].item()} at output token "
                      f"{len(self.outputs[rows[0]])} although the hidden state is finite: lm_head's rows or the final "
                      f"norm weight hold NaN/inf (loading refuses such weights: these were changed after it) or "
                      f"overflow fp32; no token is chosen from them")
            err = NonFiniteOutputError(f"{self._kind} of prompt(s) {rows[:5]}: {reason}", rows)
            err.reason = reason  # select_batch names its queries with it
            raise err


def _force(g, states, outputs, feed, max_new_tokens) -> bool:
    """Emit the tokens the grammar leaves no choice about (jump-forward); True if sequence g is finished.

    Greedy argmax over a single allowed token is that token whatever the logits, so skipping
    its step changes no output; the forced tokens ride along in the next step's segment
    (e.g. "[" with the last prompt token, "]" after "[7" in a pool of 20), and a forced END
    (cap reached, pool exhausted) finishes without a step. At pool 20, cap 10 this removes
    about a third of the decode steps.
    """
    if states is None:
        return False
    st = states[g]
    while not st.done and len(outputs[g]) < max_new_tokens:
        allowed = st.allowed()
        if len(allowed) != 1:
            return False
        st.advance(allowed[0])
        outputs[g].append(allowed[0])
        if st.done:
            return True
        feed[g].append(allowed[0])
    return True


@torch.inference_mode()
def greedy_decode_ref(model, prompt: Sequence[int], grammar: Optional[IdentifierGrammar] = None,
                      state: Optional[GrammarState] = None, max_new_tokens: int = MAX_NEW_TOKENS,
                      eos_id: Union[int, Sequence[int]] = TOKEN_IM_END) -> List[int]:
    """Oracle for one prompt: transformers ``model`` forward on the whole sequence every step.

    Full-vocabulary logits at the last position (fp32), every token the grammar state does
    not allow set to -inf, argmax. No KV cache, no batching, no restricted lm_head.
    """
    if (grammar is None) != (state is None):
        raise ValueError("pass both grammar and state (constrained) or neither (free decoding)")
    _check([prompt], None if state is None else [state], max_new_tokens)
    stops = stop_ids(eos_id)
    device = next(model.parameters()).device
    seq = list(map(int, prompt))
    out: List[int] = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([seq], device=device), logits_to_keep=1).logits[0, -1].float()  # [V]
        if state is not None:
            logits = grammar.mask_full(state, logits)
        tok = int(logits.argmax())
        out.append(tok)
        seq.append(tok)
        if state is not None:
            state.advance(tok)
        if tok in stops:
            break
    return out


class GrammarLogitsProcessor:
    """``transformers`` logits processor applying the identifier grammar (for ``generate``).

    Rows of ``input_ids`` are the prompts (left-padded to ``prompt_len``) followed by the
    generated tokens; each call replays a row's generated tokens through a fresh state of
    pool ``n_candidates[row]`` and masks the scores to that state's allowed tokens. A row
    whose state is done (it emitted END; generate keeps padding it) is left as is.
    """

    def __init__(self, grammar: IdentifierGrammar, n_candidates: Sequence[int], max_select: int, prompt_len: int):
        self.grammar = grammar
        self.n_candidates = list(n_candidates)
        self.max_select = max_select
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = scores.clone()
        for row in range(input_ids.shape[0]):
            st = self.grammar.start(self.n_candidates[row], self.max_select)
            for tok in input_ids[row, self.prompt_len:].tolist():
                if st.done:
                    break
                st.advance(tok)
            if not st.done:
                out[row] = self.grammar.mask_full(st, scores[row])
        return out
