"""Paired re-scoring of ATO (AdaTutoRank (2026), Algorithm 1 line 39; Eq. 9): no regeneration, prefix sharing.

For each query q with student prompt P = head ++ tail (the hint goes between them, see
``split_student_prompt``) and rollouts y_1..y_G, each with hint h_i:

    snapshot π_old sees   head ++ tail ++ y_i              -> logp_old[i, l]     = log π_old(y_i,l | ·)
    teacher  π_φ   sees   head ++ h_i ++ tail ++ y_i       -> logp_teacher[i, l] = log π̃_φ(y_i,l | ·)
    atd[i, l] = logp_teacher[i, l] − logp_old[i, l]                                         (Eq. 9)

π̃_φ is the teacher truncated to its top-k logits (k = 128, Appendix C.4) by ``topk_logprobs``
(renormalised; the ``outside`` rule decides what a sampled token outside the top-k gets).

Sharing (docs/ARCHITECTURE.md, "The one primitive"): one group per query in each model. The snapshot's group prefix is
the whole prompt but its last token; the teacher's is ``head`` but its last token (the
candidates and the query — nearly all of a setwise prompt — computed once per model per
query). Each segment starts with that one held-back token, so the hidden state that predicts
y_i,0 comes out of the segment: snapshot segment = P[-1] ++ y_i[:-1]; teacher segment =
head[-1] ++ h_i ++ tail ++ y_i[:-1], where a text hint is tokenized together with head[-1]
(``hint_ids(..., lead_token=head[-1])``: Qwen3 merges ".\n\n" across the seam). Positions
are those of the unshared sequences, so the results equal running each full sequence on its
own (tests check against transformers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch

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
    for no hint)."""
    prompt_head: Ids
    prompt_tail: Ids
    rollouts: Sequence[Ids]
    hints: Sequence[Union[str, Ids]]


