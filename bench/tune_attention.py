"""Write the fixed Triton attention configs (acarerank/kernels/attention_configs.json) on a GPU.

For each (head_dim, GQA ratio, dtype) of the Qwen3 family on this GPU's architecture, time
every candidate config (``candidate_configs``: the non-spilling rule config and its
neighbours) on two workloads the kernel serves — a pointwise batch (one 4,096-token prefix,
32 segments of 512 tokens) and a decode step (64 one-token segments over 2,048-token
prefixes) — check each candidate against the fp32 reference, and keep the one with the
smallest summed median time. The serving path never times anything: it reads the table
(``attention_config``), so every process uses the same config.

    python bench/tune_attention.py                       # all Qwen3 shapes, bf16 + fp16, writes the table
    python bench/tune_attention.py --head-dims 128 --gqa 4 --dtypes bfloat16 --print-only
    python bench/tune_attention.py --dry-run             # CPU: list the candidates per key, time nothing

Runs in ~2-4 minutes on an H100/H200 with a cold Triton cache (each candidate compiles once).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

QWEN3_GQA = (2, 4)  # 0.6B/1.7B: 16 q / 8 kv heads; 4B/8B: 32 q / 8 kv
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dims", type=lambda s: [int(x) for x in s.split(",")], default=[128])
    p.add_argument("--gqa", type=lambda s: [int(x) for x in s.split(",")], default=list(QWEN3_GQA))
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["bfloat16", "float16"])
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--print-only", action="store_true", help="print the winners, do not write the table")
    p.add_argument("--dry-run", action="store_true", help="list candidates per key; no GPU needed")
    return p.parse_args(argv)


def workloads(Hq, Hkv, d, dtype, dev):
    """(name, args) of the two timed batches; inputs random, metadata int32 on the device."""
    i32 = dict(dtype=torch.int32, device=dev)
    out = []
    for name, P, S, L in (("pointwise", 4096, 32, 512), ("decode", 2048, 64, 1)):
        G = 1 if name == "pointwise" else S
        T = S * L
        q = torch.randn(T, Hq, d, dtype=dtype, device=dev)
        k, v = (torch.randn(T, Hkv, d, dtype=dtype, device=dev) for _ in range(2))
        pk, pv = (torch.randn(G * P, Hkv, d, dtype=dtype, device=dev) for _ in range(2))
        cu = torch.arange(0, T + 1, L, **i32)
        cp = torch.arange(0, G * P + 1, P, **i32)
        sg = torch.zeros(S, **i32) if G == 1 else torch.arange(S, **i32)
        out.append((name, (q, k, v, cu, pk, pv, cp, sg)))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from acarerank.kernels import prefix_shared_attention as A

    if args.dry_run:
        for d in args.head_dims:
            for name in args.dtypes:
                for c in A.candidate_configs(d, DTYPES[name]):
                    print(f"d{d} {name}: BLOCK_M={c[0]} BLOCK_N={c[1]} warps={c[2]} stages={c[3]} "
                          f"acc_regs={A.acc_registers(c, d)} smem={A.smem_bytes(c, d, DTYPES[name]) // 1024} KB")
        return 0
    if not torch.cuda.is_available():
        print("tune_attention: needs a CUDA device (use --dry-run on CPU)", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    from acarerank.ops import prefix_shared_attention_ref

    dev = torch.device("cuda")
    arch = A._arch(dev)
    table = json.loads(Path(A._TABLE_PATH).read_text()) if Path(A._TABLE_PATH).exists() else {}
    for d in args.head_dims:
        for gqa in args.gqa:
            for name in args.dtypes:
                dtype = DTYPES[name]
                Hq, Hkv = gqa * args.kv_heads, args.kv_heads
                loads = workloads(Hq, Hkv, d, dtype, dev)
                best = None
                for cfg in A.candidate_configs(d, dtype):
                    total, ok = 0.0, True
                    for wname, a in loads:
                        fn = lambda a=a, cfg=cfg: A.prefix_shared_attention_triton(*a, 1 / math.sqrt(d), config=cfg)
                        try:
                            out = fn()
                        except Exception as e:  # out of resources on this GPU: not a candidate here
                            print(f"  {cfg}: {type(e).__name__}: {str(e)[:100]}")
                            ok = False
                            break
                        # fp32 reference on the first 4 segments (it loops in Python) and their groups
                        q, k, v, cu, pk, pv, cp, sg = a
                        n, g4 = int(cu[4]), int(sg[:4].max()) + 1
                        m = int(cp[g4])
                        ref = prefix_shared_attention_ref(q[:n].float(), k[:n].float(), v[:n].float(), cu[:5],
                                                          pk[:m].float(), pv[:m].float(), cp[:g4 + 1], sg[:4])
                        err = (out[:n].float() - ref).abs().max().item()
                        if err > 5e-2:
                            print(f"  {cfg}: error {err:.3e} on {wname}: rejected")
                            ok = False
                            break
                        total += do_bench(fn, warmup=10, rep=50, quantiles=[0.5])[0]
                    if ok:
                        print(f"{arch} d{d} gqa{gqa} {name} {cfg}: {total:.3f} ms")
                        if best is None or total < best[0]:
                            best = (total, cfg)
                if best is not None:
                    key = A.config_key(d, gqa, dtype, arch)
                    table[key] = list(best[1])
                    print(f"-> {key}: {best[1]} ({best[0]:.3f} ms)")
    if not args.print_only:
        Path(A._TABLE_PATH).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"wrote {A._TABLE_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
