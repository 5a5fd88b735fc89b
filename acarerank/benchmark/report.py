"""What a benchmark run leaves behind: CSV, PNG, the printed table and checks, FLOP model.

FLOP model (``plan_flops``), per forward token and per attended (query, key) pair:

    linear  = 2 · tokens · L · (H·Hq·d + 2·H·Hkv·d + Hq·d·H + 3·H·I)    (q, k, v, o, gate, up, down)
    attn    = 4 · L · Hq · d · pairs     pairs of n new tokens after c cached: n·c + n(n+1)/2
    head    = 2 · H · width per scored row  (width V for the official path's logits_to_keep=1, 2 for [no, yes])

(acarerank also skips the last layer's work nobody reads — see ``plan_flop_parts``.)

Padding is counted where a provider computes it: the official path (a) runs batches of
``batch`` full prompts padded to the batch's longest; (b) runs the prefix once, then
batches of documents padded to the batch's longest after the prefix; acarerank runs the
prefix once and every document packed, unpadded. ``flop_bound_speedup`` = FLOPs(a) /
FLOPs(provider): the speedup a provider would have if both ran at the same FLOP rate —
the limit the measured speedup is read against. Norms, RoPE, softmax and the embedding
gather are left out (a few % at these shapes).
"""
from __future__ import annotations

import csv
import math
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

COLUMNS = [
    "mode", "depth", "provider", "median_ms", "p10_ms", "p90_ms", "repeats", "docs_per_s", "tokens_per_s",
    "speedup_vs_transformers", "flop_bound_speedup", "gflop", "peak_mem_mb", "mem_kind", "max_abs_score_diff",
    "shared_tokens", "doc_tokens", "workload_tokens", "preset", "dtype", "device", "device_name",
    "attn_implementation", "random_weights", "python", "torch", "triton", "transformers", "acarerank",
    "achieved_gflops", "gemm_peak_gflops", "peak_fraction", "kendall_tau_vs_float32",
    "error",  # empty; the failing cell of a run a provider's exception stopped: "<type>: <message>"
]
SCALING_TARGET = 0.15  # target: marginal per-document latency at the deep end within 15 % of the shallow end


@dataclass(frozen=True)
class Shapes:
    """The transformer shapes the FLOP model needs."""
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, cfg) -> "Shapes":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                   cfg.num_key_value_heads, head_dim, cfg.vocab_size)

    @classmethod
    def from_arch(cls, a) -> "Shapes":
        """From the runner's ``Qwen3Arch`` (what a loaded ``PointwiseReranker`` holds)."""
        return cls(a.hidden_size, a.intermediate_size, a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim,
                   a.vocab_size)

    @property
    def layer_params(self) -> int:
        H, d = self.hidden, self.head_dim
        return H * self.heads * d + 2 * H * self.kv_heads * d + self.heads * d * H + 3 * H * self.intermediate


def _linear(sh: Shapes, tokens: int) -> float:
    return 2.0 * tokens * sh.layers * sh.layer_params


def _qkv(sh: Shapes, tokens: int) -> float:
    """One layer's q/k/v projections only."""
    return 2.0 * tokens * sh.hidden * (sh.heads + 2 * sh.kv_heads) * sh.head_dim


def _attn(sh: Shapes, n: int, cached: int) -> float:
    return 4.0 * sh.layers * sh.heads * sh.head_dim * attended_pairs(n, cached)


def attended_pairs(n: int, cached: int) -> float:
    """(query, key) pairs of n new tokens after ``cached`` ones under the causal mask."""
    return n * cached + n * (n + 1) / 2


