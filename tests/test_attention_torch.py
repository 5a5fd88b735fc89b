"""prefix_shared_attention (torch backend) and yes_no_score against their plain references."""
import math

import pytest
import torch

from acarerank.ops import (BackendError, prefix_shared_attention, prefix_shared_attention_ref, yes_no_score,
                           yes_no_score_ref)


def _pack(seg_lens, prefix_lens, groups, Hq, Hkv, d, dtype=torch.float32):
    T, P = sum(seg_lens), sum(prefix_lens)
    q, k, v = torch.randn(T, Hq, d), torch.randn(T, Hkv, d), torch.randn(T, Hkv, d)
    pk, pv = torch.randn(P, Hkv, d), torch.randn(P, Hkv, d)
    cu = torch.tensor([0] + torch.tensor(seg_lens).cumsum(0).tolist(), dtype=torch.int32)
    cp = torch.tensor([0] + torch.tensor(prefix_lens).cumsum(0).tolist(), dtype=torch.int32)
    sg = torch.tensor(groups, dtype=torch.int32)
    return [t.to(dtype) for t in (q, k, v)], cu, [t.to(dtype) for t in (pk, pv)], cp, sg


def _concat_oracle(q, k, v, cu, pk, pv, cp, sg):
    """Attention over the literally concatenated sequence prefix ++ segment (causal), via SDPA."""
    out = torch.zeros_like(q, dtype=torch.float32)
    r = q.shape[1] // k.shape[1]
    for s, g in enumerate(sg.tolist()):
        a, b = cu[s].item(), cu[s + 1].item()
        if a == b:
            continue
        P = cp[g + 1].item() - cp[g].item()
        keys = torch.cat([pk[cp[g]:cp[g + 1]], k[a:b]]).float().repeat_interleave(r, 1).transpose(0, 1)
        vals = torch.cat([pv[cp[g]:cp[g + 1]], v[a:b]]).float().repeat_interleave(r, 1).transpose(0, 1)
        # queries sit at positions P..P+L-1 of the concatenated sequence: causal mask with an offset
        L = b - a
        mask = torch.ones(L, P + L, dtype=torch.bool).tril(diagonal=P)
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].float().transpose(0, 1), keys, vals, attn_mask=mask).transpose(0, 1)
    return out


CASES = [
    # (segment lengths, prefix lengths, group of each segment, Hq, Hkv, d)
    ([1, 7, 59, 97], [1, 63, 300], [0, 1, 2, 1], 4, 2, 64),
    ([1], [1], [0], 2, 2, 64),                       # one segment of one token, prefix of one token
    ([5, 0, 3, 11], [40, 0], [1, 0, 0, 1], 8, 1, 128),  # empty segment, empty prefix, GQA 8
    ([3] * 9, [17, 4, 9], [0, 1, 2, 0, 1, 2, 2, 1, 0], 6, 3, 32),  # interleaved groups
    ([13, 2], [29], [0, 0], 4, 4, 16),
]


@pytest.mark.parametrize("path", ["cpu-flash", "matmul"])
@pytest.mark.parametrize("seg_lens,prefix_lens,groups,Hq,Hkv,d", CASES)
def test_torch_backend_equals_concatenated_attention(seg_lens, prefix_lens, groups, Hq, Hkv, d, path, monkeypatch):
    """Both inner paths: torch's fused CPU flash kernel, and the matmul path other devices take."""
    import acarerank.ops.attention as att
    if path == "matmul":
        monkeypatch.setattr(att, "_FLASH_CPU", None)
    (q, k, v), cu, (pk, pv), cp, sg = _pack(seg_lens, prefix_lens, groups, Hq, Hkv, d)
    out = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend="torch")
    ref = _concat_oracle(q, k, v, cu, pk, pv, cp, sg)
    err = (out - ref).abs()
    assert err.max() <= 1e-5, f"max err {err.max():.3e} at {divmod(int(err.argmax()), Hq * d)}"
    ref2 = prefix_shared_attention_ref(q, k, v, cu, pk, pv, cp, sg)
    assert (ref2 - ref).abs().max() <= 1e-5


def test_torch_backend_chunks_large_prefix(monkeypatch):
    """The prefix GEMM is cut into row blocks under a memory budget; results must not change."""
    import acarerank.ops.attention as att
    monkeypatch.setattr(att, "_FLASH_CPU", None)  # the fused CPU kernel needs no chunking
    (q, k, v), cu, (pk, pv), cp, sg = _pack([31, 17], [257], [0, 0], 4, 2, 32)
    full = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend="torch")
    monkeypatch.setattr(att, "_TORCH_SCORE_BUDGET", 2 * 257 * 5)
    chunked = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend="torch")
    assert (full - chunked).abs().max() <= 1e-6


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_torch_backend_half_precision(dtype, tol):
    (q, k, v), cu, (pk, pv), cp, sg = _pack([7, 59], [63, 5], [0, 1], 4, 2, 64, dtype)
    out = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend="torch")
    assert out.dtype == dtype
    ref = _concat_oracle(q, k, v, cu, pk, pv, cp, sg)
    # fp32 accumulation inside, so the only error is the final rounding to the half type
    assert (out.float() - ref).abs().max() <= tol


def test_attention_bad_inputs():
    (q, k, v), cu, (pk, pv), cp, sg = _pack([3, 4], [5], [0, 0], 4, 2, 16)
    call = lambda **kw: prefix_shared_attention(**{**dict(q=q, k=k, v=v, cu_seqlens=cu, prefix_k=pk, prefix_v=pv,
                                                            cu_prefix_lens=cp, segment_group=sg), **kw})
    with pytest.raises(ValueError, match="not a multiple"):
        call(k=torch.randn(7, 3, 16), v=torch.randn(7, 3, 16), prefix_k=torch.randn(5, 3, 16), prefix_v=torch.randn(5, 3, 16))
    with pytest.raises(TypeError, match="int32"):
        call(cu_seqlens=cu.long())
    with pytest.raises(TypeError, match="dtype"):
        call(k=k.double())
    with pytest.raises(ValueError, match="end at T"):
        call(cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="segment_group values"):
        call(segment_group=torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(BackendError, match="unknown backend"):
        call(backend="nope")


def test_yes_no_score_matches_reference():
    S, H = 13, 96
    h, nw = torch.randn(S, H) * 3, torch.rand(H) + 0.5
    wy, wn = torch.randn(H), torch.randn(H)
    s, d = yes_no_score(h, nw, wy, wn, eps=1e-6, backend="torch")
    rs, rd = yes_no_score_ref(h, nw, wy, wn, eps=1e-6)
    assert (s - rs).abs().max() <= 1e-6 and (d - rd).abs().max() <= 1e-5
    # the score is the softmax over the two full logits, as the model card computes it
    hn = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    p = torch.softmax(torch.stack([hn @ wn, hn @ wy], -1), -1)[:, 1]
    assert (s - p).abs().max() <= 1e-6
    with pytest.raises(ValueError, match="w_yes"):
        yes_no_score(h, nw, wy[:-1], wn)
