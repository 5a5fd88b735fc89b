"""Vocabulary-parallel ``topk_logprobs`` and ``linear_logprob`` over ``torch.distributed``.

Layout: Megatron-LM's vocabulary-parallel output layer (``VocabParallelEmbedding`` /
``ColumnParallelLinear`` + ``vocab_parallel_cross_entropy``; verl's Megatron backend and NeMo
use it). The lm_head [V_pad, H] is split by rows over the W ranks of ``process_group``; rank r
holds the contiguous rows [start_r, start_r + V_r) as ``weight_shard`` [V_r, H].

  start_r     ``vocab_start``; default r · ceil(Σ_r V_r / W) — Megatron's rule (its shards are
              all V_pad / W rows; the default also fits the ceil split of an unpadded vocabulary,
              whose last shard is shorter). Other uneven splits: every rank passes its start.
  vocab_size  the true vocabulary V ≤ Σ_r V_r (default Σ_r V_r). Rows with id ≥ V are padding
              (Megatron pads to a multiple of 128 · W): they never enter the top-k, the
              normaliser or a gradient (their weight gradient is 0).
  replicated  hidden [T, H], targets [T] (global ids in [0, V)), k, temperature: the same on
              every rank, as the input of Megatron's output layer is across its group.

Targets: rank r owns the target ids in [start_r, start_r + n_r) (n_r its valid, non-padding
rows). The owner reads the target's logit in its local pass; every other rank computes its
shard with that row's target replaced by a harmless local id and its target value is never
used — the combine takes the owner's value only (the owner is known from the layout).

Every rank returns the same result: that of the single-process op on the full weight.

Protocol (all collectives on ``process_group``; gloo on CPU, NCCL on GPU):
  1. check — one all_gather of a 256-int64 header per rank: status, op, T, H, V_r, k, start,
     V, temperature, a checksum and the range of targets, a flag word, and the rank's own
     error message when its local input checks failed. Every rank applies the same rules to
     the same gathered headers, so bad input anywhere — shards that do not tile [0, V), ranks
     disagreeing on k, T or targets, a dtype error on one rank — raises a ValueError on every
     rank (the failing rank raises its own error) instead of leaving the others waiting in a
     collective.
  2. local — the single-process core on this rank's valid rows.
  3. one all_gather of the per-row results (below), with a status word in front: a rank
     whose local pass failed (non-finite logits, out of memory) still joins it, and every
     rank raises after it.
  4. combine — every rank reduces the same gathered bytes in the same order: bit-identical
     results across ranks.

topk_logprobs sends per rank 4·(2 + T·(2k+2)) bytes: the k best (logit, global id) of its
shard per row, its log-sum-exp lse_r and its target logit — O(T·k·W) over the group, never
O(T·V). The candidates merge under the tie-rule key (value desc, then id asc: ``order_keys``,
across ranks too since ids are global); lse = logsumexp_r lse_r in fp64. This one all-gather
does the work of Megatron's all-reduce(max) + all-reduce(Σexp, target logit): the normaliser
of each rank travels as one number, lse_r, so no separate max round is needed.

linear_logprob (differentiable, Megatron's vocab-parallel cross-entropy fused with the
projection): forward gathers per rank and row (m_r, s_r, a_r, target logit) in fp64, m_r the
shard's max logit, s_r = Σ exp(z − m_r), a_r = Σ exp(z − m_r)·(z − m_r), and combines
M = max_r m_r, S = Σ_r s_r e^{m_r−M}, A = Σ_r e^{m_r−M} (a_r + (m_r − M) s_r), lse = M + log S,
E_p[z] = M + A/S, entropy = log S − A/S — the single-process formulas of ``linear_logprob``.
Backward: each rank's weight gradient is local (its shard's rows); the hidden gradient is the
sum over shards, one all_reduce(SUM) of [T, H] — what the backward of Megatron's
``copy_to_tensor_model_parallel_region`` does in front of its output layer (so do not add that
region as well: the gradient would be summed twice). Every rank must run the backward with the
same incoming gradient (Megatron's loss is the same on every rank of the group).

Precision: top-k ids and logits, and the renormalised (top-k) log-probs, are those of the
single-process op bit for bit whenever the GEMM gives each logit the same bits (tests use
exact dyadic inputs). A value normalised over the whole vocabulary (renormalize=False,
outside="full") combines fp32 per-shard sums in another order: it moves by fp32 rounding,
like the single-process op does when its chunk size changes (tests: ≤ 2× its error vs fp64).

Limits: the check catches disagreement, not a rank that never calls (a rank passing
process_group=None runs alone while the others wait until the group's timeout); hidden is
trusted to be the same on every rank (a checksum of it would cost a [T, H] pass); with
Megatron's sequence parallelism, gather the hidden states first with a backward that takes
this rank's slice (``gather_from_sequence_parallel_region(..., tensor_parallel_output_grad=False)``),
since the hidden gradient here is already summed over the group. NCCL is supported by
construction (buffers live on the GPU) but was tested only with gloo.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from ..topk_contract import OUTSIDE_MODES, as_int, check_k, finalize
from . import _backend
from ._checks import NONFINITE_LOGITS, PADDING_HINT, check_flag, check_projection_inputs, finite_real, vmapped
from .linear_logprob import DEFAULT_CHUNK as _LP_CHUNK
from .linear_logprob import (FirstOrderOnly, _refuse_inference_tensors, backward_chunks, compute_copy, forward_stats,
                             grad_inputs)
from .topk_logprobs import OP as _TOPK_OP
from .topk_logprobs import _check_result_finite, order_keys, topk_logprobs_core

HEADER = 256       # int64 words per rank in the check collective
_NFIELDS = 16      # fields in front; the rest holds the rank's error message, one byte per word
_OPCODES = {"topk_logprobs": 1, "linear_logprob": 2}
_DTYPE_WORDS = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_DTYPE_NAMES = {v: str(k).replace("torch.", "") for k, v in _DTYPE_WORDS.items()}
_PAD_ID = 2 ** 31 - 1  # id of the −inf filler when a shard holds fewer than k valid rows


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of a vocabulary-parallel lm_head, for ``rescore`` (module doc).

    weight: [V_r, H] this rank's rows; process_group: the group that holds the other rows;
    vocab_start: id of this rank's first row (default: Megatron's rule); vocab_size: the true
    vocabulary (rows past it are padding; ``rescore`` defaults it to the model's vocab_size).
    """
    weight: torch.Tensor
    process_group: object
    vocab_start: Optional[int] = None
    vocab_size: Optional[int] = None


