"""The runner's MLP on the fused gate/up + SiLU·up kernel (ops/gate_up_silu.py) where it applies.

bf16 rule (tests/model/test_runner.py's): the runner's hidden states against transformers' fp32
forward within 2× transformers-bf16's own error (+ a floor). The unfused runner (the same weights,
``{"gate_up_silu": "torch"}``) is held to the same rule beside it.
"""
import pytest
import torch

from _tiny import random_qwen3
from acarerank.model import Qwen3Runner
from acarerank.model.linear_weights import LINEAR_FIELDS
from acarerank.ops import PackedGateUpWeight, _native

AMX = _native.available() and _native.amx_tiles_kernel()
# hidden a multiple of 32 and intermediate of 16: the kernel takes the gate/up matrix
SHAPE = dict(layers=2, heads=4, kv_heads=2, head_dim=32, hidden=64, intermediate=96, vocab=503)
UNFUSED = {"gate_up_silu": "torch"}


def _forms(runner):
    return {f: {type(getattr(L, f)).__name__ for L in runner.weights.layers} for f in LINEAR_FIELDS}


def _hidden(runner, prefix, segs):
    cache = runner.prefill([prefix])
    return runner.final_norm(runner.forward(cache, segs, [0] * len(segs), output="all")).float()


def _hf(m, prefix, segs):
    out = []
    for s in segs:
        with torch.no_grad():
            out.append(m.model(torch.cat([prefix, s])[None]).last_hidden_state[0, -len(s):].float())
    return torch.cat(out)


def test_bf16_default_fuses_the_gate_up_where_it_can_and_stays_within_the_bf16_rule():
    m32 = random_qwen3(seed=0, perturb_norms=True, **SHAPE)
    mbf = random_qwen3(seed=0, perturb_norms=True, dtype=torch.bfloat16, **SHAPE)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 503, (45,), generator=g)
    segs = [torch.randint(0, 503, (n,), generator=g) for n in (13, 1, 33)]
    fused, unfused = Qwen3Runner.from_hf(mbf), Qwen3Runner.from_hf(mbf, backend=UNFUSED)
    if AMX:
        assert fused.gate_up_backend == "native" and _forms(fused)["w_gate_up"] == {"PackedGateUpWeight"}
        assert _forms(fused)["w_qkv"] == {"PackedLinearWeight"}
    else:
        assert fused.gate_up_backend == "torch"
    assert unfused.gate_up_backend == "torch" and _forms(unfused)["w_gate_up"] == {"PackedLinearWeight"}
    ref32, refbf = _hf(m32, prefix, segs), _hf(mbf, prefix, segs)
    theirs = (refbf - ref32).abs().max().item()
    for name, r in (("fused", fused), ("unfused", unfused)):
        ours = (_hidden(r, prefix, segs) - ref32).abs().max().item()
        assert ours <= 2 * theirs + 1e-2, f"{name}: bf16 error {ours:.3e} vs transformers-bf16 {theirs:.3e}"


@pytest.mark.skipif(not AMX, reason="the fused kernel needs AMX tiles (elsewhere the runner never packs for it)")
def test_fp32_odd_shapes_and_a_torch_preference_keep_the_unfused_mlp():
    for kw, backend in ((dict(), None), (dict(hidden=72), None), (dict(intermediate=100), None), (dict(), "torch")):
        dtype = torch.float32 if not kw and backend is None else torch.bfloat16
        r = Qwen3Runner.from_hf(random_qwen3(seed=0, dtype=dtype, **{**SHAPE, **kw}), backend=backend)
        assert r.gate_up_backend == "torch", (kw, backend, dtype)
        assert not any(isinstance(L.w_gate_up, PackedGateUpWeight) for L in r.weights.layers)


@pytest.mark.skipif(not AMX, reason="the fused kernel needs AMX tiles")
def test_settings_move_the_weights_between_forms_and_modes_agree():
    """with_settings to the unfused MLP unpacks the gate/up matrix bitwise (the same results as a
    runner built unfused); batch-invariant mode on the fused kernel keeps a segment's bits whatever
    else is in its pass. (compile_layers reads the packed matrix as a linear weight:
    test_layer_blocks.py, whose bf16 shape the kernel takes.)"""
    mbf = random_qwen3(seed=2, dtype=torch.bfloat16, **SHAPE)
    fused = Qwen3Runner.from_hf(mbf)
    moved = fused.with_settings(backend=UNFUSED)
    assert _forms(moved)["w_gate_up"] == {"PackedLinearWeight"}
    mlp = mbf.model.layers[0].mlp
    assert torch.equal(moved.weights.layers[0].w_gate_up.unpack(), torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 503, (40,), generator=g)
    segs = [torch.randint(0, 503, (n,), generator=g) for n in (7, 29)]
    assert torch.equal(_hidden(moved, prefix, segs), _hidden(Qwen3Runner.from_hf(mbf, backend=UNFUSED), prefix, segs))

    inv = fused.with_settings(batch_invariant=True)
    assert isinstance(inv.weights.layers[0].w_gate_up, PackedGateUpWeight)
    both = _hidden(inv, prefix, segs)
    alone = _hidden(inv, prefix, segs[1:])
    assert torch.equal(both[7:], alone), "batch-invariant: a segment's bits moved with its neighbour"
