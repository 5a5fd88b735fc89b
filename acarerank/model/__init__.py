"""Qwen3 decoder runner over packed, grouped, prefix-shared batches; checkpoint loading."""
from .arch import Qwen3Arch
from .block_pool import BlockPool, PoolExhausted
from .paged_cache import PagedKVCache
from .prefix_cache import PrefixCache
from .runner import ContextLengthError, Qwen3Runner, SourceModelChangedError
from .weights import CheckpointError, Qwen3Weights, load_checkpoint, weights_from_hf

__all__ = ["CheckpointError", "ContextLengthError", "Qwen3Arch", "KVCache", "BlockPool", "PoolExhausted", "PagedKVCache", "PrefixCache",
           "Qwen3Runner", "Qwen3Weights", "SourceModelChangedError", "load_checkpoint", "weights_from_hf"]
