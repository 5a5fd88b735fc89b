"""Shared test setup.

Without a GPU, Triton kernels run on the CPU under TRITON_INTERPRET=1; it must be set
before triton is first imported, hence here (conftest loads before any test module).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    from acarerank.tokenizer import load_qwen3_tokenizer
    return load_qwen3_tokenizer()
