"""Qwen3 decoder runner over packed, grouped, prefix-shared batches; checkpoint loading."""
from .arch import Qwen3Arch
from .runner import KVCache, Qwen3Runner
from .weights import CheckpointError, Qwen3Weights, load_checkpoint, weights_from_hf

__all__ = ["CheckpointError", "Qwen3Arch", "KVCache", "Qwen3Runner", "Qwen3Weights", "load_checkpoint", "weights_from_hf"]
