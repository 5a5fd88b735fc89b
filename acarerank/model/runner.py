"""Qwen3 decoder forward over packed, grouped, prefix-shared batches (docs/ARCHITECTURE.md, "Data flow").

A *group* owns a prefix whose K/V sit in pages of a ``PagedKVCache``; a *segment* is a run of new
tokens of one group. ``forward`` runs all segments of all groups in one packed pass:
every linear layer is one GEMM over all T segment tokens (no padding), and attention is
the one op ``prefix_shared_attention_paged`` (each segment sees all of its group's cache and
itself causally, never another segment). Positions are those of the unshared sequence:
segment tokens of group g start at the group's cache length P_g.

Prefill is the same pass with an empty cache and ``append=True``; so are chunked prefill
and greedy decoding (one-token segments).

KV storage: ``prefill`` returns a ``PagedKVCache`` — block tables over a ``BlockPool`` of
``[num_blocks, block_size, Hkv, d]`` pages per layer — and appending writes only the new rows
into pages (a decode step never re-packs the cache). The attention metadata (work list,
block lookups) is planned once per pass and reused by every layer. A caller that keeps KV
across calls (the prefix cache of ``PointwiseReranker``) passes its own pool-backed cache to
``extend``/``forward``; ``forward_segments`` packs segments over prefixes that callers hold
in pages (a reranker's pinned shared parts) into passes of at most ``max_batch_tokens``.

Plan once per batch: ``_forward`` builds one attention plan (work list / block lookups / host
metadata) and every layer runs attention with it; host<->device syncs per forward are those
of the plan (see ``acarerank.ops.attention`` and ``acarerank.ops.paged_attention``).
"""
from __future__ import annotations

import math
import warnings
import weakref
from typing import Iterator, Optional, Sequence

import torch

from .. import _fork
from .._validate import positive_int
from ..ops import backend_choice, backend_for, per_op_backends, prefix_shared_attention_paged
from ..ops.paged_attention import check_block_size
from ..ops._backend import _env_preference
from ..ops.gate_up_silu import resolve_gate_up_backend
from ..ops.linear import linear, resolve_linear_backend
from ..ops.rms_norm import OP_RMS_NORM
from .block_pool import BlockPool
from .layer_ops import CompiledLayers, OpsLayers, resolve_layer_backends
from .linear_weights import weights_for_linear
from .numerics import NonFiniteHiddenError, check_scorable
from .paged_cache import PagedKVCache
from .weights import Qwen3Weights, load_checkpoint, weights_from_hf


# Rows per GEMM in batch-invariant mode. BLAS (and cuBLAS) pick a different kernel for a
# different number of rows (on 2-core x86 MKL: M in {1,2,3,5,7} differ bit-wise from M=64),
# so a row's result depends on its batch. Feeding every GEMM exactly this many rows (the last
# tile zero-padded) makes a token's hidden state a function of that token's inputs alone —
# with either linear backend: oneDNN on a packed weight runs one kernel for one shape too
# (tests/model/test_linear_runner.py checks a row's result at every position of the tile).
INVARIANT_ROWS = 64


def not_picklable(name: str) -> str:
    """The message of the TypeError that pickling or deep-copying a reranker or runner raises."""
    return (f"a {name} cannot be pickled or deep-copied: it holds packed weights, KV pages and locks of this "
            "process. Build one in each process (from_pretrained(path) or model=; with multiprocessing's "
            "'spawn' or 'forkserver', pass the checkpoint path, not the object); a 'fork' child inherits the "
            "parent's (docs/api.md, \"Embedding in your process\")")


class ContextLengthError(ValueError):
    """A sequence (prompt, plus the tokens generated after it) longer than the model's positions
    (``Qwen3Arch.max_positions``, from ``max_position_embeddings``): past them RoPE rotates by
    angles the model was never trained on and the output is plausible and wrong, so it is refused,
    as vLLM refuses a request past its ``max_model_len`` (docs/input-safety.md, "Positions")."""


def position_limit_error(what: str, tokens: int, limit: int, how: str = "") -> ContextLengthError:
    """The one message for a sequence of ``tokens`` past ``limit`` positions: ``what`` names it
    (a document, a prompt and its new tokens, a flag), ``how`` says what to lower."""
    return ContextLengthError(f"{what} is {tokens:,} tokens, more than the model's maximum context length of "
                              f"{limit:,} tokens (from its max_position_embeddings: positions past it are not "
                              f"ones the model was trained on){'; ' + how if how else ''}")