def plan_flop_parts(plan: str, sh: Shapes, shared_len: int, seg_lens: Sequence[int], batch: int) -> dict:
    """{"linear", "attn", "head"} FLOPs to score documents with segment lengths ``seg_lens``
    after a ``shared_len``-token shared part.

    plan: "full_padded" (a), "prefix_padded" (b), "prefix_packed" (acarerank). The last one
    follows the runner: the prefix pass stops at the last layer's K/V projections (nothing
    reads its output), and in the segment pass the last layer's o_proj and MLP run on the
    scored rows only.
    """
    P, S = shared_len, len(seg_lens)
    lin = att = 0.0
    if plan == "full_padded":
        for i in range(0, S, batch):
            rows = seg_lens[i:i + batch]
            n = P + max(rows)
            lin += _linear(sh, n * len(rows))
            att += len(rows) * _attn(sh, n, 0)
        return {"linear": lin, "attn": att, "head": 2.0 * sh.hidden * sh.vocab * S}
    if plan == "prefix_padded":
        lin, att = _linear(sh, P), _attn(sh, P, 0)
        for i in range(0, S, batch):
            rows = seg_lens[i:i + batch]
            n = max(rows)
            lin += _linear(sh, n * len(rows))
            att += len(rows) * _attn(sh, n, P)
        return {"linear": lin, "attn": att, "head": 2.0 * sh.hidden * 2 * S}
    if plan == "prefix_packed":
        return packed_flop_parts(sh, P, seg_lens)
    raise ValueError(f"unknown FLOP plan {plan!r}")


def least_work_flops(sh: Shapes, shared_len: int, seg_lens: Sequence[int]) -> float:
    """FLOPs of the least work an exact server does to score documents of segment lengths
    ``seg_lens`` after a ``shared_len``-token shared part: the shared part once, every document
    packed, unpadded, nothing cached (``packed_flop_parts``, acarerank's runner).

    The work every server is credited with, whatever it computes (docs/benchmarks.md, "A
    server's GFLOP/s"): ``acarerank bench``'s peers and ``bench/bench_serve.py``'s targets alike.
    What a server computes is not seen from outside (vLLM's block cache may compute a shared
    part once or not at all; another server pads or recomputes it per document), so GFLOP/s is
    useful work ÷ wall time: the same numerator for every server, so GFLOP/s ratios are
    throughput ratios, and a fraction of the GEMM peak that no server doing more work can beat."""
    return sum(packed_flop_parts(sh, shared_len, seg_lens).values())


def least_work_select_flops(sh: Shapes, prompt_len: int, new_tokens: int, head_width: int, cached: int = 0) -> float:
    """FLOPs of the least work an exact server does to generate ``new_tokens`` (k >= 1) greedy
    tokens after a ``prompt_len``-token (n >= 1) prompt whose first ``cached`` (c <= n − 1) tokens
    are in the KV cache already (a batch's common prefix, computed for another of its prompts;
    0: none): the setwise counterpart of ``least_work_flops`` (docs/benchmarks.md, "A server's
    GFLOP/s"), credited to every server.

    The other n − 1 − c prompt tokens only fill the KV cache: their pass stops at the last layer's
    q/k/v projections and attention runs in the first L − 1 layers; the k fed tokens (the prompt's
    last, then the first k − 1 new ones: the last new token is never fed) go through every layer,
    attending to everything before them (``attended_pairs(k, n − 1)``), and each of their rows
    gets the head over ``head_width`` vocabulary rows (a constrained decoder needs only the
    grammar's tokens; the full vocabulary is more than the least work):

        linear = (L − 1)·lin1·(p + k) + qkv1·(p + k) + (lin1 − qkv1)·k,   p = n − 1 − c
        attn   = 4·Hq·d·((L − 1)·(p·c + p(p + 1)/2) + L·(k·(n − 1) + k(k + 1)/2))
        head   = 2·H·head_width·k

    with lin1 / qkv1 one layer's linear / q-k-v FLOPs per token (``_linear``, ``_qkv``)."""
    if prompt_len < 1 or new_tokens < 1 or head_width < 1:
        raise ValueError(f"prompt_len, new_tokens and head_width must be >= 1, got {prompt_len}, {new_tokens}, "
                         f"{head_width}")
    if not 0 <= cached <= prompt_len - 1:
        raise ValueError(f"cached must be in [0, prompt_len - 1 = {prompt_len - 1}], got {cached}")
    fill, fed = prompt_len - 1 - cached, prompt_len - 1 - cached + new_tokens
    per_layer = _linear(sh, 1) / sh.layers
    lin = (sh.layers - 1) * per_layer * fed + _qkv(sh, fed) + (per_layer - _qkv(sh, 1)) * new_tokens
    att = _attn(sh, fill, cached) * (sh.layers - 1) / sh.layers + _attn(sh, new_tokens, prompt_len - 1)
    return lin + att + 2.0 * sh.hidden * head_width * new_tokens


