"""Setwise selection beside vLLM's CPU build: acarerank's ``SetwiseReranker.select`` /
``select_batch`` and vLLM's ``/v1/completions`` doing the same work on the same prompt token ids.

vLLM serves the folder ``bench/peers/vllm_cpu.sh --runner generate`` wrote (the embedded
random-weight model of ``--preset`` as a ``Qwen3ForCausalLM``, its lm_head the tied embedding);
this process loads the same folder (``--model``, what ``vllm_cpu.sh --model-dir`` prints) in
``--dtype``, which must be the server's ``--dtype``.

Workload: one RAG query (Appendix F.1 prompt, ``max_select`` 10) over pools of ``--pools``
documents of 60-380 tokens (``acarerank.benchmark.workload``: seeded, sized with the real
tokenizer); ``--batches`` B: B prompts of the pool, its documents in B rotations (B distinct
prompts of about the same length), as ``bench/bench_setwise.py`` builds them.

Providers, per round (a fresh prefix-cache salt each, for both: no round reuses an earlier one's
prompts; the B prompts of a round may share their common head, as one batch):

  acarerank  ``select`` (B = 1) or ``select_batch(batch_size=B)``: grammar-constrained greedy
             decoding, prompt building included (a few ms beside seconds of prefill)
  vLLM       B concurrent ``POST /v1/completions``, each ``prompt`` = that prompt's token ids (the
             ids acarerank's ``encode_select`` builds, which its select decodes after),
             ``temperature`` 0, ``max_tokens`` = the new tokens acarerank produced for that
             prompt in the same round (``<|im_end|>`` included), ``ignore_eos``: both prefill the
             prompt and run the same number of decode steps. The answer must say so
             (``usage``: prompt and completion tokens; else exit 1).

vLLM's tokens are not grammar-constrained: the work is the same, the tokens are not (and are
not compared). Random weights mostly stop after one id; to time a realistic (the longest)
selection, ``<|im_end|>`` is disfavoured in acarerank's copy of the weights (``--end-bias``, as in
``bench/bench_setwise.py``; the head untied first), so a selection runs to 10 ids: that edit
changes acarerank's tokens only, not the work either server does.

Warm-up, untimed: one short selection in this process; vLLM's first request after start-up.
Before each provider's round the machine's CPUs must be idle (``wait_for_quiet_cpu``: a window of
0.25 s under 15 % busy, at most ``--settle-s``, 5 s; vLLM keeps a core busy for ~1 s after it
answers), so neither starts on cores the other still uses; a round that starts without it says so
in the log.
Reported per (pool, B): median ms per round and per selection (÷ B), prompt tokens/s (Σ of the
B prompts ÷ time), ``acarerank ÷ vLLM`` (vLLM's time ÷ acarerank's: a throughput ratio), and
GFLOP/s = the least work ÷ time (``report.least_work_select_flops``: each prompt's prefill and
decode steps, the batch's common head once, a head of the grammar's 14 tokens; the same
numerator for both, docs/benchmarks.md "A server's GFLOP/s") with its fraction of the GEMM peak
in ``--dtype`` at the model's layer shapes (``gemm_peak``, measured before and after the rounds
in this process, each shape's faster kept).

    python bench/bench_setwise_peer.py --model "$(bench/peers/vllm_cpu.sh --model-dir)" \\
        --peer http://127.0.0.1:8001 [--dtype float32] [--pools 20,50] [--batches 1,8] [--repeats 3]

Writes ``setwise_peer.csv`` (one row per pool, B and provider) and ``setwise_peer.txt`` into ``--out``.

glibc's allocator settings (``--malloc-env default,thresholds``; no ``--peer``, vLLM is not run):
acarerank's rounds alone, in child processes of this script (``--_child``) — glibc reads
``MALLOC_*`` only at process start, so one process cannot run two settings. Per pass
(``--malloc-passes``, 2) and thread (``--malloc-threads``: ``main``, and ``worker``: one worker
thread, as ``acarerank serve`` runs its model, with its own glibc arena) one child per variant,
the variants in turn; each child loads the model, makes the same workload and runs the same
warm-up as the vLLM comparison (all on that thread), then ``--repeats`` timed rounds per
(pool, B) (``wait_for_quiet_cpu`` before each). Variants
(``MALLOC_VARIANTS``): ``default`` (every ``MALLOC_*`` variable removed from the environment),
``thresholds`` (mmap threshold 512 MiB, trim threshold 1 GiB: docs/cpu.md "Memory between
passes"), ``arena1`` (those and ``MALLOC_ARENA_MAX=1``). Reported per (thread, variant, pool, B):
s per selection (median and every round), minor page faults per selection (``ru_minflt`` of the
child around each timed round ÷ B), the children's peak RSS (``ru_maxrss``), and
``x_default`` = default's median ÷ this variant's (> 1: faster). A child that fails exits this
script with 1 and its stderr's tail; no row is written.

    python bench/bench_setwise_peer.py --model "$(bench/peers/vllm_cpu.sh --model-dir)" \\
        --dtype bfloat16 --pools 20 --batches 1 --repeats 2 --malloc-env default,thresholds

writes ``setwise_malloc.csv`` and ``setwise_malloc.txt`` into ``--out``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from acarerank.benchmark.measure import machine_info, wait_for_quiet_cpu
from acarerank.benchmark.peers import detect_api, served_model
from acarerank.benchmark.report import Shapes, least_work_select_flops, write_csv
from acarerank.benchmark.workload import MAX_DOCS, WorkloadSpec, make_workload
from acarerank.tokenizer import load_qwen3_tokenizer

COLUMNS = ["pool", "batch", "provider", "prompt_tokens", "new_tokens", "median_ms", "min_ms", "max_ms", "repeats",
           "ms_per_selection", "prompt_tok_per_s", "acarerank_x_vllm", "gflop", "gflop_per_s", "gemm_peak_gflops",
           "peak_fraction", "dtype", "model", "peer_version", "device_name", "torch", "acarerank"]
MALLOC_COLUMNS = ["thread", "variant", "malloc_env", "pool", "batch", "provider", "prompt_tokens", "new_tokens",
                  "median_ms", "min_ms", "max_ms", "repeats", "ms_per_selection", "s_per_selection_all",
                  "prompt_tok_per_s", "minflt_per_selection", "minflt_per_selection_all", "peak_rss_mb", "x_default",
                  "dtype", "model", "device_name", "machine", "torch", "acarerank"]
# glibc mallopt(3) environment settings; every MALLOC_* variable of the caller's environment is
# removed first, so "default" is glibc's own behaviour (docs/cpu.md "Memory between passes")
MALLOC_VARIANTS = {
    "default": {},
    "thresholds": {"MALLOC_MMAP_THRESHOLD_": "536870912", "MALLOC_TRIM_THRESHOLD_": "1073741824"},
    "arena1": {"MALLOC_MMAP_THRESHOLD_": "536870912", "MALLOC_TRIM_THRESHOLD_": "1073741824",
               "MALLOC_ARENA_MAX": "1"},
}
MALLOC_THREADS = ("main", "worker")
MAX_SELECT = 10
REQUEST_TIMEOUT_S = 3600.0  # one round of 8 pool-50 prompts in fp32 on 2 cores takes minutes


def _int_list(name: str, text: str, low: int, high: int) -> list:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} must be comma-separated ints, got {text!r}") from None
    if not values or any(not low <= v <= high for v in values):
        raise argparse.ArgumentTypeError(f"{name} values must be in [{low}, {high}], got {text!r}")
    return values


def _name_list(name: str, text: str, choices) -> list:
    values = text.split(",")
    if any(v not in choices for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{name} must be distinct names of {', '.join(choices)}, got {text!r}")
    return values


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the folder vLLM serves (bench/peers/vllm_cpu.sh --model-dir)")
    ap.add_argument("--peer", help="vLLM's URL (bench/peers/vllm_cpu.sh --runner generate prints it)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the server's --dtype")
    ap.add_argument("--pools", default="20,50", type=lambda s: _int_list("--pools", s, 2, MAX_DOCS))
    ap.add_argument("--batches", default="1,8", type=lambda s: _int_list("--batches", s, 1, 64))
    ap.add_argument("--doc-tokens", default="60,380", type=lambda s: _int_list("--doc-tokens", s, 1, 4000),
                    help="low,high document length in tokens")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per (pool, batch) and provider")
    ap.add_argument("--end-bias", type=float, default=-0.3, help="acarerank's lm_head[<|im_end|>, 0]; < 0 runs "
                                                                 "to 10 ids (nan: the weights as served)")
    ap.add_argument("--settle-s", type=float, default=5.0,
                    help="before each provider's round, wait up to this long for idle CPUs (0: do not wait)")
    ap.add_argument("--out", default=os.path.join("results", "bench_setwise_peer"))
    ap.add_argument("--malloc-env", type=lambda s: _name_list("--malloc-env", s, MALLOC_VARIANTS),
                    help="acarerank alone under these glibc settings, a child process each, instead of vLLM: "
                         f"{', '.join(MALLOC_VARIANTS)}; default among them")
    ap.add_argument("--malloc-threads", type=lambda s: _name_list("--malloc-threads", s,
                                                                                           MALLOC_THREADS),
                    help="with --malloc-env: the rounds on the main thread, on one worker thread (as serve), or both "
                         "(default main,worker)")
    ap.add_argument("--malloc-passes", type=int,
                    help="with --malloc-env: child processes per variant and thread, the variants in turn (default 2)")
    ap.add_argument("--_child", choices=MALLOC_THREADS, help=argparse.SUPPRESS)  # a --malloc-env child's thread
    args = ap.parse_args(argv)
    if not 0 <= args.settle_s <= 60:
        ap.error(f"--settle-s must be in [0, 60], got {args.settle_s}")
    if len(args.doc_tokens) != 2 or args.doc_tokens[0] > args.doc_tokens[1]:
        ap.error(f"--doc-tokens must be low,high with low <= high, got {args.doc_tokens}")
    if not 1 <= args.repeats <= 100:
        ap.error(f"--repeats must be in [1, 100], got {args.repeats}")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        ap.error(f"--model {args.model!r} has no config.json (bench/peers/vllm_cpu.sh --model-dir prints the folder)")
    if args.malloc_env is None and args._child is None:
        given = [f for f, v in (("--malloc-threads", args.malloc_threads), ("--malloc-passes", args.malloc_passes))
                 if v is not None]
        if given:   # silently ignored, they would time vLLM instead of what was asked
            ap.error(f"{' and '.join(given)} only apply with --malloc-env")
    args.malloc_threads = args.malloc_threads or list(MALLOC_THREADS)
    args.malloc_passes = 2 if args.malloc_passes is None else args.malloc_passes
    if not 1 <= args.malloc_passes <= 20:
        ap.error(f"--malloc-passes must be in [1, 20], got {args.malloc_passes}")
    if args.malloc_env is not None or args._child is not None:
        if args.peer is not None:
            ap.error("--malloc-env times acarerank alone: drop --peer")
        if args._child is None and "default" not in args.malloc_env:
            ap.error(f"--malloc-env needs default among its variants (the ratios' base), got {args.malloc_env}")
        # the children inherit them: "default" would not be glibc's own allocator (a tcmalloc preload)
        # or settings (tunables)
        other = [k for k in ("LD_PRELOAD", "GLIBC_TUNABLES") if os.environ.get(k)]
        if args._child is None and other:
            ap.error(f"--malloc-env compares glibc's own settings: unset {', '.join(other)} first")
        return args
    if args.peer is None:
        ap.error("--peer is required (or --malloc-env, which times acarerank alone)")
    args.peer = args.peer.rstrip("/")
    if not args.peer.startswith(("http://", "https://")):
        ap.error(f"--peer must be an http(s) URL, got {args.peer!r}")
    return args


def completion_body(model: str, prompt_ids: list, max_tokens: int, cache_salt: str) -> dict:
    """vLLM's ``/v1/completions`` body that prefills ``prompt_ids`` and decodes exactly
    ``max_tokens`` greedy tokens (``ignore_eos``: an end token does not stop it early)."""
    if not prompt_ids or max_tokens < 1:
        raise ValueError(f"a completion needs a prompt and max_tokens >= 1, got {len(prompt_ids)} ids, {max_tokens}")
    return {"model": model, "prompt": [int(t) for t in prompt_ids], "max_tokens": int(max_tokens),
            "temperature": 0.0, "ignore_eos": True, "stream": False, "cache_salt": cache_salt}


def check_completion(answer: dict, prompt_len: int, max_tokens: int) -> None:
    """ValueError unless vLLM says it read ``prompt_len`` prompt tokens and made ``max_tokens``."""
    usage = answer.get("usage") or {}
    got = (usage.get("prompt_tokens"), usage.get("completion_tokens"))
    if got != (prompt_len, max_tokens):
        raise ValueError(f"vLLM did other work than asked: prompt/completion tokens {got}, asked "
                         f"({prompt_len}, {max_tokens})")


async def _post_all(url: str, bodies: list) -> list:
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        answers = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
    for a in answers:
        if a.status_code != 200:
            raise ValueError(f"vLLM answered {a.status_code}: {a.text[:500]}")
    return [a.json() for a in answers]


def vllm_round(url: str, bodies: list) -> float:
    """Seconds from sending the bodies (concurrently) to the last answer, every answer checked."""
    t0 = time.perf_counter()
    answers = asyncio.run(_post_all(url, bodies))
    secs = time.perf_counter() - t0
    for a, b in zip(answers, bodies):
        check_completion(a, len(b["prompt"]), b["max_tokens"])
    return secs


def load_reranker(path: str, dtype: torch.dtype, end_bias: float):
    """A ``SetwiseReranker`` on the folder's weights, ``<|im_end|>`` disfavoured by ``end_bias``
    (coordinate 0 of the embedding set to 2.0 makes it ~constant in the final-normed state, so
    ``lm_head[:, 0]`` acts as a bias; the head is untied first), or as served when it is nan."""
    from transformers import Qwen3ForCausalLM

    from acarerank import SetwiseReranker
    from acarerank.reranker_base import checkpoint_tokenizer
    from acarerank.tokenizer import TOKEN_IM_END

    model = Qwen3ForCausalLM.from_pretrained(path, dtype=dtype).eval()
    if end_bias == end_bias:
        with torch.no_grad():
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
            model.config.tie_word_embeddings = False
            model.model.embed_tokens.weight[:, 0] = 2.0
            model.lm_head.weight[TOKEN_IM_END, 0] = end_bias
    return SetwiseReranker(model=model, tokenizer=checkpoint_tokenizer(path))


def batch_flops(sh: Shapes, prompts: list, new_tokens: list, head_width: int) -> float:
    """The least work of one round: each prompt's selection, the batch's common head once."""
    common = len(os.path.commonprefix(prompts)) if len(prompts) > 1 else 0
    common = min([common] + [len(p) - 1 for p in prompts])
    return sum(least_work_select_flops(sh, len(p), k, head_width, cached=common if i else 0)
               for i, (p, k) in enumerate(zip(prompts, new_tokens)))


def acarerank_round(rr, work, lists: list, salt: str) -> tuple:
    """(seconds, selections) of one acarerank round: ``select`` over ``lists[0]`` (B = 1) or
    ``select_batch`` over the B rotations ``lists``."""
    B = len(lists)
    t0 = time.perf_counter()
    if B == 1:
        sels = [rr.select(work.query, lists[0], max_select=MAX_SELECT, cache_salt=salt)]
    else:
        sels = rr.select_batch([work.query] * B, lists, max_select=MAX_SELECT, batch_size=B, cache_salt=salt)
    return time.perf_counter() - t0, sels


def rotations(docs: list, B: int) -> list:
    """B rotations of a pool's documents: B distinct prompts of about the same length."""
    return [docs[b % len(docs):] + docs[:b % len(docs)] for b in range(B)]


