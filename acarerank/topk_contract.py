"""The top-k contract shared by every top-k backend (docs/ARCHITECTURE.md, "Top-k stack").

A leaf: it imports only torch, so ``acarerank.ops`` (the ops) and ``acarerank.kernels`` (the
Triton core, which needs its k limit) both build on it without importing each other.

  * ``MAX_K``          the largest k of each backend (None: k <= V only)
  * ``DEFAULT_CHUNK``  vocabulary columns per GEMM when the caller passes chunk=None
  * ``TopKLogprobs``   the one result type
  * ``check_k``        k an int in [1, V] and within the backend's limit, the error naming both
  * ``logsumexp_of``   log Σ exp from a running (max, Σ exp(x − max)) pair
  * ``finalize``       core outputs -> ``TopKLogprobs``, the only finalize

The order used everywhere is (value descending, vocabulary id ascending): ties go to the
lower id. k limits: "torch" none (k <= V), "triton" 512 (the running top-K lives in
registers; at 1,024 every tile spills, see ``acarerank.kernels.topk_logprobs.gpu_tile_config``), "cpp"/"cuda" 4,096 (one row's keys in 32 KB of shared memory,
csrc/topk_merge.cuh kTopKMax). Chunk default (the cores' peak extra memory is one [T, chunk]
fp32 block): 2,048 on CPU, 16,384 on CUDA (wider GEMMs keep cuBLAS busy); the triton core
tiles on its own.
"""
from __future__ import annotations

import numbers
from collections import namedtuple
from typing import Optional

import torch

#: the largest k of each top-k backend (None: k <= V only); see the module docstring
MAX_K = {"torch": None, "native": None, "triton": 512, "cpp": 4096, "cuda": 4096}
TOPK_MAX_K = MAX_K["cpp"]  # the streaming state's limit (csrc kTopKMax)

#: vocabulary columns per GEMM when the caller passes chunk=None, per device type
DEFAULT_CHUNK = {"cpu": 2048, "cuda": 16384}

OUTSIDE_MODES = ("floor", "mask", "full")

TopKLogprobs = namedtuple("TopKLogprobs", ["target_logprob", "topk_ids", "topk_logprobs", "in_topk"])
TopKLogprobs.__doc__ = """The one top-k result type (T rows; log-probs of logits / temperature).

target_logprob [T] fp32 (None without targets), topk_ids [T,k] int64 best first (ties: lower
id first), topk_logprobs [T,k] fp32, in_topk [T] bool (None without targets)."""


def default_chunk(device) -> int:
    return DEFAULT_CHUNK.get(torch.device(device).type, DEFAULT_CHUNK["cpu"])


def as_int(k):
    """``int(k)`` for an integer that is not a bool (``numpy.int64(4)`` is 4, as everywhere in the
    API: ``acarerank._validate``); anything else unchanged, for ``check_k`` to name."""
    return int(k) if isinstance(k, numbers.Integral) and not isinstance(k, bool) else k


def check_k(k, V: Optional[int], backend: str, op: str) -> int:
    """k an int in [1, V] and within ``backend``'s limit (``MAX_K``); the error names both.
    Returns it as a Python int (numpy integers are ints here too)."""
    k = as_int(k)
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"{op}: k must be an int, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"{op}: k must be >= 1, got k={k}")
    if V is not None and k > V:
        raise ValueError(f"{op}: k must be <= V, got k={k} > the vocabulary size {V}")
    limit = MAX_K.get(backend)
    if limit is not None and k > limit:
        others = ", ".join(f"{b!r} (k <= {m})" if m else f"{b!r} (any k)" for b, m in MAX_K.items() if b != backend)
        raise ValueError(f"{op}: k must be <= {limit} with the {backend!r} backend, got k={k}; use {others}")
    return k


def logsumexp_of(row_max: torch.Tensor, row_sumexp: torch.Tensor) -> torch.Tensor:
    """[T] fp32 log Σ exp(x) = max + log Σ exp(x − max), from the running pair (max fp32,
    Σ exp fp64) that the streaming cores keep; summed in fp64, rounded once."""
    return (row_max.double() + row_sumexp.log()).float()


def finalize(topk_logits, topk_ids, target_logit, lse, targets, outside: str = "floor", floor: float = -20.0,
             renormalize: bool = True) -> TopKLogprobs:
    """The one finalize: core outputs -> TopKLogprobs (formulas in topk_logprobs' docstring).

    renormalize: top-k log-probs over the top-k (True) or over the vocabulary (lse). A target
    outside the top-k gets ``floor`` ("floor"), 0 ("mask") or its full-softmax log-prob
    ("full"). ``targets`` None: target_logprob and in_topk are None.
    """
    # fp64, rounded once to fp32 at the end: a log-prob of −25 has an fp32 ulp of 2e-6
    vals, lse64 = topk_logits.double(), lse.double()
    norm = torch.logsumexp(vals, dim=1) if renormalize else lse64
    topk_lp = (vals - norm[:, None]).float()
    if targets is None:
        return TopKLogprobs(None, topk_ids, topk_lp, None)
    tg = targets.to(torch.int64)
    in_topk = (topk_ids == tg[:, None]).any(dim=1)
    inside = target_logit.double() - norm  # same value as the target's top-k entry (same logit, same norm)
    if outside == "floor":
        out = torch.full_like(inside, float(floor))
    elif outside == "mask":
        out = torch.zeros_like(inside)
    else:  # "full"
        out = target_logit.double() - lse64
    return TopKLogprobs(torch.where(in_topk, inside, out).float(), topk_ids, topk_lp, in_topk)


__all__ = ["MAX_K", "TOPK_MAX_K", "DEFAULT_CHUNK", "OUTSIDE_MODES", "TopKLogprobs", "default_chunk", "check_k",
           "logsumexp_of", "finalize"]