def packed_flop_parts(sh: Shapes, shared_len: int, seg_lens: Sequence[int], cached: int = 0) -> dict:
    """{"linear", "attn", "head"} FLOPs of acarerank's runner when ``cached`` of the
    ``shared_len`` shared tokens are already in its KV cache (a prefix-cache hit; 0: none).

    The new shared tokens n = shared_len − cached go through a pass that stops at the last
    layer's q/k/v projections (nothing reads its output), attending to the cached ones
    (n·cached + n(n+1)/2 pairs in each of the first L − 1 layers); the T = Σ seg_lens segment
    tokens go through every layer, attending to the whole shared part, except that the last
    layer's o_proj and MLP run on the S scored rows only; the head is the [no, yes] rows.
    """
    if not 0 <= cached <= shared_len:
        raise ValueError(f"cached must be in [0, shared_len={shared_len}], got {cached}")
    new, T, S = shared_len - cached, sum(seg_lens), len(seg_lens)
    per_layer = _linear(sh, 1) / sh.layers  # all of one layer's linears, per token
    rest = per_layer - _qkv(sh, 1)           # o_proj + MLP per token
    lin = (sh.layers - 1) * per_layer * (new + T) + _qkv(sh, new + T) + rest * S
    att = _attn(sh, new, cached) * (sh.layers - 1) / sh.layers + sum(_attn(sh, n, shared_len) for n in seg_lens)
    return {"linear": lin, "attn": att, "head": 2.0 * sh.hidden * 2 * S}


def plan_flops(plan: str, sh: Shapes, shared_len: int, seg_lens: Sequence[int], batch: int) -> float:
    """Total of ``plan_flop_parts``."""
    return sum(plan_flop_parts(plan, sh, shared_len, seg_lens, batch).values())


# -- checks ---------------------------------------------------------------------------
def score_check(rows: Sequence[dict], tolerance: float) -> tuple:
    """(ok, line): whether every provider's scores equal the reference provider's within tolerance."""
    worst = max(rows, key=lambda r: r["max_abs_score_diff"] if r["max_abs_score_diff"] == r["max_abs_score_diff"]
                else math.inf)
    ref = rows[0]["provider"]
    bad = [r for r in rows if not r["max_abs_score_diff"] <= tolerance]
    others = sorted({r["provider"] for r in rows} - {ref})
    if not bad:
        return True, (f"scores agree: max |score - score[{ref}]| = {worst['max_abs_score_diff']:.2e} over "
                      f"{len(rows)} cells ({', '.join(others) or 'no other provider'}; tolerance {tolerance:g})")
    cells = "; ".join(f"{r['mode']} d={r['depth']} {r['provider']}: {r['max_abs_score_diff']:.2e}" for r in bad[:6])
    return False, f"SCORES DISAGREE with {ref} (tolerance {tolerance:g}): {cells}"


