"""Paired re-scoring of ATO (AdaTutoRank (2026), Algorithm 1 line 39; Eq. 9): no regeneration, prefix sharing.

For each query q with student prompt P = head ++ tail (the hint goes between them, see
``split_student_prompt``) and rollouts y_1..y_G, each with hint h_i:

    snapshot π_old sees   head ++ tail ++ y_i              -> logp_old[i, l]     = log π_old(y_i,l | ·)
    teacher  π_φ   sees   head ++ h_i ++ tail ++ y_i       -> logp_teacher[i, l] = log π̃_φ(y_i,l | ·)
    atd[i, l] = logp_teacher[i, l] − logp_old[i, l]                                         (Eq. 9)
                (0 where outside="mask" drops y_i,l, a token outside the teacher's top-k)

π̃_φ is the teacher truncated to its top-k logits (k = 128, Appendix C.4) by ``topk_logprobs``
(renormalised; the ``outside`` rule decides what a sampled token outside the top-k gets).

Sharing (docs/ARCHITECTURE.md, "The one primitive"): one group per query in each model. The snapshot's group prefix is
the whole prompt but its last token; the teacher's is ``head`` but its last token (the
candidates and the query — nearly all of a setwise prompt — computed once per model per
query). Each segment starts with that one held-back token, so the hidden state that predicts
y_i,0 comes out of the segment: snapshot segment = P[-1] ++ y_i[:-1]; teacher segment =
head[-1] ++ h_i ++ tail ++ y_i[:-1], where a text hint is tokenized together with head[-1]
(``hint_ids(..., head=head)``: Qwen3 merges ".\n\n" across the seam; a head whose end the
separator re-tokenizes beyond its last token is a ValueError). Positions
are those of the unshared sequences, so the results equal running each full sequence on its
own (tests check against transformers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch

from .._validate import check_token_ids
from ..model.numerics import NonFiniteHiddenError, NonFiniteOutputError, check_scorable, nonfinite_rows
from ..model.runner import position_limit_error
from ..ops.linear_logprob import linear_logprob
from ..ops.topk_logprobs import OUTSIDE_MODES, topk_logprobs
from ..ops.vocab_parallel import VocabShard
from ..tokenizer import TOKEN_IM_END
from .hints import hint_ids

Ids = Sequence[int]


@dataclass
class RescoreQuery:
    """One query's inputs: ``prompt_head`` ++ ``prompt_tail`` is the student prompt (token ids),
    the hint is inserted between the two; ``rollouts``: G response token ids (as sampled, may
    end with <|im_end|>); ``hints``: per rollout, the hint text (the teacher text is
    head_text + HINT_SEPARATOR + hint + tail_text) or token ids to insert as given ([] / ""
    for no hint); a list of G, never one str (a TypeError: it would be read per character)."""
    prompt_head: Ids
    prompt_tail: Ids
    rollouts: Sequence[Ids]
    hints: Sequence[Union[str, Ids]]


@dataclass
class RescoreResult:
    """Per-token results, rollouts in query order, padded to L = the longest rollout.

    logp_old, logp_teacher, atd: [N, L] fp32 (0 at padding); response_mask: [N, L] bool;
    teacher_in_topk: [N, L] bool; atd_mask: response_mask, and in_topk too when outside="mask";
    atd is 0 outside atd_mask (with "mask", a dropped token gets no distillation signal);
    query_index: [N] int64; lengths: rollout lengths.
    """
    logp_old: torch.Tensor
    logp_teacher: torch.Tensor
    atd: torch.Tensor
    response_mask: torch.Tensor
    teacher_in_topk: torch.Tensor
    atd_mask: torch.Tensor
    query_index: torch.Tensor
    lengths: List[int]


def split_student_prompt(prompt_ids: Ids, close_token: int = TOKEN_IM_END):
    """(head, tail) of a chat prompt: tail starts at the last ``close_token`` (<|im_end|>, closing
    the user turn), so a hint lands at the end of the user's message — where Fig. 3 puts it."""
    ids = check_token_ids("split_student_prompt: prompt_ids", prompt_ids)  # never 151645.5 read as 151645
    for pos in range(len(ids) - 1, -1, -1):
        if ids[pos] == close_token:
            return ids[:pos], ids[pos:]
    raise ValueError(f"prompt has no token {close_token} (<|im_end|>) closing the user turn; split it yourself")


