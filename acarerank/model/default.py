"""The embedded default model: seeded random weights in a small Qwen3-Reranker architecture.

It lets the CLI, the server and the benchmarks run with no checkpoint.
Its scores and selections carry no meaning: the weights are random. The shape is the one
the pointwise benchmarks run on 2 CPU cores: hidden 384, 6 layers, 6 query / 2 KV
heads, head_dim 64, the real Qwen3 vocabulary (151,669) so the real tokenizer drives it.

Presets with the real shapes (random weights too) are for GPU users of ``acarerank bench``.
"""
from __future__ import annotations

import sys

import torch

from ..tokenizer import QWEN3_VOCAB

PRESETS = {
    # name: Qwen3Config keyword arguments
    "tiny-cpu": dict(hidden_size=384, intermediate_size=1152, num_hidden_layers=6, num_attention_heads=6,
                     num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
    "qwen3-reranker-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-reranker-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
}
DEFAULT_PRESET = "tiny-cpu"
NO_MEANING = ("NOTE: no --model given; using the embedded default, a seeded RANDOM-weight Qwen3 "
              "({preset}). Its scores and selections carry no meaning.")
#: why the embedded default cannot be built under ``python -OO`` (``docstrings_kept``)
NO_DOCSTRINGS = ("python -OO strips docstrings, and transformers' model classes (Qwen3ForCausalLM, which builds "
                 "the embedded default model) read theirs when they are defined")


def docstrings_kept() -> bool:
    """Whether this interpreter keeps docstrings: not under ``python -OO`` (``PYTHONOPTIMIZE=2``),
    where importing transformers' Qwen3ForCausalLM failed with "No `Args` or `Parameters` section
    is found in the docstring of `BaseModelOutputWithPast`" (its ``auto_docstring`` decorator).
    A checkpoint loads without that class (``from_pretrained``); ``-O`` keeps docstrings."""
    return sys.flags.optimize < 2


def _config_fields(base: dict) -> set:
    """The keywords a Qwen3Config reads: its constructor's parameters and attributes (this
    transformers' version), and those the presets pass (``rope_theta``, which newer versions fold
    into ``rope_parameters``; ``attn_implementation``)."""
    import inspect

    from transformers import Qwen3Config

    params = set(inspect.signature(Qwen3Config.__init__).parameters) - {"self", "args", "kwargs"}
    return params | set(Qwen3Config().to_dict()) | set(base)


def qwen3_config(preset: str = DEFAULT_PRESET, **overrides):
    from transformers import Qwen3Config

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    kw = dict(vocab_size=QWEN3_VOCAB, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
              attention_bias=False, attn_implementation="eager")
    kw.update(PRESETS[preset])
    unknown = sorted(set(overrides) - _config_fields(kw))
    if unknown:
        # Qwen3Config keeps any keyword as an attribute that nothing reads: a typo
        # (num_hidden_layer=2) benchmarked the preset unchanged, under the typo's name
        import difflib

        hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, _config_fields(kw), 1))
                 else repr(k) for k in unknown]
        raise ValueError(f"unknown Qwen3Config field(s) in the overrides: {', '.join(hints)}")
    kw.update(overrides)
    # the shape checks of a checkpoint's config.json, before Qwen3Config and the model see it: an
    # override such as hidden_size=-1, head_dim=0 or hidden_size=nan was an unnamed error from
    # inside torch's or transformers' constructors (`acarerank bench --override`: exit 1, not 2)
    from .arch import Qwen3Arch

    Qwen3Arch.from_config(kw)
    return Qwen3Config(**kw)


def check_model_fits(config, device) -> None:
    """ValueError when a ``Qwen3ForCausalLM`` of ``config`` cannot be built on ``device``: its
    float32 weights (it is built in float32, then cast to the run's dtype) take more than the
    device's memory (a GPU's total, the host's physical memory; ``device_memory_bytes``).

    Computed from the shape (``Qwen3Arch.num_parameters``) before anything is allocated: an
    override such as ``hidden_size=10**6`` (151,669 × 10**6 embedding weights alone, 565 GiB)
    allocated until the host ran out. A model under the cap may still not fit beside its
    activations and KV pages; the cap refuses what can never be built.
    """
    from .arch import Qwen3Arch
    from .cached_prefill import device_memory_bytes

    arch = Qwen3Arch.from_config(config)
    device = torch.device(device)
    n, total = arch.num_parameters(), device_memory_bytes(device)
    if total is not None and 4 * n > total:
        raise ValueError(f"a Qwen3 of hidden_size={arch.hidden_size}, intermediate_size={arch.intermediate_size}, "
                         f"num_hidden_layers={arch.num_layers}, vocab_size={arch.vocab_size} has {n:,} parameters: "
                         f"{4 * n / 2 ** 30:.4g} GiB as the float32 weights it is built with, more than the "
                         f"{total / 2 ** 30:.4g} GiB of {device.type} memory")


def build_default_model(preset: str = DEFAULT_PRESET, seed: int = 0, dtype=torch.float32, device="cpu", **overrides):
    """A transformers ``Qwen3ForCausalLM`` with seeded random weights (eval mode); a shape whose
    weights cannot fit the device's memory is a ValueError before any is allocated
    (``check_model_fits``).

    The weights are a function of (preset, overrides, seed) alone: they are drawn in float32 on
    the host from a seeded copy of the RNG state (the caller's stream is untouched), whatever
    the caller's ``torch.set_default_dtype`` / default device — a float64 default drew other
    numbers (a different model under the same seed), a "meta" default had no data to move.
    RuntimeError under ``python -OO`` (``docstrings_kept``).
    """
    if not docstrings_kept():
        raise RuntimeError(f"{NO_DOCSTRINGS}: run it under python or python -O, or load a checkpoint")
    from transformers import Qwen3ForCausalLM

    cfg = qwen3_config(preset, **overrides)
    check_model_fits(cfg, device)
    with torch.random.fork_rng(devices=[]), _float32_default(), torch.device("cpu"):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    return model.to(dtype=dtype, device=device).eval()


class _float32_default:
    """float32 as torch's default dtype inside the block, the caller's back after it. The
    default dtype is process-wide (torch has no per-thread one), so it is changed only where it
    is not float32 already: the usual caller sees nothing."""

    def __enter__(self):
        self.before = torch.get_default_dtype()
        if self.before != torch.float32:
            torch.set_default_dtype(torch.float32)

    def __exit__(self, *exc):
        if self.before != torch.float32:
            torch.set_default_dtype(self.before)
