"""Interleaved A/B of one Qwen3 decoder layer around attention on CPU: the element-wise ops with
their torch references ("eager") vs the native kernels vs torch.compile'd halves (compile_layers).

One layer at the Qwen3-Reranker-0.6B shape (hidden 1024, 16/8 heads of 128, intermediate 3072),
T packed rows, fp32 and bf16. The attention output is a fixed random [T, 16·128] tensor, so the
timed work is exactly the layer's own: input norm (+ residual add), QKV GEMM, q/k-norm + RoPE, o
GEMM, residual add + post norm, gate_up GEMM, SiLU·up, down GEMM. GFLOP/s counts the four GEMMs.
A second table times the element-wise ops alone (no GEMMs) for eager vs native, as GB/s of the
activations they read and write. Variants run one call each in turn for ``--rounds`` rounds.

    python bench/bench_cpu_layer.py [--rows 512 2048] [--rounds 7] [--dtype float32 bfloat16] [--no-compile]
    python bench/bench_cpu_layer.py --quick     # smoke test
    ACARERANK_CPU_LAYER_ISA=avx2 python bench/bench_cpu_layer.py   # the native ops' AVX2 build (also avx512, baseline)

glibc's malloc is tuned first (``--malloc tuned``, as ``acarerank serve`` runs its passes; see
bench_cpu_linear.py: with glibc as it is, the page faults of outputs past its mmap threshold are
timed with the layer).

torch.compile's first call (compilation) is excluded and printed. The CPU's flags are printed
first: without native bf16 (AVX512_BF16/AMX) bf16 GEMMs are emulated, so bf16 layer times there
say little about a bf16 machine; the element-wise table still holds.
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from acarerank import malloc_tuning
from acarerank.benchmark.measure import add_malloc_flag, timed_call
from acarerank.model.arch import Qwen3Arch
from acarerank.model.layer_ops import CompiledLayers, OpsLayers
from acarerank.ops import available_backends

ARCH_0_6B = Qwen3Arch(vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_layers=1, num_heads=16,
                      num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)
OPS = ("rms_norm", "fused_add_rms_norm", "qk_norm_rope", "silu_and_mul")


def layer_weights(a: Qwen3Arch, dtype, g):
    H, d, I = a.hidden_size, a.head_dim, a.intermediate_size
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype)
    n = lambda k: (torch.rand(k, generator=g) + 0.5).to(dtype)
    return SimpleNamespace(input_norm=n(H), post_norm=n(H), q_norm=n(d), k_norm=n(d), b_qkv=None, b_o=None,
                           w_qkv=r((a.num_heads + 2 * a.num_kv_heads) * d, H, scale=H ** -0.5),
                           w_o=r(H, a.num_heads * d, scale=(a.num_heads * d) ** -0.5),
                           w_gate_up=r(2 * I, H, scale=H ** -0.5), w_down=r(H, I, scale=I ** -0.5))


def rope_tables(a: Qwen3Arch, T: int):
    inv = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2).float() / a.head_dim))
    freqs = torch.arange(1650, 1650 + T).float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def layer_call(layers, x, attn, L):
    """One layer: the residual stream comes in as the previous layer's (x, delta) pair."""
    def call():
        layers.begin(x.clone())
        layers.attn_in(L)
        layers.attn_out_mlp(attn, L)
        return layers.end()
    return call


def gemm_gflop(a: Qwen3Arch, T: int) -> float:
    H, d, I = a.hidden_size, a.head_dim, a.intermediate_size
    return 2.0 * T * (H * (a.num_heads + 2 * a.num_kv_heads) * d + a.num_heads * d * H + H * 2 * I + I * H) / 1e9


def elementwise_call(backends, a, T, dtype, g, cos, sin, L):
    """The layer's element-wise ops alone, on inputs of the layer's shapes."""
    from acarerank.ops.qk_norm_rope import OP as ROPE
    from acarerank.ops.rms_norm import OP_FUSED_ADD, OP_RMS_NORM
    from acarerank.ops.silu_and_mul import OP as SILU

    H, d, I = a.hidden_size, a.head_dim, a.intermediate_size
    x, delta = torch.randn(T, H, generator=g).to(dtype), torch.randn(T, H, generator=g).to(dtype)
    qkv = torch.randn(T, (a.num_heads + 2 * a.num_kv_heads) * d, generator=g).to(dtype)
    gu = torch.randn(T, 2 * I, generator=g).to(dtype)
    norm, add_norm = OP_RMS_NORM.impl(backends["rms_norm"]), OP_FUSED_ADD.impl(backends["fused_add_rms_norm"])
    rope, silu = ROPE.impl(backends["qk_norm_rope"]), SILU.impl(backends["silu_and_mul"])
    c, s = (cos, sin) if backends["qk_norm_rope"] == "native" else (cos.to(dtype), sin.to(dtype))
    res = x.clone()

    def call():
        norm(x, L.input_norm, 1e-6)
        rope(qkv, L.q_norm, L.k_norm, c, s, a.num_heads, a.num_kv_heads, 1e-6)
        add_norm(delta, res, L.post_norm, 1e-6)
        silu(gu)
    el = torch.tensor([], dtype=dtype).element_size()
    # bytes each op must move at least: norm 2·H, add_norm 3·H (+1 write), rope 2·qkv, silu 1.5·2I
    moved = T * el * (2 * H + 4 * H + 2 * qkv.shape[1] + 3 * I)
    return call, moved / 1e9