@dataclass(frozen=True)
class Layout:
    """The agreed split, identical on every rank: starts[r], rows[r] (V_r) and valid[r] (n_r,
    non-padding rows) per rank, the true vocabulary V, this rank and the world size."""
    rank: int
    world: int
    starts: List[int]
    rows: List[int]
    valid: List[int]
    vocab_size: int

    def owner(self, targets: torch.Tensor) -> torch.Tensor:
        """[T] int64: the rank whose valid rows hold each target id."""
        own = torch.zeros_like(targets)
        for r, (s, n) in enumerate(zip(self.starts, self.valid)):
            if n and r:
                own.masked_fill_((targets >= s) & (targets < s + n), r)
        return own


# ----------------------------------------------------------------------------- check collective
def _check_group(process_group, op):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{op}: process_group given but torch.distributed is not initialised "
                           f"(call torch.distributed.init_process_group first)")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"{op}: process_group must be a torch.distributed.ProcessGroup, got "
                        f"{type(process_group).__name__}")
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError(f"{op}: this process (global rank {dist.get_rank()}) is not a member of process_group")
    return rank, dist.get_world_size(process_group)


def _comm_device(group, hidden):
    """Where collective buffers live: the hidden states' GPU under NCCL, the CPU under gloo."""
    backend = str(dist.get_backend(group)).lower()
    dev = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
    if dev.type == "cuda" and "nccl" in backend:
        return dev
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather(t: torch.Tensor, group, world: int, device) -> torch.Tensor:
    """[world, *t.shape]: every rank's ``t``, in rank order."""
    t = t.to(device).contiguous()
    out = torch.empty((world,) + tuple(t.shape), dtype=t.dtype, device=device)
    dist.all_gather(list(out.unbind(0)), t, group=group)
    return out