@dataclass
class RescoreResult:
    """Per-token results, rollouts in query order, padded to L = the longest rollout.

    logp_old, logp_teacher, atd: [N, L] fp32 (0 at padding); response_mask: [N, L] bool;
    teacher_in_topk: [N, L] bool; atd_mask: response_mask, and in_topk too when outside="mask";
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
    ids = [int(t) for t in prompt_ids]
    for pos in range(len(ids) - 1, -1, -1):
        if ids[pos] == close_token:
            return ids[:pos], ids[pos:]
    raise ValueError(f"prompt has no token {close_token} (<|im_end|>) closing the user turn; split it yourself")


def _ids(x, what: str) -> List[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.is_floating_point():
            raise TypeError(f"{what}: token ids must be a 1-D integer sequence, got {x.dtype} {tuple(x.shape)}")
        return [int(t) for t in x.tolist()]
    if isinstance(x, str):
        raise TypeError(f"{what}: expected token ids, got a str")
    return [int(t) for t in x]


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
    Returns: RescoreResult (constants: computed under inference_mode, the sg[·] of line 39).
    """
    if outside not in OUTSIDE_MODES:
        raise ValueError(f"rescore: outside must be one of {OUTSIDE_MODES}, got {outside!r}")
    if snapshot.arch.vocab_size != teacher.arch.vocab_size:
        raise ValueError(f"snapshot and teacher vocabularies differ ({snapshot.arch.vocab_size} vs "
                         f"{teacher.arch.vocab_size})")
    if not queries:
        raise ValueError("rescore: no queries")
    heads, tails, rolls, hints, qidx = [], [], [], [], []
    for q, item in enumerate(queries):
        head = _ids(item.prompt_head, f"query {q} prompt_head")
        tail = _ids(item.prompt_tail, f"query {q} prompt_tail")
        if not head:
            raise ValueError(f"query {q}: prompt_head is empty (the shared part must hold at least one token)")
        if len(item.hints) != len(item.rollouts):
            raise ValueError(f"query {q}: {len(item.rollouts)} rollouts but {len(item.hints)} hints")
        heads.append(head)
        tails.append(tail)
        for i, (y, h) in enumerate(zip(item.rollouts, item.hints)):
            rolls.append(_ids(y, f"query {q} rollout {i}"))
            if isinstance(h, str) and h and tokenizer is None:
                from ..tokenizer import load_qwen3_tokenizer
                tokenizer = load_qwen3_tokenizer()
            # the segment's first tokens: head[-1] + hint, the seam re-tokenized for text hints
            h = h if isinstance(h, str) else _ids(h, f"query {q} hint {i}")
            hints.append(hint_ids(tokenizer, h, lead_token=head[-1]))
            qidx.append(q)
    if not rolls:
        raise ValueError("rescore: no rollouts")
    V = snapshot.arch.vocab_size
    bad = [(i, t) for i, y in enumerate(rolls) for t in y if not 0 <= t < V]
    if bad:
        raise ValueError(f"rollout {bad[0][0]} has token id {bad[0][1]} outside [0, {V})")

    lengths = [len(y) for y in rolls]
    targets = torch.tensor([t for y in rolls for t in y], dtype=torch.long)
    with torch.inference_mode():
        # -- snapshot: group prefix = whole prompt but its last token
        ctx = [h + t for h, t in zip(heads, tails)]
        seg_s = [ctx[q][-1:] + y[:-1] for q, y in zip(qidx, rolls)]
        hid_s = _predicting_rows(snapshot, [c[:-1] for c in ctx], seg_s, qidx, lengths)
        # -- teacher: group prefix = head but its last token; the hint rides in the segment
        seg_t = [h + tails[q] + y[:-1] for q, h, y in zip(qidx, hints, rolls)]
        hid_t = _predicting_rows(teacher, [h[:-1] for h in heads], seg_t, qidx, lengths)

        tg_s = targets.to(snapshot.device)
        w_s, par_s = _head(snapshot, snapshot_head)
        logp_old = linear_logprob(snapshot.final_norm(hid_s), w_s, tg_s, temperature=temperature, chunk=chunk,
                                  **par_s) if tg_s.numel() else torch.zeros(0, device=snapshot.device)
        tg_t = targets.to(teacher.device)
        if tg_t.numel():
            w_t, par_t = _head(teacher, teacher_head)
            res = topk_logprobs(teacher.final_norm(hid_t), w_t, tg_t, k=k, chunk=chunk, outside=outside,
                                floor=floor, renormalize=renormalize, temperature=temperature, backend=backend,
                                **par_t)
            logp_t, in_topk = res.target_logprob, res.in_topk
        else:
            logp_t, in_topk = torch.zeros(0), torch.zeros(0, dtype=torch.bool)

        N, L = len(rolls), max(lengths)
        mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
        out_old = torch.zeros(N, L)
        out_t = torch.zeros(N, L)
        out_in = torch.zeros(N, L, dtype=torch.bool)
        out_old[mask] = logp_old.float().cpu()
        out_t[mask] = logp_t.float().cpu()
        out_in[mask] = in_topk.cpu()
        atd = torch.where(mask, out_t - out_old, torch.zeros(()))
        atd_mask = mask & out_in if outside == "mask" else mask.clone()
    return RescoreResult(out_old, out_t, atd, mask, out_in, atd_mask,
                         torch.tensor(qidx, dtype=torch.long), lengths)


def _head(runner, shard: Optional[VocabShard]):
    """(lm_head weight, vocabulary-parallel keyword arguments) of a model."""
    if shard is None:
        return runner.lm_head, {}
    if not isinstance(shard, VocabShard):
        raise TypeError(f"rescore: an output-layer shard must be an acarerank.ops.VocabShard, got {type(shard).__name__}")
    vocab = runner.arch.vocab_size if shard.vocab_size is None else shard.vocab_size
    return shard.weight, dict(process_group=shard.process_group, vocab_start=shard.vocab_start, vocab_size=vocab)


def _predicting_rows(runner, prefixes, segments, groups, n_pred):
    """Hidden states (before the final norm) that predict each rollout's tokens, packed [ΣL, H]:
    the last n_pred[i] rows of segment i."""
    cache = runner.prefill(prefixes)
    hid = runner.forward(cache, segments, groups, output="all")
    rows, off = [], 0
    for seg, n in zip(segments, n_pred):
        off += len(seg)
        rows.extend(range(off - n, off))
    return hid[torch.tensor(rows, dtype=torch.long, device=hid.device)]


__all__ = ["RescoreQuery", "RescoreResult", "rescore", "split_student_prompt"]
