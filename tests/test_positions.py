"""The model's maximum context length (``max_position_embeddings``, scaled by its RoPE) bounds
every entry point: a cap past it is refused where it is set, naming both numbers; a default cap
is clamped to it; a sequence exactly at it scores as transformers' forward (docs/input-safety.md,
"Positions"). Past it RoPE rotates by angles the model never saw: a plausible score, no error —
vLLM refuses such input ("maximum context length is N tokens").

One 1-layer random Qwen3 of 1,024 positions (the real vocabulary and tokenizer), built once.
"""
import pytest
import torch
from _tiny import random_qwen3

from acarerank.model import ContextLengthError, Qwen3Runner
from acarerank.model.arch import Qwen3Arch

LIMIT = 1024                                                  # a setwise prompt's template alone is ~640


@pytest.fixture(scope="module")
def model():
    return random_qwen3(seed=3, spread_yes_no=40, max_position_embeddings=LIMIT)


@pytest.fixture(scope="module")
def runner(model):
    return Qwen3Runner.from_hf(model)


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 5000, (n,), generator=g).tolist()


def _config(**kw):
    return dict(model_type="qwen3", vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=1, num_key_value_heads=1, head_dim=8, **kw)


@pytest.mark.parametrize("config, want", [
    ({}, 32768),                                                  # Qwen3Config's default
    ({"max_position_embeddings": 40960}, 40960),                  # Qwen3's own
    # Qwen3's card for 131,072 tokens: YaRN factor 4 over 32,768, max_position_embeddings left at 40,960
    ({"max_position_embeddings": 40960, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32768}}, 131072),
    # transformers 5.x's own form: factor null = max_position_embeddings / original
    ({"max_position_embeddings": 1024, "rope_parameters": {"rope_type": "yarn", "factor": None,
                                                           "original_max_position_embeddings": 256,
                                                           "rope_theta": 1e6}}, 1024),
    ({"max_position_embeddings": 2048, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 4096),
    # Llama 3.1's form: max_position_embeddings is already the scaled length
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                          "original_max_position_embeddings": 8192,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0}}, 131072),
])
def test_the_limit_is_max_position_embeddings_scaled_by_the_rope(config, want):
    assert Qwen3Arch.from_config(_config(**config)).max_positions == want


@pytest.mark.parametrize("bad", [0, -5, 1.5, "4096", True])
def test_a_bad_max_position_embeddings_is_named(bad):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Qwen3Arch.from_config(_config(max_position_embeddings=bad))


def test_the_runner_exposes_the_limit_and_refuses_a_pass_past_it(model, runner):
    """At the limit the prefill's last hidden state is transformers'; one token more is refused
    before any pass (the last line of defence behind every entry point's own check)."""
    assert runner.max_positions == LIMIT
    ids = _ids(LIMIT)
    cache = runner.prefill([ids[:-1]])
    try:
        hidden = runner.final_norm(runner.forward(cache, [ids[-1:]], [0], output="last"))
    finally:
        cache.free()
    with torch.no_grad():
        want = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
    torch.testing.assert_close(hidden[0], want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ContextLengthError, match=f"{LIMIT + 1:,} tokens, more than the model's maximum context length of "
                                                 f"{LIMIT:,} tokens"):
        runner.prefill([_ids(LIMIT + 1)])
    cache = runner.prefill([ids[:-1]])
    try:
        with pytest.raises(ContextLengthError, match=rf"{LIMIT - 1:,} cached \+ 2 new"):
            runner.forward(cache, [[1, 2]], [0], output="last", append=True)
    finally:
        cache.free()