def _refuse_vmap(op, *tensors):
    """RuntimeError when torch.func.vmap batches one of ``tensors``: the collectives have no batching
    rule (torch's "Batching rule not implemented for c10d::allgather_", or for linear_logprob "an
    autograd.Function ... must override the setup_context staticmethod", naming no op). Called in
    ``local_check``, so every rank raises, none is left waiting."""
    if any(vmapped(t) for t in tensors):
        raise RuntimeError(f"{op}: no torch.func.vmap with process_group= (its collectives cannot be batched); "
                           f"stack the examples' rows into hidden [T, H] and targets [T] (rows are independent), or "
                           f"call it once per example")


def _optional_int(x, name, op, lo):
    if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < lo):
        raise ValueError(f"{op}: {name} must be None or an int ≥ {lo}, got {x!r}")


def _outside_word(outside, renormalize) -> int:
    """outside and renormalize as one header word (-1 for an outside local_check refuses: computed
    before the collective, it must not raise)."""
    return 2 * OUTSIDE_MODES.index(outside) + bool(renormalize) if outside in OUTSIDE_MODES else -1


def _as_word(x: float) -> int:
    """A float's bits as one int64 header word (compared exactly)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _from_word(w: int) -> float:
    """The float whose bits ``_as_word`` wrote."""
    return struct.unpack("<d", struct.pack("<q", w))[0]


def _header(op, err, hidden, weight, targets, k, vocab_start, vocab_size, temperature, flags,
            options) -> torch.Tensor:
    h = torch.zeros(HEADER, dtype=torch.int64, device="cpu")
    h[1] = _OPCODES[op]
    if err is None:
        tg = targets.long()
        T = tg.shape[0]
        h[2], h[3], h[4] = T, hidden.shape[1], weight.shape[0]
        h[5] = -1 if k is None else k
        h[6] = -1 if vocab_start is None else vocab_start
        h[7] = -1 if vocab_size is None else vocab_size
        h[8] = _as_word(temperature)
        if T:  # one host sync; int64 sums wrap around, identically on every rank
            pos = torch.arange(1, 2 * T, 2, device=tg.device)
            stats = torch.stack([(tg * pos).sum(), tg.min(), tg.max()]).cpu()
            h[9], h[10], h[11] = stats[0], stats[1], stats[2]
        h[12] = flags
        # hidden's dtype: the backward's all-reduce buffer has it (fp32 on one rank and fp64 on
        # another: gloo aborted the process on a size mismatch)
        h[13] = _DTYPE_WORDS.get(hidden.dtype, 0)
        h[14], h[15] = options[0], _as_word(options[1])   # topk_logprobs: outside and renormalize; floor
    else:
        h[0] = 1
        msg = f"{type(err).__name__}: {err}".encode("utf-8")[:HEADER - _NFIELDS]
        h[_NFIELDS:_NFIELDS + len(msg)] = torch.tensor(list(msg), dtype=torch.int64, device="cpu")
    return h


def _message(row: torch.Tensor) -> str:
    return bytes(int(b) for b in row[_NFIELDS:].tolist() if b).decode("utf-8", errors="replace")


def _disagree(op, name, values):
    if len(set(values)) > 1:
        shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values[:8]))
        raise ValueError(f"{op}: ranks of the process group disagree on {name} ({shown}); every rank must "
                         f"pass the same {name}")


def agree(op, group, local_check, hidden, weight, targets, k, vocab_start, vocab_size, temperature, flags=0,
          options=(0, 0.0)):
    """Step 1 of the protocol: run ``local_check`` (raises on bad input), gather every rank's
    header, apply the global rules. Returns the ``Layout``; raises on every rank alike.
    ``options``: (an int, a float) every rank must pass alike (topk_logprobs' outside mode and
    renormalize; its floor)."""
    rank, world = _check_group(group, op)
    err = None
    try:
        local_check()
        _optional_int(vocab_start, "vocab_start", op, 0)
        _optional_int(vocab_size, "vocab_size", op, 1)
    except Exception as e:  # any local failure must still reach the collective, or the others hang
        err = e
    hdr = _header(op, err, hidden, weight, targets, k, vocab_start, vocab_size, temperature, flags, options)
    g = _all_gather(hdr, group, world, _comm_device(group, hidden)).cpu()
    if err is not None:
        raise err
    bad = [r for r in range(world) if g[r, 0] != 0]
    if bad:
        raise ValueError(f"{op}: rank {bad[0]} of the process group rejected its input: {_message(g[bad[0]])}")
    f = g[:, :_NFIELDS].tolist()
    _disagree(op, "the op (each rank must call the same function)", [r[1] for r in f])
    _disagree(op, "T (rows of hidden and targets)", [r[2] for r in f])
    _disagree(op, "H (hidden size)", [r[3] for r in f])
    _disagree(op, "k", [r[5] for r in f])
    _disagree(op, "temperature", [_from_word(r[8]) for r in f])
    _disagree(op, "targets (checksum)", [r[9] for r in f])
    _disagree(op, "flags (return_entropy / hidden.requires_grad)", [r[12] for r in f])
    _disagree(op, "hidden's dtype", [_DTYPE_NAMES.get(r[13], r[13]) for r in f])
    _disagree(op, "outside / renormalize", [r[14] for r in f])
    _disagree(op, "floor", [_from_word(r[15]) for r in f])
    given_v = sorted({r[7] for r in f if r[7] >= 0})
    if len(given_v) > 1 or (given_v and any(r[7] < 0 for r in f)):
        _disagree(op, "vocab_size", [r[7] if r[7] >= 0 else None for r in f])
    rows = [r[4] for r in f]
    total = sum(rows)
    step = -(-total // world)  # Megatron's rule: rank · ceil(Σ V_r / W)
    starts = [r[6] if r[6] >= 0 else i * step for i, r in enumerate(f)]
    order = sorted(range(world), key=lambda i: (starts[i], i))
    end = 0
    for i in order:
        if rows[i] == 0:
            continue  # an empty shard holds nothing, wherever it says it starts
        if starts[i] != end:
            spans = ", ".join(f"rank {j}: [{starts[j]}, {starts[j] + rows[j]})" for j in range(world))
            what = "a gap" if starts[i] > end else "an overlap"
            raise ValueError(f"{op}: the vocabulary shards do not tile [0, {total}): {what} at id {min(end, starts[i])} "
                             f"({spans}); pass vocab_start on every rank when the split is not Megatron's "
                             f"rank · ceil(V / world)")
        end += rows[i]
    V = given_v[0] if given_v else total
    if V > total:
        raise ValueError(f"{op}: vocab_size={V} but the shards hold only {total} rows")
    if k is not None and k > V:
        raise ValueError(f"{op}: k must be <= V, got k={k} > the vocabulary size {V}")
    T = f[0][2]
    if T and (f[rank][10] < 0 or f[rank][11] >= V):
        bad_id = f[rank][10] if f[rank][10] < 0 else f[rank][11]
        # -100 (cross_entropy's ignore_index) is named as the single-process ops name it
        raise ValueError(f"{op}: target id {bad_id} is out of range [0, V={V})" + (PADDING_HINT if bad_id < 0 else ""))
    valid = [max(0, min(n, V - s)) for s, n in zip(starts, rows)]
    return Layout(rank, world, starts, rows, valid, V)


def _raise_if_failed(op, status: torch.Tensor, err, layout: Layout):
    """Step 3's status words: a local failure raises everywhere, after the collective."""
    if err is not None:
        raise err
    bad = status.nonzero().flatten().tolist()
    if bad:
        r = bad[0]
        raise ValueError(f"{op}: rank {r} failed on its vocabulary rows [{layout.starts[r]}, "
                         f"{layout.starts[r] + layout.rows[r]}) (non-finite logits or another error: see that "
                         f"rank's exception)")


