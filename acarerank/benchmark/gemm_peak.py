"""The machine's GEMM peak in one dtype, measured at the model's own linear-layer shapes.

``acarerank bench`` reads each provider's achieved FLOP rate against this number (the
"%peak" column): end-to-end scoring cannot beat the GEMMs it is made of, so a fraction
near 1 means nothing but the GEMMs is left to speed up. The peak is measured in the same
run as the latencies (same machine load, same threads), as the GEMM of ``rows`` activation
rows against each of the model's four weight shapes of one layer:

    qkv: [H → (Hq + 2·Hkv)·d],  o: [Hq·d → H],  gate_up: [H → 2·I],  down: [I → H]

by each way this CPU offers in that dtype: ``F.linear``, and the weight reordered once for
oneDNN where it can be (``acarerank.ops.linear``, what the runner's linear layers use), so the
runner's own GEMMs can never read as above the peak. GFLOP/s = 2·rows·K·N / t with t the
fastest of ``repeats`` calls of either after one warm-up call each; the peak is the largest
over the four shapes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.linear import onednn_why_unavailable, prepare_linear_weight
from ..ops.linear import linear as packed_linear
from .measure import timed_call
from .report import Shapes

#: activation rows per GEMM: the CPU pass size of ``PointwiseReranker`` (2,048 segment tokens)
DEFAULT_ROWS = 2048


def linear_shapes(sh: Shapes) -> dict:
    """{name: (K, N)} of one layer's linear layers (input features K, output features N)."""
    return {"qkv": (sh.hidden, (sh.heads + 2 * sh.kv_heads) * sh.head_dim), "o": (sh.heads * sh.head_dim, sh.hidden),
            "gate_up": (sh.hidden, 2 * sh.intermediate), "down": (sh.intermediate, sh.hidden)}


@torch.inference_mode()
def gemm_peak(sh: Shapes, dtype: torch.dtype, device="cpu", rows: int = DEFAULT_ROWS, repeats: int = 5,
              seed: int = 0) -> dict:
    """{"peak_gflops": float, "per_shape": {name: GFLOP/s}, "rows": rows, "dtype": name,
    "ways": "F.linear" or "F.linear | oneDNN-packed" (what was timed)}."""
    if rows < 1 or repeats < 1:
        raise ValueError(f"rows and repeats must be >= 1, got {rows}, {repeats}")
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    per = {}
    packed = dev.type == "cpu" and not onednn_why_unavailable(dtype)
    for name, (K, N) in linear_shapes(sh).items():
        x = torch.randn(rows, K, generator=gen, device=dev).to(dtype)
        w = (torch.randn(N, K, generator=gen, device=dev) / K ** 0.5).to(dtype)
        ways = [lambda: F.linear(x, w)]
        if packed:
            pw = prepare_linear_weight(w, "onednn")
            ways.append(lambda: packed_linear(x, pw))
        best = float("inf")
        for way in ways:
            way()  # warm-up: first-call packing / kernel selection
            best = min([best] + [timed_call(way, dev)[1] for _ in range(repeats)])
        per[name] = 2.0 * rows * K * N / best / 1e9
    return {"peak_gflops": max(per.values()), "per_shape": per, "rows": rows,
            "dtype": str(dtype).replace("torch.", ""), "ways": "F.linear | oneDNN-packed" if packed else "F.linear"}


def best_of(*peaks: dict) -> dict:
    """Several ``gemm_peak`` results of one dtype and row count merged: each shape's fastest rate
    (a measurement on a shared machine is only ever slowed down by other work, e.g. a server
    still warming up), and the peak recomputed from those."""
    if not peaks or len({(p["dtype"], p["rows"]) for p in peaks}) != 1:
        raise ValueError("best_of needs one or more gemm_peak results of one dtype and row count")
    per = {name: max(p["per_shape"][name] for p in peaks) for name in peaks[0]["per_shape"]}
    return dict(peaks[0], per_shape=per, peak_gflops=max(per.values()))
