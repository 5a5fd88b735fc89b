"""Compile every shipped Triton config ahead of time for a GPU architecture — no GPU, no driver —
and read the compiler's own resource report: registers, stack/local bytes (spills), shared memory.

    python bench/aot_check.py --arch 90,80            # one line per kernel and config; exit 1 on a spill
    python bench/aot_check.py --arch 90 --only attention --json

What is compiled (docs/ARCHITECTURE.md, "Kernel configs"): the attention kernel at its rule
config (``_rule_config``) for each dtype, head_dim class and arch, packed and paged, plus every
entry of ``acarerank/kernels/attention_configs.json``; the Triton top-k tile and merge kernels at
``gpu_tile_config`` / ``gpu_merge_config`` for each K class and dtype; the yes/no head at the
config its wrapper launches. ``triton.compile`` with a ``GPUTarget`` runs Triton's own pipeline
and its bundled ``ptxas``; the cubin's resource usage comes from Triton's bundled ``cuobjdump
--dump-resource-usage`` (REG, STACK, LOCAL), Triton's own metadata gives the dynamic shared
memory. A kernel fails when its stack frame or local memory is non-zero (register spills)
or its shared memory is over the architecture's per-block limit.

Compiled kernels land in Triton's cache (``TRITON_CACHE_DIR``, default ~/.triton/cache), so a
second run only reads the cubins back: ~2 s instead of minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile real GPU kernels, not interpreted functions
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is its default
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

#: dynamic shared memory one block may use (cudaFuncAttributeMaxDynamicSharedMemorySize limits)
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_for(fn, sig: dict, constexprs: dict, arch: int, **options):
    """``triton.compile`` of ``fn`` for sm_<arch>: ``sig`` types the runtime arguments (pointers
    and strides marked 16-divisible, as a real launch specializes them), the rest are constexprs."""
    names = fn.arg_names
    full = {n: sig.get(n, "constexpr") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t.startswith("*") or (n.startswith("stride") and not n.endswith("d"))}
    src = ASTSource(fn=fn, signature=full, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def resources(kernel) -> dict:
    """{reg, stack, local, shared} of a compiled kernel, from its cubin and Triton's metadata."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    fields = dict(kv.split(":", 1) for kv in line.split() if ":" in kv)
    return {"reg": int(fields["REG"]), "stack": int(fields["STACK"]), "local": int(fields["LOCAL"]),
            "shared": int(kernel.metadata.shared) + int(fields.get("SHARED", 0))}


# ---------------------------------------------------------------------------- what is shipped
def attention_cases(archs):
    from acarerank.kernels import prefix_shared_attention as A
    fn = A._prefix_shared_attn_fwd
    cases = []
    for arch in archs:
        for dtype in (torch.bfloat16, torch.float32):
            for d in (128, 256):  # the two head_dim classes of the rule (<= 128, <= 256)
                cfg = A._rule_config(d, dtype, f"sm{arch}")
                pages = (0, 16) if (dtype, d) == (torch.bfloat16, 128) else (0,)  # paged: Qwen3's hot config
                for page in pages:
                    cases.append((f"attention {DT[dtype]} d{d} gqa4 page{page} {cfg}", arch, fn,
                                  _attention_args(fn, dtype, d, 4, cfg, page)))
    for key, cfg in sorted(A._TABLE.items()):  # tuned entries: "sm90/bf16/d128/gqa4"
        arch_s, dt_s, d_s, g_s = key.split("/")
        arch = int(arch_s[2:])
        if arch in archs:
            dtype = {v: k for k, v in DT.items()}[dt_s]
            cases.append((f"attention table {key} {tuple(cfg)}", arch, fn,
                          _attention_args(fn, dtype, int(d_s[1:]), int(g_s[3:]), tuple(cfg), 0)))
    return cases


def _attention_args(fn, dtype, d, gqa, cfg, page):
    dt = DT[dtype]
    sig = {n: f"*{dt}" for n in ("Q", "K", "V", "PK", "PV", "Out")}
    sig.update({n: "*i32" for n in ("CU_SEQ", "CU_PRE", "SEG_GROUP", "WORK", "BT")})
    sig.update({n: "i32" for n in fn.arg_names if n.startswith("stride") and not n.endswith("d")})
    sig["qk_scale"] = "fp32"
    const = {n: 1 for n in fn.arg_names if n.startswith("stride") and n.endswith("d")}
    bm, bn, nw, ns = cfg
    const.update(HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), GQA=gqa, BLOCK_M=bm, BLOCK_N=bn,
                 DOT_FP32=False, IEEE=dtype == torch.float32, PAGE=page)
    return sig, const, {"num_warps": nw, "num_stages": ns}