def depth_scaling(rows: Sequence[dict]) -> list:
    """Marginal latency per added document, shallow vs deep end, per (mode, provider).

    With depths d0 < ... < d_mid < d_hi (d_mid the second largest): low = (t(d_mid) − t(d0)) /
    (d_mid − d0), high = (t(d_hi) − t(d_mid)) / (d_hi − d_mid), ratio = high / low; the
    target is |ratio − 1| ≤ 15 % (the prefix is paid once and nothing grows faster than the
    documents). Per 1k document tokens too, since document lengths vary between the slices.
    """
    by = defaultdict(dict)
    for r in rows:
        by[(r["mode"], r["provider"], r.get("dtype", ""))][r["depth"]] = r
    out = []
    for (mode, prov, dt), cells in by.items():
        ds = sorted(cells)
        if len(ds) < 3:
            continue
        d0, dm, dh = ds[0], ds[-2], ds[-1]
        t = {d: cells[d]["median_ms"] for d in (d0, dm, dh)}
        tok = {d: cells[d]["doc_tokens"] for d in (d0, dm, dh)}
        low, high = (t[dm] - t[d0]) / (dm - d0), (t[dh] - t[dm]) / (dh - dm)
        low_tok = (t[dm] - t[d0]) / max(tok[dm] - tok[d0], 1) * 1e3
        high_tok = (t[dh] - t[dm]) / max(tok[dh] - tok[dm], 1) * 1e3
        ratio = high / low if low > 0 else math.nan
        out.append(dict(mode=mode, provider=prov, dtype=dt, depths=(d0, dm, dh), ms_per_doc_low=low, ms_per_doc_high=high,
                        ratio=ratio, ms_per_1k_tok_low=low_tok, ms_per_1k_tok_high=high_tok,
                        within_target=abs(ratio - 1) <= SCALING_TARGET))
    return out


# Speed targets for the depth-50 M3 row: acarerank over (a) and over (b).
ROW_TARGETS = {"transformers": 5.0, "transformers+prefix-cache": 1.6}


def format_targets(rows: Sequence[dict], mode: str = "M3", depth: int = 50) -> str:
    """acarerank's speedup over each baseline in the (mode, depth) row (same dtype), against ROW_TARGETS."""
    med = {(r.get("dtype", ""), r["provider"]): r["median_ms"]
           for r in rows if r["mode"] == mode and r["depth"] == depth}
    multi = len({dt for dt, _ in med}) > 1
    lines = []
    for dt, prov in (k for k in med if k[1].startswith("acarerank-")):
        for base, target in ROW_TARGETS.items():
            if (dt, base) in med:
                x = med[(dt, base)] / med[(dt, prov)]
                lines.append(f"target {mode} depth {depth}: {prov}{' ' + dt if multi else ''} is {x:.2f}x {base} "
                              f"(target >= {target:g}x: {'met' if x >= target else 'NOT met'})")
    return "\n".join(lines) or f"target {mode} depth {depth}: row not measured in this run"


