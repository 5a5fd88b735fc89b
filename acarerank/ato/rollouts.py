"""Rollouts of π_old: G samples per prompt through the runner's paged KV cache, with their log-probs.

AdaTutoRank (2026), Algorithm 1 line 7: for each query, G rollouts y_i ~ π_old(· | q, C), at most
64 new tokens (Appendix C.4), the setwise prompt. The G rollouts of one prompt share it whole, the
best case of prefix sharing (docs/ARCHITECTURE.md, "A rollout call"):

1. each prompt but its last token is computed once, one group per prompt, in one private pool;
2. G groups per prompt are made over those pages (``PagedKVCache.add_group`` takes a reference to
   each block: nothing copied, nothing recomputed); the partly filled last page is copied on a
   rollout's first write (copy-on-write), so the rollouts never see each other's tokens;
3. decoding as ``GreedyStepper`` (one 1-token segment per running rollout per step, stop ids,
   ``max_new_tokens``, the grammar's forced tokens), but the next token is drawn from
   softmax(z / T) instead of taken as the argmax.

Sampled log-probs. ``Rollouts.logprobs[i, l]`` is the log-probability of token l under the
distribution it was drawn from: log_softmax(z / T) over the full vocabulary when unconstrained,
or over the grammar's allowed tokens when constrained (0 for a token the grammar forces). Unconstrained,
this is ``rescore``'s ``logp_old`` at the same temperature (the same model, prompt and tokens):
within fp32 rounding (tests: 1e-5) on an fp32 runner, not bitwise — the decode step's hidden state comes from a
1-token segment over the cache and its log-softmax from ``runner.logits``, ``rescore``'s from
one packed segment per rollout and ``linear_logprob``'s chunked pass, so the GEMMs sum in
other orders. Constrained, it is not π_old's log-prob (the renormalisation over allowed tokens adds
log 1/Σ_allowed p); the loss's ratio π_θ / π_old is over the full vocabulary, so take ``logp_old``
from ``rescore`` then.

Why unconstrained is the default: the paper samples π_old as it is, and a malformed rollout gets
reward −1 and no distillation (Eq. 6, Algorithm 1 lines 9–10) — that is how the policy is taught
the format during RL; under the grammar no rollout is ever malformed, and the samples come from a
distribution other than π_old's, which the ratio does not account for. Constrained sampling is for
models that cannot yet write a selection (a random model: ``examples/ato_train_step.py``).

Not offered: top-k / top-p. The recipe's rollouts (verl's GRPO defaults) use neither, and a truncated
sampler's draws and log-probs are not π_old's, which the ratio would again not account for.

Memory: a step computes its S running rollouts' logits (S ≤ prompts × G) in row chunks of at most
``SAMPLE_LOGITS_ELEMENTS`` fp32 numbers (27 rows of Qwen3's 151,669), so it holds at most three
such [rows, V] tensors — the logits (turned into log-probs in place), their exp, and
``torch.multinomial``'s draw: 16 MiB each, whatever the number of prompts and G (the whole
[S, V] at once was 296 MiB each for 64 prompts × 8) — never [G · steps, V]; the log-probs are
kept as one float per token.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .._validate import positive_int
from ..model.paged_cache import PagedKVCache
from ..ops._checks import finite_real, positive_in_fp32
from ..setwise.decode import (LOGITS_CHUNK_ELEMENTS, MAX_NEW_TOKENS, GreedyStepper, _check, check_positions,
                              decode_reserve, stop_ids as _stop_set)
from ..setwise.grammar import IdentifierGrammar
from ..tokenizer import TOKEN_IM_END
from .rescore import _ids

#: <|endoftext|> of the Qwen3 tokenizer; with <|im_end|> the stop ids of its generation config
TOKEN_ENDOFTEXT = 151643
#: where an unconstrained rollout stops (as ``SetwiseReranker``'s free decoding)
DEFAULT_STOP_IDS = (TOKEN_IM_END, TOKEN_ENDOFTEXT)
#: fp32 logits per chunk of a sampling step's rows (4 Mi: 16 MiB; 27 rows at V = 151,669, all rows
#: under the grammar's 14 columns): the step's memory is bounded by it, not by prompts × G. The
#: chunks are ``GreedyStepper``'s (its ``_next_tokens``), the same for greedy decoding
SAMPLE_LOGITS_ELEMENTS = LOGITS_CHUNK_ELEMENTS
#: KV rows reserved up front for the rollouts' own tokens (beyond the prompts' pages): 126 prompts ×
#: G = 8 × 65 rows (the paper's 64 new tokens + 1). A call that may need more (a large G ×
#: max_new_tokens) reserves this many and the pool grows by doubling as its rollouts reach them, so
#: memory follows the tokens actually drawn: up front, G = 8 × max_new_tokens = 10⁹ asked for 5·10⁸
#: pages and their Python free list (tens of GiB) before the first token
ROLLOUT_RESERVE_ROWS = 65_536


@dataclass
class Rollouts:
    """G rollouts per prompt, in ``rescore``'s layout (``RescoreResult``): rollout i of prompt q is row
    q·G + i; rows padded to L = the longest rollout.

    tokens: the N = Q·G rollouts' new token ids (the stop token included when emitted);
    logprobs: [N, L] fp32, the log-probability each token was sampled with (0 at padding; module
      docstring); response_mask: [N, L] bool; query_index: [N] int64 (``grpo_advantage``'s
      group_index); lengths: len(tokens[n]); group_size: G; temperature: T.
    """
    tokens: List[List[int]]
    logprobs: torch.Tensor
    response_mask: torch.Tensor
    query_index: torch.Tensor
    lengths: List[int]
    group_size: int
    temperature: float

    def of_query(self, q: int) -> List[List[int]]:
        """The G rollouts of prompt q (``RescoreQuery.rollouts``): q in [-Q, Q) for Q prompts, a
        negative q counting from the end as a list index does; else IndexError (a slice past the
        end was [] with no word). q: an int, or a 0-d integer tensor / numpy int (an item of
        ``query_index``); a bool or a float is a TypeError."""
        G = self.group_size
        Q = len(self.tokens) // G
        # a 0-d tensor / numpy value as its Python number (a bool or float one stays so, refused below)
        v = q.tolist() if hasattr(q, "tolist") and getattr(q, "ndim", None) == 0 else q
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"of_query: q must be an int, got {q!r} ({type(q).__name__})")
        q = int(v)
        if not -Q <= q < Q:
            raise IndexError(f"of_query: prompt {q} out of range for {Q} prompt(s)")
        q %= Q
        return self.tokens[q * G:(q + 1) * G]


class _SampleStepper(GreedyStepper):
    """``GreedyStepper`` drawing each next token from softmax(z / T) (over the allowed tokens when
    constrained) with ``generator``, and keeping the log-probability of each draw."""

    _kind = "sampling"

    def __init__(self, runner, prompts, grammar, states, max_new_tokens, eos_id, cache, temperature, generator):
        self.temperature, self.generator = temperature, generator
        self.logprobs: List[List[float]] = [[] for _ in prompts]
        super().__init__(runner, prompts, grammar, states, max_new_tokens, eos_id, cache)

    def _choose(self, logits: torch.Tensor, running) -> List[int]:
        z = logits.div_(self.temperature)                                     # [S, V] or [S, 14], fp32
        if not bool(torch.isfinite(z.amax(-1)).all()):  # the logits are finite (_next_logits checked)
            raise ValueError(f"sample_rollouts: temperature={self.temperature!r} is too small for these logits: "
                             f"logits / temperature overflow fp32; use greedy_decode for the argmax")
        logp = z.sub_(torch.logsumexp(z, -1, keepdim=True))                   # log_softmax, in place
        col = torch.multinomial(logp.exp(), 1, generator=self.generator)      # [S, 1]
        lp = logp.gather(1, col)[:, 0].tolist()
        cols = col[:, 0].tolist()
        for g, v in zip(running, lp):
            self._pad_forced(g)
            self.logprobs[g].append(v)
        return cols if self.grammar is None else [int(self.vocab[c]) for c in cols]

    def _pad_forced(self, g: int) -> None:
        """Tokens the grammar forced since the last draw were emitted with probability 1: log-prob 0."""
        lps = self.logprobs[g]
        lps.extend([0.0] * (len(self.outputs[g]) - len(lps)))


def sample_rollouts(runner, prompts: Sequence[Sequence[int]], group_size: int = 8, *, temperature: float = 1.0,
                    max_new_tokens: int = MAX_NEW_TOKENS, stop_ids: Union[int, Sequence[int]] = DEFAULT_STOP_IDS,
                    grammar: Optional[IdentifierGrammar] = None, pools: Optional[Sequence[Tuple[int, int]]] = None,
                    generator: Optional[torch.Generator] = None, seed: Optional[int] = None) -> Rollouts:
    """``group_size`` samples of π_old for each prompt, with the log-probability of every sampled token.

    Args:
      runner: ``acarerank.model.Qwen3Runner`` of the snapshot (``Qwen3Runner.from_hf(snapshot)``).
      prompts: Q token-id sequences (integers in [0, V), >= 1 token each), e.g. ``build_prompt(...).input_ids``.
      group_size: G >= 1 rollouts per prompt (the paper's G = 8).
      temperature: T, finite and > 0 (in fp32 too); the draws follow softmax(logits / T). T = 0 is
        refused: it is greedy decoding (``acarerank.setwise.decode.greedy_decode``), whose tokens'
        log-probs at T → 0 are 0 or −∞, no ratio a loss can use.
      max_new_tokens: at most this many new tokens per rollout (the paper's 64).
      stop_ids: a rollout ends at any of these (emitted, and kept in ``tokens``): one id or a non-empty
        list/tuple/set, each in [0, V) (an id the model cannot emit is refused); default <|im_end|>
        and <|endoftext|>.
      grammar, pools: constrained sampling (both or neither): ``pools[q] = (n_candidates, max_select)``
        of prompt q; each rollout starts a fresh ``grammar.start(n, max_select)`` and draws over the
        allowed tokens only (every rollout then parses strictly). Default: unconstrained, the full
        vocabulary (module docstring: why training samples so).
      generator: a ``torch.Generator`` on ``runner.device``, or ``seed``: an int seeding a new one;
        neither: torch's global generator (``torch.manual_seed``). The same seed, runner, prompts and
        settings give the same rollouts.

    Returns: ``Rollouts`` in ``rescore``'s layout; ``Rollouts.of_query(q)`` is ``RescoreQuery.rollouts``.
    The log-probs are unconstrained π_old's at T, as ``rescore(..., temperature=T).logp_old``
    (within fp32 rounding on an fp32 runner; in bf16 take ``logp_old`` from ``rescore``: docs/api.md).
    """
    G = positive_int("group_size", group_size)
    max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
    if not finite_real(temperature) or temperature <= 0 or not positive_in_fp32(temperature):
        hint = " (0 is greedy decoding: use acarerank.setwise.decode.greedy_decode)" if temperature == 0 else ""
        raise ValueError(f"sample_rollouts: temperature must be a finite number > 0 (in float32 too), got "
                         f"{temperature!r}{hint}")
    stops = _stop_ids(stop_ids, runner.arch.vocab_size)
    ids = _prompt_ids(prompts, runner.arch.vocab_size)
    check_positions(runner, ids, max_new_tokens, "sample_rollouts: prompt")  # before anything is computed
    states = _grammar_states(grammar, pools, len(ids), G)
    gen = _generator(generator, seed, runner.device)
    repeated = [p for p in ids for _ in range(G)]
    # before the prompts are computed: a grammar whose longest output passes max_new_tokens, or whose
    # END is no stop id (GreedyStepper checks both again)
    _check(repeated, states, max_new_tokens)
    if grammar is not None and grammar.tokens.end not in stops:
        raise ValueError(f"sample_rollouts: the grammar ends on token {grammar.tokens.end} but stop_ids are "
                         f"{sorted(stops)}")
    longest = None if states is None else max(st.max_tokens() for st in states)
    reserve = decode_reserve(max_new_tokens, longest)
    cache = _shared_prompt_cache(runner, ids, G, reserve)
    try:
        dec = _SampleStepper(runner, repeated, grammar, states, max_new_tokens, tuple(stops), cache,
                             float(temperature), gen)
        while not dec.done:
            dec.step()
    finally:
        cache.free()
    for g in range(len(repeated)):
        dec._pad_forced(g)
    return _padded(dec.outputs, dec.logprobs, G, float(temperature))


def _prompt_ids(prompts, vocab_size: int) -> List[List[int]]:
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, Sequence) or isinstance(prompts, (str, bytes)):
        raise TypeError(f"sample_rollouts: prompts must be a list of token-id lists (one per query), got "
                        f"{type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("sample_rollouts: no prompts")
    # a numpy array is a prompt too (ndim 1: _ids reads it as rescore does); a number is one prompt's id
    first = prompts[0]
    if isinstance(first, (str, bytes)) or not (isinstance(first, Sequence) or getattr(first, "ndim", 0) >= 1):
        raise TypeError(f"sample_rollouts: prompts must be a list of token-id lists (one per query); prompt 0 is a "
                        f"{type(prompts[0]).__name__} (wrap a single prompt in a list: [prompt])")
    out = []
    for q, p in enumerate(prompts):
        p = _ids(p, f"prompt {q}", vocab_size)
        if not p:
            raise ValueError(f"sample_rollouts: prompt {q} is empty; a rollout continues at least one prompt token")
        out.append(p)
    return out


def _stop_ids(stop_ids, vocab_size: int):
    """The stop set: one id or a non-empty list/tuple/set of ids, each in [0, V) — an id the model
    cannot emit (another tokenizer's, or Qwen3's defaults on a smaller vocabulary) would leave every
    rollout running to max_new_tokens without a word."""
    try:
        stops = _stop_set(stop_ids)
    except TypeError:
        raise TypeError(f"sample_rollouts: stop_ids must be a token id or a non-empty list/tuple/set of them, got "
                        f"{stop_ids!r}") from None
    outside = sorted(i for i in stops if not 0 <= i < vocab_size)
    if outside:
        raise ValueError(f"sample_rollouts: stop id {outside[0]} is outside the vocabulary [0, {vocab_size}): no "
                         f"rollout could stop there (the default stop ids are Qwen3's {list(DEFAULT_STOP_IDS)}; "
                         f"pass stop_ids= ids of this model's vocabulary)")
    return stops


def _grammar_states(grammar, pools, Q: int, G: int):
    """One fresh grammar state per rollout (prompt-major), or None when unconstrained."""
    if (grammar is None) != (pools is None):
        raise ValueError("sample_rollouts: pass both grammar and pools (constrained) or neither (unconstrained)")
    if grammar is None:
        return None
    if not isinstance(grammar, IdentifierGrammar):
        raise TypeError(f"sample_rollouts: grammar must be an IdentifierGrammar, got {type(grammar).__name__}")
    pools = list(pools)
    if len(pools) != Q:
        raise ValueError(f"sample_rollouts: {len(pools)} pools (n_candidates, max_select) for {Q} prompts")
    return [grammar.start(n, cap) for n, cap in pools for _ in range(G)]


def _generator(generator, seed, device: torch.device) -> Optional[torch.Generator]:
    if generator is not None and seed is not None:
        raise ValueError("sample_rollouts: pass a generator or a seed, not both")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):  # numpy ints are ints (_validate)
            raise TypeError(f"sample_rollouts: seed must be an int, got {seed!r}")
        seed = int(seed)
        if not -2 ** 63 <= seed < 2 ** 64:  # torch.Generator.manual_seed's range
            raise ValueError(f"sample_rollouts: seed must be in [-2**63, 2**64), got {seed}")
        return torch.Generator(device=device).manual_seed(seed)
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"sample_rollouts: generator must be a torch.Generator, got {type(generator).__name__}")
        if torch.device(generator.device).type != device.type:
            raise ValueError(f"sample_rollouts: the generator is on {generator.device}, the runner on {device}; "
                             f"torch.multinomial draws with a generator of the runner's device")
    return generator


@torch.inference_mode()
def _shared_prompt_cache(runner, prompts: List[List[int]], G: int, reserve: int) -> PagedKVCache:
    """A cache of Q·G groups, group q·G + i holding prompt q but its last token: each prompt computed once
    (one pass of all Q, chunked as ``prefill``), then G groups per prompt over the same pages.

    The pool has room for every rollout's ``reserve`` rows from the start (the partly filled last
    prompt page copied once per rollout, then its own pages), so it never grows mid-sampling — up
    to ``ROLLOUT_RESERVE_ROWS`` rows of them; past that it grows as the rollouts reach it.
    """
    bs = runner.block_size
    lens = [len(p) - 1 for p in prompts]
    own = sum(G * (-(-(P + reserve) // bs) - P // bs) for P in lens)
    own = min(own, -(-ROLLOUT_RESERVE_ROWS // bs))
    pool = runner.new_pool(sum(-(-P // bs) for P in lens) + own, growable=True)
    shared = PagedKVCache(pool)
    for _ in prompts:
        shared.add_group()
    try:
        runner.extend(shared, list(range(len(prompts))), [p[:-1] for p in prompts])
        cache = PagedKVCache(pool)
        for q in range(len(prompts)):
            for _ in range(G):
                cache.add_group(shared.block_tables[q], shared.lengths[q])
    finally:
        shared.free()  # the rollouts' groups hold their own references
    return cache


def _padded(outputs: List[List[int]], logprobs: List[List[float]], G: int, temperature: float) -> Rollouts:
    lengths = [len(o) for o in outputs]
    N, L = len(outputs), max(lengths)
    mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    lp = torch.zeros(N, L)
    lp[mask] = torch.tensor([v for row in logprobs for v in row], dtype=torch.float32)
    qidx = torch.arange(N, dtype=torch.long) // G
    return Rollouts(outputs, lp, mask, qidx, lengths, G, temperature)


__all__ = ["Rollouts", "sample_rollouts", "DEFAULT_STOP_IDS", "SAMPLE_LOGITS_ELEMENTS", "ROLLOUT_RESERVE_ROWS"]