def measure(rr, work, args, name: str, version: str, sh: Shapes, width: int, info: dict) -> list:
    """The rows of every (pool, B): both providers' rounds, taking turns."""
    rows = []
    for pool in args.pools:
        for B in args.batches:
            docs = work.docs(pool)
            lists = rotations(docs, B)
            prompts = [rr.encode_select(work.query, d, max_select=MAX_SELECT).prompt.input_ids for d in lists]
            times, news = {"acarerank": [], "vllm": []}, None
            for r in range(args.repeats):  # the providers take turns: a load change hits both
                salt = uuid.uuid4().hex
                _settle(f"pool {pool} x {B} round {r + 1}: acarerank", args.settle_s)
                secs, sels = acarerank_round(rr, work, lists, salt)
                times["acarerank"].append(secs)
                if [s.prompt_tokens for s in sels] != [len(p) for p in prompts]:
                    raise SystemExit("acarerank's select built other prompts than encode_select")
                k = [s.num_tokens for s in sels]
                if news is not None and k != news:  # the same weights and prompts: greedy repeats itself
                    raise SystemExit(f"pool {pool} x {B}: acarerank made {k} new tokens, {news} in round 1")
                news = k
                bodies = [completion_body(name, p, n, salt) for p, n in zip(prompts, k)]
                _settle(f"pool {pool} x {B} round {r + 1}: vLLM", args.settle_s)
                times["vllm"].append(vllm_round(args.peer, bodies))
                _log(f"[round {r + 1}/{args.repeats}] pool {pool} x {B}: acarerank {times['acarerank'][-1]:.2f} s, "
                     f"vLLM {times['vllm'][-1]:.2f} s")
            n_prompt, flops = sum(map(len, prompts)), batch_flops(sh, prompts, news, width)
            med = {p: statistics.median(t) for p, t in times.items()}
            for prov, ts in times.items():
                rows.append(dict(pool=pool, batch=B, provider=prov, prompt_tokens=n_prompt, new_tokens=sum(news),
                                 median_ms=med[prov] * 1e3, min_ms=min(ts) * 1e3, max_ms=max(ts) * 1e3,
                                 repeats=args.repeats, ms_per_selection=med[prov] * 1e3 / B,
                                 prompt_tok_per_s=n_prompt / med[prov], gflop=flops / 1e9,
                                 gflop_per_s=flops / med[prov] / 1e9, acarerank_x_vllm=med["vllm"] / med["acarerank"],
                                 dtype=args.dtype, model=name, peer_version=version, **info))
    return rows


