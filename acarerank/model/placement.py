"""Checks on the dtype and device a caller asks a model to be loaded with."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_dtype_device(dtype, device) -> torch.device:
    """Return ``torch.device(device)``; TypeError for a non-float dtype, ValueError for a bad or absent device
    (anything but cpu and an existing cuda[:N])."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of torch.float32, torch.float16, torch.bfloat16; got {dtype!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a valid torch device: {e}") from e
    # the ops have CPU and CUDA backends only: another device type (mps, xpu, meta) once loaded the
    # whole checkpoint and then failed inside torch or the first op (exit 1, not a usage error)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: acarerank runs on cpu or cuda[:N], not {dev.type}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} asked for, but this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return dev
