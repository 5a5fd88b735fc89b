"""Latency versus reranking depth, every provider side by side in one run.

For each context mode and depth d, every provider scores the workload's first d
documents against the same agent context, end to end from strings (tokenization
included, as a serving stack pays it). Per (mode, depth, provider) the harness records:

* latency: median, p10, p90 of ``repeats`` timed calls (``measure.timed_call``: wall
  clock, the device synchronised on both sides), after ``warmup`` untimed calls per provider and
  mode; providers take turns call by call; a provider stops repeating at a depth once it
  has spent ``max_cell_seconds`` there (≥ 1 call);
* docs/s = d / median; tokens/s = workload tokens / median, where workload tokens are the
  tokens of the d full, unshared prompts (Σ_i shared + segment_i) — the same numerator
  for every provider, so tokens/s ratios equal latency ratios;
* peak memory above the starting point of one untimed call per provider and depth, before
  its timed calls (``PeakMemory``: on the CPU it trims the heap first, which a timed call must
  not follow);
* the largest |score − score of the first provider| (the official path when it runs);
* FLOPs each in-process provider's algorithm performs for these shapes (``report.plan_flops``),
  a peer's the least work (``credited_flops``), the FLOP rate they give (GFLOP/s = FLOPs /
  median) and that rate as a fraction of the machine's GEMM peak in the run's dtype, measured
  in the same run at the model's linear shapes (``gemm_peak``);
* every provider's scores per cell (``BenchResult.scores``), for rank agreement across dtypes.

Providers: "transformers" (a), "transformers+prefix-cache" (b) (``baselines``),
"acarerank-<backend>" — the public ``PointwiseReranker`` with that backend — and any peer
server (``BenchConfig.peers``: vLLM, llama.cpp, TEI, another acarerank; ``peers.PeerProvider``)
timed over HTTP. A peer gets the context folded into its query (``peers.fold_context``) and is
compared with the first provider scoring that same folded prompt; it is credited with the least
work (the shared part once, ``report.least_work_flops``), whatever server it is, as
``bench/bench_serve.py`` credits every server; its tokens/s counts the full prompts' tokens, as
every provider's; and its memory is its server's (NaN here). An acarerank peer gets a
fresh ``cache_salt`` per call (no cross-call prefix-cache hits, as the in-process providers).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch

from .._validate import is_positive_int
from .baselines import OfficialTransformers, PrefixCacheTransformers, split_prompt_ids
from .gemm_peak import gemm_peak
from .measure import PeakMemory, machine_info, percentile, sync, timed_call
from .peers import PeerProvider, Target
from .report import Shapes, least_work_flops, plan_flops
from .workload import MAX_DOCS, MODES, Workload, WorkloadSpec, make_workload

PROVIDERS = ("transformers", "transformers+prefix-cache", "acarerank")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Largest score difference from the official path still called "equal", per dtype. fp32:
# the paths differ only in summation order (the runner itself is held to ≤ 1e-5; the
# padded transformers batches add their own ~1e-7). bf16/fp16: every layer rounds to the
# model dtype, and padded batches and packed segments round differently.
SCORE_TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
# Backends probed for "acarerank-<backend>" when --backends is not given.
#: the automatic ``--backends``: "native" is the CPU's default path (every op that has a native
#: kernel on it, the linear layers on oneDNN), what PointwiseReranker runs there; left out where
#: acarerank._cpu is not built
AUTO_BACKENDS = ("torch", "cpp", "native", "triton", "cuda")


@dataclass
class BenchConfig:
    """Everything one run depends on; ``cli/bench.py`` fills it from the command line."""
    depths: tuple = (10, 20, 50, 100)
    modes: tuple = ("M0", "M3")
    preset: str = "tiny-cpu"
    model_path: Optional[str] = None          # an HF checkpoint folder instead of random weights
    overrides: dict = field(default_factory=dict)  # Qwen3Config fields over the preset
    providers: tuple = PROVIDERS
    backends: Optional[tuple] = None          # None: every backend that runs on the device
    repeats: int = 3
    warmup: int = 1
    max_cell_seconds: float = 20.0
    dtype: str = "float32"
    device: str = "cpu"
    attn_implementation: str = "sdpa"         # for the transformers providers
    spec: WorkloadSpec = field(default_factory=WorkloadSpec)
    seed: int = 0
    compile_layers: bool = False              # also acarerank with torch.compile'd layer halves
    peers: tuple = ()                         # peers.Target: rerank servers timed beside (over HTTP)
    batch_official: int = 4
    batch_prefix_cache: int = 16

    def validate(self) -> "BenchConfig":
        if not self.depths or not all(is_positive_int(d) for d in self.depths):
            raise ValueError(f"depths must be positive ints, got {self.depths!r}")
        if max(self.depths) > MAX_DOCS:  # the workload holds max(depths) documents
            raise ValueError(f"depths must be at most {MAX_DOCS:,} (the server's documents per request), "
                             f"got {max(self.depths):,}")
        bad = [m for m in self.modes if m not in MODES]
        if not self.modes or bad:
            raise ValueError(f"unknown context mode(s) {bad}; modes: {', '.join(MODES)}")
        if self.backends is not None and not self.backends:  # --backends "" or ",": not the default (None)
            raise ValueError("backends names no backend (--backends: e.g. torch,cpp; omit it for every one that runs)")
        bad = [p for p in self.providers if p not in PROVIDERS]
        if not self.providers or bad:
            raise ValueError(f"unknown provider(s) {bad}; providers: {', '.join(PROVIDERS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not one of {', '.join(DTYPES)}")
        if any(not isinstance(t, Target) for t in self.peers):
            raise TypeError("peers must be acarerank.benchmark.peers.Target values (peers.parse_target)")
        names = [t.name for t in self.peers]
        if len(set(names)) != len(names) or any(n.startswith(("transformers", "acarerank")) for n in names):
            raise ValueError(f"peer names must be unique and not start with 'transformers' or 'acarerank', got {names}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {self.repeats}, {self.warmup}")
        # warm-up calls have no time bound (max_cell_seconds ends the timed ones only): a typo
        # (--warmup 10**22) would never end; the count cap of the workload, as bench_serve's
        for name in ("repeats", "warmup"):
            if getattr(self, name) > MAX_DOCS:
                raise ValueError(f"{name} must be at most {MAX_DOCS:,} (the cap on a count), "
                                 f"got {getattr(self, name):,}")
        if not -2 ** 63 <= self.seed < 2 ** 64:  # torch.manual_seed's range (past it: 'Overflow when unpacking long')
            raise ValueError(f"seed must be in [-2**63, 2**64), torch.manual_seed's range, got {self.seed}")
        if not self.max_cell_seconds >= 0:  # NaN compares false: the cell would never stop repeating
            raise ValueError(f"max_cell_seconds must be a number >= 0, got {self.max_cell_seconds!r}")
        from ..model.placement import check_dtype_device

        check_dtype_device(torch.float32, self.device)  # cpu or an existing cuda[:N], as every subcommand
        if self.model_path is not None and os.path.isdir(self.model_path):
            from ..reranker_base import check_transformers_files

            check_transformers_files(self.model_path)  # before the run sets anything up (load_model checks again)
        if self.model_path is None:
            from ..model.default import check_model_fits, qwen3_config

            # the preset and --override checked as a config.json is, and its weights against the
            # device's memory (hidden_size=10**6 allocated until the host ran out)
            check_model_fits(qwen3_config(self.preset, **self.overrides), self.device)
        # a name given twice (--modes M0,M0) ran its cells twice: duplicates dropped, order kept
        return replace(self, depths=tuple(sorted(set(self.depths))), modes=tuple(dict.fromkeys(self.modes)),
                       providers=tuple(dict.fromkeys(self.providers)),
                       backends=None if self.backends is None else tuple(dict.fromkeys(self.backends)),
                       spec=replace(self.spec, num_docs=max(self.depths)))


# -- score agreement ----------------------------------------------------------------
def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """max |a_i − b_i|; NaN if any score is NaN or the lengths differ (never silently fine)."""
    if len(a) != len(b):
        return math.nan
    diffs = [abs(x - y) for x, y in zip(a, b)]
    return math.nan if any(d != d for d in diffs) else max(diffs, default=0.0)


# -- providers --------------------------------------------------------------------------
class ProviderFailed(RuntimeError):
    """A provider raised while scoring; ``provider`` names it, the cause is chained."""

    def __init__(self, provider: str, error: BaseException):
        super().__init__(f"{provider}: {type(error).__name__}: {' '.join(str(error).split())}")
        self.provider = provider


def call_provider(name: str, fn: Callable, *args, **kw):
    """``fn(*args, **kw)``; any exception becomes ProviderFailed naming the provider ``name``
    (the benchmark marks that cell and stops; a KeyboardInterrupt passes through)."""
    try:
        return fn(*args, **kw)
    except Exception as e:
        raise ProviderFailed(name, e) from e


def _score(p, **kw) -> list:
    """``p.score(**kw)``; any exception becomes ProviderFailed naming ``p``."""
    return call_provider(p.name, p.score, **kw)


class AcarerankProvider:
    """acarerank through its public API: ``PointwiseReranker(model=..., tokenizer=..., backend=...)``."""

    flop_plan = "prefix_packed"

    def __init__(self, model, tokenizer, backend: str, compile_layers: bool = False):
        from acarerank import PointwiseReranker

        self.name = f"acarerank-{backend}" + ("+compile" if compile_layers else "")
        # No cross-call prefix cache here: every timed call repeats the same context, so a cache
        # would turn repeats into hits the baselines cannot have. The cache's own benchmark is
        # `acarerank bench --workload agent` (cache on vs off vs transformers, side by side).
        self.rr = PointwiseReranker(model=model, tokenizer=tokenizer, backend=bench_preference(backend),
                                    compile_layers=compile_layers, prefix_cache=False)

    def score(self, query, documents, question=None, trace=None, instruction=None) -> list:
        return self.rr.score(query, documents, question=question, trace=trace, instruction=instruction)


def bench_preference(entry: str):
    """One ``--backends`` entry as a backend preference (``acarerank.ops.backend_for``):

      "native"                a name: every op that has it, the others on their default
      "linear=torch"          op=name pairs joined by "+": those ops, the others on their default
      "native+linear=torch"   a name, then overrides: every op that has "native", the linear
                              layers on F.linear (so native+onednn vs native+torch linear side by side)
    """
    from acarerank.ops import per_op_backends
    from acarerank.ops._backend import op_decl

    name, over = None, {}
    for part in (p.strip() for p in entry.split("+")):
        if "=" in part:
            op, _, b = part.partition("=")
            over[op_decl(op.strip()).name] = b.strip()
        elif name is None and part:
            name = part
        else:
            raise ValueError(f"--backends entry {entry!r}: one backend name at most, then op=name overrides "
                             "joined by '+', e.g. native+linear=torch")
    if not over:
        per_op_backends(name)
        return name
    pref = {op: b for op, b in per_op_backends(name).items() if b is not None} if name else {}
    pref.update(over)
    per_op_backends(pref)  # a bad op or backend fails here, by name
    return pref


def backend_runs(backend: str, device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """None if the scoring path runs with the ``--backends`` entry ``backend`` here, else the reason.

    As ``PointwiseReranker(backend=...)`` takes it: each op gets ``backend_choice(op, backend)``,
    so "cpp"/"cuda" run the head on its C++/CUDA kernel and attention on its device default.
    """
    from acarerank.ops import backend_choice, prefix_shared_attention, yes_no_score
    from acarerank.ops.linear import resolve_linear_backend

    q = torch.randn(3, 2, 16, device=device, dtype=dtype)
    k = torch.randn(3, 1, 16, device=device, dtype=dtype)
    i32 = dict(dtype=torch.int32, device=device)
    try:
        backend = bench_preference(backend)
        resolve_linear_backend(backend, device, dtype)
        prefix_shared_attention(q, k, k, torch.tensor([0, 3], **i32), k, k, torch.tensor([0, 3], **i32),
                                torch.tensor([0], **i32), backend=backend_choice("attention", backend))
        h = torch.randn(2, 16, device=device, dtype=dtype)
        w = torch.randn(16, device=device, dtype=dtype)
        yes_no_score(h, w, w, w, backend=backend_choice("yes_no", backend))
    except Exception as e:  # BackendError, ImportError, a kernel that cannot compile here...
        return f"{type(e).__name__}: {e}"
    sync(device)
    return None


def pick_backends(cfg: BenchConfig, device: torch.device, log: Callable) -> list:
    """The backends to run: those asked for (each must run here), or every one that does.

    Triton on a CPU runs only under TRITON_INTERPRET (an interpreter, far too slow to time),
    so the automatic choice leaves it out there; CUDA kernels take CUDA tensors only, so it
    leaves "cuda" out off a CUDA device (said in one line, not as the probe's BackendError).
    """
    dtype = DTYPES[cfg.dtype]
    if cfg.backends is not None:
        for b in cfg.backends:
            why = backend_runs(b, device, dtype)
            if why is not None:
                raise ValueError(f"backend {b!r} cannot run on {device} {cfg.dtype}: {why}")
        return list(cfg.backends)
    chosen = []
    for b in AUTO_BACKENDS:
        if b == "triton" and device.type != "cuda":
            log(f"backend triton: left out on {device.type} (only the interpreter runs it there)")
            continue
        if b == "cuda" and device.type != "cuda":
            log(f"backend cuda: left out on {device.type} (it runs on CUDA devices only)")
            continue
        why = backend_runs(b, device, dtype)
        if why is None:
            chosen.append(b)
        else:
            log(f"backend {b}: not available here ({why.splitlines()[0][:160]})")
    if not chosen:
        raise ValueError(f"no acarerank backend runs on {device}")
    return chosen


def load_model(cfg: BenchConfig):
    """(transformers Qwen3ForCausalLM, tokenizer, random_weights: bool)."""
    from acarerank.tokenizer import load_qwen3_tokenizer

    dtype, device = DTYPES[cfg.dtype], torch.device(cfg.device)
    if cfg.model_path is not None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from acarerank.reranker_base import check_transformers_files

        if not os.path.isdir(cfg.model_path):
            raise FileNotFoundError(f"--model {cfg.model_path!r} is not a folder (config.json + *.safetensors)")
        check_transformers_files(cfg.model_path)  # the caps of our own loader: transformers reads these whole
        model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=dtype).to(device).eval()
        has_tok = any(os.path.isfile(os.path.join(cfg.model_path, f)) for f in ("tokenizer.json", "vocab.json"))
        tok = AutoTokenizer.from_pretrained(cfg.model_path) if has_tok else load_qwen3_tokenizer()
        random_weights = False
    else:
        from acarerank.model.default import build_default_model, check_model_fits, qwen3_config

        if device.type == "cuda":
            # initialised on the GPU itself: 4B parameters initialised on the host take minutes
            from transformers import Qwen3ForCausalLM

            torch.manual_seed(cfg.seed)
            config = qwen3_config(cfg.preset, **cfg.overrides)
            check_model_fits(config, device)
            with torch.device(device):
                model = Qwen3ForCausalLM(config)
            model = model.to(dtype).eval()
        else:
            model = build_default_model(cfg.preset, seed=cfg.seed, dtype=dtype, device=device, **cfg.overrides)
        tok = load_qwen3_tokenizer()
        random_weights = True
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(cfg.attn_implementation)
    else:  # transformers < 4.48
        model.config._attn_implementation = cfg.attn_implementation
    return model, tok, random_weights


def make_providers(cfg: BenchConfig, model, tok, backends: list) -> list:
    """Providers in the fixed order of ``PROVIDERS``: the official path first, so it is the
    reference for score differences and speedups."""
    out = []
    for p in (name for name in PROVIDERS if name in cfg.providers):
        if p == "transformers":
            out.append(OfficialTransformers(model, tok, batch_size=cfg.batch_official))
        elif p == "transformers+prefix-cache":
            out.append(PrefixCacheTransformers(model, tok, batch_size=cfg.batch_prefix_cache))
        else:
            for b in backends:  # with --compile-layers, the compiled twin runs beside the eager one
                out += [AcarerankProvider(model, tok, b)] + ([AcarerankProvider(model, tok, b, True)]
                                                             if cfg.compile_layers else [])
    return out


# -- the run ----------------------------------------------------------------------------
@dataclass
class BenchResult:
    rows: list            # one dict per (mode, depth, provider); keys: report.COLUMNS
    config: BenchConfig
    meta: dict            # machine, versions, workload token counts, random_weights, gemm_peak
    tolerance: float
    scores: dict = field(default_factory=dict)  # (mode, depth, provider) -> score list of its first call


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class _Setup:
    """What every cell of a run shares (``_set_up``)."""
    model: object
    tok: object
    random_weights: bool
    providers: list
    shapes: Shapes
    workload: Workload
    meter: PeakMemory
    info: dict
    peak: dict


def _set_up(cfg: BenchConfig, device: torch.device, progress: Callable) -> _Setup:
    """Model, providers (peers last), workload, memory meter, machine info and the GEMM peak."""
    model, tok, random_weights = load_model(cfg)
    backends = pick_backends(cfg, device, progress) if "acarerank" in cfg.providers else []
    providers = make_providers(cfg, model, tok, backends)
    for t in cfg.peers:
        providers.append(PeerProvider(t))
        progress(f"peer {t.name}: {providers[-1].target.api} {providers[-1].version} at {t.url} (context folded "
                 f"into the query; scores compared with {providers[0].name} on the same prompt)")
    shapes = Shapes.from_config(model.config)
    peak = gemm_peak(shapes, DTYPES[cfg.dtype], device)
    progress(f"GEMM peak {cfg.dtype}: {peak['peak_gflops']:.1f} GFLOP/s (best of {peak.get('ways', 'F.linear')}, {peak['rows']} rows; "
             + ", ".join(f"{k} {v:.0f}" for k, v in peak["per_shape"].items()) + ")")
    progress(f"model {'random ' + cfg.preset if random_weights else cfg.model_path} {cfg.dtype} on {device}; "
             f"providers: {', '.join(p.name for p in providers)}")
    return _Setup(model, tok, random_weights, providers, shapes, make_workload(tok, cfg.spec), PeakMemory(device),
                  machine_info(device), peak)


def _time_cell(cfg: BenchConfig, providers: list, docs: list, ctx: dict, meter: PeakMemory, device) -> tuple:
    """({name: [seconds]}, {name: scores of the first timed call}, {name: peak MB}) of one (mode, depth).

    Memory first: one untimed call per in-process provider between ``meter.start()`` and
    ``meter.stop()`` (a peer's memory is its server's: NaN). The CPU meter trims the heap at its
    start, so a call it measures page-faults its buffers again, and the heap an earlier
    provider's call grew is gone: every in-process provider but the last then runs once more,
    untimed, so that no timed call follows a trim — they run on the heap the process keeps
    (``--malloc tuned``: freed blocks kept, as a server's; docs/benchmarks.md, "Latency vs
    reranking depth"). Then round-robin: repeat r of every provider before repeat r + 1 of any,
    so that a load change on a shared machine hits all providers alike, not one cell."""
    times = {p.name: [] for p in providers}
    scores, peaks = {}, {}
    local = [p for p in providers if not isinstance(p, PeerProvider)]
    for p in providers:
        if isinstance(p, PeerProvider):
            peaks[p.name] = math.nan
            continue
        meter.start()
        _score(p, documents=docs, **ctx)
        peaks[p.name] = meter.stop()
    for p in local[:-1]:   # the last one's heap is still there: it ran after the last trim
        _score(p, documents=docs, **ctx)
    for _ in range(cfg.repeats):
        for p in providers:
            ts = times[p.name]
            if ts and sum(ts) >= cfg.max_cell_seconds:
                continue
            s, dt = timed_call(lambda: _score(p, documents=docs, **ctx), device)
            ts.append(dt)
            scores.setdefault(p.name, s)
    return times, scores, peaks


def _reference_scores(providers: list, docs: list, ctx: dict, scores: dict) -> dict:
    """{provider name: the scores it is compared with}: the first provider's; a peer with a
    context (M1–M3) is compared with the first provider scoring its folded prompt (untimed)."""
    first = providers[0]
    refs = {p.name: scores[first.name] for p in providers}
    peers = [p for p in providers if isinstance(p, PeerProvider)]
    if peers and (ctx.get("question") or ctx.get("trace")):
        folded = _score(first, documents=docs, **PeerProvider.folded(ctx))
        refs.update({p.name: folded for p in peers})
    return refs


def credited_flops(p, shapes: Shapes, shared_len: int, seg_lens: list, cfg: BenchConfig) -> float:
    """The FLOPs provider ``p``'s row is credited with (its ``gflop``, GFLOP/s and %peak): a peer
    server's, the least work (``report.least_work_flops``, as ``bench/bench_serve.py`` credits
    every server: what it computes is not seen from here); an in-process provider's, what its
    algorithm computes (``report.plan_flops`` of its ``flop_plan``, padding included), which for
    acarerank's is the least work."""
    if isinstance(p, PeerProvider):
        return least_work_flops(shapes, shared_len, seg_lens)
    batch = cfg.batch_official if p.flop_plan == "full_padded" else cfg.batch_prefix_cache
    return plan_flops(p.flop_plan, shapes, shared_len, seg_lens, batch)


def _cell_rows(cfg: BenchConfig, su: _Setup, mode: str, depth: int, times: dict, scores: dict, peaks: dict,
               refs: dict, shared: list, seg_lens: list) -> list:
    """One row per provider of a (mode, depth) cell (keys: report.COLUMNS)."""
    device = torch.device(cfg.device)
    flops_official = plan_flops("full_padded", su.shapes, len(shared), seg_lens, cfg.batch_official)
    ref_median = percentile(times["transformers"], 50) if "transformers" in times else math.nan
    rows = []
    for p in su.providers:
        ts = times[p.name]
        med = percentile(ts, 50)
        flops = credited_flops(p, su.shapes, len(shared), seg_lens, cfg)
        rows.append({
            "mode": mode, "depth": depth, "provider": p.name,
            "median_ms": med * 1e3, "p10_ms": percentile(ts, 10) * 1e3, "p90_ms": percentile(ts, 90) * 1e3,
            "repeats": len(ts), "docs_per_s": depth / med,
            "tokens_per_s": (len(shared) * depth + sum(seg_lens)) / med,
            "speedup_vs_transformers": ref_median / med,
            "flop_bound_speedup": flops_official / flops, "gflop": flops / 1e9,
            "achieved_gflops": flops / 1e9 / med, "gemm_peak_gflops": su.peak["peak_gflops"],
            "peak_fraction": flops / 1e9 / med / su.peak["peak_gflops"], "kendall_tau_vs_float32": math.nan,
            "peak_mem_mb": peaks[p.name], "mem_kind": su.meter.kind,
            "max_abs_score_diff": max_abs_diff(scores[p.name], refs[p.name]),
            "shared_tokens": len(shared), "doc_tokens": sum(seg_lens),
            "workload_tokens": len(shared) * depth + sum(seg_lens),
            "preset": cfg.preset if cfg.model_path is None else os.path.basename(cfg.model_path.rstrip("/")),
            "dtype": cfg.dtype, "device": device.type, "attn_implementation": cfg.attn_implementation,
            "random_weights": su.random_weights, **su.info,
        })
    return rows


def _failed_row(cfg: BenchConfig, su: _Setup, mode: str, depth: int, e: ProviderFailed) -> dict:
    """The CSV row of the cell where ``e`` stopped the run: its keys, no figures, ``error`` set."""
    return {"mode": mode, "depth": depth, "provider": e.provider, "error": str(e).partition(": ")[2],
            "preset": cfg.preset if cfg.model_path is None else os.path.basename(cfg.model_path.rstrip("/")),
            "dtype": cfg.dtype, "device": torch.device(cfg.device).type,
            "attn_implementation": cfg.attn_implementation, "random_weights": su.random_weights, **su.info}


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = _stderr, partial_csv: Optional[str] = None,
              rows_before: Sequence[dict] = ()) -> BenchResult:
    """Run every (mode, depth, provider) cell; progress goes to ``log``.

    partial_csv: rewritten after every cell (``rows_before`` — an earlier dtype's rows — first),
    so a run cut short (a timeout on a GPU machine) still leaves the rows it measured. A provider
    that raises stops the run with ``ProviderFailed``, after a last row for the failing cell
    (its ``error`` column set, no figures) is written there.
    """
    from .report import write_csv

    cfg = cfg.validate()
    device = torch.device(cfg.device)
    t_start = time.perf_counter()

    def progress(msg):
        el = time.perf_counter() - t_start
        log(f"[bench {int(el // 60):d}:{el % 60:04.1f}] {msg}")

    su = _set_up(cfg, device, progress)
    rows, all_scores = [], {}
    for mode in cfg.modes:
        ctx = su.workload.context(mode)
        depth = cfg.depths[0]  # the warm-up's depth: a failure there is this cell's
        try:
            for p in su.providers:
                for _ in range(cfg.warmup):
                    _score(p, documents=su.workload.docs(depth), **ctx)
            for depth in cfg.depths:
                docs = su.workload.docs(depth)
                shared, segs = split_prompt_ids(su.tok, documents=docs, **ctx)
                times, scores, peaks = _time_cell(cfg, su.providers, docs, ctx, su.meter, device)
                refs = _reference_scores(su.providers, docs, ctx, scores)
                cell = _cell_rows(cfg, su, mode, depth, times, scores, peaks, refs, shared, [len(s) for s in segs])
                for r in cell:
                    all_scores[(mode, depth, r["provider"])] = scores[r["provider"]]
                    progress(f"{mode} depth {depth:>4} {r['provider']:<26} median {r['median_ms']:9.1f} ms over "
                             f"{r['repeats']} run(s)")
                rows += cell
                if partial_csv is not None:
                    write_csv(list(rows_before) + rows, partial_csv)
        except ProviderFailed as e:
            progress(f"{mode} depth {depth:>4} FAILED {e}")
            if partial_csv is not None:  # the rows so far, then the failing cell marked
                write_csv(list(rows_before) + rows + [_failed_row(cfg, su, mode, depth, e)], partial_csv)
            raise
    for p in su.providers:
        if isinstance(p, PeerProvider):
            p.close()
    meta = dict(su.info, random_weights=su.random_weights, shared_tokens={m: len(split_prompt_ids(
        su.tok, documents=su.workload.docs(1), **su.workload.context(m))[0]) for m in cfg.modes},
        doc_token_counts=su.workload.doc_token_counts, elapsed_s=time.perf_counter() - t_start, gemm_peak=su.peak,
        peers={p.name: dict(api=p.target.api, url=p.target.url, version=p.version) for p in su.providers
               if isinstance(p, PeerProvider)})
    return BenchResult(rows=rows, config=cfg, meta=meta, tolerance=SCORE_TOLERANCE[cfg.dtype], scores=all_scores)