def _ids(x, what: str, vocab_size: int) -> List[int]:
    """Token ids as ints in [0, vocab_size): integers only (int, numpy or 0-d torch integers),
    never a float or a bool — int() would silently truncate 1.7 to 1 and read True as id 1 —
    nor bytes, whose items are ints too (b"ok" would be read as ids 111, 107)."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{what}: token ids must be a 1-D integer sequence, got {x.dtype} {tuple(x.shape)}")
        return _in_vocab([int(t) for t in x.tolist()], what, vocab_size)
    return _in_vocab(check_token_ids(what, x), what, vocab_size)


def _in_vocab(ids: List[int], what: str, vocab_size: int) -> List[int]:
    """``ids``, or a ValueError naming the input: the runner's own check would name only its
    "segment n" / "prefix n" of the packed pass."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} has token id {bad[0]} outside [0, {vocab_size})")
    return ids


def rescore(snapshot, teacher, queries: Sequence[RescoreQuery], tokenizer=None, k: int = 128,
            outside: str = "floor", floor: float = -20.0, renormalize: bool = True, temperature: float = 1.0,
            chunk: Optional[int] = None, backend: Optional[str] = None, teacher_head: Optional[VocabShard] = None,
            snapshot_head: Optional[VocabShard] = None) -> RescoreResult:
    """Re-score every rollout under the hint-free snapshot and the hint-conditioned teacher.

    Args:
      snapshot, teacher: ``acarerank.model.Qwen3Runner`` (π_old and the frozen π_φ = θ_sft);
        they must share the vocabulary.
      queries: RescoreQuery per query (one prefix-sharing group each, all run in one pass).
      tokenizer: needed only for hints given as text (default: the Qwen3 tokenizer).
      k, outside, floor, renormalize, temperature, chunk, backend: as ``topk_logprobs`` (the
        teacher's truncation); ``temperature`` also divides the snapshot's logits (verl
        computes old log-probs at the rollout temperature).
      teacher_head, snapshot_head: an output layer split by vocabulary over a process group
        (``acarerank.ops.VocabShard``: this rank's rows, the group, optionally vocab_start and
        vocab_size — default the model's ``arch.vocab_size``, so Megatron's padding rows past
        it are left out). The runner then supplies only the hidden states; its own
        ``lm_head`` is not read. Every rank of the group calls ``rescore`` with the same
        queries and gets the same result (``acarerank.ops.vocab_parallel``).

        Megatron-LM (and verl's Megatron workers, which hold the same modules):
            from megatron.core import parallel_state as mpu
            w = gpt_model.output_layer.weight            # [V_pad / tp, H]; tied embeddings:
            # w = gpt_model.shared_embedding_or_output_weight()
            head = VocabShard(w, mpu.get_tensor_model_parallel_group(), vocab_size=hf_config.vocab_size)
            rescore(snapshot, teacher, queries, teacher_head=head)
        Megatron's rule (rank · V_pad / tp) is the default ``vocab_start``. The weight must be
        in the runner's dtype; the hidden states come from the runner on every rank.
    Returns: RescoreResult (constants, the sg[·] of line 39: the models run under inference_mode,
      but the results are ordinary tensors without grad, so training code may edit them in
      place or multiply them into a loss — inference tensors refuse both).

    Steps: ``_flatten`` (check and flatten the queries), ``_snapshot_logprobs``,
    ``_teacher_logprobs``, ``_padded`` (pad to [N, L], Eq. 9).
    """
    if outside not in OUTSIDE_MODES:
        raise ValueError(f"rescore: outside must be one of {OUTSIDE_MODES}, got {outside!r}")
    if snapshot.arch.vocab_size != teacher.arch.vocab_size:
        raise ValueError(f"snapshot and teacher vocabularies differ ({snapshot.arch.vocab_size} vs "
                         f"{teacher.arch.vocab_size})")
    batch = _flatten(queries, tokenizer, snapshot.arch.vocab_size)
    _check_positions(batch, snapshot, teacher)
    with torch.inference_mode():
        logp_old = _snapshot_logprobs(snapshot, batch, temperature, chunk, snapshot_head)
        logp_t, in_topk = _teacher_logprobs(teacher, batch, k, chunk, outside, floor, renormalize, temperature,
                                            backend, teacher_head)
        for who, lp in (("snapshot", logp_old), ("teacher", logp_t)):
            _check_finite(batch, who, lp)
    # outside inference_mode: fresh tensors filled from the [ΣL] ones. Built inside, res.atd.clamp_()
    # or (res.atd * logp).sum().backward() raised "Inplace update to inference tensor" / "Inference
    # tensors cannot be saved for backward"
    padded = _padded(batch, logp_old, logp_t, in_topk, outside)
    return RescoreResult(*padded, torch.tensor(batch.qidx, dtype=torch.long), batch.lengths)