# ----------------------------------------------------------------------------- topk_logprobs
def topk_logprobs_vocab_parallel(hidden, weight_shard, targets, k=128, chunk=None, outside="floor", floor=-20.0,
                                 renormalize=True, temperature=1.0, backend=None, *, process_group,
                                 vocab_start=None, vocab_size=None):
    """``topk_logprobs`` over a vocabulary-parallel lm_head (module doc); same arguments and
    result (TopKLogprobs with global ids), plus the layout: ``weight_shard`` [V_r, H] this
    rank's rows, ``process_group``, ``vocab_start``, ``vocab_size``. Collective: every rank
    of the group calls it with the same hidden (its dtype too), targets, k, temperature, outside,
    floor and renormalize (a disagreement is a ValueError on every rank)."""
    op = "topk_logprobs"
    k = as_int(k)   # numpy.int64(128) is 128 (the header and the buffers need an int); else check_k names it

    def local_check():
        _refuse_vmap(op, hidden, weight_shard, targets)
        check_projection_inputs(hidden, weight_shard, targets, op, temperature=temperature, chunk=chunk, shard=True)
        # k ≤ the backend's limit here (V is checked once the shards are known); the local
        # core sees min(k, n_r) ≤ k
        check_k(k, None, _TOPK_OP.resolve(backend, hidden.device), op)
        if outside not in OUTSIDE_MODES:
            raise ValueError(f"{op}: outside must be one of {OUTSIDE_MODES}, got {outside!r}")
        if not finite_real(floor):
            raise ValueError(f"{op}: floor must be a finite number, got {floor!r}")
        check_flag(op, "renormalize", renormalize)

    layout = agree(op, process_group, local_check, hidden, weight_shard, targets, k, vocab_start, vocab_size,
                   temperature, options=(_outside_word(outside, renormalize), floor))
    r, W = layout.rank, layout.world
    start, n = layout.starts[r], layout.valid[r]
    T, dev = hidden.shape[0], hidden.device
    tg = targets.long()
    err = None
    tv = torch.full((T, k), -math.inf, dtype=torch.float32, device=dev)
    ti = torch.full((T, k), _PAD_ID, dtype=torch.int64, device=dev)
    tz = torch.zeros(T, dtype=torch.float32, device=dev)
    lse = torch.full((T,), -math.inf, dtype=torch.float32, device=dev)
    if T and n:
        try:
            local = torch.where((tg >= start) & (tg < start + n), tg - start, 0)  # non-owners: any valid id
            kr = min(k, n)
            # shard=True: a row all −inf on this shard (masked vocabulary) is fine; the combined lse
            # is checked below, as the single-process op checks its own
            v, i, tz, lse = topk_logprobs_core(hidden, weight_shard[:n], local, kr, chunk, temperature, backend,
                                               shard=True)
            tv[:, :kr], ti[:, :kr] = v, i + start
        except Exception as e:  # joins step 3 anyway; raised after it
            err = e
    packed = torch.cat([torch.tensor([0 if err is None else 1, 0], dtype=torch.int32, device=dev),
                        tv.view(torch.int32).flatten(), ti.to(torch.int32).flatten(),
                        lse.view(torch.int32), tz.view(torch.int32)])
    g = _all_gather(packed, process_group, W, _comm_device(process_group, hidden)).to(dev)
    _raise_if_failed(op, g[:, 0], err, layout)
    body, Tk = g[:, 2:], T * k
    vals = body[:, :Tk].reshape(W, T, k).view(torch.float32)
    ids = body[:, Tk:2 * Tk].reshape(W, T, k).long()
    lse_r = body[:, 2 * Tk:2 * Tk + T].contiguous().view(torch.float32)
    tz_r = body[:, 2 * Tk + T:].contiguous().view(torch.float32)
    # -- merge the W·k candidates of each row under the tie rule (global ids: exact across ranks)
    cand_v = vals.permute(1, 0, 2).reshape(T, W * k)
    cand_i = ids.permute(1, 0, 2).reshape(T, W * k)
    pos = order_keys(cand_v, cand_i).topk(k, dim=1, sorted=True).indices
    top_v, top_i = cand_v.gather(1, pos), cand_i.gather(1, pos)
    lse_all = torch.logsumexp(lse_r.double(), dim=0).float()
    _check_result_finite(lse_all)  # −inf on every shard; the same gathered bytes on every rank: all raise
    tz_all = tz_r.gather(0, layout.owner(tg)[None, :]).squeeze(0)
    return finalize(top_v, top_i, tz_all, lse_all, targets, outside, floor, renormalize)