def interleaved(variants: dict, rounds: int) -> dict:
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            times[k].append(timed_call(fn, "cpu")[1])
    return times


def report(title, times, unit_per_call, unit):
    print(f"\n{title}")
    base = None
    for k, ts in times.items():
        med = statistics.median(ts)
        base = base or med
        print(f"  {k:<30} median {med * 1e3:8.2f} ms  min {min(ts) * 1e3:8.2f} ms  "
              f"{unit_per_call / med:8.1f} {unit}  {base / med:5.2f}x")


def main() -> None:
    from acarerank.hardware import native_bf16

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    ap.add_argument("--quick", action="store_true", help="7 rows, 1 round, no torch.compile: a smoke test")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    add_malloc_flag(ap)
    args = ap.parse_args()
    if args.rounds < 1:  # no round or no row: a traceback after the set-up
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if min(args.rows) < 1:
        ap.error(f"--rows must be >= 1, got {args.rows}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.rows, args.rounds, args.no_compile = [7], 1, True
    ok, why = native_bf16()
    with open("/proc/cpuinfo") as f:
        flags = sorted({w for line in f if line.startswith("flags") for w in line.split()[2:]
                        if w.startswith(("avx", "amx", "fma"))})
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; native bf16: {ok} ({why}); "
          f"CPU flags: {' '.join(flags)}")
    print(f"malloc: {malloc_tuning.apply(args.malloc)}")
    native = all("native" in available_backends(op, "cpu") for op in OPS)
    if not native:
        print("acarerank._cpu is not built: the native variant is skipped")
    else:
        from acarerank.ops import _native
        print(f"native element-wise kernels: the {_native.layer_kernel_isa()} build "
              "(ACARERANK_CPU_LAYER_ISA=avx512|avx2|baseline picks one)")
    a = ARCH_0_6B
    for dt_name in args.dtype:
        dtype = getattr(torch, dt_name)
        for T in args.rows:
            g = torch.Generator().manual_seed(0)
            L = layer_weights(a, dtype, g)
            x = torch.randn(T, a.hidden_size, generator=g).to(dtype)
            attn = torch.randn(T, a.num_heads * a.head_dim, generator=g).to(dtype)
            cos, sin = rope_tables(a, T)
            eager_b = {op: "torch" for op in OPS}
            native_b = {op: "native" for op in OPS}
            layer = {"eager (torch references)": layer_call(OpsLayers(eager_b, a, F.linear, cos, sin, dtype), x, attn, L)}
            if native:
                layer["native kernels"] = layer_call(OpsLayers(native_b, a, F.linear, cos, sin, dtype), x, attn, L)
            if not args.no_compile:
                comp = layer_call(CompiledLayers(a, F.linear, cos, sin, dtype), x, attn, L)
                t0 = time.perf_counter()
                comp()
                print(f"\n{dtype} rows {T}: torch.compile first call (compilation) {time.perf_counter() - t0:.1f} s")
                layer["torch.compile (compile_layers)"] = comp
            for fn in layer.values():
                fn()
            report(f"one layer (GEMMs + element-wise), {dtype}, {T} rows", interleaved(layer, args.rounds),
                   gemm_gflop(a, T), "GFLOP/s")
            ew = {}
            e_call, gb = elementwise_call(eager_b, a, T, dtype, g, cos, sin, L)
            ew["eager (torch references)"] = e_call
            if native:
                ew["native kernels"] = elementwise_call(native_b, a, T, dtype, g, cos, sin, L)[0]
            for fn in ew.values():
                fn()
            report(f"element-wise ops alone, {dtype}, {T} rows", interleaved(ew, args.rounds), gb, "GB/s")


if __name__ == "__main__":
    main()
