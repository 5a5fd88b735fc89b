"""Benchmark: vocabulary-parallel ``topk_logprobs`` (``process_group=``) over gloo on CPU.

Default shape: T=512 rows, H=1,024, V=151,669, k=128, fp32; the lm_head split over W=2 and
W=4 ranks as Megatron does it: V padded to a multiple of 128 · W (151,808 rows for W=2 and 4),
rank r holding rows [r · V_pad/W, (r+1) · V_pad/W), ``vocab_size=V`` leaving the padding rows
out. Providers, on the same inputs:

  single      (a) the single-process op on the full weight, in one process
  sharded     ours: each rank its shard, one header all-gather + one all-gather of the k best
              (logit, id), lse and target logit per row (acarerank/ops/vocab_parallel.py)
  gathered    (b) each rank computes its [T, V_r] logits, all-gathers them into the full
              [T, V] logits on every rank, then top-k, logsumexp and the target gather

One thread per rank (torch.set_num_threads(1) in every rank, and in (a)): W=4 on a 2-core
machine oversubscribes the cores, so its times measure the machine, not the algorithm — read
the bytes and memory columns there.

Columns, per provider (max over ranks):
  median_ms       wall time of one call, all ranks started together (barrier), median of
                  --repeats, each sample the slowest rank's time
  payload_bytes   bytes this rank hands to collectives per call (counted by wrapping
                  torch.distributed.all_gather / all_reduce)
  sent_bytes      what one rank sends on a ring all-gather: payload × (W − 1)
  alloc_extra_mb  peak extra tensor bytes during one call (torch.profiler memory events:
                  bytes live at the peak minus bytes live before; inputs not counted)
  bytes_vs_gathered, mem_vs_gathered   ours / (b); targets ≤ 1 % and ≤ 5 %
and a check that every rank's result equals (a): ids equal, max |Δ log-prob|. (b) may show
ids_equal False: torch.topk orders exactly tied logits arbitrarily (2 of 512 rows at the
default shape), where the op's tie rule puts the lower id first.

    python bench/bench_vocab_parallel.py            # the default shape (W = 2 and 4)
    python bench/bench_vocab_parallel.py --quick    # tiny shapes, seconds
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from acarerank.benchmark.measure import alloc_peak_extra, machine_info

QUICK = dict(rows=32, hidden=64, vocab=4099, k=16, repeats=2)
FULL = dict(rows=512, hidden=1024, vocab=151669, k=128, repeats=3)
BYTES_TARGET, MEM_TARGET = 0.01, 0.05
BLOCK = 4096  # weight rows per seeded block: any rank can build its own rows alone
COLUMNS = ["provider", "world", "rows", "hidden", "vocab", "k", "threads_per_rank", "median_ms", "p20_ms", "p80_ms",
           "payload_bytes", "sent_bytes", "alloc_extra_mb", "bytes_vs_gathered", "mem_vs_gathered", "ids_equal",
           "max_abs_logprob_diff", "device_name", "python", "torch", "triton", "machine"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (smoke run)")
    for name in ("rows", "hidden", "vocab", "k", "repeats"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--worlds", default="2,4", help="comma list of world sizes")
    p.add_argument("--csv", type=Path, default=None)
    args = p.parse_args(argv)
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.worlds = [int(w) for w in args.worlds.split(",")]
    if args.csv is None:
        args.csv = Path("results") / "bench_vocab_parallel" / ("quick.csv" if args.quick else "vocab_parallel.csv")
    return args


# ----------------------------------------------------------------------------- inputs
def make_hidden_targets(rows, hidden, vocab, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g) / hidden ** 0.5 * 4
    return h, torch.randint(0, vocab, (rows,), generator=g)


def padded_vocab(vocab, world, multiple=128):
    """Megatron's padded vocabulary: the next multiple of ``multiple`` · world."""
    m = multiple * world
    return -(-vocab // m) * m


def weight_rows(start, stop, hidden, seed=0):
    """Rows [start, stop) of the seeded [V, H] weight, built block by block."""
    import torch

    parts = []
    for b in range(start // BLOCK, -(-stop // BLOCK)):
        blk = torch.randn(BLOCK, hidden, generator=torch.Generator().manual_seed(seed * 1_000_003 + b))
        lo, hi = max(start, b * BLOCK) - b * BLOCK, min(stop, (b + 1) * BLOCK) - b * BLOCK
        parts.append(blk[lo:hi])
    return torch.cat(parts) if parts else torch.empty(0, hidden)


# ----------------------------------------------------------------------------- providers
def gathered_topk(h, w_shard, tg, k, group, vocab):
    """(b): all-gather the full [T, V] logits on every rank, then what topk_logprobs computes."""
    import torch
    import torch.distributed as dist

    from acarerank.ops.topk_logprobs import finalize

    W = dist.get_world_size(group)
    z = h @ w_shard.T  # [T, V_r] fp32
    full = torch.empty((W,) + tuple(z.shape))
    dist.all_gather(list(full.unbind(0)), z, group=group)
    logits = full.permute(1, 0, 2).reshape(z.shape[0], -1)[:, :vocab]  # [T, V]: one copy, as torch.cat would
    top = logits.topk(k, dim=1)
    lse = torch.logsumexp(logits, dim=1)
    tz = logits.gather(1, tg[:, None]).squeeze(1)
    return finalize(top.values, top.indices, tz, lse, tg)


class CommCounter:
    """Counts the bytes each collective call hands over (wraps dist.all_gather / all_reduce)."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.bytes, self._orig = dist, 0, {}

    def __enter__(self):
        for name in ("all_gather", "all_reduce"):
            orig = getattr(self.dist, name)
            self._orig[name] = orig

            def wrapped(*a, _orig=orig, _name=name, **kw):
                t = a[1] if _name == "all_gather" else a[0]
                self.bytes += t.numel() * t.element_size()
                return _orig(*a, **kw)
            setattr(self.dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(self.dist, name, orig)


def _rank_main(rank, world, init_file, args, ref_path, out_path):
    import torch
    import torch.distributed as dist

    from acarerank.ops import topk_logprobs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.group.WORLD
    V, k = args.vocab, args.k
    step = padded_vocab(V, world) // world  # Megatron: equal shards of the padded vocabulary
    h, tg = make_hidden_targets(args.rows, args.hidden, V)
    w = weight_rows(rank * step, (rank + 1) * step, args.hidden)
    ref = torch.load(ref_path)
    fns = {"sharded": lambda: topk_logprobs(h, w, tg, k=k, process_group=group, vocab_size=V),
           "gathered": lambda: gathered_topk(h, w, tg, k, group, V)}
    rows = []
    for name, fn in fns.items():
        fn()  # warm-up
        with CommCounter() as cc:
            out = fn()
        times = []
        for _ in range(args.repeats):
            dist.barrier(group)
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        dist.barrier(group)
        _, peak = alloc_peak_extra(fn)
        rows.append(dict(provider=name, times=times, payload=cc.bytes, peak=peak,
                         ids_equal=bool(torch.equal(out.topk_ids, ref["ids"])),
                         diff=max(float((out.topk_logprobs - ref["topk_logprobs"]).abs().max()),
                                  float((out.target_logprob - ref["target_logprob"]).abs().max()))))
    gathered = [None] * world
    dist.all_gather_object(gathered, rows, group=group)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def _summary(per_rank, world):
    """Max over ranks per provider; each timing sample is the slowest rank's."""
    out = {}
    for i, name in enumerate(r["provider"] for r in per_rank[0]):
        rs = [pr[i] for pr in per_rank]
        samples = sorted(max(t) for t in zip(*(r["times"] for r in rs)))
        q = statistics.quantiles(samples, n=5) if len(samples) > 1 else samples * 4
        payload = max(r["payload"] for r in rs)
        out[name] = dict(median_ms=statistics.median(samples), p20_ms=q[0], p80_ms=q[-1], payload_bytes=payload,
                         sent_bytes=payload * (world - 1), alloc_extra_mb=max(r["peak"] for r in rs) / 2 ** 20,
                         ids_equal=all(r["ids_equal"] for r in rs), max_abs_logprob_diff=max(r["diff"] for r in rs))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    from acarerank.ops import topk_logprobs

    torch.set_num_threads(1)
    info = machine_info("cpu")
    base = dict(rows=args.rows, hidden=args.hidden, vocab=args.vocab, k=args.k, threads_per_rank=1, **info)
    table = []
    with tempfile.TemporaryDirectory(prefix="bench_vp_") as tmp:
        # -- (a) the single-process op on the full weight; its result is every rank's yardstick
        h, tg = make_hidden_targets(args.rows, args.hidden, args.vocab)
        w = weight_rows(0, args.vocab, args.hidden)
        fn = lambda: topk_logprobs(h, w, tg, k=args.k)  # noqa: E731
        ref = fn()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        _, peak = alloc_peak_extra(fn)
        ref_path = os.path.join(tmp, "ref.pt")
        torch.save({"ids": ref.topk_ids, "topk_logprobs": ref.topk_logprobs, "target_logprob": ref.target_logprob},
                   ref_path)
        del w
        times.sort()
        q = statistics.quantiles(times, n=5) if len(times) > 1 else times * 4
        table.append(dict(base, provider="single", world=1, median_ms=statistics.median(times), p20_ms=q[0],
                          p80_ms=q[-1], payload_bytes=0, sent_bytes=0, alloc_extra_mb=peak / 2 ** 20, ids_equal=True,
                          max_abs_logprob_diff=0.0))
        for world in args.worlds:
            out_path = os.path.join(tmp, f"w{world}.json")
            mp.start_processes(_rank_main, args=(world, os.path.join(tmp, f"store{world}"), args, ref_path, out_path),
                               nprocs=world, join=True, start_method="spawn")
            with open(out_path) as f:
                summ = _summary(json.load(f), world)
            g = summ["gathered"]
            for name in ("sharded", "gathered"):
                row = dict(base, provider=name, world=world, **summ[name])
                row["bytes_vs_gathered"] = row["payload_bytes"] / g["payload_bytes"]
                row["mem_vs_gathered"] = row["alloc_extra_mb"] / g["alloc_extra_mb"]
                table.append(row)
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        wr.writeheader()
        wr.writerows(table)
    print(f"T={args.rows} H={args.hidden} V={args.vocab} k={args.k} fp32, gloo, 1 thread per rank "
          f"({os.cpu_count()} cpus: world > cpus oversubscribes); targets: bytes ≤ {BYTES_TARGET:.0%}, "
          f"peak extra memory ≤ {MEM_TARGET:.0%} of (b) 'gathered'")
    print(f"{'provider':<9} {'W':>2} {'median ms':>10} {'payload/rank':>13} {'sent/rank':>11} {'peak extra MB':>14} "
          f"{'bytes vs b':>10} {'mem vs b':>9} {'ids eq':>6} {'max |Δlp|':>9}")
    for r in table:
        bvb = f"{r['bytes_vs_gathered']:.3%}" if "bytes_vs_gathered" in r else "-"
        mvb = f"{r['mem_vs_gathered']:.2%}" if "mem_vs_gathered" in r else "-"
        print(f"{r['provider']:<9} {r['world']:>2} {r['median_ms']:>10.1f} {r['payload_bytes']:>13,} "
              f"{r['sent_bytes']:>11,} {r['alloc_extra_mb']:>14.2f} {bvb:>10} {mvb:>9} {str(r['ids_equal']):>6} "
              f"{r['max_abs_logprob_diff']:>9.2e}")
    print(f"CSV: {args.csv}")
    ok = all(r["ids_equal"] for r in table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