# -- outputs --------------------------------------------------------------------------
def write_csv(rows: Sequence[dict], path, columns: Sequence[str] = COLUMNS) -> None:
    """``columns`` of every row (missing: empty; others ignored), floats to 6 significant digits;
    the parent folder is created. Every benchmark's CSV goes through here."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def format_table(rows: Sequence[dict]) -> str:
    head = (f"{'mode':<4} {'depth':>5} {'dtype':<8} {'provider':<26} {'median ms':>10} {'p10':>9} {'p90':>9} "
            f"{'docs/s':>8} {'tok/s':>9} {'speedup':>7} {'bound':>6} {'GFLOP/s':>7} {'%peak':>6} {'mem MB':>7} "
            f"{'|dscore|':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['mode']:<4} {r['depth']:>5} {_short(r['dtype']):<8} {r['provider']:<26} {r['median_ms']:>10.1f} "
            f"{r['p10_ms']:>9.1f} {r['p90_ms']:>9.1f} {r['docs_per_s']:>8.1f} {r['tokens_per_s']:>9.0f} "
            f"{_x(r['speedup_vs_transformers']):>7} {_x(r['flop_bound_speedup']):>6} {r['achieved_gflops']:>7.1f} "
            f"{r['peak_fraction']:>6.1%} {r['peak_mem_mb']:>7.0f} {r['max_abs_score_diff']:>8.1e}")
    lines.append("speedup = median(transformers) / median (same dtype); bound = FLOP-bound speedup (FLOPs of "
                 "transformers / FLOPs of the provider); tok/s = tokens of the unshared prompts / median; "
                 "GFLOP/s = the provider's FLOPs / median; %peak = GFLOP/s / the GEMM peak measured in this run in "
                 "that dtype; mem = peak above the start of one untimed call (after a heap trim); |dscore| = max |score - score of "
                 "the first provider| (same dtype)")
    return "\n".join(lines)


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)


# -- across dtypes ----------------------------------------------------------------------
def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b between two score lists over the same documents (1 = same ordering)."""
    if len(a) != len(b):
        raise ValueError(f"kendall_tau: {len(a)} vs {len(b)} scores")
    if len(a) < 2:
        return math.nan
    try:
        from scipy.stats import kendalltau
    except ImportError:  # scipy is the `bench` extra: a base install reports "n/a" (format_rank_agreement)
        return math.nan
    return float(kendalltau(a, b).statistic)


def rank_agreement(rows: Sequence[dict], scores: dict, base: str = "float32") -> list:
    """Kendall tau between each cell's scores and the same cell's scores in ``base`` dtype.

    rows: bench rows of several dtypes; scores: {(dtype, mode, depth, provider): [score]}.
    Fills ``kendall_tau_vs_<base>`` of the non-base rows that have a base twin; returns
    [{mode, depth, provider, dtype, tau}] for them.
    """
    out = []
    for r in rows:
        key = (r["mode"], r["depth"], r["provider"])
        if r["dtype"] == base or (base, *key) not in scores or (r["dtype"], *key) not in scores:
            continue
        tau = kendall_tau(scores[(r["dtype"], *key)], scores[(base, *key)])
        r[f"kendall_tau_vs_{base}"] = tau
        out.append(dict(mode=r["mode"], depth=r["depth"], provider=r["provider"], dtype=r["dtype"], tau=tau))
    return out


def format_rank_agreement(agree: Sequence[dict], base: str = "float32") -> str:
    if not agree:
        return f"rank agreement with {base}: no cell measured in two dtypes"
    import importlib.util

    na = "n/a (needs scipy: pip install 'acarerank[bench]')" if importlib.util.find_spec("scipy") is None else "nan"
    return "\n".join(f"rank agreement {a['mode']} depth {a['depth']} {a['provider']:<26} {a['dtype']} vs {base}: "
                     f"Kendall tau {na if math.isnan(a['tau']) else format(a['tau'], '.3f')}" for a in agree)


# CPU dtype targets for the M3 depth-50 row of acarerank, per dtype: the fraction of the
# GEMM peak, and bf16's speedup over fp32.
PEAK_TARGETS = {"float32": 0.85, "bfloat16": 0.65}
BF16_OVER_FP32_TARGET = 1.6


def format_dtype_targets(rows: Sequence[dict], mode: str = "M3", depth: int = 50) -> str:
    """The %peak target per dtype and bf16 ≥ 1.6× fp32, for every acarerank provider in the (mode, depth) row."""
    cell = {(r["dtype"], r["provider"]): r for r in rows
            if r["mode"] == mode and r["depth"] == depth and r["provider"].startswith("acarerank-")}
    lines = []
    for (dt, prov), r in cell.items():
        if dt in PEAK_TARGETS:
            t = PEAK_TARGETS[dt]
            lines.append(f"target {mode} depth {depth}: {prov} {dt} at {r['peak_fraction']:.1%} of the {dt} GEMM peak "
                         f"({r['achieved_gflops']:.0f} of {r['gemm_peak_gflops']:.0f} GFLOP/s; target >= {t:.0%}: "
                         f"{'met' if r['peak_fraction'] >= t else 'NOT met'})")
        if dt == "bfloat16" and ("float32", prov) in cell:
            x = cell[("float32", prov)]["median_ms"] / r["median_ms"]
            lines.append(f"target {mode} depth {depth}: {prov} bfloat16 is {x:.2f}x float32 "
                         f"(target >= {BF16_OVER_FP32_TARGET:g}x: {'met' if x >= BF16_OVER_FP32_TARGET else 'NOT met'})")
    return "\n".join(lines)