@dataclass
class _Batch:
    """Every query's prompt halves and every rollout, flattened in query order: rollout n
    belongs to query ``qidx[n]``; ``hints[n]`` = head[-1] ++ the hint's tokens (the segment's
    first tokens); ``targets`` [ΣL] the rollouts' tokens, packed."""
    heads: List[List[int]]
    tails: List[List[int]]
    rolls: List[List[int]]
    hints: List[List[int]]
    qidx: List[int]

    @property
    def lengths(self) -> List[int]:
        return [len(y) for y in self.rolls]

    @property
    def targets(self) -> torch.Tensor:
        return torch.tensor([t for y in self.rolls for t in y], dtype=torch.long)

    def rollout_token(self, rows) -> list:
        """(rollout, token position) of each packed token row."""
        where = [(n, pos) for n, y in enumerate(self.rolls) for pos in range(len(y))]
        return [where[r] for r in rows]

    def describe(self, pairs) -> str:
        """Human words for (rollout, token) pairs: the first with its query, and how many more."""
        n, pos = pairs[0]
        more = f" (and {len(pairs) - 1} more (rollout, token) pair(s), first {pairs[1:5]})" if len(pairs) > 1 else ""
        return f"token {pos} of rollout {n} (query {self.qidx[n]}){more}"


def _check_finite(b: _Batch, who: str, logp: torch.Tensor) -> None:
    """The last check before the log-probs are returned (ΣL numbers): the ops refuse non-finite
    logits, but a target whose own logit is −inf (``outside="full"``, or a top-k reaching past
    the finite logits) would still give −inf, and an advantage of ±inf."""
    bad = nonfinite_rows(logp)
    if bad:
        pairs = b.rollout_token(bad)
        raise NonFiniteOutputError(f"rescore: the {who}'s log-prob of {b.describe(pairs)} is {logp[bad[0]].item()}: "
                                   f"its output layer gives that token a non-finite logit (NaN/inf weights, changed "
                                   f"after loading, which refuses them); no advantage is computed from it", pairs)


def _starts_with_control(tokenizer, tail: List[int]) -> bool:
    """Whether ``tail`` starts with one of the tokenizer's control (added) tokens, which
    tokenization never merges with the text before them."""
    from ..tokenizer import TextEncoder

    return bool(tail) and tail[0] in set(TextEncoder.of(tokenizer).added_tokens.values())