# ----------------------------------------------------------------------------- linear_logprob
class _VocabParallelLinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight_shard, targets, temperature, chunk, with_entropy, layout, group):
        r, W = layout.rank, layout.world
        start, n = layout.starts[r], layout.valid[r]
        h32 = compute_copy(hidden)
        T, dev, cd = hidden.shape[0], hidden.device, h32.dtype
        tg = targets.long()
        m = torch.full((T,), -math.inf, dtype=torch.float64, device=dev)
        s = torch.zeros(T, dtype=torch.float64, device=dev)
        a = torch.zeros(T, dtype=torch.float64, device=dev)
        tz = torch.zeros(T, dtype=torch.float64, device=dev)
        err = None
        if T and n:
            try:
                # targets outside [0, n) after the shift belong to another rank: never matched here
                m, s, a, tz = (x.double() for x in forward_stats(h32, weight_shard[:n], tg - start, temperature,
                                                                 chunk, with_entropy))
            except Exception as e:
                err = e
        status = torch.tensor([0.0 if err is None else 1.0], dtype=torch.float64, device=dev)
        g = _all_gather(torch.cat([status, m, s, a, tz]), group, W, _comm_device(group, hidden)).to(dev)
        _raise_if_failed("linear_logprob", g[:, 0], err, layout)
        m_r, s_r, a_r, tz_r = g[:, 1:].reshape(W, 4, T).unbind(1)
        M = m_r.max(dim=0).values
        d = m_r - M
        scale = torch.exp(d)  # 0 for an empty shard (m_r = −inf)
        S = (s_r * scale).sum(0)
        log_S = torch.log(S)  # lse − M
        tz_all = tz_r.gather(0, layout.owner(tg)[None, :]).squeeze(0)
        logprob = (tz_all - (M + log_S)).to(cd)
        if with_entropy:  # a_r is relative to m_r: move it to M (an empty shard adds nothing)
            A = (scale * (a_r + torch.where(s_r > 0, d * s_r, torch.zeros_like(s_r)))).sum(0)
            ez_m, entropy = A / S, log_S - A / S  # E_p[z] − M, the entropy
        else:
            ez_m = entropy = torch.zeros_like(S)
        # as the single-process op: inf/NaN in hidden or weight is an error, never a silent NaN
        # loss or entropy; every rank holds the same gathered numbers, so every rank raises alike
        bad = ~torch.isfinite(logprob) | ~torch.isfinite(ez_m + M) | ~torch.isfinite(entropy)
        if T and bad.any():
            rows = bad.nonzero().flatten().tolist()[:8]
            raise ValueError(f"linear_logprob: {NONFINITE_LOGITS} in rows {rows}")
        # the backward's statistics relative to M (linear_logprob's module doc); M is one shard's
        # fp32 max logit, exact in cd
        # tg copied: an inference tensor's ids (sampled under torch.inference_mode()) cannot be saved
        ctx.save_for_backward(hidden, weight_shard, tg.clone(), M.to(cd), log_S.to(cd), ez_m.to(cd))
        ctx.temperature, ctx.chunk, ctx.with_entropy, ctx.compute_dtype = temperature, chunk, with_entropy, cd
        ctx.start, ctx.n, ctx.group = start, n, group
        if with_entropy:
            return logprob, entropy.to(cd)
        return logprob

    @staticmethod
    def backward(ctx, g_lp, g_ent=None):
        create_graph = torch.is_grad_enabled()
        with torch.no_grad():  # first derivatives only (module doc of linear_logprob)
            grad_h, grad_w = _VocabParallelLinearLogprob._grads(ctx, g_lp, g_ent)
        if create_graph:  # a backward of these gradients must raise, not silently skip this op
            hidden, weight_shard = ctx.saved_tensors[:2]
            anchor = next((t for t in (hidden, weight_shard, g_lp, g_ent) if t is not None and t.requires_grad), None)
            out = [t for t in (grad_h, grad_w) if t is not None]
            if anchor is not None and out:
                wrapped = iter(FirstOrderOnly.apply(anchor, *out))
                grad_h, grad_w = (None if t is None else next(wrapped) for t in (grad_h, grad_w))
        return grad_h, grad_w, None, None, None, None, None, None

    @staticmethod
    def _grads(ctx, g_lp, g_ent):
        hidden, weight_shard, tg, m, lse_m, ez_m = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        T = hidden.shape[0]
        g_lp, g_ent = grad_inputs(ctx, g_lp, g_ent, T, hidden.device)
        h32 = compute_copy(hidden)
        n = ctx.n
        grad_h = torch.zeros_like(h32) if need_h else None
        grad_w = None
        if T and n:
            grad_h, gw = backward_chunks(h32, weight_shard[:n], tg - ctx.start, m, lse_m, ez_m, g_lp, g_ent,
                                         ctx.temperature, ctx.chunk, need_h, need_w)
            if need_w:
                grad_w = gw if n == weight_shard.shape[0] else \
                    torch.cat([gw, gw.new_zeros(weight_shard.shape[0] - n, gw.shape[1])])  # padding rows: 0
        if need_w and grad_w is None:
            grad_w = torch.zeros_like(weight_shard)
        if need_h:  # Σ over shards; the header check made hidden.requires_grad agree on every rank
            comm = _comm_device(ctx.group, hidden)
            buf = grad_h.to(comm)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=ctx.group)
            grad_h = buf.to(hidden.device, hidden.dtype)
        return grad_h, grad_w


