"""``acarerank bench``: pointwise scoring latency versus reranking depth, all providers side by side.

    acarerank bench [--depths 10,20,50,100] [--modes M0,M3] [--preset tiny-cpu] [--output DIR]
                    [--dtype float32,auto] [--extra-dtype-depths 50] ...
    acarerank bench --workload agent [--subqueries 1,3] [--steps 8] ...   (prefix cache across calls)

Writes ``bench.csv``, ``bench.png`` and ``bench.txt`` (the printed report) to the output
folder; exits 1 if any provider's scores differ from the official path's beyond the
dtype's tolerance. Several dtypes run one after the other in the same process, every
provider in each (the model card's path in the same dtype, side by side): the first at
``--depths``, the others at ``--extra-dtype-depths``; cells measured in two dtypes report
the Kendall tau between their orderings. "auto" is the automatic dtype of
``acarerank.hardware`` (bf16 on a CPU with native bf16, else fp32), printed with its reason. The default (no --model) is a seeded RANDOM-weight Qwen3 with the real
tokenizer: timings are real, scores carry no meaning.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from ..malloc_tuning import CHOICES as MALLOC_CHOICES  # stdlib only: --help imports no torch
from .common import check_default_buildable

PEER_TOLERANCE = 1e-2  # largest |peer − reference| score on the same prompt (bench_serve's --peer-tolerance)
QUICK_SPEC = dict(query_tokens=10, question_tokens=30, trace_tokens=200, doc_tokens=(20, 60))


def _ints(text: str) -> tuple:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return vals


def _names(text: str) -> tuple:
    """Comma-separated names; none at all is a usage error (``--providers ''`` ran every provider,
    ``--modes ''`` said 'unknown context mode(s) []')."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


