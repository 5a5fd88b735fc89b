"""Qwen3's rotary tables: the inverse frequencies and the cos/sin scale a config's RoPE gives.

Every backend (the native ``qk_norm_rope`` kernel, the torch reference, the compiled layers)
reads the fp32 ``[T, d]`` cos/sin tables the runner builds from these, so a scaled RoPE is
applied by the tables alone. For positions p and ``inv_freq`` f ([d/2])::

    cos = cos(cat(p·f, p·f)) · attention_factor,   sin = sin(cat(p·f, p·f)) · attention_factor

The kinds, as transformers 5.x's ``modeling_rope_utils`` computes them (same fp32 op order, so the
tables agree with its ``Qwen3RotaryEmbedding`` bit for bit), θ the base, i = 0, 2, .., d-2:

* ``default``: f_i = θ^(-i/d), attention_factor 1;
* ``linear``: f_i = θ^(-i/d) / factor;
* ``yarn``: f = interp·(1 − m) + extrap·m with extrap_i = θ^(-i/d), interp_i = extrap_i / factor,
  m = 1 − clamp((j − low) / (high − low), 0, 1) over j = 0..d/2-1, [low, high] the dims that turn
  ``beta_fast`` (32) and ``beta_slow`` (1) times over ``original_max_position_embeddings``
  (floored / ceiled unless ``truncate`` is false); attention_factor given, else
  mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given, else
  mscale(factor) = 0.1·ln(factor) + 1 (1 for factor ≤ 1);
* ``llama3``: f_i / factor where the wavelength 2π/f_i exceeds original / low_freq_factor, f_i
  below original / high_freq_factor, smoothed between; attention_factor 1.

Not computed (refused in ``Qwen3Arch.from_config``): ``dynamic`` and ``longrope`` change the
frequencies with the longest position of each call in transformers, so a key cached at one
length would be rotated unlike the same key computed at another (the prefix cache reuses
keys across calls of any length); other kinds are not Qwen3's.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

#: the kinds the tables follow; transformers 5.x's ``ROPE_INIT_FUNCTIONS`` names
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
#: Qwen3Config's max_position_embeddings when config.json has none (the YaRN / llama3 default
#: ``original_max_position_embeddings`` and YaRN's ``factor: null`` ratio read it)
QWEN3_MAX_POSITIONS = 32768


@dataclass(frozen=True)
class RopeScaling:
    """A config's RoPE kind with every parameter resolved as transformers 5.x resolves it."""
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: Optional[int] = None
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def inv_freq(self, theta: float, head_dim: int, device=None) -> torch.Tensor:
        """fp32 [head_dim / 2] inverse frequencies (the module docstring's formulas)."""
        d = head_dim
        exponent = torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d
        base = theta ** exponent  # θ^(i/d)
        if self.rope_type == "yarn":
            extrap, interp = 1.0 / base, 1.0 / (self.factor * base)
            low, high = _yarn_correction_range(self.beta_fast, self.beta_slow, d, theta,
                                               self.original_max_position_embeddings, self.truncate)
            if low == high:
                high += 0.001  # transformers' guard against a zero-width ramp
            ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
            keep = 1 - ramp  # 1: the dimension keeps its frequency (extrapolation), 0: divided by factor
            return interp * (1 - keep) + extrap * keep
        inv = 1.0 / base
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv


