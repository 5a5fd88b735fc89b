"""Qwen3 weights in the layout the runner computes with.

Per layer, q/k/v projections are concatenated into one [(Hq+2·Hkv)·d, H] matrix and
gate/up into one [2·I, H] matrix: one GEMM each instead of three and two, which is what
matters on CPU. (So ``from_hf`` holds a copy of those matrices beside the HF model.)
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

from .arch import Qwen3Arch


@dataclass
class LayerWeights:
    input_norm: torch.Tensor      # [H]
    w_qkv: torch.Tensor           # [(Hq + 2·Hkv)·d, H]
    b_qkv: Optional[torch.Tensor]  # [(Hq + 2·Hkv)·d] when attention_bias
    q_norm: torch.Tensor          # [d]
    k_norm: torch.Tensor          # [d]
    w_o: torch.Tensor             # [H, Hq·d]
    post_norm: torch.Tensor       # [H]
    w_gate_up: torch.Tensor       # [2·I, H]
    w_down: torch.Tensor          # [H, I]


@dataclass
class Qwen3Weights:
    arch: Qwen3Arch
    embed: torch.Tensor           # [V, H]
    layers: list
    final_norm: torch.Tensor      # [H]
    lm_head: torch.Tensor         # [V, H] (the embedding itself when tied)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device


def _from_state_dict(arch: Qwen3Arch, sd: dict, dtype, device) -> Qwen3Weights:
    def take(name):
        if name not in sd:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return sd[name].to(device=device, dtype=dtype)

    layers = []
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        b_qkv = None
        if arch.attention_bias:
            b_qkv = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            w_qkv=torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
            b_qkv=b_qkv,
            q_norm=take(p + "self_attn.q_norm.weight"),
            k_norm=take(p + "self_attn.k_norm.weight"),
            w_o=take(p + "self_attn.o_proj.weight"),
            post_norm=take(p + "post_attention_layernorm.weight"),
            w_gate_up=torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
            w_down=take(p + "mlp.down_proj.weight"),
        ))
    embed = take("model.embed_tokens.weight")
    lm_head = embed if arch.tie_word_embeddings or "lm_head.weight" not in sd else take("lm_head.weight")
    if embed.shape != (arch.vocab_size, arch.hidden_size):
        raise ValueError(f"embed_tokens is {tuple(embed.shape)}, config says [{arch.vocab_size}, {arch.hidden_size}]")
    return Qwen3Weights(arch=arch, embed=embed, layers=layers, final_norm=take("model.norm.weight"), lm_head=lm_head)


def weights_from_hf(model) -> Qwen3Weights:
    """From an in-memory ``transformers`` Qwen3ForCausalLM (its dtype and device)."""
    if not hasattr(model, "config") or not hasattr(model, "state_dict"):
        raise TypeError(f"expected a transformers Qwen3ForCausalLM, got {type(model).__name__}")
    arch = Qwen3Arch.from_config(model.config)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    p = next(iter(sd.values()))
    return _from_state_dict(arch, sd, p.dtype, p.device)


def load_checkpoint(path: str, dtype=torch.float32, device="cpu") -> Qwen3Weights:
    """From a local HF checkpoint folder: config.json + *.safetensors (sharded or not)."""
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint folder {path!r} does not exist")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json")
    with open(cfg_path) as f:
        arch = Qwen3Arch.from_config(json.load(f))
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path!r} has no *.safetensors weights")
    sd = {}
    for f in files:
        sd.update(load_file(f, device="cpu"))
    sd = {k[len("base_model."):] if k.startswith("base_model.") else k: v for k, v in sd.items()}
    return _from_state_dict(arch, sd, dtype, torch.device(device))
