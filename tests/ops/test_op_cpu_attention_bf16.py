"""bf16 on CPU: the attention op's CPU backends in bf16, and the automatic dtype (hardware.py).

Attention is held to flash-attn's rule: error against an fp32 reference on the same
(bf16-rounded) inputs ≤ 2× the error of plain PyTorch attention in bf16 (+ a small floor).
Each backend is asked for by name, so the path under test is the one that runs whatever the
CPU ("native" takes cpublas' bf16 brgemm where it can pack bf16, else converts tiles to fp32);
only its speed depends on the hardware. The kernel's own tests: tests/ops/test_op_cpu_attention_native.py.
"""
import math

import pytest
import torch

from acarerank import hardware
from acarerank.ops import prefix_shared_attention, prefix_shared_attention_ref


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_bf16_op_within_twice_plain_bf16(gen, backend):
    """Both CPU backends, asked for by name, on bf16 inputs: the whole op within flash-attn's rule
    (error against fp32 on the same bf16 values ≤ 2× plain bf16 PyTorch's + fp32's rounding step)."""
    if backend == "native":
        from _ext import NATIVE_MISSING
        if NATIVE_MISSING:
            pytest.skip(NATIVE_MISSING)
    i32 = dict(dtype=torch.int32)
    seg, pre, grp = [7, 59, 1, 0, 30], [300, 0, 41], [0, 0, 2, 1, 1]
    Hq, Hkv, d = 6, 2, 64
    T, Pt = sum(seg), sum(pre)
    mk = lambda n, h: torch.randn(n, h, d, generator=gen).to(torch.bfloat16)  # noqa: E731
    q, k, v, pk, pv = mk(T, Hq), mk(T, Hkv), mk(T, Hkv), mk(Pt, Hkv), mk(Pt, Hkv)
    cu = torch.tensor([0] + list(torch.tensor(seg).cumsum(0)), **i32)
    cp = torch.tensor([0] + list(torch.tensor(pre).cumsum(0)), **i32)
    sg = torch.tensor(grp, **i32)
    out = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend=backend)
    assert out.dtype == torch.bfloat16
    ref = prefix_shared_attention_ref(q.float(), k.float(), v.float(), cu, pk.float(), pv.float(), cp, sg)
    scale = 1.0 / math.sqrt(d)
    plain = torch.zeros_like(ref)
    r = Hq // Hkv
    cs, cpl = cu.tolist(), cp.tolist()
    for s, g in enumerate(grp):
        a, b = cs[s], cs[s + 1]
        if a == b:
            continue
        keys = torch.cat([pk[cpl[g]:cpl[g + 1]], k[a:b]]).repeat_interleave(r, 1).transpose(0, 1)
        vals = torch.cat([pv[cpl[g]:cpl[g + 1]], v[a:b]]).repeat_interleave(r, 1).transpose(0, 1)
        P = cpl[g + 1] - cpl[g]
        mask = torch.ones(b - a, P + b - a, dtype=torch.bool).tril(diagonal=P)
        probs = ((q[a:b].transpose(0, 1) @ keys.transpose(1, 2)) * scale).masked_fill(~mask, float("-inf")).softmax(-1)
        plain[a:b] = (probs @ vals).transpose(0, 1).float()
    err, plain_err = (out.float() - ref).abs().max().item(), (plain - ref).abs().max().item()
    atol = 2 * (ref + 0.3 - 0.3 - ref).abs().max().item()
    assert err <= 2 * plain_err + atol, f"{backend}: bf16 error {err:.3e} vs plain bf16 PyTorch {plain_err:.3e}"


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
def test_pointwise_bf16_rule_cpu_default(qwen3_tokenizer, shape):
    """bf16 rule on the fidelity shapes with the CPU default backends (the native attention kernel
    where built): |ours − fp32| ≤ 2·|transformers_bf16 − fp32| + 2e-3."""
    from test_pointwise import DOCS, QUESTION, TRACE, random_reranker_model

    from acarerank import PointwiseReranker
    from acarerank.prompts import joint_input_ids, official_scores

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
