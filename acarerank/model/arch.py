"""Qwen3 architecture numbers, read from a transformers config (object or config.json dict)."""
from __future__ import annotations

from dataclasses import dataclass

from .._validate import positive_int


@dataclass(frozen=True)
class Qwen3Arch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool = False

    @classmethod
    def from_config(cls, cfg) -> "Qwen3Arch":
        get = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        model_type = get("model_type")
        if model_type not in (None, "qwen3"):
            raise ValueError(f"acarerank runs Qwen3 decoders; this checkpoint's model_type is {model_type!r}")
        quant = get("quantization_config")
        if quant:  # e.g. Qwen's FP8 releases: fp8 weights with block scales the runner does not apply
            method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
            raise ValueError(f"quantized checkpoints are not supported (quantization_config, quant_method "
                             f"{method!r}): the runner reads float32 / bfloat16 / float16 weights")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            v = get(key)
            positive_int(f"config field {key!r}", v)
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        # transformers >= 5 keeps RoPE in rope_parameters, which wins over a top-level rope_theta
        # (4.x's key, still read) and takes rope_scaling's type; neither given: Qwen3Config's
        # default, 10,000 (Qwen3-Reranker's config says 1,000,000)
        params = get("rope_parameters")
        for key, value in (("rope_parameters", params), ("rope_scaling", get("rope_scaling"))):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ValueError(f"config field {key!r} must be an object, got {value!r}")
            if value.get("rope_type", value.get("type", "default")) != "default":
                raise ValueError(f"{key} {value} is not supported (Qwen3-Reranker uses the default RoPE)")
        rope_theta = (params or {}).get("rope_theta", get("rope_theta"))
        rope_theta = 10000.0 if rope_theta is None else rope_theta
        if (isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float))
                or not 0 < rope_theta < float("inf")):
            raise ValueError(f"config field 'rope_theta' must be a positive finite number, got {rope_theta!r}")
        act = get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # transformers' ACT2FN: "swish" is SiLU too
            raise ValueError(f"hidden_act {act!r} is not supported: the runner's MLP is SiLU(gate)·up, as Qwen3's")
        _check_no_sliding_window(get, get("num_hidden_layers"))
        arch = cls(
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get("intermediate_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or hidden // heads,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", False)),
        )
        if arch.num_heads % arch.num_kv_heads:
            raise ValueError(f"num_attention_heads {arch.num_heads} is not a multiple of num_key_value_heads {arch.num_kv_heads}")
        return arch


def _check_no_sliding_window(get, num_layers: int) -> None:
    """ValueError when the config makes transformers run sliding-window attention in some layer.

    transformers' Qwen3 rule: the window is ``sliding_window`` when ``use_sliding_window`` is true
    (else none), and a layer uses it when ``layer_types`` says "sliding_attention" (default: the
    layers from ``max_window_layers``, 28, on). The runner attends to every earlier token, so such
    a checkpoint would score differently from transformers' forward on inputs past the window.
    Qwen3 and Qwen3-Reranker set ``use_sliding_window: false``.
    """
    window = get("sliding_window") if get("use_sliding_window", False) else None
    if window is None:
        return
    types = get("layer_types")
    if types is None:
        first = get("max_window_layers", 28)
        sliding = [i for i in range(num_layers) if i >= first]
    else:
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding:
        raise ValueError(f"sliding-window attention (use_sliding_window with sliding_window={window}, in layers "
                         f"{sliding[:8]}{'...' if len(sliding) > 8 else ''}) is not supported: the runner attends to "
                         f"every earlier token, as Qwen3-Reranker (use_sliding_window: false) does")