class SourceModelChangedError(RuntimeError):
    """The in-memory model a runner was built from (``Qwen3Runner.from_hf``) changed in place
    after the build (an optimizer step, ``load_state_dict``, an edit under ``torch.no_grad``) in a
    tensor the runner shares with it."""


class _SourceWatch:
    """Weak references to the model tensors a runner shares (the same storage) and their
    version counters at build time.

    ``from_hf`` shares some of the model's tensors (norms, embedding, lm_head) and packs others
    into the runner's own form, so after an in-place change of the model a pass would mix old
    and new weights (a snapshot π_old that is neither θ_old nor θ), with no error. torch bumps a
    tensor's ``_version`` on every in-place write, an optimizer step's included. Only tensors
    still in the storage the runner holds are compared: ``model.to(dtype)`` (or ``param.data =``)
    gives a Parameter new storage and leaves the runner's untouched, so a later edit of it changes
    nothing the runner reads (the Parameter object, and its version counter, are the same).
    The runner keeps each shared storage alive, so no other tensor can take its address. Weak:
    the runner does not keep a model alive that its caller dropped (a dropped model cannot change).
    """

    def __init__(self, model, weights: Qwen3Weights):
        shared = {_storage_ptr(t) for t in _tensors_of(weights)} - {None}
        self._refs = [(name, weakref.ref(t), ptr, t._version, *_samples(t))
                      for name, t in model.state_dict(keep_vars=True).items()
                      if (ptr := _storage_ptr(t)) in shared]

    def check(self) -> None:
        for name, ref, ptr, version, where, bits in self._refs:
            t = ref()
            if t is None or _storage_ptr(t) != ptr:
                continue
            # a write through .data (p.data.copy_(new), an EMA's p.data.mul_(d)) bumps no version
            # counter of p's: a few elements' bits, compared, catch a write to most of the tensor
            if t._version != version or not torch.equal(_bits(t.detach()[where]), bits):
                raise SourceModelChangedError(
                    f"the model this runner was built from changed in place after Qwen3Runner.from_hf ({name!r}: an "
                    f"optimizer step, load_state_dict, a write through .data or an edit): the runner holds its own "
                    f"packed copy of some matrices and shares the others, so a pass would mix old and new weights. "
                    f"Build a new runner from the model as it is now (ATO: a snapshot per update), or from a copy "
                    f"(copy.deepcopy(model)) to keep the old weights")


#: elements of each shared tensor whose bits ``_SourceWatch`` compares before a pass (first, last, and
#: evenly between): ~5 µs a tensor, 0.6 ms a pass at the 0.6B shape's 115 shared tensors (Zen 4, 2026-12-07)
_SAMPLES = 8


def _samples(t: torch.Tensor) -> tuple:
    """(index, bits): ``_SAMPLES`` positions of ``t`` spread over its elements (an index tuple, for
    any strides: no copy of a strided tensor) and their values' bits as now."""
    k = min(_SAMPLES, t.numel())
    flat = torch.arange(k) * (t.numel() - 1) // max(k - 1, 1)   # integers: linspace's fp32 wrapped past 2²⁴
    where = torch.unravel_index(flat, t.shape)
    return where, _bits(t.detach()[where]).clone()


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed as integers of its size: NaN equals NaN, -0.0 differs from 0.0."""
    size = x.element_size()
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]) if size <= 8 \
        else x.view(torch.int64)   # complex128: two words an element


def _gate_up_backend(backend, weights: Qwen3Weights) -> str:
    """The MLP's gate/up backend (``acarerank.ops.gate_up_silu``) for these weights: "native" (AMX
    tiles, SiLU·up fused; ``w_gate_up`` packed for it) or "torch" (linear + silu_and_mul)."""
    a = weights.arch
    return resolve_gate_up_backend(backend, weights.device, weights.dtype, a.hidden_size, a.intermediate_size)


def _storage_ptr(t) -> Optional[int]:
    """The address of a dense tensor's storage (None for an empty one, or a packed weight, which
    is the runner's own)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.numel() == 0:
        return None
    return t.untyped_storage().data_ptr()


def _tensors_of(weights: Qwen3Weights):
    """Every tensor the runner computes with (packed weights included; ``_storage_ptr`` skips them)."""
    yield from (weights.embed, weights.final_norm, weights.lm_head, weights.score_head)
    for layer in weights.layers:
        yield from vars(layer).values()