def linear_logprob_vocab_parallel(hidden, weight_shard, targets, temperature=1.0, return_entropy=False, chunk=None,
                                  *, process_group, vocab_start=None, vocab_size=None):
    """``linear_logprob`` over a vocabulary-parallel lm_head (module doc): same arguments and
    results, differentiable (hidden's gradient all-reduced, the shard's gradient local).
    Collective in forward and backward: every rank of the group calls it (same hidden,
    targets, temperature, return_entropy) and, when training, runs its backward."""
    op = "linear_logprob"

    def local_check():
        _refuse_vmap(op, hidden, weight_shard, targets)
        check_projection_inputs(hidden, weight_shard, targets, op, temperature=temperature, chunk=chunk, shard=True)
        check_flag(op, "return_entropy", return_entropy)
        # here, not at the save after the forward's collectives: torch's error from there named
        # neither the op nor the argument, and one rank's inference tensor left the others with
        # a flags disagreement
        _refuse_inference_tensors(hidden, weight_shard)

    flags = int(bool(return_entropy)) | (2 if isinstance(hidden, torch.Tensor) and hidden.requires_grad
                                         and torch.is_grad_enabled() else 0)
    layout = agree(op, process_group, local_check, hidden, weight_shard, targets, None, vocab_start, vocab_size,
                   temperature, flags)
    return _VocabParallelLinearLogprob.apply(hidden, weight_shard, targets, float(temperature), chunk or _LP_CHUNK,
                                             bool(return_entropy), layout, process_group)