def _yarn_correction_range(beta_fast, beta_slow, d, theta, original, truncate):
    """The dimensions (of d/2) whose wavelength turns ``beta_fast`` / ``beta_slow`` times over
    ``original`` positions: below ``low`` a dimension keeps its frequency, above ``high`` it is
    divided by factor."""
    def dim_of(rotations):
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, d - 1)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _number(key: str, value, *, minimum: Optional[float] = None, above: Optional[float] = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{key} must be >= {minimum:g}, got {value!r} (transformers' RoPE validation says so too)")
    if above is not None and value <= above:
        raise ValueError(f"{key} must be > {above:g}, got {value!r}")
    return float(value)


#: the keys transformers 5.x's RoPE validation knows per kind (required and optional)
_COMMON_KEYS = {"rope_type", "type", "factor", "rope_theta", "partial_rotary_factor"}
_KNOWN_KEYS = {"linear": _COMMON_KEYS,
               "yarn": _COMMON_KEYS | {"original_max_position_embeddings", "attention_factor", "beta_fast",
                                       "beta_slow", "mscale", "mscale_all_dim", "truncate"},
               "llama3": _COMMON_KEYS | {"original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}}


def rope_scaling_from(name: str, rope: dict, get) -> RopeScaling:
    """The ``RopeScaling`` of ``rope`` (the config's ``rope_scaling`` or ``rope_parameters`` object,
    called ``name`` in errors); ``get(key, default)`` reads the config's top level. ValueError
    naming the field for a kind not computed here or a parameter transformers would not run."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return RopeScaling()
    if rope_type not in SUPPORTED_ROPE_TYPES:
        why = ("its frequencies change with the longest position of each call in transformers, so a key "
               "cached at one length would be rotated unlike the same key at another (the prefix cache reuses "
               "keys across calls)" if rope_type in ("dynamic", "longrope") else "it is not a Qwen3 RoPE")
        raise ValueError(f"{name} {rope} is not supported: rope_type {rope_type!r} ({why}); the runner computes "
                         f"{', '.join(repr(t) for t in SUPPORTED_ROPE_TYPES)}")
    where = f"{name} {rope}: "
    unknown = sorted(set(rope) - _KNOWN_KEYS[rope_type])
    if unknown:  # a misspelt parameter would silently take its default (transformers logs them too)
        warnings.warn(f"{where}unrecognised key(s) {unknown} for rope_type {rope_type!r}: ignored, their parameters "
                      f"take their defaults (known: {sorted(_KNOWN_KEYS[rope_type])})", stacklevel=2)
    partial = rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
    if partial != 1.0:  # transformers' Qwen3 then rotates with tables narrower than a head: it raises
        raise ValueError(f"{where}partial_rotary_factor {partial!r} is not supported: Qwen3 rotates the whole head")
    if "factor" not in rope:
        raise ValueError(f"{where}no 'factor' ({rope_type} RoPE needs one; transformers refuses it too)")
    factor = rope["factor"]
    max_positions = get("max_position_embeddings", QWEN3_MAX_POSITIONS)
    original = None
    if rope_type in ("yarn", "llama3"):
        # a top-level original_max_position_embeddings wins over the object's (transformers 5.x's
        # standardize_rope_params, run when the model is built), else the object's, else
        # max_position_embeddings
        original = get("original_max_position_embeddings", rope.get("original_max_position_embeddings",
                                                                     max_positions))
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise ValueError(f"{where}original_max_position_embeddings must be a positive integer, got {original!r}")
        if factor is None and rope_type == "yarn":  # transformers 5.x: the ratio of the two context lengths
            if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
                raise ValueError(f"{where}factor is null and max_position_embeddings {max_positions!r} is not a "
                                 "positive integer to derive it from")
            factor = max_positions / original
    factor = _number(f"{where}factor", factor, minimum=1.0)
    if rope_type == "linear":
        return RopeScaling("linear", factor=factor)
    if rope_type == "llama3":
        missing = [k for k in ("low_freq_factor", "high_freq_factor") if k not in rope]
        if missing:
            raise ValueError(f"{where}no {missing} (llama3 RoPE needs them; transformers refuses it too)")
        low = _number(f"{where}low_freq_factor", rope["low_freq_factor"], above=0)
        high = _number(f"{where}high_freq_factor", rope["high_freq_factor"], above=low)
        return RopeScaling("llama3", factor=factor, original_max_position_embeddings=original,
                           low_freq_factor=low, high_freq_factor=high)
    # yarn; beta_fast / beta_slow: null or 0 is the paper's 32 / 1, as in transformers (`or`)
    beta_fast = _number(f"{where}beta_fast", rope.get("beta_fast") or 32, above=0)
    beta_slow = _number(f"{where}beta_slow", rope.get("beta_slow") or 1, above=0)
    if beta_fast < beta_slow:
        raise ValueError(f"{where}beta_fast {beta_fast:g} must be >= beta_slow {beta_slow:g} (transformers' RoPE "
                         "validation says so too)")
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"{where}truncate must be true or false, got {truncate!r}")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        for key, v in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
            if v is not None:
                _number(f"{where}{key}", v)
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    attention_factor = _number(f"{where}attention_factor", attention_factor, above=0)
    return RopeScaling("yarn", factor=factor, original_max_position_embeddings=original,
                       attention_factor=attention_factor, beta_fast=beta_fast, beta_slow=beta_slow, truncate=truncate)
