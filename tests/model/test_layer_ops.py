"""The runner's layers through the element-wise ops (model/layer_ops.py).

With the torch backends the layers are bitwise the eager halves of layer_blocks (transformers'
order); a runner pass with the native kernels is within 1e-5 of the torch one in fp32 and within
the bf16 rule against fp32 (error ≤ 2x the eager bf16 error + 1e-3).
"""
import pytest
import torch
import torch.nn.functional as F

from _ext import needs_native
from acarerank.model import Qwen3Runner
from acarerank.model import layer_blocks
from acarerank.model.layer_ops import OpsLayers
from acarerank.model.default import build_default_model
from acarerank.ops import BackendError

SMALL = dict(num_hidden_layers=2, hidden_size=96, intermediate_size=97 * 2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=24)
OPS = ("rms_norm", "fused_add_rms_norm", "qk_norm_rope", "silu_and_mul")


def _run(model, backend, segs):
    runner = Qwen3Runner.from_hf(model, backend=backend)
    g = torch.Generator().manual_seed(1)
    cache = runner.prefill([torch.randint(0, 50000, (61,), generator=g)])
    return runner, runner.forward(cache, segs, [0] * len(segs), output="all").float()


def _segments():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 50000, (n,), generator=g) for n in (17, 1, 29)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backends_are_bitwise_the_eager_layer(dtype):
    """OpsLayers with every op on "torch" equals layer_blocks' eager halves bit for bit, layer after
    layer (the residual carried between layers instead of added at the end of each)."""
    runner = Qwen3Runner.from_hf(build_default_model("tiny-cpu", seed=0, **SMALL).to(dtype), backend="torch")
    a, W = runner.arch, runner.weights
    g = torch.Generator().manual_seed(3)
    T = 37
    x = W.embed[torch.randint(0, 50000, (T,), generator=g)]
    cos, sin = runner._rope(torch.arange(100, 100 + T))
    layers = OpsLayers({op: "torch" for op in OPS}, a, F.linear, cos, sin, dtype)
    layers.begin(x.clone())
    c, s = cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]
    for L in W.layers:
        got = layers.attn_in(L)
        want = layer_blocks.attn_in(x, L.input_norm, L.w_qkv, L.b_qkv, L.q_norm, L.k_norm, c, s, a.num_heads,
                                    a.num_kv_heads, a.head_dim, a.rms_norm_eps)
        for name, u, w in zip("qkv", got, want):
            assert torch.equal(u, w), f"{name} differs by {(u.float() - w.float()).abs().max():.3e}"
        attn = torch.randn(T, a.num_heads * a.head_dim, generator=g).to(dtype)
        layers.attn_out_mlp(attn, L)
        x = layer_blocks.attn_out_mlp(x, attn, L.w_o, L.post_norm, L.w_gate_up, L.w_down, a.rms_norm_eps)
    out = layers.end()
    assert torch.equal(out, x), f"hidden differs by {(out.float() - x.float()).abs().max():.3e}"


@needs_native
def test_native_layers_are_the_cpu_default_and_match_eager():
    m32 = build_default_model("tiny-cpu", seed=0, **SMALL)
    segs = _segments()
    runner, nat32 = _run(m32, None, segs)
    assert all(runner._layer_backends[op] == "native" for op in OPS), runner._layer_backends
    _, eager32 = _run(m32, "torch", segs)
    err32 = (nat32 - eager32).abs().max().item()
    assert err32 <= 1e-5 * max(1.0, eager32.abs().max().item()), f"native vs torch layers, fp32: {err32:.3e}"

    mbf = build_default_model("tiny-cpu", seed=0, **SMALL).to(torch.bfloat16)
    _, nat = _run(mbf, {op: "native" for op in OPS}, segs)
    _, eager = _run(mbf, {op: "torch" for op in OPS}, segs)
    e_nat, e_eager = (nat - eager32).abs().max().item(), (eager - eager32).abs().max().item()
    assert e_nat <= 2 * e_eager + 1e-3, f"native bf16 error {e_nat:.3e} vs eager bf16 {e_eager:.3e} (both vs fp32)"


def test_a_layer_backend_asked_for_that_cannot_run_is_an_error():
    model = build_default_model("tiny-cpu", seed=0, **SMALL)
    with pytest.raises(BackendError, match="no 'cuda' backend"):
        Qwen3Runner.from_hf(model, backend={"rms_norm": "cuda"})
