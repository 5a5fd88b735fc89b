"""Inputs and ratio columns shared by the vocabulary-projection benchmarks
(``bench/bench_topk_logprobs.py``, ``bench/bench_linear_logprob.py``): one seeded input maker,
so both measure the same tensors, and one way to turn rows into target ratios."""
from __future__ import annotations

import torch


def make_inputs(rows: int, hidden: int, vocab: int, dtype, device, seed: int = 0):
    """(hidden [rows, H], lm_head weight [V, H], targets [rows] int64), seeded on the CPU so
    every device gets the same values; hidden scaled so logits have a realistic spread (std ≈ 4)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = (torch.randn(rows, hidden, generator=g) / hidden ** 0.5 * 4).to(device=device, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=g).to(device=device, dtype=dtype)
    tg = torch.randint(0, vocab, (rows,), generator=g).to(device)
    return h, w, tg


def add_ratios(results: dict, time_base: str, time_key: str, mem_key: str) -> None:
    """Per row: median time / the ``time_base`` row's (as ``time_key``) and, for kind alloc and
    rss, extra memory / the materialised row's (as ``mem_key.format(kind=...)``)."""
    base_ms = results.get(time_base, {}).get("median_ms")
    mat = results.get("materialised", {})
    for row in results.values():
        if "median_ms" not in row:
            continue
        if base_ms:
            row[time_key] = row["median_ms"] / base_ms
        for kind in ("alloc", "rss"):
            if mat.get(f"{kind}_extra_mb") and row.get(f"{kind}_extra_mb") is not None:
                row[mem_key.format(kind=kind)] = row[f"{kind}_extra_mb"] / mat[f"{kind}_extra_mb"]


__all__ = ["make_inputs", "add_ratios"]
