"""bf16 CPU prefix attention (ops/cpu_attention_bf16.py) and the automatic dtype (hardware.py).

Attention is held to flash-attn's rule: error against an fp32 reference on the same
(bf16-rounded) inputs ≤ 2× the error of plain PyTorch attention in bf16 (+ a small floor).
This machine may lack native bf16: the path is forced on (``ENABLED = True``) so it runs
here whatever the CPU; only its speed depends on the hardware.
"""
import math

import pytest
import torch

import acarerank.ops.cpu_attention_bf16 as bf16_attn
from acarerank import hardware
from acarerank.ops import prefix_shared_attention, prefix_shared_attention_ref


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def _plain_bf16(q, k, v, scale):
    """Plain PyTorch attention in bf16 (q [M, d], k/v [N, d]): bf16 GEMMs, softmax in fp32."""
    p = torch.softmax((q @ k.T).float() * scale, dim=-1).to(torch.bfloat16)
    return (p @ v).float()


def _fp32(q, k, v, scale):
    s = (q.float() @ k.float().T) * scale
    return torch.softmax(s, -1) @ v.float(), torch.logsumexp(s, -1)


@pytest.mark.parametrize("Tg,P,Hq,Hkv,d,row_block,key_tile", [
    (7, 1, 2, 2, 64, 512, 2048),        # one key
    (59, 769, 6, 2, 64, 512, 2048),     # one tile, GQA 3
    (97, 769, 4, 1, 128, 64, 100),      # many row blocks and key tiles (online rescale), GQA 4
    (13, 257, 8, 8, 64, 5, 7),          # tiny blocks, no GQA
])
def test_prefix_attention_bf16_within_twice_plain_bf16(gen, Tg, P, Hq, Hkv, d, row_block, key_tile):
    q = (torch.randn(Tg, Hq, d, generator=gen) * 1.5).to(torch.bfloat16)
    # the group's rows of a packed cache with one more group after it: strided [P, Hkv, d] views
    cache_k = (torch.randn(P + 11, Hkv, d, generator=gen) * 1.5).to(torch.bfloat16)
    cache_v = torch.randn(P + 11, Hkv, d, generator=gen).to(torch.bfloat16)
    pk, pv = cache_k[:P], cache_v[:P]
    scale = 1.0 / math.sqrt(d)
    o, lse = bf16_attn.prefix_attention_bf16(q, pk, pv, scale, row_block=row_block, key_tile=key_tile)
    assert o.shape == (Tg, Hq, d) and lse.shape == (Tg, Hq) and o.dtype == lse.dtype == torch.float32
    r = Hq // Hkv
    err = plain_err = 0.0
    for h in range(Hq):
        ref_o, ref_lse = _fp32(q[:, h], pk[:, h // r], pv[:, h // r], scale)
        plain = _plain_bf16(q[:, h], pk[:, h // r], pv[:, h // r], scale)
        err = max(err, (o[:, h] - ref_o).abs().max().item())
        plain_err = max(plain_err, (plain - ref_o).abs().max().item())
        lse_err = (lse[:, h] - ref_lse).abs()
        # lse: raw scores are rounded to bf16 (rel. 2^-9 of |s|): allow that on the largest score
        assert lse_err.max() <= 2 ** -8 * ref_lse.abs().max() + 1e-3, f"head {h}: lse err {lse_err.max():.3e}"
    assert err <= 2 * plain_err + 1e-4, f"bf16 path error {err:.3e} vs plain bf16 PyTorch {plain_err:.3e}"


def test_prefix_attention_bf16_bad_inputs():
    q = torch.randn(3, 4, 16).to(torch.bfloat16)
    k = torch.randn(5, 2, 16).to(torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        bf16_attn.prefix_attention_bf16(q.float(), k, k, 0.25)
    with pytest.raises(ValueError, match="P >= 1"):
        bf16_attn.prefix_attention_bf16(q, k[:0], k[:0], 0.25)
    with pytest.raises(ValueError, match="multiple"):
        bf16_attn.prefix_attention_bf16(q, torch.randn(5, 3, 16).to(torch.bfloat16),
                                        torch.randn(5, 3, 16).to(torch.bfloat16), 0.25)
    with pytest.raises(ValueError, match="row_block"):
        bf16_attn.prefix_attention_bf16(q, k, k, 0.25, row_block=0)


def test_torch_backend_routes_bf16_prefix(monkeypatch, gen):
    """The torch backend with the bf16 prefix path on: whole op within 2× plain bf16's error."""
    i32 = dict(dtype=torch.int32)
    seg, pre, grp = [7, 59, 1, 0, 30], [300, 0, 41], [0, 0, 2, 1, 1]
    Hq, Hkv, d = 6, 2, 64
    T, Pt = sum(seg), sum(pre)
    mk = lambda n, h: torch.randn(n, h, d, generator=gen).to(torch.bfloat16)  # noqa: E731
    q, k, v, pk, pv = mk(T, Hq), mk(T, Hkv), mk(T, Hkv), mk(Pt, Hkv), mk(Pt, Hkv)
    cu = torch.tensor([0] + list(torch.tensor(seg).cumsum(0)), **i32)
    cp = torch.tensor([0] + list(torch.tensor(pre).cumsum(0)), **i32)
    sg = torch.tensor(grp, **i32)
    calls = []
    real = bf16_attn.prefix_attention_bf16
    monkeypatch.setattr(bf16_attn, "prefix_attention_bf16", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(bf16_attn, "ENABLED", True)
    out = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend="torch")
    assert out.dtype == torch.bfloat16 and len(calls) == 2  # groups 0 and 2 have a prefix, group 1 none
    ref = prefix_shared_attention_ref(q.float(), k.float(), v.float(), cu, pk.float(), pv.float(), cp, sg)
    monkeypatch.setattr(bf16_attn, "ENABLED", False)
    old = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend="torch")  # fp32 inside, bf16 out
    err, old_err = (out.float() - ref).abs().max().item(), (old.float() - ref).abs().max().item()
    # the fp32 path's error is the output rounding alone; bf16 GEMMs add about as much again
    assert err <= 4 * old_err + 2e-3, f"bf16 prefix path error {err:.3e} vs fp32-inside path {old_err:.3e}"


def test_fp32_and_non_cpu_never_take_the_bf16_path(monkeypatch):
    monkeypatch.setattr(bf16_attn, "ENABLED", True)
    assert not bf16_attn.use_bf16_prefix_path(torch.zeros(1, 1, 1))
    assert bf16_attn.use_bf16_prefix_path(torch.zeros(1, 1, 1, dtype=torch.bfloat16))
    monkeypatch.setattr(bf16_attn, "ENABLED", None)
    assert bf16_attn.use_bf16_prefix_path(torch.zeros(1, 1, 1, dtype=torch.bfloat16)) == hardware.native_bf16()[0]


@pytest.mark.parametrize("flags,expect", [
    ("fpu sse avx2 avx512f avx512_bf16 vaes", True),
    ("fpu sse avx2 amx_tile amx_bf16", True),
    ("fp asimd sve bf16 i8mm", True),
    ("fpu sse avx2 avx512f avx512bw", False),
])
def test_native_bf16_from_cpuinfo_flags(tmp_path, monkeypatch, flags, expect):
    key = "Features" if "asimd" in flags else "flags"
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: test\n{key}\t\t: {flags}\n\nprocessor\t: 1\n")
    real = hardware._cpuinfo_flags
    monkeypatch.setattr(hardware, "_cpuinfo_flags", lambda: real(str(info)))
    hardware.native_bf16.cache_clear()
    try:
        ok, why = hardware.native_bf16()
        assert ok is expect, why
        dtype, why2 = hardware.default_dtype("cpu")
        assert dtype == (torch.bfloat16 if expect else torch.float32) and why2 == why
        assert ("native bf16 (" in why) if expect else ("no native bf16" in why)
        # an explicit dtype always wins
        assert hardware.resolve_dtype("float32") == (torch.float32, "asked for explicitly")
        assert hardware.resolve_dtype(torch.bfloat16)[0] == torch.bfloat16
        assert hardware.resolve_dtype("auto") == (dtype, why)
    finally:
        hardware.native_bf16.cache_clear()


def test_resolve_dtype_bad_input():
    with pytest.raises(ValueError, match="float64"):
        hardware.resolve_dtype("float64")
    with pytest.raises(TypeError, match="dtype"):
        hardware.resolve_dtype(3)


@pytest.mark.parametrize("shape", [dict(layers=2, heads=4, kv_heads=2, head_dim=128),
                                   dict(layers=4, heads=4, kv_heads=1, head_dim=64)],
                         ids=lambda s: f"L{s['layers']}-h{s['heads']}/{s['kv_heads']}-d{s['head_dim']}")
def test_pointwise_bf16_rule_with_bf16_prefix_path(monkeypatch, qwen3_tokenizer, shape):
    """bf16 rule on the fidelity shapes, bf16 prefix attention on: |ours − fp32| ≤ 2·|transformers_bf16 − fp32| + 2e-3."""
    from test_pointwise import DOCS, QUESTION, TRACE, random_reranker_model

    from acarerank import PointwiseReranker
    from acarerank.prompts import joint_input_ids, official_scores

    monkeypatch.setattr(bf16_attn, "ENABLED", True)
    tok = qwen3_tokenizer
    m32 = random_reranker_model(**shape)
    mbf = random_reranker_model(**shape, dtype=torch.bfloat16)
    ctx = dict(question=QUESTION, trace=TRACE)  # M3: the longest prefix
    ids = [joint_input_ids(tok, "q", d, **ctx) for d in DOCS]
    ref32 = torch.tensor(official_scores(m32, tok, ids, batch_size=1))
    refbf = torch.tensor(official_scores(mbf, tok, ids, batch_size=1))
    ours = torch.tensor(PointwiseReranker(model=mbf, tokenizer=tok).score("q", DOCS, **ctx))
    e_ours, e_hf = (ours - ref32).abs().max().item(), (refbf - ref32).abs().max().item()
    assert e_ours <= 2 * e_hf + 2e-3, f"bf16 error {e_ours:.2e} vs transformers-bf16 {e_hf:.2e}"
