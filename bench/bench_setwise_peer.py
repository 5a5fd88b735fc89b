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
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid

import httpx
import torch

from acarerank.benchmark.gemm_peak import best_of, gemm_peak
from acarerank.benchmark.measure import machine_info, wait_for_quiet_cpu
from acarerank.benchmark.peers import detect_api, served_model
from acarerank.benchmark.report import Shapes, least_work_select_flops, write_csv
from acarerank.benchmark.workload import MAX_DOCS, WorkloadSpec, make_workload
from acarerank.tokenizer import load_qwen3_tokenizer

COLUMNS = ["pool", "batch", "provider", "prompt_tokens", "new_tokens", "median_ms", "min_ms", "max_ms", "repeats",
           "ms_per_selection", "prompt_tok_per_s", "acarerank_x_vllm", "gflop", "gflop_per_s", "gemm_peak_gflops",
           "peak_fraction", "dtype", "model", "peer_version", "device_name", "torch", "acarerank"]
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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the folder vLLM serves (bench/peers/vllm_cpu.sh --model-dir)")
    ap.add_argument("--peer", required=True, help="vLLM's URL (bench/peers/vllm_cpu.sh --runner generate prints it)")
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
    args = ap.parse_args(argv)
    if not 0 <= args.settle_s <= 60:
        ap.error(f"--settle-s must be in [0, 60], got {args.settle_s}")
    if len(args.doc_tokens) != 2 or args.doc_tokens[0] > args.doc_tokens[1]:
        ap.error(f"--doc-tokens must be low,high with low <= high, got {args.doc_tokens}")
    if not 1 <= args.repeats <= 100:
        ap.error(f"--repeats must be in [1, 100], got {args.repeats}")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        ap.error(f"--model {args.model!r} has no config.json (bench/peers/vllm_cpu.sh --model-dir prints the folder)")
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


def measure(rr, work, args, name: str, version: str, sh: Shapes, width: int, info: dict) -> list:
    """The rows of every (pool, B): both providers' rounds, taking turns."""
    rows = []
    for pool in args.pools:
        for B in args.batches:
            docs = work.docs(pool)
            lists = [docs[b % pool:] + docs[:b % pool] for b in range(B)]
            prompts = [rr.encode_select(work.query, d, max_select=MAX_SELECT).prompt.input_ids for d in lists]
            times, news = {"acarerank": [], "vllm": []}, None
            for r in range(args.repeats):  # the providers take turns: a load change hits both
                salt = uuid.uuid4().hex
                _settle(f"pool {pool} x {B} round {r + 1}: acarerank", args.settle_s)
                t0 = time.perf_counter()
                if B == 1:
                    sels = [rr.select(work.query, lists[0], max_select=MAX_SELECT, cache_salt=salt)]
                else:
                    sels = rr.select_batch([work.query] * B, lists, max_select=MAX_SELECT, batch_size=B,
                                           cache_salt=salt)
                times["acarerank"].append(time.perf_counter() - t0)
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
    dtype = getattr(torch, args.dtype)
    api, version = detect_api(args.peer)
    if api != "vllm":
        raise SystemExit(f"--peer {args.peer} is {api}, not vLLM (bench/peers/vllm_cpu.sh --runner generate)")
    name = served_model(args.peer)
    rr = load_reranker(args.model, dtype, args.end_bias)
    sh = Shapes.from_arch(rr.runner.arch)
    width = len(rr.grammar.tokens.vocab)
    spec = WorkloadSpec(num_docs=max(args.pools), doc_tokens=tuple(args.doc_tokens))
    work = make_workload(load_qwen3_tokenizer(), spec)
    peak = gemm_peak(sh, dtype)
    info = machine_info(torch.device("cpu"))

    # warm-ups, untimed: one-time costs here (lazy imports, allocator growth); vLLM's first request
    rr.select(work.query, work.docs(2), max_select=2, cache_salt=uuid.uuid4().hex)
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