def _flatten(queries: Sequence[RescoreQuery], tokenizer, vocab_size: int) -> _Batch:
    """Step 1: check the queries and flatten them into one batch (text hints tokenized across
    the seam with head[-1]; the Qwen3 tokenizer is loaded only when a text hint needs it)."""
    if not queries:
        raise ValueError("rescore: no queries")
    b = _Batch([], [], [], [], [])
    for q, item in enumerate(queries):
        head = _ids(item.prompt_head, f"query {q} prompt_head", vocab_size)
        tail = _ids(item.prompt_tail, f"query {q} prompt_tail", vocab_size)
        if not head:
            raise ValueError(f"query {q}: prompt_head is empty (the shared part must hold at least one token)")
        for field in ("rollouts", "hints"):
            if isinstance(getattr(item, field), (str, bytes, bytearray)):
                # one str is not one per rollout: iterated, hints="Keep" gave 4 rollouts 'K', 'e', 'e', 'p'
                raise TypeError(f"query {q}: {field} must hold one entry per rollout (a list), got a "
                                f"{type(getattr(item, field)).__name__}")
        if len(item.hints) != len(item.rollouts):
            raise ValueError(f"query {q}: {len(item.rollouts)} rollouts but {len(item.hints)} hints")
        b.heads.append(head)
        b.tails.append(tail)
        for i, (y, h) in enumerate(zip(item.rollouts, item.hints)):
            b.rolls.append(_ids(y, f"query {q} rollout {i}", vocab_size))
            if isinstance(h, str) and h and tokenizer is None:
                from ..tokenizer import load_qwen3_tokenizer
                tokenizer = load_qwen3_tokenizer()
            # the segment's first tokens: head[-1] + hint, the seam re-tokenized for text hints
            h = h if isinstance(h, str) else _ids(h, f"query {q} hint {i}", vocab_size)
            if isinstance(h, str) and h and not _starts_with_control(tokenizer, tail):
                # the teacher text is head_text + sep + hint + tail_text: a tail starting with plain
                # text would merge with the hint's end there, not in these ids (no error otherwise)
                raise ValueError(f"query {q} hint {i}: a text hint needs prompt_tail to start with a control token "
                                 f"(<|im_end|>, as split_student_prompt splits), got "
                                 f"{tail[:1] or 'an empty tail'}; the hint's last characters and the tail's first "
                                 f"would tokenize together in the teacher's text; pass the hint as token ids")
            try:  # the seam checked against the joint tokenization of head text + separator + hint
                b.hints.append(hint_ids(tokenizer, h, head=head))
            except ValueError as e:
                raise ValueError(f"query {q} hint {i}: {e}") from None
            b.qidx.append(q)
    if not b.rolls:
        raise ValueError("rescore: no rollouts")
    return b


def _check_positions(b: _Batch, snapshot, teacher) -> None:
    """ContextLengthError (a ValueError) naming the first rollout whose sequence is past its
    model's maximum context length (``max_positions``), before either model runs. The snapshot
    reads head ++ tail ++ y[:-1], the teacher head ++ hint ++ tail ++ y[:-1]: a longer rollout or
    hint is not cut, and past its positions the model's log-probs would be plausible and wrong."""
    seen: dict = {}
    for n, (q, y, h) in enumerate(zip(b.qidx, b.rolls, b.hints)):
        i = seen[q] = seen.get(q, -1) + 1  # the rollout's index within its query
        prompt, rest = len(b.heads[q]) + len(b.tails[q]), max(len(y) - 1, 0)
        for who, runner, n_tokens in (("snapshot", snapshot, prompt + rest),
                                      ("teacher", teacher, prompt - 1 + len(h) + rest)):
            if n_tokens > runner.max_positions:
                raise position_limit_error(f"rescore: query {q} rollout {i}'s {who} sequence (prompt"
                                           f"{' + hint' if who == 'teacher' else ''} + rollout but its last token)",
                                           n_tokens, runner.max_positions, "shorten the prompt, the hint or the rollout")


def _snapshot_logprobs(snapshot, b: _Batch, temperature, chunk, shard) -> torch.Tensor:
    """Step 2: log π_old(y_i,l | prompt, y_i,<l) [ΣL]. Group prefix = the whole prompt but its
    last token; each segment = that token ++ y_i[:-1]."""
    ctx = [h + t for h, t in zip(b.heads, b.tails)]
    segments = [ctx[q][-1:] + y[:-1] for q, y in zip(b.qidx, b.rolls)]
    hidden = _predicting_rows(snapshot, [c[:-1] for c in ctx], segments, b.qidx, b.lengths, b, "snapshot")
    targets = b.targets.to(snapshot.device)
    weight, parallel = _head(snapshot, shard)
    if not targets.numel():
        return torch.zeros(0, device=snapshot.device)
    return linear_logprob(snapshot.final_norm(hidden), weight, targets, temperature=temperature, chunk=chunk,
                          **parallel)