def _eager_only(fn, op):
    """``fn`` kept out of torch.compile's graphs: a graph break, run eagerly on concrete values
    (docs/api.md, "Vocabulary-parallel output layers"). The protocol branches on the gathered
    headers on the host and raises from them on every rank, which no graph can hold; traced, its
    frames failed on a recompile (a SymFloat temperature in the header's struct.pack: Dynamo's
    RecursionError) and under fullgraph=True (functorch's wrapper probe). fullgraph=True now
    names the op and process_group= in Dynamo's error (the reason below)."""
    return torch.compiler.disable(fn, reason=(
        f"{op}(process_group=) runs eagerly, outside torch.compile's graph (its agreement protocol reads the "
        f"gathered headers on the host): a graph break, which fullgraph=True refuses; compile with fullgraph=False "
        f"or call {op} outside the compiled function"))


topk_logprobs_vocab_parallel = _eager_only(topk_logprobs_vocab_parallel, "topk_logprobs")
linear_logprob_vocab_parallel = _eager_only(linear_logprob_vocab_parallel, "linear_logprob")
# the ops' process_group= path (they find it here without importing this module: _backend)
_backend.register_process_group_impl("topk_logprobs", topk_logprobs_vocab_parallel)
_backend.register_process_group_impl("linear_logprob", linear_logprob_vocab_parallel)

__all__ = ["VocabShard", "Layout", "agree", "topk_logprobs_vocab_parallel", "linear_logprob_vocab_parallel"]