class _Given(argparse._StoreAction):
    """argparse's store, noting the flag in ``namespace.given``: a flag with a default, given or not."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


def _output_dir(path: str) -> str:
    """``path`` made a folder (``--output`` or the default) that takes files, before anything is
    measured or loaded; OSError naming the flag (it was '[Errno 17] File exists: ...', the agent
    workload's after the model had loaded). A folder that exists but refuses files (a read-only
    mount, no write permission) passed, and its first write failed after every measurement had run
    (minutes), nothing saved: a file is made and removed in it here."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        what = "is a file, not a folder" if os.path.isfile(path) else f"cannot be made a folder: {e.strerror or e}"
        raise OSError(f"--output {path!r} {what}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".acarerank-bench-probe-", dir=path)
    except OSError as e:
        raise OSError(f"--output {path!r} cannot be written: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(probe)
    return path


def _range(text: str) -> tuple:
    lo, _, hi = text.partition("-")
    try:
        return (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH or N (tokens), got {text!r}") from None


def _overrides(items) -> dict:
    """``key=value[,key=value]`` → Qwen3Config overrides; values parsed as int, float, bool or str."""
    out = {}
    for item in items or ():
        for kv in item.split(","):
            if not kv.strip():
                continue
            key, sep, val = kv.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"--override expects key=value, got {kv!r}")
            v = val.strip()
            for conv in (int, float):
                try:
                    v = conv(v)
                    break
                except ValueError:
                    pass
            if v in ("true", "false", "True", "False"):
                v = v in ("true", "True")
            out[key.strip()] = v
    return out


def add_parser(subparsers) -> None:
    from acarerank.model.default import PRESETS

    from acarerank.cli import SUBCOMMANDS

    p = subparsers.add_parser(
        "bench", help=SUBCOMMANDS["bench"],
        description="End-to-end pointwise scoring latency versus depth, every provider in the same run; "
                    "CSV + PNG + table. Default model: seeded random weights (timings real, scores meaningless).")
    p.add_argument("--depths", type=_ints, default=None, action=_Given, help="comma-separated depths (default 10,20,50,100; each at most 1,000)")
    p.add_argument("--modes", type=_names, default=("M0", "M3"), action=_Given, help="context modes, e.g. M0,M3 (default)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny-cpu",
                   help="random-weight model shape (default tiny-cpu: 2 CPU cores finish in minutes)")
    p.add_argument("--model", default=None, help="a local HF checkpoint folder instead of random weights")
    p.add_argument("--override", action="append", metavar="KEY=VALUE[,...]",
                   help="Qwen3Config fields over the preset, e.g. num_hidden_layers=2 (repeatable); a shape whose "
                        "float32 weights exceed the device's memory is refused before the set-up")
    p.add_argument("--providers", type=_names, default=None, action=_Given,
                   help="subset of transformers,transformers+prefix-cache,acarerank (default all)")
    p.add_argument("--peer", action="append", default=None, metavar="NAME=[API@]URL",
                   help="a rerank server timed beside the others over HTTP (repeatable): vLLM, llama.cpp, TEI or "
                        "another acarerank, e.g. started by bench/peers/*.sh on the same --model")
    p.add_argument("--backends", type=_names, default=None,
                   help="acarerank backends (default: torch, cpp, native, triton, cuda where each runs on the device and "
                        "is not an interpreter; native is the CPU's default path); an entry may override "
                        "ops, e.g. native,native+linear=torch (oneDNN vs F.linear under the native kernels)")
    p.add_argument("--repeats", type=int, default=None, action=_Given, help="timed calls per cell (default 3; --quick 1)")
    p.add_argument("--warmup", type=int, default=None, action=_Given, help="untimed calls per provider and mode (default 1)")
    p.add_argument("--max-cell-seconds", type=float, default=20.0, action=_Given,
                   help="stop repeating a cell after this long (default 20; at least one call)")
    p.add_argument("--dtype", type=_names, default=("float32", "auto"),
                   help="comma-separated dtypes among auto,float32,bfloat16,float16 (default float32,auto: fp32, "
                        "plus bf16 on a CPU with native bf16); the first runs at --depths, the others at "
                        "--extra-dtype-depths")
    p.add_argument("--compile-layers", action="store_true",
                   help="also run acarerank with torch.compile'd element-wise layer work, beside the eager "
                        "one (compiles during warm-up)")
    p.add_argument("--extra-dtype-depths", type=_ints, default=None, action=_Given,
                   help="depths of the second and later dtypes (default: 50 if the first dtype runs it, "
                        "else the same depths)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--malloc", choices=MALLOC_CHOICES, default="tuned",
                   help="glibc's malloc in this process, as acarerank serve's --malloc (default tuned: freed blocks "
                        "kept in the heap, CPU passes of 4,096 tokens; default: glibc's own, passes of 2,048)")
    p.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa",
                   help="attention of the transformers providers (default sdpa, transformers' own default)")
    p.add_argument("--query-tokens", type=int, default=None, help="sub-query length (default 20)")
    p.add_argument("--question-tokens", type=int, default=None, help="original question length (default 60)")
    p.add_argument("--trace-tokens", type=int, default=None, action=_Given, help="reasoning trace length (default 1500)")
    p.add_argument("--doc-tokens", type=_range, default=None,
                   help="document length range LOW-HIGH, uniform, or N for equal lengths (default 60-380); every "
                        "text length at most 32,768 tokens")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the workload (default 0)")
    p.add_argument("--output", default=None,
                   help="results folder (default results/bench-<preset>-<dtypes>-<device>: the dtypes run, joined "
                        "by '+', <preset> 'model' with --model; --workload agent: "
                        "results/bench-agent-<preset>-<dtype>-<device>, the first dtype)")
    p.add_argument("--workload", choices=("depth", "agent"), default="depth",
                   help="depth: latency vs depth (default); agent: a growing-trace agent session, prefix cache "
                        "on vs off vs transformers with a per-request prefix cache; a flag only the other "
                        "workload reads is a usage error")
    p.add_argument("--steps", type=int, default=8, action=_Given, help="agent: calls in the session (default 8)")
    p.add_argument("--trace-step-tokens", type=int, default=600, action=_Given, help="agent: trace growth per step (default 600)")
    p.add_argument("--docs-per-call", type=int, default=20, action=_Given, help="agent: documents per call (default 20, at most 1,000)")
    p.add_argument("--subqueries", type=_ints, default=(1, 3), action=_Given,
                   help="agent: sub-queries per step under one context, one session each (default 1,3)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: depths 2,4,8, short texts (trace 200, docs 20-60 tokens), 1 repeat, no warmup, "
                        "no target judged")
    p.set_defaults(run=run)


def default_output(preset: str, dtypes, device: str, model: bool = False, agent: bool = False) -> str:
    """The results folder without ``--output``: ``results/bench-<preset>-<dtypes>-<device>``, the
    dtypes run joined by '+' and the preset ``model`` for a checkpoint; the agent workload's
    ``results/bench-agent-<preset>-<dtype>-<device>`` (it runs the first dtype only). ``--help``
    and docs/benchmarks.md name this pattern."""
    device = device.replace(":", "")
    if agent:
        return os.path.join("results", f"bench-agent-{preset}-{dtypes[0]}-{device}")
    return os.path.join("results", f"bench-{'model' if model else preset}-{'+'.join(dtypes)}-{device}")


def resolve_dtypes(names, device: str) -> list:
    """[(dtype name, reason)] for --dtype, "auto" resolved, duplicates dropped (first kept)."""
    from acarerank.hardware import resolve_dtype

    out = []
    for n in names:
        dt, why = resolve_dtype(n, device)
        name = str(dt).replace("torch.", "")
        if n == "auto":
            why = f"auto: {why}"
        if name not in (o[0] for o in out):
            out.append((name, why))
    if not out:
        raise ValueError("--dtype names no dtype")
    return out


def config_from_args(args, dtype: str = "float32", depths=None):
    from acarerank.benchmark.harness import PROVIDERS, BenchConfig
    from acarerank.benchmark.peers import parse_target
    from acarerank.benchmark.workload import WorkloadSpec

    spec = dict(QUICK_SPEC) if args.quick else {}
    for name in ("query_tokens", "question_tokens", "trace_tokens", "doc_tokens"):
        if getattr(args, name) is not None:
            spec[name] = getattr(args, name)
    spec["seed"] = args.seed
    return BenchConfig(
        depths=depths or args.depths or ((2, 4, 8) if args.quick else (10, 20, 50, 100)),
        modes=args.modes, preset=args.preset, model_path=args.model, overrides=_overrides(args.override),
        providers=args.providers or PROVIDERS, backends=args.backends,
        repeats=args.repeats if args.repeats is not None else (1 if args.quick else 3),
        warmup=args.warmup if args.warmup is not None else (0 if args.quick else 1),
        max_cell_seconds=args.max_cell_seconds, dtype=dtype, device=args.device, attn_implementation=args.attn,
        spec=WorkloadSpec(**spec), seed=args.seed, compile_layers=args.compile_layers,
        peers=tuple(parse_target(t, "--peer") for t in args.peer or ()),
    ).validate()


def equivalent_command(cfg, dtypes=None, extra_depths=None) -> str:
    """The fully explicit command line that reproduces ``cfg`` (printed with the results);
    ``dtypes``/``extra_depths``: the run's dtype list and the later dtypes' depths."""
    sp = cfg.spec
    parts = ["acarerank bench", f"--depths {','.join(map(str, cfg.depths))}", f"--modes {','.join(cfg.modes)}",
             f"--model {cfg.model_path}" if cfg.model_path else f"--preset {cfg.preset}"]
    if cfg.overrides:
        parts.append("--override " + ",".join(f"{k}={v}" for k, v in cfg.overrides.items()))
    parts.append(f"--providers {','.join(cfg.providers)}")
    if cfg.backends:
        parts.append(f"--backends {','.join(cfg.backends)}")
    if cfg.compile_layers:
        parts.append("--compile-layers")
    parts += [f"--peer {t.name}={t.api + '@' if t.api else ''}{t.url}" for t in cfg.peers]
    parts += [f"--repeats {cfg.repeats}", f"--warmup {cfg.warmup}", f"--max-cell-seconds {cfg.max_cell_seconds:g}",
              f"--dtype {','.join(dtypes or [cfg.dtype])}"
              + (f" --extra-dtype-depths {','.join(map(str, extra_depths))}" if dtypes and len(dtypes) > 1 else ""),
              f"--device {cfg.device}", f"--attn {cfg.attn_implementation}",
              f"--query-tokens {sp.query_tokens}", f"--question-tokens {sp.question_tokens}",
              f"--trace-tokens {sp.trace_tokens}", f"--doc-tokens {sp.doc_tokens[0]}-{sp.doc_tokens[1]}",
              f"--seed {cfg.seed}"]
    return " ".join(parts)


def _apply_malloc(args) -> str:
    """``--malloc`` (acarerank.malloc_tuning), once the arguments are checked and before the model
    loads, as acarerank serve; what holds then, also printed."""
    from acarerank import malloc_tuning

    malloc = malloc_tuning.apply(args.malloc)
    print(f"[bench] malloc {malloc}", file=sys.stderr, flush=True)
    return malloc


#: each workload's own flags (argparse dest: flag); the other workload does not read them, so one
#: given there is a usage error (the agent workload ran without --providers, --peer, --repeats ...)
DEPTH_ONLY = dict(depths="--depths", modes="--modes", providers="--providers", peer="--peer", repeats="--repeats",
                  warmup="--warmup", max_cell_seconds="--max-cell-seconds", compile_layers="--compile-layers",
                  extra_dtype_depths="--extra-dtype-depths", trace_tokens="--trace-tokens")
AGENT_ONLY = dict(steps="--steps", trace_step_tokens="--trace-step-tokens", docs_per_call="--docs-per-call",
                  subqueries="--subqueries")


def check_workload_flags(args) -> None:
    """ValueError naming the first flag given that ``args.workload`` does not use (``DEPTH_ONLY``,
    ``AGENT_ONLY``; the agent workload runs one backend: a second in --backends is refused too)."""
    own = "agent" if args.workload == "agent" else "depth"
    other = DEPTH_ONLY if own == "agent" else AGENT_ONLY
    given = getattr(args, "given", frozenset())
    for dest, flag in other.items():
        value = getattr(args, dest)
        if dest in given or value is True or (isinstance(value, list) and value):  # _Given; store_true; append
            raise ValueError(f"{flag} is not read by --workload {own}")
    if own == "agent" and args.backends is not None and len(args.backends) > 1:
        raise ValueError(f"--backends: --workload agent runs one backend, got {','.join(args.backends)}")


def run_agent(args) -> int:
    """``--workload agent``: one session per --subqueries value, in the first ``--dtype``; prints
    and writes agent.txt / agent.csv."""
    from acarerank.benchmark.agent import (AgentSpec, cache_tolerance, check_line, format_report, run_agent_bench,
                                           tolerance)
    from acarerank.benchmark.harness import load_model

    cfg = config_from_args(args, resolve_dtypes(args.dtype, args.device)[0][0])  # the first --dtype only
    lo, hi = cfg.spec.doc_tokens if args.doc_tokens is not None or args.quick else (60, 380)
    specs = [AgentSpec(steps=args.steps, trace_step_tokens=args.trace_step_tokens,  # checked before loading
                       question_tokens=cfg.spec.question_tokens, query_tokens=cfg.spec.query_tokens,
                       docs=args.docs_per_call, doc_tokens=(lo, hi), subqueries=n, seed=args.seed)
             for n in args.subqueries]
    out_dir = _output_dir(args.output or default_output(cfg.preset, [cfg.dtype], cfg.device, agent=True))
    _apply_malloc(args)
    model, tok, random_weights = load_model(cfg)
    texts, rows, ok = [], [], True
    backend = cfg.backends[0] if cfg.backends else None
    csv_path = os.path.join(out_dir, "agent.csv")
    for spec in specs:  # agent.csv is rewritten after every step, a failing step marked (as bench.csv)
        res = run_agent_bench(model, tok, spec, backend=backend, log=lambda m: print(m, flush=True),
                              partial_csv=csv_path, rows_before=rows)
        # the dtype's: bf16 is not held to fp32's 1e-5 (nor, cache on against off, to its 1e-6)
        ok_s, line = check_line(res, tolerance(cfg.dtype), cache_tolerance(cfg.dtype))
        texts.append(format_report(res) + f"\n{line} [{cfg.dtype}]")
        ok &= ok_s
        rows += res["rows"]
        print(texts[-1], flush=True)
    cmd = (f"acarerank bench --workload agent --subqueries {','.join(map(str, args.subqueries))} --steps {args.steps} "
           f"--trace-step-tokens {args.trace_step_tokens} --docs-per-call {args.docs_per_call} "
           f"--doc-tokens {lo}-{hi} --question-tokens {cfg.spec.question_tokens} "
           f"--query-tokens {cfg.spec.query_tokens} "
           + (f"--model {cfg.model_path}" if cfg.model_path else f"--preset {cfg.preset}")
           + ("" if not cfg.overrides else " --override " + ",".join(f"{k}={v}" for k, v in cfg.overrides.items()))
           + f" --dtype {cfg.dtype} --device {cfg.device} --seed {args.seed}"
           + (f" --backends {backend}" if backend else ""))
    head = "random weights: timings are real, scores carry no meaning\n" if random_weights else ""
    text = head + "\n\n".join(texts) + f"\ncommand: {cmd}"
    with open(os.path.join(out_dir, "agent.txt"), "w") as f:
        f.write(text + "\n")
    print(f"command: {cmd}\nwrote {out_dir}/agent.txt, agent.csv")
    return 0 if ok else 1


def run(args) -> int:
    check_workload_flags(args)
    # bench does not call check_common (its flags differ); -OO without --model failed ~9 s in, exit 1
    check_default_buildable(args.model)
    if args.workload == "agent":
        return run_agent(args)
    from acarerank.benchmark import report
    from acarerank.benchmark.harness import run_bench
    from acarerank.model.default import NO_MEANING

    dtypes = resolve_dtypes(args.dtype, args.device)
    first = config_from_args(args, dtypes[0][0])
    # later dtypes: depth 50 (the targets' row) when the first dtype runs it, else the same depths
    extra_depths = args.extra_dtype_depths or ((50,) if 50 in first.depths and not args.quick else first.depths)
    cfgs = [first] + [config_from_args(args, name, extra_depths) for name, _ in dtypes[1:]]
    names = [name for name, _ in dtypes]
    cfg = first
    out_dir = args.output or default_output(cfg.preset, names, cfg.device, model=cfg.model_path is not None)
    _output_dir(out_dir)
    malloc = _apply_malloc(args)
    for name, why in dtypes:
        print(f"[bench] dtype {name}: {why}", file=sys.stderr, flush=True)
    rows, scores, results = [], {}, []
    for c in cfgs:  # one dtype after the other, all providers of a dtype side by side
        res = run_bench(c, partial_csv=os.path.join(out_dir, "bench.csv"), rows_before=rows)
        results.append(res)
        rows += res.rows
        scores.update({(c.dtype, *k): v for k, v in res.scores.items()})
    agree = report.rank_agreement(rows, scores) if "float32" in names and len(names) > 1 else []

    cmd = equivalent_command(cfg, names, extra_depths) + (" --malloc default" if args.malloc == "default" else "")
    meta = results[0].meta
    lines = []
    if meta["random_weights"]:
        lines.append(NO_MEANING.format(preset=cfg.preset) + " Timings are real.")
    lines.append(f"machine: {meta['device_name']}; python {meta['python']}, torch {meta['torch']}, "
                 f"transformers {meta['transformers']}, acarerank {meta['acarerank']}; "
                 f"attention of the transformers providers: {cfg.attn_implementation}; malloc {malloc}")
    for (name, why), res in zip(dtypes, results):
        pk = res.meta["gemm_peak"]
        lines.append(f"dtype {name} ({why}); GEMM peak {pk['peak_gflops']:.1f} GFLOP/s (best of {pk.get('ways', 'F.linear')}, {pk['rows']} rows: "
                     + ", ".join(f"{k} {v:.0f}" for k, v in pk["per_shape"].items()) + ")")
    docs = meta["doc_token_counts"]
    model_name = cfg.model_path or cfg.preset + (" + " + ",".join(f"{k}={v}" for k, v in cfg.overrides.items())
                                                 if cfg.overrides else "")
    shared = ", ".join(f"{m} {n}" for m, n in meta["shared_tokens"].items())
    lines.append(f"model: {model_name}; workload: shared context {shared} tokens; {len(docs)} documents of "
                 f"{min(docs)}-{max(docs)} tokens (mean {sum(docs) / len(docs):.0f}); repeats {cfg.repeats}, "
                 f"warmup {cfg.warmup}; memory: {rows[0]['mem_kind']} (peak above the start of one untimed call per cell, after a heap trim, MB)")
    lines.append(report.format_table(rows))
    ok = True
    for res in results:
        peers = res.meta.get("peers", {})
        ok_d, check_line = report.score_check([r for r in res.rows if r["provider"] not in peers], res.tolerance)
        ok = ok and ok_d
        lines.append(check_line + (f" [{res.config.dtype}]" if len(results) > 1 else ""))
        if peers:  # other kernels, other summation orders (llama.cpp f32 ~1e-3, q8_0 ~7e-3): their own tolerance
            ok_p, peer_line = report.score_check([r for r in res.rows if r["provider"] == res.rows[0]["provider"]]
                                                 + [r for r in res.rows if r["provider"] in peers], PEER_TOLERANCE)
            ok = ok and ok_p
            lines.append("peers " + peer_line + "; " + ", ".join(f"{n}: {m['api']} {m['version']}".strip()
                                                                   for n, m in peers.items()))
    if len(names) > 1:
        lines.append(report.format_rank_agreement(agree))
    lines.append(report.format_scaling(report.depth_scaling(rows), judge=not args.quick))
    if args.quick:  # one cold call per cell: "NOT within 15%" and "NOT met" there would be noise
        lines.append("targets: not judged in a --quick run (one call per cell, no warm-up); "
                     "a full run (bash scripts/main.sh) judges them at M3 depth 50")
    else:
        lines.append(report.format_targets(rows))
        dt_targets = report.format_dtype_targets(rows)
        if dt_targets:
            lines.append(dt_targets)
    csv_path, png_path, txt_path = (os.path.join(out_dir, f"bench.{ext}") for ext in ("csv", "png", "txt"))
    report.write_csv(rows, csv_path)
    try:
        report.plot(rows, png_path, title=f"{model_name} {'+'.join(names)} on {meta['device_name']}"
                                          f"{' (random weights)' if meta['random_weights'] else ''}")
    except ImportError as e:  # matplotlib is the `bench` extra; the measurement stands without it
        png_path = f"no PNG ({e}; pip install matplotlib)"
    lines.append(f"command: {cmd}")
    elapsed = sum(r.meta["elapsed_s"] for r in results)
    lines.append(f"wrote {csv_path}, {png_path}, {txt_path} ({elapsed:.0f} s, {time.strftime('%Y-%m-%d %H:%M')})")
    text = "\n".join(lines)
    with open(txt_path, "w") as f:
        f.write(text + "\n")
    print(text)
    return 0 if ok else 1