def _teacher_logprobs(teacher, b: _Batch, k, chunk, outside, floor, renormalize, temperature, backend, shard):
    """Step 3: (log π̃_φ(y_i,l | head, h_i, tail, y_i,<l) [ΣL], in_topk [ΣL]) under the top-k
    truncated teacher. Group prefix = head but its last token; the hint rides in the segment."""
    segments = [h + b.tails[q] + y[:-1] for q, h, y in zip(b.qidx, b.hints, b.rolls)]
    hidden = _predicting_rows(teacher, [h[:-1] for h in b.heads], segments, b.qidx, b.lengths, b, "teacher")
    targets = b.targets.to(teacher.device)
    if not targets.numel():
        return torch.zeros(0), torch.zeros(0, dtype=torch.bool)
    weight, parallel = _head(teacher, shard)
    res = topk_logprobs(teacher.final_norm(hidden), weight, targets, k=k, chunk=chunk, outside=outside, floor=floor,
                        renormalize=renormalize, temperature=temperature, backend=backend, **parallel)
    return res.target_logprob, res.in_topk


def _padded(b: _Batch, logp_old, logp_t, in_topk, outside: str) -> tuple:
    """Step 4: the packed per-token values as [N, L] rows padded with 0 / False, and Eq. 9's
    atd = logp_teacher − logp_old on the response tokens: RescoreResult's first six fields."""
    lengths = b.lengths
    N, L = len(b.rolls), max(lengths)
    mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    out_old = torch.zeros(N, L)
    out_t = torch.zeros(N, L)
    out_in = torch.zeros(N, L, dtype=torch.bool)
    out_old[mask] = logp_old.float().cpu()
    out_t[mask] = logp_t.float().cpu()
    out_in[mask] = in_topk.cpu()
    atd_mask = mask & out_in if outside == "mask" else mask.clone()
    # "mask" drops the tokens outside the teacher's top-k: their atd is 0, not 0 − logp_old
    # (a positive advantage of up to −logp_old for exactly the tokens the teacher excluded)
    atd = torch.where(atd_mask, out_t - out_old, torch.zeros(()))
    return out_old, out_t, atd, mask, out_in, atd_mask


def _head(runner, shard: Optional[VocabShard]):
    """(lm_head weight, vocabulary-parallel keyword arguments) of a model."""
    if shard is None:
        return runner.lm_head, {}
    if not isinstance(shard, VocabShard):
        raise TypeError(f"rescore: an output-layer shard must be an acarerank.ops.VocabShard, got {type(shard).__name__}")
    vocab = runner.arch.vocab_size if shard.vocab_size is None else shard.vocab_size
    return shard.weight, dict(process_group=shard.process_group, vocab_start=shard.vocab_start, vocab_size=vocab)


def _predicting_rows(runner, prefixes, segments, groups, n_pred, b: _Batch, who: str):
    """Hidden states (before the final norm) that predict each rollout's tokens, packed [ΣL, H]:
    the last n_pred[i] rows of segment i. A row that is NaN/inf or too large for fp32's RMSNorm
    (which would make its logits NaN, or all 0: log-probs of exactly −log V, with no error) is a
    ``NonFiniteHiddenError`` naming the (rollout, token) pairs, as ``output="last"`` passes are."""
    cache = runner.prefill(prefixes)
    hid = runner.forward(cache, segments, groups, output="all")
    rows, off = [], 0
    for seg, n in zip(segments, n_pred):
        off += len(seg)
        rows.extend(range(off - n, off))
    hid = hid[torch.tensor(rows, dtype=torch.long, device=hid.device)]
    try:
        check_scorable(hid)  # one [ΣL, H] pass: a fraction of the [ΣL, V] logits that follow
    except NonFiniteHiddenError as e:
        pairs = b.rollout_token(e.rows)
        raise NonFiniteHiddenError(f"rescore: the {who}'s final hidden state predicting {b.describe(pairs)} is NaN/inf "
                                   f"or too large for fp32's RMSNorm: its activations overflowed (broken weights, or a "
                                   f"dtype too narrow: try float32); no log-prob is computed from it", pairs) from None
    return hid


__all__ = ["RescoreQuery", "RescoreResult", "rescore", "split_student_prompt"]