def _x(v: float) -> str:
    return "n/a" if v != v else f"{v:.2f}x"


def format_scaling(scaling: Sequence[dict], judge: bool = True) -> str:
    """One line per depth_scaling() entry; ``judge``: with the verdict against SCALING_TARGET
    (a smoke run's single cold call per cell gives figures too noisy to judge: negative ms/doc)."""
    if not scaling:
        return "depth scaling: needs at least 3 depths"
    lines = []
    for s in scaling:
        d0, dm, dh = s["depths"]
        ratio = "n/a" if s["ratio"] != s["ratio"] else f"{s['ratio']:.2f}"
        verdict = f" ({'within' if s['within_target'] else 'NOT within'} {SCALING_TARGET:.0%})" if judge else ""
        lines.append(
            f"depth scaling {s['mode']} {s['provider']:<26} {_short(s['dtype']):<4} ms/doc {d0}->{dm}: {s['ms_per_doc_low']:.2f}, "
            f"{dm}->{dh}: {s['ms_per_doc_high']:.2f}, ratio {ratio}{verdict}; per 1k doc tokens "
            f"{s['ms_per_1k_tok_low']:.1f} vs {s['ms_per_1k_tok_high']:.1f} ms")
    return "\n".join(lines)


def plot(rows: Sequence[dict], path: str, title: str = "") -> None:
    """PNG: per mode, latency vs depth (p10–p90 bars) and speedup over transformers vs depth
    (dashed: the FLOP bound of the same provider); one line per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    multi = len({r["dtype"] for r in rows}) > 1
    if multi:  # one line per (provider, dtype)
        rows = [dict(r, provider=f"{r['provider']} {_short(r['dtype'])}") for r in rows]
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    colors = {p: f"C{i}" for i, p in enumerate(providers)}
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 3.8 * len(modes)), squeeze=False)
    for i, mode in enumerate(modes):
        ax_l, ax_s = axes[i]
        for p in providers:
            rs = sorted((r for r in rows if r["mode"] == mode and r["provider"] == p), key=lambda r: r["depth"])
            d = [r["depth"] for r in rs]
            med = [r["median_ms"] for r in rs]
            err = [[m - r["p10_ms"] for m, r in zip(med, rs)], [r["p90_ms"] - m for m, r in zip(med, rs)]]
            ax_l.errorbar(d, med, yerr=err, marker="o", color=colors[p], label=p, capsize=3)
            sp = [r["speedup_vs_transformers"] for r in rs]
            if not p.startswith("transformers ") and p != "transformers" and not all(v != v for v in sp):
                ax_s.plot(d, sp, marker="o", color=colors[p], label=p)
                ax_s.plot(d, [r["flop_bound_speedup"] for r in rs], ls="--", color=colors[p], alpha=0.6,
                          label=f"{p} FLOP bound")
        ax_l.set(title=f"{mode}: latency", xlabel="depth (documents)", ylabel="ms (median, p10-p90)", yscale="log")
        ax_s.set(title=f"{mode}: speedup over transformers", xlabel="depth (documents)", ylabel="x")
        ax_s.axhline(1.0, color="gray", lw=0.8, label="transformers (1x)")
        depths = sorted({r["depth"] for r in rows})
        for ax in (ax_l, ax_s):
            ax.set_xticks(depths)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        ax_l.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