def acarerank_setup(args) -> tuple:
    """(reranker, workload) of a run, warmed up: one short selection, untimed (one-time costs:
    lazy imports, allocator growth)."""
    rr = load_reranker(args.model, getattr(torch, args.dtype), args.end_bias)
    spec = WorkloadSpec(num_docs=max(args.pools), doc_tokens=tuple(args.doc_tokens))
    work = make_workload(load_qwen3_tokenizer(), spec)
    rr.select(work.query, work.docs(2), max_select=2, cache_salt=uuid.uuid4().hex)
    return rr, work


def malloc_child(args) -> int:
    """A ``--malloc-env`` child: acarerank's rounds on ``args._child``'s thread, one JSON line on
    stdout: per (pool, B) each round's seconds and minor page faults (``ru_minflt`` of this process
    around the round: every thread's), prompt and new tokens; the process's peak RSS (MB) and the
    ``MALLOC_*`` variables it started with."""
    cells = []

    def work_fn():   # loaded, warmed up and timed on one thread: the warm-up grows the arena the rounds use
        rr, work = acarerank_setup(args)
        for pool in args.pools:
            for B in args.batches:
                lists, secs, faults, sels = rotations(work.docs(pool), B), [], [], []
                for r in range(args.repeats):
                    _settle(f"{args._child} thread, pool {pool} x {B} round {r + 1}", args.settle_s)
                    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    dt, sels = acarerank_round(rr, work, lists, uuid.uuid4().hex)
                    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
                    secs.append(dt)
                cells.append(dict(pool=pool, batch=B, secs=secs, minflt=faults,
                                  new_tokens=[s.num_tokens for s in sels],
                                  prompt_tokens=[s.prompt_tokens for s in sels]))

    if args._child == "main":
        work_fn()
    else:   # a worker thread gets its own glibc arena; .result() re-raises the thread's error here
        with ThreadPoolExecutor(1, thread_name_prefix="acarerank-model") as ex:
            ex.submit(work_fn).result()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    print(json.dumps(dict(cells=cells, peak_rss_mb=peak_mb, env=env)), flush=True)
    return 0


