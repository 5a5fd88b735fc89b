"""Checks on the dtype and device a caller asks a model to be loaded with."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_dtype_device(dtype, device) -> torch.device:
    """Return ``torch.device(device)``; TypeError for a non-float dtype, ValueError for a bad or absent device."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of torch.float32, torch.float16, torch.bfloat16; got {dtype!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a valid torch device: {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available on this machine")
    return dev
