"""Qwen3 decoder forward over packed, grouped, prefix-shared batches (docs/ARCHITECTURE.md, "Data flow").

A *group* owns a prefix whose K/V sit in a ``KVCache``; a *segment* is a run of new
tokens of one group. ``forward`` runs all segments of all groups in one packed pass:
every linear layer is one GEMM over all T segment tokens (no padding), and attention is
the one op ``prefix_shared_attention`` (each segment sees all of its group's cache and
itself causally, never another segment). Positions are those of the unshared sequence:
segment tokens of group g start at the group's cache length P_g.

Prefill is the same pass with an empty cache and ``append=True``; so are chunked prefill
and greedy decoding (one-token segments).

Plan once per batch: ``_forward`` builds one ``AttentionPlan`` (work list / host metadata)
and every layer runs attention with it; host<->device syncs per forward are those of the
plan (0 with the Triton backend, 1 with torch; see ``acarerank.ops.attention``) plus one in
``_append`` when the cache grows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ..ops import backend_for, per_op_backends, plan_prefix_shared_attention, prefix_shared_attention
from . import layer_blocks
from .arch import Qwen3Arch
from .weights import Qwen3Weights, load_checkpoint, weights_from_hf


@dataclass
class KVCache:
    """Per-layer K/V of every group's prefix, packed group after group.

    k[i], v[i]: [Ptot, Hkv, d] (RoPE applied); cu_prefix_lens: [G+1] int32 on the device;
    lengths: P_g per group (host list).
    """
    k: list
    v: list
    lengths: list
    cu_prefix_lens: torch.Tensor

    @property
    def num_groups(self) -> int:
        return len(self.lengths)

    @staticmethod
    def empty(arch: Qwen3Arch, num_groups: int, dtype, device) -> "KVCache":
        z = torch.empty(0, arch.num_kv_heads, arch.head_dim, dtype=dtype, device=device)
        return KVCache(k=[z] * arch.num_layers, v=[z] * arch.num_layers, lengths=[0] * num_groups,
                       cu_prefix_lens=torch.zeros(num_groups + 1, dtype=torch.int32, device=device))


_rms_norm = layer_blocks.rms_norm


# Rows per GEMM in batch-invariant mode. BLAS (and cuBLAS) pick a different kernel for a
# different number of rows (on 2-core x86 MKL: M in {1,2,3,5,7} differ bit-wise from M=64),
# so a row's result depends on its batch. Feeding every GEMM exactly this many rows (the last
# tile zero-padded) makes a token's hidden state a function of that token's inputs alone.
INVARIANT_ROWS = 64


def _linear_fixed_tiles(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    T = x.shape[0]
    pad = (-T) % INVARIANT_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = torch.cat([F.linear(x[i:i + INVARIANT_ROWS], w, b) for i in range(0, x.shape[0], INVARIANT_ROWS)])
    return out[:T]


class Qwen3Runner:
    """Runs a Qwen3 decoder over prefix-shared batches; holds no per-request state."""

    def __init__(self, weights: Qwen3Weights, backend=None, prefill_chunk: int = 4096,
                 batch_invariant: bool = False, compile_layers: bool = False):
        """
        Args:
          weights: see ``Qwen3Weights``; backend: a backend preference (a name, or a per-op
            mapping) of which the attention op's part is used (``acarerank.ops.backend_for``);
            None = ACARERANK_BACKEND / device default.
          prefill_chunk: tokens per group per prefill pass.
          batch_invariant: run every GEMM on fixed tiles of ``INVARIANT_ROWS`` rows, so a
            segment's output is bitwise independent of the other segments in its batch (with a
            batch-invariant attention backend: "triton"). Costs some speed; off by default.
          compile_layers: fuse the element-wise work around the GEMMs with torch.compile
            (``layer_blocks``; the first pass compiles, ~tens of seconds). Off by default;
            ignored in batch-invariant mode.
        """
        self.compile_layers = compile_layers
        self.weights = weights
        self.batch_invariant = batch_invariant
        self.arch = weights.arch
        per_op_backends(backend)  # a bad preference fails here, by name
        self.backend = backend
        self.prefill_chunk = prefill_chunk
        a = self.arch
        self._inv_freq = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.int64, device=self.device)
                                                .float() / a.head_dim))

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_hf(cls, model, backend: Optional[str] = None, **kw) -> "Qwen3Runner":
        return cls(weights_from_hf(model), backend=backend, **kw)

    @classmethod
    def from_pretrained(cls, path: str, dtype=torch.float32, device="cpu", backend: Optional[str] = None, **kw):
        return cls(load_checkpoint(path, dtype=dtype, device=device), backend=backend, **kw)

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.dtype

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
        return _rms_norm(hidden, self.weights.final_norm, self.arch.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 [N, V] next-token logits for a few rows (final norm + lm_head)."""
        return (self.final_norm(hidden) @ self.weights.lm_head.T).float()

    # -- public passes ------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prefixes: Sequence, chunk_tokens: Optional[int] = None) -> KVCache:
        """Compute every group's prefix once; returns their KVCache.

        prefixes: one token-id list / 1-D LongTensor per group (may be empty). Long
        prefixes go in chunks of ``chunk_tokens`` (all groups' chunks in one pass each), so
        a 16k-token prompt never needs 16k tokens of activations at once.
        """
        chunk = chunk_tokens or self.prefill_chunk
        ids = [self._as_ids(p, f"prefix {g}", allow_empty=True) for g, p in enumerate(prefixes)]
        cache = KVCache.empty(self.arch, len(ids), self.dtype, self.device)
        start = 0
        while True:
            pieces = [(g, t[start:start + chunk]) for g, t in enumerate(ids) if t.numel() > start]
            if not pieces:
                return cache
            self._forward(cache, [p for _, p in pieces], [g for g, _ in pieces], output="none", append=True)
            start += chunk

    @torch.inference_mode()
    def forward(self, cache: KVCache, segments: Sequence, segment_group: Sequence[int], output: str = "last",
                append: bool = False) -> Optional[torch.Tensor]:
        """One packed pass of all segments over their groups' caches.

        segments: token-id lists / 1-D LongTensors; segment_group: the group of each.
        output: "last" -> [S, H] hidden state (before the final norm) at each segment's last
                token; "all" -> [T, H] every token, packed in segment order; "none" -> None.
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

    # -- internals ----------------------------------------------------------------------
    def _as_ids(self, x, what: str, allow_empty: bool) -> torch.Tensor:
        t = x if isinstance(x, torch.Tensor) else torch.as_tensor(list(x), dtype=torch.long)
        if t.dim() != 1 or t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{what}: token ids must be a 1-D integer sequence, got {t.dtype} shape {tuple(t.shape)}")
        if t.numel() == 0 and not allow_empty:
            raise ValueError(f"{what} is empty; output='last' needs at least one token per segment")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.arch.vocab_size):
            raise ValueError(f"{what}: token id out of range [0, {self.arch.vocab_size})")
        return t.to(device=self.device, dtype=torch.long)

    def _rope(self, positions: torch.Tensor):
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]

    def _forward(self, cache: KVCache, ids: list, groups: list, output: str, append: bool):
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
        # one plan for every layer: the cache's cu_prefix_lens only changes in _append, after the layers
        plan = plan_prefix_shared_attention(cu_seqlens, cache.cu_prefix_lens, seg_group, num_tokens=T, num_q_heads=Hq,
                                            num_kv_heads=Hkv, head_dim=d, dtype=self.dtype,
                                            backend=backend_for("prefix_shared_attention", self.backend),
                                            validate=False)
        linear = _linear_fixed_tiles if self.batch_invariant else F.linear
        x = W.embed[torch.cat(ids)] if T else W.embed.new_zeros(0, a.hidden_size)
        new_k, new_v = [], []
        # the element-wise work around the GEMMs: eager, or fused by torch.compile (layer_blocks.py)
        attn_in, attn_out_mlp = (layer_blocks.compiled() if self.compile_layers and not self.batch_invariant
                                 else (layer_blocks.attn_in, layer_blocks.attn_out_mlp))
        for i, L in enumerate(W.layers):
            q, k, v = attn_in(x, L.input_norm, L.w_qkv, L.b_qkv, L.q_norm, L.k_norm, cos, sin, Hq, Hkv, d,
                              a.rms_norm_eps, linear=linear)
            if append:
                new_k.append(k)
                new_v.append(v)
            is_last_layer = i == len(W.layers) - 1
            if is_last_layer and output == "none":
                break  # the last layer's output feeds nothing that is asked for
            attn = prefix_shared_attention(q, k, v, cu_seqlens, cache.k[i], cache.v[i], cache.cu_prefix_lens, seg_group,
                                           plan=plan).reshape(T, Hq * d)
            if is_last_layer and output == "last":
                x, attn = x[last], attn[last]  # only the rows asked for go through o_proj and the MLP
            x = attn_out_mlp(x, attn, L.w_o, L.post_norm, L.w_gate_up, L.w_down, a.rms_norm_eps, linear=linear)
        if append:
            self._append(cache, new_k, new_v, groups, cu)
        return None if output == "none" else x

    @staticmethod
    def _append(cache: KVCache, new_k: list, new_v: list, groups: list, cu: list) -> None:
        """Re-pack each layer's cache with every group's new rows after its old ones."""
        old = cache.lengths
        seg_of = {g: s for s, g in enumerate(groups)}
        cp = cache.cu_prefix_lens.tolist()
        for i in range(len(cache.k)):
            ks, vs = [], []
            for g in range(len(old)):
                ks.append(cache.k[i][cp[g]:cp[g + 1]])
                vs.append(cache.v[i][cp[g]:cp[g + 1]])
                s = seg_of.get(g)
                if s is not None:
                    ks.append(new_k[i][cu[s]:cu[s + 1]])
                    vs.append(new_v[i][cu[s]:cu[s + 1]])
            cache.k[i] = torch.cat(ks)
            cache.v[i] = torch.cat(vs)
        cache.lengths = [n + (cu[seg_of[g] + 1] - cu[seg_of[g]] if g in seg_of else 0) for g, n in enumerate(old)]
        acc = [0]
        for n in cache.lengths:
            acc.append(acc[-1] + n)
        cache.cu_prefix_lens = torch.tensor(acc, dtype=torch.int32, device=cache.cu_prefix_lens.device)