def malloc_env(variant: str) -> dict:
    """This process's environment with every ``MALLOC_*`` variable replaced by ``variant``'s."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(MALLOC_VARIANTS[variant])
    return env


def _child_argv(args, thread: str) -> list:
    ints = lambda xs: ",".join(map(str, xs))  # noqa: E731
    return [sys.executable, os.path.abspath(__file__), "--model", args.model, "--dtype", args.dtype,
            "--pools", ints(args.pools), "--batches", ints(args.batches), "--doc-tokens", ints(args.doc_tokens),
            # "--end-bias=" joined: argparse takes "-1e-05" (a negative in exponent form) for a flag
            "--repeats", str(args.repeats), f"--end-bias={args.end_bias!r}", f"--settle-s={args.settle_s!r}",
            "--_child", thread]


def malloc_ab(args) -> int:
    """``--malloc-env``: the children in turn (pass, thread, variant), their rounds gathered into
    one row per (thread, variant, pool, B); 1 on the first child that fails (its stderr's tail)."""
    got = {}   # (thread, variant) -> list of child outputs
    for p in range(args.malloc_passes):
        for thread in args.malloc_threads:
            for variant in args.malloc_env:
                _settle(f"pass {p + 1} {thread} {variant}", args.settle_s)
                out = subprocess.run(_child_argv(args, thread), env=malloc_env(variant), capture_output=True,
                                     text=True, check=False)
                lines = out.stdout.strip().splitlines()
                try:
                    child = json.loads(lines[-1]) if out.returncode == 0 and lines else None
                except json.JSONDecodeError:
                    child = None
                if child is None or len(child["cells"]) != len(args.pools) * len(args.batches):
                    _log(f"bench_setwise_peer: the {variant} child ({thread} thread, pass {p + 1}) failed "
                         f"(exit {out.returncode}); its stderr's tail:\n{out.stderr[-3000:]}")
                    return 1
                if child["env"] != MALLOC_VARIANTS[variant]:
                    _log(f"bench_setwise_peer: the {variant} child started with {child['env']}, not "
                         f"{MALLOC_VARIANTS[variant]}")
                    return 1
                got.setdefault((thread, variant), []).append(child)
                _log(f"[pass {p + 1}/{args.malloc_passes}] {thread} {variant}: " + ", ".join(
                    f"pool {c['pool']} x {c['batch']} {statistics.median(c['secs']):.2f} s" for c in child["cells"]))
    rows = malloc_rows(args, got, machine_info(torch.device("cpu")))
    lines = [f"setwise selection under glibc malloc settings ({args.model}, {args.dtype}); {rows[0]['device_name']}",
             "thread | variant | pool x B | s/selection median (all) | minor faults/selection | peak RSS MB | "
             "default / this"]
    for r in rows:
        lines.append(f"{r['thread']:<6} | {r['variant']:<10} | {r['pool']:>4} x {r['batch']:<2} | "
                     f"{r['ms_per_selection'] / 1e3:.3f} ({r['s_per_selection_all']}) | "
                     f"{r['minflt_per_selection']:,.0f} | {r['peak_rss_mb']:,.0f} | {r['x_default']:.3f}x")
    os.makedirs(args.out, exist_ok=True)
    write_csv(rows, os.path.join(args.out, "setwise_malloc.csv"), MALLOC_COLUMNS)
    with open(os.path.join(args.out, "setwise_malloc.txt"), "w") as f:
        f.write(json.dumps(dict(args=vars(args), variants={v: MALLOC_VARIANTS[v] for v in args.malloc_env})) + "\n")
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def malloc_rows(args, got: dict, info: dict) -> list:
    """One row per (thread, variant, pool, B) of the children's rounds (every pass together);
    ``x_default`` = the default variant's median ÷ this one's, in the same thread and cell.
    SystemExit when two children made other new tokens (the same weights and prompts: greedy
    repeats itself)."""
    rows, base, tokens = [], {}, {}
    for (thread, variant), children in got.items():
        for i, cell in enumerate(children[0]["cells"]):
            pool, B = cell["pool"], cell["batch"]
            secs = [s for c in children for s in c["cells"][i]["secs"]]
            faults = [f / B for c in children for f in c["cells"][i]["minflt"]]
            news = {tuple(c["cells"][i]["new_tokens"]) for c in children}
            if len(news) != 1 or tokens.setdefault((pool, B), news) != news:
                raise SystemExit(f"pool {pool} x {B}: the children made different new tokens: {news}")
            med = statistics.median(secs)
            n_prompt = sum(cell["prompt_tokens"])
            rows.append(dict(thread=thread, variant=variant, malloc_env=" ".join(
                f"{k}={v}" for k, v in MALLOC_VARIANTS[variant].items()), pool=pool, batch=B, provider="acarerank",
                prompt_tokens=n_prompt, new_tokens=sum(next(iter(news))), median_ms=med * 1e3,
                min_ms=min(secs) * 1e3, max_ms=max(secs) * 1e3, repeats=len(secs), ms_per_selection=med * 1e3 / B,
                s_per_selection_all=";".join(f"{s / B:.3f}" for s in secs), prompt_tok_per_s=n_prompt / med,
                minflt_per_selection=statistics.median(faults),
                minflt_per_selection_all=";".join(f"{f:.0f}" for f in faults),
                peak_rss_mb=max(c["peak_rss_mb"] for c in children), dtype=args.dtype, model=args.model, **info))
            if variant == "default":
                base[(thread, pool, B)] = med
    for r in rows:
        r["x_default"] = base[(r["thread"], r["pool"], r["batch"])] / (r["median_ms"] / 1e3)
    return rows


def _settle(what: str, max_wait_s: float) -> None:
    """Wait (≤ ``max_wait_s``) for idle CPUs before ``what``'s round; log a round that starts on busy ones."""
    if max_wait_s <= 0:
        return
    waited, quiet = wait_for_quiet_cpu(max_wait_s)
    if not quiet:
        _log(f"note: {what} starts on busy CPUs (not idle after {waited:.1f} s): another job on the machine?")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._child is not None:
        return malloc_child(args)
    if args.malloc_env is not None:
        return malloc_ab(args)
    # here, not at the top: its import (torch._dynamo, ~1.4 s) would be in every --malloc-env child
    from acarerank.benchmark.gemm_peak import best_of, gemm_peak

    dtype = getattr(torch, args.dtype)
    api, version = detect_api(args.peer)
    if api != "vllm":
        raise SystemExit(f"--peer {args.peer} is {api}, not vLLM (bench/peers/vllm_cpu.sh --runner generate)")
    name = served_model(args.peer)
    rr, work = acarerank_setup(args)
    sh = Shapes.from_arch(rr.runner.arch)
    width = len(rr.grammar.tokens.vocab)
    peak = gemm_peak(sh, dtype)
    info = machine_info(torch.device("cpu"))

    # vLLM's first request, untimed (acarerank's warm-up is acarerank_setup's)
    first = rr.encode_select(work.query, work.docs(2), max_select=2).prompt.input_ids
    try:
        vllm_round(args.peer, [completion_body(name, first, 2, uuid.uuid4().hex)])
        rows = measure(rr, work, args, name, version, sh, width, info)
    except ValueError as e:  # vLLM refused a request or did other work than asked: no row is written
        _log(f"bench_setwise_peer: {e}")
        return 1
    lines = []
    peak = best_of(peak, gemm_peak(sh, dtype))  # again with both servers idle
    for r in rows:
        r.update(gemm_peak_gflops=peak["peak_gflops"], peak_fraction=r["gflop_per_s"] / peak["peak_gflops"])
    lines.append(f"setwise beside vLLM {version} ({args.peer}, {name}): {sh.layers} layers, hidden {sh.hidden}, "
                 f"{args.dtype}; {info['device_name']}; GEMM peak {peak['peak_gflops']:.1f} GFLOP/s")
    lines.append("pool x B | prompt tok | new tok | ms/selection acarerank, vLLM | prompt tok/s acarerank, vLLM | "
                 "acarerank / vLLM | GFLOP/s (of peak) acarerank, vLLM")
    for a, v in zip(rows[0::2], rows[1::2]):
        lines.append(f"{a['pool']:>4} x {a['batch']:<2} | {a['prompt_tokens']:>10} | {a['new_tokens']:>7} | "
                     f"{a['ms_per_selection']:10.1f}, {v['ms_per_selection']:10.1f} | {a['prompt_tok_per_s']:8.1f}, "
                     f"{v['prompt_tok_per_s']:8.1f} | {a['acarerank_x_vllm']:5.2f}x | {a['gflop_per_s']:.1f} "
                     f"({a['peak_fraction']:.0%}), {v['gflop_per_s']:.1f} ({v['peak_fraction']:.0%})")
    lines.append("vLLM decoded unconstrained with ignore_eos: the same work as acarerank's selection, not its tokens")
    os.makedirs(args.out, exist_ok=True)
    write_csv(rows, os.path.join(args.out, "setwise_peer.csv"), COLUMNS)
    with open(os.path.join(args.out, "setwise_peer.txt"), "w") as f:
        f.write(json.dumps(dict(gemm_peak=peak, args={k: v for k, v in vars(args).items()})) + "\n")
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