def topk_cases(archs):
    from acarerank.kernels import topk_logprobs as K_
    tiles, merge = K_._topk_tiles_kernel, K_._topk_merge_kernel
    cases = []
    for arch in archs:
        # K classes of gpu_tile_config: <= 128 (ATO's 128), 256, 512 (the backend's limit); fp16 = bf16's code
        for dtype in (torch.bfloat16, torch.float32):
            for K in (128, 256, K_.MAX_K) if arch == 90 else (128,):
                bt, bv, bh, nw = K_.gpu_tile_config(K, dtype)
                dt = DT[dtype]
                sig = {"Hid": f"*{dt}", "W": f"*{dt}", "Tgt": "*i64", "KeysOut": "*i64", "MaxOut": "*fp32",
                       "SumOut": "*fp64", "TgtOut": "*fp32", "T": "i32", "V": "i32", "H": "i32", "span": "i32",
                       "temperature": "fp32", "stride_ht": "i32", "stride_hh": "i32", "stride_wv": "i32",
                       "stride_wh": "i32", "NSPLIT": "i32"}
                const = dict(K=K, KT=min(K, bv), BLOCK_T=bt, BLOCK_V=bv, BLOCK_H=bh, HAS_TEMP=True,
                             IEEE=dtype == torch.float32, UPCAST=False)
                cases.append((f"topk tiles {dt} K{K} {(bt, bv, bh, nw)}", arch, tiles, (sig, const, {"num_warps": nw})))
        for K in (128, 256, K_.MAX_K) if arch == 90 else (128,):
            bt, nw = K_.gpu_merge_config(K)
            sig = {"KeysIn": "*i64", "MaxIn": "*fp32", "SumIn": "*fp64", "TopVal": "*fp32", "TopId": "*i64",
                   "Lse": "*fp32", "T": "i32", "k": "i32", "NSPLIT": "i32"}
            cases.append((f"topk merge K{K} {(bt, nw)}", arch, merge, (sig, dict(K=K, BLOCK_T=bt), {"num_warps": nw})))
    return cases


def yes_no_cases(archs):
    from acarerank.kernels import yes_no_head as Y
    cases = []
    for arch in archs:
        for dtype in (torch.bfloat16, torch.float32):
            dt = DT[dtype]
            sig = {"Hid": f"*{dt}", "NormW": f"*{dt}", "WYes": f"*{dt}", "WNo": f"*{dt}", "Score": "*fp32",
                   "Diff": "*fp32", "S": "i32", "H": "i32", "stride_s": "i32", "stride_h": "i32", "eps": "fp32"}
            bs, bh, nw = Y.gpu_config(4096)  # H of Qwen3-8B; 0.6B/4B take the same BLOCK_H
            cases.append((f"yes_no {dt} {(bs, bh, nw)}", arch, Y._yes_no_head_kernel,
                          (sig, dict(BLOCK_S=bs, BLOCK_H=bh), {"num_warps": nw})))
    return cases


FAMILIES = {"attention": attention_cases, "topk": topk_cases, "yes_no": yes_no_cases}


def check(name, arch, fn, args) -> dict:
    sig, const, opts = args
    t0 = time.perf_counter()
    res = resources(compile_for(fn, sig, const, arch, **opts))
    res.update(name=name, arch=f"sm{arch}", seconds=round(time.perf_counter() - t0, 1))
    problems = []
    if res["stack"] or res["local"]:
        problems.append(f"spills: stack {res['stack']} B, local {res['local']} B per thread")
    if res["shared"] > SHARED_LIMIT[arch]:
        problems.append(f"shared memory {res['shared']} B > {SHARED_LIMIT[arch]} B")
    res["ok"] = not problems
    res["problems"] = problems
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="90,80", help="compute capabilities, e.g. 90,80 (default)")
    ap.add_argument("--only", default=",".join(FAMILIES), help=f"kernel families among {','.join(FAMILIES)}")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    args = ap.parse_args(argv)
    archs = [int(a) for a in args.arch.split(",") if a.strip()]
    bad = [a for a in archs if a not in SHARED_LIMIT]
    if bad:
        ap.error(f"unknown arch {bad}: one of {sorted(SHARED_LIMIT)}")
    failed = 0
    for family in args.only.split(","):
        for name, arch, fn, fargs in FAMILIES[family](archs):
            res = check(name, arch, fn, fargs)
            failed += not res["ok"]
            if args.json:
                print(json.dumps(res), flush=True)
            else:
                status = "ok    " if res["ok"] else "FAILED"
                print(f"{status} sm{arch} {name}: {res['reg']} regs, stack {res['stack']} B, local {res['local']} B, "
                      f"shared {res['shared'] / 1024:.1f} KB ({res['seconds']} s)"
                      + ("" if res["ok"] else " -- " + "; ".join(res["problems"])), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