def _linear_fixed_tiles(x: torch.Tensor, w, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    T = x.shape[0]
    pad = (-T) % INVARIANT_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = torch.cat([linear(x[i:i + INVARIANT_ROWS], w, b) for i in range(0, x.shape[0], INVARIANT_ROWS)])
    return out[:T]


def autocast_off(device: torch.device):
    """A region where a caller's ``torch.autocast`` does not apply on ``device``: the model computes
    in its weights' dtype wherever it is called from. Autocast is per thread, so a pass run inside
    a bf16 autocast region (a training loop's) had its fp32 GEMMs in bf16 — scores off by ~2e-3
    from the same call elsewhere, or, on the torch attention backend, a ValueError about the plan's
    dtype (docs/api.md, "Threads")."""
    return torch.autocast(device.type, enabled=False)


#: tokens per KV page of the runner's caches (a power of two, 16..256): the prefix cache
#: reuses whole pages only, so small pages lose at most 15 tokens of a hit
DEFAULT_BLOCK_SIZE = 16

#: prefill rows per pass by device type when the caller gives none (``Qwen3Runner(prefill_chunk=)``).
#: On CPU a 2,048-row pass keeps each layer's outputs (bf16 at the 0.6B shape: QKV 16 MB, gate/up
#: 25 MB) under glibc's 32 MB mmap ceiling, so they come back from the heap in the next layer
#: instead of as fresh, faulting pages: a bf16 setwise selection's prompt of 5,291 tokens took
#: 10.05–10.45 s against 10.65–10.93 s in 4,096-row passes, 11,684 tokens 1.5–2 % less, fp32 a few
#: % less, the same selections and peak RSS (docs/cpu.md, "Memory between passes"); pointwise
#: passes are 2,048 segment tokens on CPU already (``pointwise.DEFAULT_BATCH_TOKENS``).
DEFAULT_PREFILL_CHUNK = {"cpu": 2048, "cuda": 4096}


class Qwen3Runner:
    """Runs a Qwen3 decoder over prefix-shared batches; holds no per-request state."""

    def __init__(self, weights: Qwen3Weights, backend=None, prefill_chunk: Optional[int] = None,
                 batch_invariant: bool = False, compile_layers: bool = False,
                 block_size: int = DEFAULT_BLOCK_SIZE):
        """
        Args:
          weights: see ``Qwen3Weights``; backend: a backend preference (a name, or a per-op
            mapping) of which the attention op's part is used (``acarerank.ops.backend_for``);
            None = ACARERANK_BACKEND / device default.
          prefill_chunk: prefix tokens per group per prefill chunk, and rows per prefill pass:
            several groups' chunks share a pass up to this many rows (``extend``); None: by
            device type, ``DEFAULT_PREFILL_CHUNK`` (CPU 2,048, CUDA 4,096).
          batch_invariant: run every GEMM on fixed tiles of ``INVARIANT_ROWS`` rows, so a
            segment's output is bitwise independent of the other segments in its batch, and start
            every prefill pass at a multiple of ``prefix_align`` tokens, so it is independent of
            what the prefix cache held too (with a batch-invariant attention backend: "triton" or
            "native", which then runs every group on its tile path, never its decode-like direct
            path, whose bits differ: ``tiles_only``). Costs some speed (and up to
            ``prefix_align`` − 1 tokens of each cache hit, native: 512 − 1); off by default.
          compile_layers: fuse the element-wise work around the GEMMs with torch.compile
            (``layer_blocks``; the first pass compiles, ~tens of seconds) instead of running the
            layer's element-wise ops (``layer_ops.OpsLayers``: the native CPU kernels when
            ``acarerank._cpu`` is built, else the torch references; a preference for
            "rms_norm" / "fused_add_rms_norm" / "qk_norm_rope" / "silu_and_mul" picks them).
            Off by default; ignored in batch-invariant mode.
          block_size: tokens per KV page of the caches ``prefill`` and ``new_pool`` make.

        The linear layers' backend ("linear" in a preference; ``acarerank.ops.linear``) is chosen
        here, once: on CPU "onednn" where oneDNN can reorder weights of this dtype, else "torch"
        (``linear_fallback`` holds the reason). With "onednn" ``self.weights`` holds the four
        layer matrices packed, never beside their dense copies; ``weights`` itself is not
        modified (a caller that keeps it keeps its dense matrices: ``from_pretrained`` and
        ``from_hf`` hand theirs over and pack them one at a time). The same packed matrices serve
        every mode (eager, ``batch_invariant``, ``compile_layers``). The MLP's gate/up matrix is
        packed for ``acarerank.ops.gate_up_silu`` instead where its AMX kernel takes it (bf16,
        AMX tiles; ``gate_up_backend`` "native"; ``{"gate_up_silu": "torch"}`` keeps it unfused).
        """
        _fork.enter("Qwen3Runner")  # a forked child's stale OpenMP pool: an error, not a hang
        self.compile_layers = compile_layers
        self.batch_invariant = batch_invariant
        self.arch = weights.arch
        per_op_backends(backend)  # a bad preference fails here, by name
        self.backend = backend
        # the layer's element-wise ops: native CPU kernels when built, else the torch references
        self._layer_backends = resolve_layer_backends(backend, weights.device, weights.dtype, weights.arch.head_dim)
        self.linear_backend, self.linear_fallback = resolve_linear_backend(backend, weights.device, weights.dtype)
        self.gate_up_backend = _gate_up_backend(backend, weights)
        self.weights = weights_for_linear(weights, self.linear_backend, fused=self._fused_fields())
        if prefill_chunk is None:
            prefill_chunk = DEFAULT_PREFILL_CHUNK.get(weights.device.type, DEFAULT_PREFILL_CHUNK["cuda"])
        self.prefill_chunk = positive_int("prefill_chunk", prefill_chunk)
        # refused here, by name: it was taken and refused at the first pass, by the attention op
        self.block_size = check_block_size(block_size)
        if batch_invariant and (attention := self._attention_backend()) not in ("triton", "native"):
            # the GEMMs alone are fixed-tile: a cache hit or another prefill chunking moves a
            # shared-part token's attention tiles (docs/ARCHITECTURE.md, "Linear layers": Modes)
            warnings.warn(f"batch_invariant=True with the {attention!r} attention backend: the GEMMs run on fixed "
                          "tiles, but this attention claims no invariance, so a score may move in its last bits "
                          "with a prefix-cache hit or the prefill's chunks; the 'triton' and 'native' attention "
                          "backends hold the whole promise (docs/ARCHITECTURE.md, \"Linear layers\": Modes)",
                          stacklevel=2)
        self._source: Optional[_SourceWatch] = None  # from_hf's model, checked before each pass
        self._prefix_align: Optional[int] = None  # prefix_align, resolved on first use
        a = self.arch
        # [d/2] fp32, and the factor both tables are scaled by (YaRN's; 1 otherwise): rope.py
        self._inv_freq = a.rope.inv_freq(a.rope_theta, a.head_dim, self.device)
        self._rope_scale = a.rope.attention_factor

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_hf(cls, model, backend: Optional[str] = None, **kw) -> "Qwen3Runner":
        """From an in-memory transformers Qwen3 model (its tensors are shared where the layouts
        agree and never modified; packed matrices are the runner's own). The runner stands for
        the model as it is now: a pass after the model changed in place where the runner shares its
        tensors (an optimizer step) is a ``SourceModelChangedError``; build a new runner then
        (docs/api.md, "ATO re-scoring")."""
        _fork.enter("Qwen3Runner.from_hf")
        runner = cls._owning(weights_from_hf(model), backend, kw)
        runner._source = _SourceWatch(model, runner.weights)
        return runner

    @classmethod
    def from_pretrained(cls, path: str, dtype=torch.float32, device="cpu", backend: Optional[str] = None, **kw):
        _fork.enter("Qwen3Runner.from_pretrained")
        return cls._owning(load_checkpoint(path, dtype=dtype, device=device), backend, kw)

    @classmethod
    def _owning(cls, weights: Qwen3Weights, backend, kw: dict) -> "Qwen3Runner":
        """A runner over weights nobody else holds: their matrices are packed in place, each dense
        one freed as soon as its packed form exists (peak: the model + one matrix, not two models)."""
        per_op_backends(backend)
        fused = ("w_gate_up",) if _gate_up_backend(backend, weights) == "native" else ()
        weights_for_linear(weights, resolve_linear_backend(backend, weights.device, weights.dtype)[0], in_place=True,
                           fused=fused)
        return cls(weights, backend=backend, **kw)

    def __reduce_ex__(self, protocol):
        # as RerankerBase.__reduce_ex__: a clear TypeError, not torch's NotImplementedError about
        # the packed weights' OpaqueTensorImpl
        raise TypeError(not_picklable(type(self).__name__))

    def __copy__(self):
        """copy.copy: a second runner object over the same weights (shallow, as before)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def with_settings(self, **changes) -> "Qwen3Runner":
        """A runner over the same weights with some constructor settings changed (``backend``,
        ``batch_invariant``, ``compile_layers``, ``prefill_chunk``, ``block_size``); this one is
        not modified. The weight tensors are shared when the new linear backend is this one's;
        otherwise the copy holds its own form of the four layer matrices."""
        settings = dict(backend=self.backend, prefill_chunk=self.prefill_chunk, batch_invariant=self.batch_invariant,
                        compile_layers=self.compile_layers, block_size=self.block_size)
        unknown = set(changes) - set(settings)
        if unknown:
            raise TypeError(f"with_settings: unknown setting(s) {sorted(unknown)}; known: {sorted(settings)}")
        settings.update(changes)
        new = type(self)(self.weights, **settings)
        new._source = self._source
        return new

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.dtype

    @property
    def max_positions(self) -> int:
        """The model's maximum context length in tokens (``Qwen3Arch.max_positions``: the config's
        ``max_position_embeddings``, scaled by its RoPE): no pass computes a position at or past it."""
        return self.arch.max_positions

    def _fused_fields(self) -> tuple:
        """The layer matrices packed for an AMX kernel of ours (``linear_weights.FUSED_FORMS``)."""
        return ("w_gate_up",) if self.gate_up_backend == "native" else ()

    def _attention_backend(self) -> str:
        """The name of the backend the paged attention op runs on for this runner."""
        from ..ops import cpu_attention, paged_attention

        return cpu_attention.resolve(paged_attention.OP, self._paged_attention_preference(), self.device,
                                     self.arch.head_dim)

    def _paged_attention_preference(self):
        """The paged attention op's ``backend=``: a preference's entry for it, else for the packed op
        (the two take the same backends), else the default — the runner's preference, or where it
        has none ``ACARERANK_BACKEND``'s (``ACARERANK_BACKEND=attention=torch`` reached the packed op's
        name only, and the runner's attention stayed native)."""
        pref = self.backend if self.backend is not None else _env_preference()
        if pref is None:
            return None
        return backend_for("prefix_shared_attention_paged", pref) or backend_choice("prefix_shared_attention", pref)

    @property
    def prefix_align(self) -> int:
        """Tokens at a multiple of which every prefill pass starts in batch-invariant mode: a
        prefix-cache hit is cut down to it and prefill chunks are multiples of it
        (``acarerank.model.cached_prefill``), so each token of a shared part is computed over a
        prefix that ends where its tiles do and gets the same bits as in one prefill of the whole
        part — whatever was cached, whatever the pass's chunks (docs/ARCHITECTURE.md, "Linear
        layers": Modes). The attention's ``aligned_prefix_tokens`` at this model's heads and
        dtype (Triton's; the native kernel's key tile, 512), in whole pages. 1 (no constraint)
        without ``batch_invariant`` or with another attention backend, which claims no
        invariance."""
        if self._prefix_align is None:
            align = 1
            if self.batch_invariant:
                a = self.arch
                attention = self._attention_backend()
                if attention == "triton":
                    from ..kernels.prefix_shared_attention import aligned_prefix_tokens

                    align = math.lcm(aligned_prefix_tokens(a.head_dim, a.num_heads // a.num_kv_heads, self.dtype,
                                                           self.device), self.block_size)
                elif attention == "native":
                    from ..ops.cpu_attention import aligned_prefix_tokens as native_aligned_prefix_tokens

                    align = math.lcm(native_aligned_prefix_tokens(), self.block_size)
            self._prefix_align = align
        return self._prefix_align

    @property
    def device(self) -> torch.device:
        return self.weights.device

    @property
    def lm_head(self) -> torch.Tensor:
        if self.weights.lm_head is None:
            raise ValueError("this model is a sequence-classification reranker (score.weight): it has no "
                             "language-model head to generate or compute token log-probs with")
        return self.weights.lm_head

    @property
    def final_norm_weight(self) -> torch.Tensor:
        return self.weights.final_norm

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        norm = OP_RMS_NORM.impl(self._layer_backends["rms_norm"])
        return norm(hidden.contiguous(), self.weights.final_norm, self.arch.rms_norm_eps)

    def logits(self, hidden: torch.Tensor, head: Optional[torch.Tensor] = None) -> torch.Tensor:
        """fp32 [N, V] next-token logits for a few rows: final norm, then lm_head [V, H] (or
        ``head`` [K, H], some of its rows: [N, K]), in the weights' dtype.

        In batch-invariant mode the rows go in fixed tiles of ``INVARIANT_ROWS`` (zero-padded), as
        every GEMM of the layers (``_linear_fixed_tiles``): a GEMM picks its kernel and blocking by
        the rows beside a row (fp32 on CPU: 1, 3 and 5 rows gave a row other bits), so a prompt's
        logits followed the prompts decoded with it. The head is read once per tile, not once per
        row (free decoding over the whole vocabulary: 310 MB of bf16 lm_head at the 0.6B shape)."""
        W = self.lm_head if head is None else head
        with autocast_off(self.device):
            x = self.final_norm(hidden)
            if not self.batch_invariant:
                return (x @ W.T).float()
            N = x.shape[0]
            x = torch.cat([x, x.new_zeros((-N) % INVARIANT_ROWS, x.shape[1])])
            return torch.cat([x[i:i + INVARIANT_ROWS] @ W.T for i in range(0, x.shape[0], INVARIANT_ROWS)])[:N].float()

    # -- public passes ------------------------------------------------------------------
    def new_pool(self, num_blocks: int, growable: bool = False) -> BlockPool:
        """KV pages for every layer of this model (``num_blocks`` × ``block_size`` tokens)."""
        a = self.arch
        return BlockPool(a.num_layers, num_blocks, self.block_size, a.num_kv_heads, a.head_dim, self.dtype,
                         self.device, growable=growable)

    @torch.inference_mode()
    def prefill(self, prefixes: Sequence, chunk_tokens: Optional[int] = None,
                reserve_tokens: int = 1) -> PagedKVCache:
        """Compute every group's prefix once; returns their paged cache (a private, growable pool).

        prefixes: one token-id list / 1-D LongTensor per group (may be empty). Long
        prefixes go in chunks of ``chunk_tokens``, the groups' chunks in passes of at most
        ``chunk_tokens`` rows (one group's chunk alone where it is longer: ``extend``), so
        neither a 16k-token prompt nor 8 of them ever need more than a chunk of activations
        at once. The pool has room
        for ``reserve_tokens`` more tokens per group (a decode loop's), beyond which it grows by
        doubling, copying every page once (setwise decoding of 8 pool-20 prompts at the default
        shape: 255 ms, a quarter of its decode loop, and twice the cache's memory).
        """
        ids = [self._as_ids(p, f"prefix {g}", allow_empty=True) for g, p in enumerate(prefixes)]
        reserve_tokens = positive_int("reserve_tokens", reserve_tokens)
        bs = self.block_size
        cache = PagedKVCache(self.new_pool(sum(-(-(t.numel() + reserve_tokens) // bs) for t in ids), growable=True))
        for _ in ids:
            cache.add_group()
        self.extend(cache, list(range(len(ids))), ids, chunk_tokens)
        return cache

    @torch.inference_mode()
    def extend(self, cache, groups: Sequence[int], tokens: Sequence, chunk_tokens: Optional[int] = None) -> None:
        """Append ``tokens[i]`` (computed over the cache) to group ``groups[i]``, in chunks.

        The chunked prefill of ``prefill``, for a cache that already holds part of each prefix
        (a prefix-cache hit): only the new tokens are computed. Each group's tokens go in chunks of
        ``chunk_tokens`` (default ``prefill_chunk``), and the groups' chunks in packed passes of at most
        ``chunk_tokens`` rows, a group's chunk never split. In batch-invariant mode the chunk
        is a multiple of ``prefix_align`` (and the caller's cached lengths are: ``prefill_cached``).
        """
        chunk = chunk_tokens or self.prefill_chunk
        align = self.prefix_align  # batch-invariant mode: every chunk starts at a multiple of it
        chunk = max(align, chunk - chunk % align)
        ids = [self._as_ids(p, f"prefix {g}", allow_empty=True) for g, p in zip(groups, tokens)]
        if len(set(groups)) != len(groups):
            raise ValueError("extend: at most one token run per group")
        start = 0
        while True:
            pieces = [(g, t[start:start + chunk]) for g, t in zip(groups, ids) if t.numel() > start]
            if not pieces:
                return
            # one pass holds about ``chunk`` rows, not ``chunk`` per group: 8 groups' chunks packed
            # made passes of 32k rows whose activations (hundreds of MB) the element-wise ops
            # streamed through memory, 10-15 % slower a row and +700 MB (docs/ARCHITECTURE.md,
            # "Prefix cache"); a group's piece is never split, so its passes start where they did
            for run in bounded_runs(pieces, chunk, lambda p: p[1].numel()):
                self._forward(cache, [p for _, p in run], [g for g, _ in run], output="none", append=True)
            start += chunk

    @torch.inference_mode()
    def forward(self, cache: PagedKVCache, segments: Sequence, segment_group: Sequence[int], output: str = "last",
                append: bool = False) -> Optional[torch.Tensor]:
        """One packed pass of all segments over their groups' caches.

        segments: token-id lists / 1-D LongTensors; segment_group: the group of each.
        output: "last" -> [S, H] hidden state (before the final norm) at each segment's last
                token; "all" -> [T, H] every token, packed in segment order; "none" -> None.
                A "last" row that is NaN/inf or too large for the final RMSNorm raises
                ``NonFiniteHiddenError`` (``acarerank.model.numerics``) instead of being returned.
        append: append each segment's K/V to its group's cache (≤ one segment per group).
        """
        if output not in ("last", "all", "none"):
            raise ValueError(f"output must be 'last', 'all' or 'none', got {output!r}")
        if len(segments) != len(segment_group):
            raise ValueError(f"{len(segments)} segments but {len(segment_group)} segment_group entries")
        ids = [self._as_ids(s, f"segment {i}", allow_empty=output != "last") for i, s in enumerate(segments)]
        groups = [int(g) for g in segment_group]
        bad = [g for g in groups if not 0 <= g < cache.num_groups]
        if bad:
            raise ValueError(f"segment_group value {bad[0]} is outside the cache's {cache.num_groups} groups")
        if append and len(set(groups)) != len(groups):
            raise ValueError("append=True needs at most one segment per group")
        return self._forward(cache, ids, groups, output, append)

    def forward_segments(self, items: Sequence, max_batch_tokens: int) -> Iterator[tuple]:
        """The packed passes over prefixes that callers hold in pages.

        items: ``(prefix, segment ids)`` pairs; a prefix is any object with ``pool`` (its
        ``BlockPool``), ``blocks`` (block ids, in order) and ``length`` (tokens) — e.g. a
        ``PointwiseReranker`` ``PrefixHandle`` — and several items may share one. Items whose
        prefixes live in the same pool run in consecutive passes of at most ``max_batch_tokens``
        segment tokens (a longer single segment runs alone), each over a cache of that pass's
        prefixes only: the attention reads (and the torch backend gathers) every group of its
        cache, so a deep batch must not carry all of its prefixes into every pass.

        Yields, per pass, (item indices, hidden [n, H] at each segment's last token, before the
        final norm). The caller keeps the prefixes' pages alive; the pass's cache is freed. A
        hidden state that cannot be scored raises ``NonFiniteHiddenError`` whose ``rows`` are the
        item indices (not rows of the pass).
        """
        by_pool: dict = {}
        for n, (prefix, ids) in enumerate(items):
            by_pool.setdefault(id(prefix.pool), []).append((n, prefix, ids))
        for entries in by_pool.values():
            for run in bounded_runs(entries, max_batch_tokens, lambda e: len(e[2])):  # e: (index, prefix, ids)
                cache = PagedKVCache(run[0][1].pool)
                group_of: dict = {}
                try:
                    for _, prefix, _ in run:
                        if id(prefix) not in group_of:
                            group_of[id(prefix)] = cache.add_group(prefix.blocks, prefix.length)
                    hidden = self.forward(cache, [ids for _, _, ids in run],
                                          [group_of[id(prefix)] for _, prefix, _ in run], output="last")
                except NonFiniteHiddenError as e:
                    items = [run[i][0] for i in e.rows]
                    raise NonFiniteHiddenError(f"item(s) {items[:5]}{f' ({len(items)} in all)' if len(items) > 5 else ''}"
                                               f": {e}", items) from None
                finally:
                    cache.free()
                yield [n for n, _, _ in run], hidden

    # -- internals ----------------------------------------------------------------------
    def _as_ids(self, x, what: str, allow_empty: bool) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            t = x
        else:
            # the dtype is inferred, not forced: as_tensor(..., dtype=long) would truncate 1.7 to
            # token 1 and read True as token 1 without a word
            vals = list(x)
            try:
                # on the host whatever the caller's default device (docs/api.md, "Threads")
                t = torch.as_tensor(vals, device="cpu") if vals else torch.empty(0, dtype=torch.long, device="cpu")
            except (TypeError, ValueError, RuntimeError) as e:
                raise TypeError(f"{what}: token ids must be a 1-D integer sequence ({e})") from None
        integer = not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
        if t.dim() != 1 or not integer:
            raise TypeError(f"{what}: token ids must be a 1-D integer sequence, got {t.dtype} shape {tuple(t.shape)}")
        t = t.long()  # before the range check: min/max do not take every integer width
        if t.numel() == 0 and not allow_empty:
            raise ValueError(f"{what} is empty; output='last' needs at least one token per segment")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.arch.vocab_size):
            raise ValueError(f"{what}: token id out of range [0, {self.arch.vocab_size})")
        return t.to(device=self.device, dtype=torch.long)

    def _rope(self, positions: torch.Tensor):
        """fp32 [T, d] cos, sin at ``positions`` (the layers cast them once per pass if they need to):
        cos(cat(p·f, p·f))·s, sin(...)·s, f the config's inverse frequencies, s its attention factor."""
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        if self._rope_scale == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self._rope_scale, emb.sin() * self._rope_scale

    def _forward(self, cache: PagedKVCache, ids: list, groups: list, output: str, append: bool):
        _fork.enter("a model pass")  # every pass of every reranker comes here first
        # the last line of defence: the callers refuse a too-long input where it is set, by name
        for g, t in zip(groups, ids):
            if cache.lengths[g] + t.numel() > self.arch.max_positions:
                raise position_limit_error(f"group {g}'s sequence ({cache.lengths[g]:,} cached + {t.numel():,} new)",
                                           cache.lengths[g] + t.numel(), self.arch.max_positions)
        if self._source is not None:
            self._source.check()
        with autocast_off(self.device):
            return self._pass(cache, ids, groups, output, append)

    def _pass(self, cache: PagedKVCache, ids: list, groups: list, output: str, append: bool):
        a, W = self.arch, self.weights
        dev = self.device
        lens = [t.numel() for t in ids]
        T = sum(lens)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=dev)
        seg_group = torch.tensor(groups, dtype=torch.int32, device=dev)
        positions = torch.cat([torch.arange(cache.lengths[g], cache.lengths[g] + n, device=dev)
                               for g, n in zip(groups, lens)]) if T else torch.zeros(0, dtype=torch.long, device=dev)
        cos, sin = self._rope(positions)
        last = torch.tensor([c - 1 for c in cu[1:]], dtype=torch.long, device=dev)

        Hq, Hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        # pages for the appended rows first (copy-on-write may change a table), then one plan for
        # every layer; the paged op follows a preference given for the packed one (same backends)
        slots = cache.reserve(groups, lens).to(dev) if append else None
        plan = cache.plan(cu_seqlens, seg_group, Hq, Hkv, d, self.dtype,
                          self._paged_attention_preference(), num_tokens=T)
        linear_fn = _linear_fixed_tiles if self.batch_invariant else linear
        x = W.embed[torch.cat(ids)] if T else W.embed.new_zeros(0, a.hidden_size)
        # the element-wise work around the GEMMs: the layer ops (native kernels or torch references),
        # or fused by torch.compile (layer_ops.py)
        if self.compile_layers and not self.batch_invariant:
            layers = CompiledLayers(a, linear_fn, cos, sin, self.dtype)
        else:
            layers = OpsLayers(self._layer_backends, a, linear_fn, cos, sin, self.dtype)
        layers.begin(x)
        # the new rows go into their pages inside qk_norm_rope where the layers can (OpsLayers on the
        # native kernel: one pass, docs/ARCHITECTURE.md "Native CPU ops around attention"), else here
        fused_write = append and layers.writes_pages
        for i, L in enumerate(W.layers):
            k_pages, v_pages = cache.pages(i)
            q, k, v = layers.attn_in(L, (k_pages, v_pages, slots) if fused_write else None)
            if append and not fused_write:
                cache.write(i, slots, k, v)  # the new rows only; this layer attends to them as k, v
            is_last_layer = i == len(W.layers) - 1
            if is_last_layer and output == "none":
                break  # the last layer's output feeds nothing that is asked for
            # batch-invariant: the native kernel's tile path for every group (its direct path, taken
            # for a group of a few rows, rounds otherwise: a token's bits would follow its group's size)
            attn = prefix_shared_attention_paged(q, k, v, cu_seqlens, k_pages, v_pages,
                                                 plan.block_table, plan.prefix_lens, seg_group, plan=plan,
                                                 validate=False, tiles_only=self.batch_invariant).reshape(T, Hq * d)
            if is_last_layer and output == "last":
                layers.select(last)  # only the rows asked for go through o_proj and the MLP
                attn = attn[last]
            layers.attn_out_mlp(attn, L)
        hidden = None if output == "none" else layers.end()
        if output == "last":
            check_scorable(hidden)  # every score and next token comes from these rows (numerics.py)
        # committed last: a pass that raises leaves its rows reserved, not committed, so a retry
        # writes them again (committed before the checks, a decode step that then failed was fed
        # its token twice on retry)
        if append:
            cache.commit(groups, lens)
        return hidden


def bounded_runs(items, max_total: int, size):
    """Consecutive runs of ``items`` whose ``size(item)`` add up to at most ``max_total`` each
    (>= 1 item per run, so one item over the bound is a run of its own)."""
    run, used = [], 0
    for entry in items:
        n = size(entry)
        if run and used + n > max_total:
            yield run
            run, used = [], 0
        run.append(entry)
        used += n
    if run:
        yield run
