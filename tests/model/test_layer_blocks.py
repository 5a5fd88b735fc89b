"""torch.compile'd layer halves (model/layer_blocks.py) against the eager runner.

Slow: inductor compiles two graphs per dtype (~40-80 s on 2 busy cores); the eager halves
are what every other runner test runs.
"""
import pytest
import torch

from acarerank.model import Qwen3Runner
from acarerank.model.default import build_default_model

SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, None)])  # fp32 (tol 1e-5) passes too: 15 s more
def test_compiled_layers_match_eager(dtype, tol):
    m32 = build_default_model("tiny-cpu", seed=0, **SMALL)
    model = m32.to(dtype)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 50000, (97,), generator=g)
    segs = [torch.randint(0, 50000, (n,), generator=g) for n in (17, 1, 40)]
    out = {}
    for name, runner in (("eager", Qwen3Runner.from_hf(model)), ("compiled", Qwen3Runner.from_hf(model, compile_layers=True)),
                         ("fp32", Qwen3Runner.from_hf(build_default_model("tiny-cpu", seed=0, **SMALL)))):
        cache = runner.prefill([prefix])
        out[name] = runner.forward(cache, segs, [0, 0, 0], output="all").float()
    err = (out["compiled"] - out["eager"]).abs().max().item()
    if tol is not None:
        assert err <= tol, f"compiled vs eager fp32: {err:.3e}"
    else:  # bf16: compiled error against fp32 within 2x the eager bf16 error (+ a floor)
        e_c, e_e = ((out[k] - out["fp32"]).abs().max().item() for k in ("compiled", "eager"))
        assert e_c <= 2 * e_e + 1e-3, f"compiled bf16 error {e_c:.3e} vs eager bf16 {e_e:.3e}"
