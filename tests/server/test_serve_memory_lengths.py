"""``acarerank serve`` under traffic whose every request has its own length: RSS stays flat.

Each pass's token count is a new GEMM row count, and the libraries under the ops generate code
per shape and keep it (docs/cpu.md, "Memory: oneDNN's caches"; csrc/cpu/attn_tiles.h, "GEMMs"). A
server that does not bound them climbs for its first thousands of requests: +330 MB here (the
tiny checkpoint, fp32, passes of at most 256 tokens, oneDNN's default cache sizes, EPYC
2026-12-02), against +26 MB (fp32) and +13 MB (bf16) with the package's bounds.

The server is started as a user would start it: without the cache variables this test process
has (importing acarerank set them here), so only the server's own import bounds its caches.
"""
import asyncio
import contextlib
import os
import random

import pytest
from _optional import require

require("httpx", "fastapi", "uvicorn")

import httpx  # noqa: E402

from acarerank._onednn_env import VARIABLES  # noqa: E402
from serve_util import rss_mb, serve_subprocess, tiny_model  # noqa: E402

# 200 requests: passes are at most 256 tokens (--max-batch-tokens), so the row counts a cache could
# key on are few and most have come by then. With oneDNN's default capacities (1,024 entries) the
# server grew by +79 MB (fp32) / +83 MB (bf16) over the first 100 requests, +213 / +239 MB over
# 400 and +263 / +283 MB over 1,200; with the package's bound it was flat after the first 100
# (+4 to +5 MB) (Xeon, 2026-12). 1,200 requests took 14 s a dtype there and told nothing more.
# These 200 (50, then 2 x 75): +159 / +158 MB at 1,024 entries, +6 / +4 MB bounded (EPYC, 2026-12-07).
WARMUP, ROUNDS, PER_ROUND = 50, 2, 75
BOUND_MB = 64     # growth from the server's start to the end, over 200 requests


@contextlib.contextmanager
def _without(names):
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_requests_of_every_length_leave_memory_flat(tmp_path, dtype):
    tiny_model().save_pretrained(tmp_path)
    rnd = random.Random(0)

    def body():
        return dict(query="q " * rnd.randint(1, 30),
                    documents=["w " * rnd.randint(1, 300) for _ in range(rnd.randint(1, 4))])

    async def send(base, n):
        sem = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            async def one():
                async with sem:
                    r = await c.post("/v1/rerank", json=body())
                    assert r.status_code == 200, r.text
            await asyncio.gather(*(one() for _ in range(n)))

    with contextlib.ExitStack() as stack:
        with _without(VARIABLES):
            base, proc = stack.enter_context(serve_subprocess(
                "--model", str(tmp_path), "--dtype", dtype, "--max-batch-tokens", "256", "--cache-budget", "512",
                "--max-queue", "16", "--log-level", "warning"))
        start = rss_mb(proc.pid)
        seen = [start]
        for n in [WARMUP] + [PER_ROUND] * ROUNDS:
            asyncio.run(send(base, n))
            seen.append(rss_mb(proc.pid))
    total = WARMUP + ROUNDS * PER_ROUND
    print(f"{dtype}: RSS {' -> '.join(f'{s:.0f}' for s in seen)} MB over {total:,} requests of random lengths")
    assert seen[-1] - start < BOUND_MB, (f"{dtype}: {total:,} requests of random lengths grew the server's RSS from "
                                         f"{start:.0f} to {seen[-1]:.0f} MB (over {BOUND_MB} MB; after each round: "
                                         f"{', '.join(f'{s:.0f}' for s in seen[1:])}): something keeps state per shape")
