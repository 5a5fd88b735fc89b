"""Qwen3 architecture numbers, read from a transformers config (object or config.json dict)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .._validate import positive_int
from .rope import QWEN3_MAX_POSITIONS, RopeScaling, rope_scaling_from

#: transformers' Qwen3Config defaults (4.x and 5.x alike) for shape fields a config.json may omit:
#: an absent head_dim is 128 (not hidden_size / num_attention_heads) and an absent
#: num_key_value_heads is 32 (an explicit null is num_attention_heads)
QWEN3_SHAPE_DEFAULTS = {"head_dim": 128, "num_key_value_heads": 32}
#: layer_types entries Qwen3's decoder runs (its forward picks each layer's mask by this name and has
#: only these two); "attention": transformers' legacy name, read as "full_attention"
QWEN3_LAYER_TYPES = ("full_attention", "sliding_attention", "attention")
#: Qwen3Config's sliding_window when use_sliding_window is true and config.json has no sliding_window
#: key (transformers 4.51+ and 5.x alike; an explicit null is no window)
QWEN3_SLIDING_WINDOW = 4096


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
    #: the RoPE kind and its parameters (default RoPE: ``RopeScaling()``); see rope.py
    rope: RopeScaling = RopeScaling()
    #: config keys that were absent and took ``QWEN3_SHAPE_DEFAULTS``' value (named in shape errors)
    defaulted: tuple = field(default=(), compare=False)
    #: the positions the model is made for (``max_positions_of``): no pass of the runner reaches
    #: past it, and every reranker's prompt caps are checked against it (docs/input-safety.md)
    max_positions: int = QWEN3_MAX_POSITIONS

    @classmethod
    def from_config(cls, cfg) -> "Qwen3Arch":
        get = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        has = (lambda k: k in cfg) if isinstance(cfg, dict) else (lambda k: hasattr(cfg, k))
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
        for key in ("tie_word_embeddings", "attention_bias", "use_sliding_window"):
            # bool("false") is True: a quoted flag once tied an untied model's output layer to its embedding
            if not isinstance(get(key, False), bool):
                raise ValueError(f"config field {key!r} must be true or false, got {get(key)!r} (transformers' "
                                 "Qwen3Config refuses it too)")
        eps = get("rms_norm_eps", 1e-6)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
            raise ValueError(f"config field 'rms_norm_eps' must be a finite number >= 0, got {eps!r}")
        # transformers >= 5 keeps RoPE in rope_parameters, but a non-empty rope_scaling (4.x's name)
        # replaces it whole; rope_theta is the chosen object's, else the top-level key (4.x's), else
        # Qwen3Config's default, 10,000 (Qwen3-Reranker's config says 1,000,000). So a
        # rope_scaling {"rope_type": "default"} beside rope_parameters' theta runs at 10,000 there.
        # Scaled kinds (rope.py) are read as transformers 5.x reads them; 4.x differed (its YaRN
        # replaced an explicit factor by max_position_embeddings / original_max_position_embeddings).
        params, scaling = get("rope_parameters"), get("rope_scaling")
        for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ValueError(f"config field {key!r} must be an object, got {value!r}")
            per_type = sorted(k for k, v in value.items() if isinstance(v, dict))
            if per_type:  # transformers' form for models whose layer types rotate differently
                raise ValueError(f"{key} {value} gives RoPE per layer type ({per_type}), which is not supported: "
                                 "Qwen3 has one RoPE for every layer (transformers' Qwen3 cannot run it either)")
        chosen = "rope_scaling" if scaling else "rope_parameters"
        if scaling and params and scaling != params and _rope_type(params) != "default":
            raise ValueError(f"rope_scaling {scaling} replaces rope_parameters {params} whole (transformers 5), so "
                             f"its rope_type {_rope_type(params)!r} would be ignored: give the RoPE in one of them")
        rope = rope_scaling_from(chosen, scaling or params or {}, get)
        rope_theta = (scaling or params or {}).get("rope_theta", get("rope_theta"))
        rope_theta = 10000.0 if rope_theta is None else rope_theta
        if (isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float))
                or not 0 < rope_theta < float("inf")):
            raise ValueError(f"config field 'rope_theta' must be a positive finite number, got {rope_theta!r}")
        act = get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # transformers' ACT2FN: "swish" is SiLU too
            raise ValueError(f"hidden_act {act!r} is not supported: the runner's MLP is SiLU(gate)·up, as Qwen3's")
        max_positions = max_positions_of(get("max_position_embeddings", QWEN3_MAX_POSITIONS), rope)
        _check_layer_types(get("layer_types"), get("num_hidden_layers"))
        _check_no_sliding_window(get, get("num_hidden_layers"))
        defaulted = tuple(k for k in QWEN3_SHAPE_DEFAULTS if not has(k))
        head_dim = positive_int("config field 'head_dim'", get("head_dim", QWEN3_SHAPE_DEFAULTS["head_dim"]))
        if head_dim % 2:  # RoPE rotates the two halves of a head into each other
            raise ValueError(f"config field 'head_dim' must be even (RoPE rotates a head's two halves), got {head_dim} "
                             "(transformers' Qwen3Config refuses it too)")
        kv_heads = get("num_key_value_heads", QWEN3_SHAPE_DEFAULTS["num_key_value_heads"])
        kv_heads = heads if kv_heads is None else positive_int("config field 'num_key_value_heads'", kv_heads)
        arch = cls(
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get("intermediate_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(eps),
            rope_theta=float(rope_theta),
            tie_word_embeddings=get("tie_word_embeddings", False),
            attention_bias=get("attention_bias", False),
            rope=rope,
            defaulted=defaulted,
            max_positions=max_positions,
        )
        if arch.num_heads % arch.num_kv_heads:
            raise ValueError(f"num_attention_heads {arch.num_heads} is not a multiple of num_key_value_heads "
                             f"{arch.num_kv_heads}" + arch.default_note("num_key_value_heads"))
        return arch

    def num_parameters(self) -> int:
        """Parameters of transformers' ``Qwen3ForCausalLM`` of this shape (H hidden, I intermediate,
        V vocab, d head_dim, L layers; tied embeddings counted once)::

            V·H·(1 if tied else 2) + H + L·(H·(Hq + 2·Hkv)·d + Hq·d·H + 3·H·I + 2·d + 2·H
                                            + (Hq + 2·Hkv)·d + H if attention_bias)

        (q/k/v/o projections, gate/up/down, q/k norms, the two layer norms, the final norm)."""
        H, d, hq, hkv = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads
        layer = H * (hq + 2 * hkv) * d + hq * d * H + 3 * H * self.intermediate_size + 2 * d + 2 * H
        if self.attention_bias:
            layer += (hq + 2 * hkv) * d + H
        return self.vocab_size * H * (1 if self.tie_word_embeddings else 2) + H + self.num_layers * layer

    def default_note(self, *keys) -> str:
        """A sentence for an error message about ``keys``: which of them the config did not give."""
        return "".join(f"; the config has no {k!r}, so it is transformers' Qwen3Config default "
                       f"{QWEN3_SHAPE_DEFAULTS[k]} — is {k} missing from config.json?"
                       for k in keys if k in self.defaulted)


def max_positions_of(max_position_embeddings, rope: RopeScaling) -> int:
    """The longest sequence (prompt + generated tokens) the model is made for, vLLM's
    ``max_model_len`` rule: ``max_position_embeddings`` (Qwen3Config's 32,768 when absent); with
    ``linear`` RoPE times ``factor``; with ``yarn`` at least ``original_max_position_embeddings`` ×
    ``factor`` (Qwen3's card: 32,768 × 4 = 131,072 over its 40,960; transformers 5.x's own form,
    ``factor: null``, gives max_position_embeddings itself); with ``llama3`` max_position_embeddings
    unscaled (Llama 3.1's is already the long length, 131,072 over 8,192 × 8; vLLM scales no
    llama3 config). Past it RoPE rotates by angles the model never saw: a plausible score and no error."""
    n = positive_int("config field 'max_position_embeddings'", max_position_embeddings)
    if rope.rope_type == "linear":
        return int(n * rope.factor)
    if rope.rope_type == "yarn":
        return max(n, int(rope.original_max_position_embeddings * rope.factor))
    return n


def _rope_type(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def _check_layer_types(types, num_layers: int) -> None:
    """ValueError when ``layer_types`` is not one Qwen3 layer type per layer: transformers'
    Qwen3Config refuses a length other than ``num_hidden_layers`` (and names outside its list);
    a shorter list once left the missing layers' sliding window unchecked, a longer one named
    layers the model does not have."""
    if types is None:
        return
    if not isinstance(types, (list, tuple)) or not all(isinstance(t, str) for t in types):
        raise ValueError(f"config field 'layer_types' must be a list of layer type names, got {types!r}")
    if len(types) != num_layers:
        raise ValueError(f"config field 'layer_types' has {len(types)} entries but num_hidden_layers is {num_layers}: "
                         "one per layer (transformers' Qwen3Config refuses it too)")
    unknown = sorted(set(types) - set(QWEN3_LAYER_TYPES))
    if unknown:
        raise ValueError(f"config field 'layer_types' has {unknown}, not a Qwen3 layer type "
                         f"({', '.join(QWEN3_LAYER_TYPES)}): the runner computes Qwen3's attention layers only")


def _check_no_sliding_window(get, num_layers: int) -> None:
    """ValueError when the config makes transformers run sliding-window attention in some layer.

    transformers' Qwen3 rule: the window is ``sliding_window`` (4,096 when the key is absent) when
    ``use_sliding_window`` is true (else none), and a layer uses it when ``layer_types`` says
    "sliding_attention" (default: the layers from ``max_window_layers``, 28, on, if there is a
    window). The runner attends to every earlier token, so such a checkpoint would score
    differently from transformers' forward on inputs past the window; a "sliding_attention" layer
    with no window is refused too (transformers' forward raises on it). Qwen3 and Qwen3-Reranker
    set ``use_sliding_window: false``.
    """
    # an absent sliding_window is Qwen3Config's default window (4,096), an explicit null none
    window = get("sliding_window", QWEN3_SLIDING_WINDOW) if get("use_sliding_window", False) else None
    types = get("layer_types")
    if types is None:
        first = get("max_window_layers", 28)
        if not isinstance(first, int) or isinstance(first, bool):
            raise ValueError(f"config field 'max_window_layers' must be an int, got {first!r}")
        # a range, not a list: num_hidden_layers is not bounded yet (10**8 built 4.5 GB here first)
        sliding = range(min(max(first, 0), num_layers), num_layers) if window is not None else range(0)
    else:
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if not sliding:
        return
    named = f"{list(sliding[:8])}{'...' if len(sliding) > 8 else ''}"
    if window is None:
        raise ValueError(f"layer_types makes layers {named} sliding_attention but the config gives no window "
                         f"(use_sliding_window {get('use_sliding_window', False)!r}, sliding_window "
                         f"{get('sliding_window')!r}): transformers' Qwen3 cannot run it either")
    raise ValueError(f"sliding-window attention (use_sliding_window with sliding_window={window}, in layers "
                     f"{named}) is not supported: the runner attends to every earlier token, as Qwen3-Reranker "
                     f"(use_sliding_window: false) does")
