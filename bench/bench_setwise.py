"""Setwise speed benchmark: time to first selection vs pool size, acarerank vs transformers.

Model: the embedded default shape (``tiny-cpu``: hidden 384, 6 layers, 6 query / 2 KV heads,
head_dim 64, the real Qwen3 vocabulary), random fp32 weights, on CPU. Workload: one RAG
query (Appendix F.1 prompt) over pools of 10, 20, 30, 50 documents of 60-380 tokens
(``acarerank.benchmark.workload``: seeded, sized with the real tokenizer; pool p = the first p
documents). Output cap 10 ids, at most 64 new tokens, grammar on.

Providers, on the same prompt token ids (tokenization is not timed):

  acarerank      ``greedy_decode``: prefill once (prefix-shared runner), then one 1-token
                 segment per step over the KV cache, 14-row lm_head under the grammar mask
  transformers   ``model.generate(do_sample=False)`` (sdpa attention, its own KV cache) with
                 the same grammar as a logits processor (``GrammarLogitsProcessor``)

Random weights would mostly stop after one id; to time a realistic (in fact the worst) decode
loop, ``<|im_end|>`` is disfavoured in the weights (as in the tests) so every selection runs
to the cap: 10 ids, 31-41 new tokens. Both providers must emit the same tokens (checked).

``--batch B`` decodes B prompts together (pool p, its documents in B rotations: B distinct
prompts of the same length), as ``SetwiseReranker.select_batch`` does: acarerank one
``GreedyStepper`` over B groups (every decode step one call of the attention kernel over B
one-token segments), transformers one ``generate`` over the B prompts (left-padded, attention
mask). Tokens and times then cover all B prompts.

Reported per pool: median / p10 / p90 ms (``measure.time_ms``: ``--repeats`` runs after one warm-up),
prompt tokens/s, ``x`` = transformers / acarerank, and for acarerank its two phases, timed inside
each timed call (medians over the calls): the prefill (``GreedyStepper``'s set-up: the prompt but
its last token into the cache) and the decode loop (every step after it). Timing them in the same
call keeps the loop's figure from mixing two runs' noise (total − prefill from separate runs went
negative on a busy machine).
Target: at pool 20 the decode loop adds <= 20 % to the prefill.

In bf16 the two providers round differently, and random weights leave near-ties among the
grammar's tokens, so their tokens may part at some step. Such a prompt counts as agreeing when
the parting is a near-tie: at the first step where they differ (same prefix up to there), the
fp32 model (the same weights, upcast) puts the two chosen tokens' logits at most 4·e apart, e
being transformers' own bf16 logit error there (max over the grammar's tokens, against fp32) —
each provider's logits may be off by 2·e under the suite's bf16 rule (2× plain bf16's error),
so their difference by 4·e. A wider fp32 margin is a real disagreement (exit 1). fp32 must
agree token for token.

    python bench/bench_setwise.py [--repeats 3] [--output results/bench_setwise]
    python bench/bench_setwise.py --quick        # 2 layers, pools 10/20 of 20-60-token docs, 1 run
    python bench/bench_setwise.py --pools 20 --batch 8   # 8 selections decoded together

Writes ``bench_setwise.csv`` (one row per pool and provider, with machine and versions) and
``bench_setwise.png`` (latency vs pool size) when matplotlib is available.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from acarerank.benchmark.measure import machine_info, time_ms
from acarerank.benchmark.report import write_csv
from acarerank.benchmark.workload import WorkloadSpec, make_workload
from acarerank.model import Qwen3Runner
from acarerank.model.default import DEFAULT_PRESET, build_default_model
from acarerank.setwise.decode import MAX_NEW_TOKENS, GrammarLogitsProcessor, GreedyStepper, greedy_decode
from acarerank.setwise.grammar import IdentifierGrammar
from acarerank.setwise.prompts import build_prompt
from acarerank.tokenizer import TOKEN_IM_END, load_qwen3_tokenizer

DECODE_SHARE_TARGET = 0.20     # decode loop / prefill at pool 20
COLUMNS = ["pool", "batch", "provider", "prompt_tokens", "new_tokens", "median_ms", "p10_ms", "p90_ms", "prompt_tok_per_s",
           "x_vs_transformers", "prefill_ms", "decode_loop_ms", "decode_share", "tokens_agree", "device_name",
           "python", "torch", "transformers", "acarerank", "dtype", "layers"]


def build_model(layers, dtype, end_bias):
    """The default shape, random weights, sdpa attention for the transformers provider; <|im_end|> disfavoured."""
    kw = {"attn_implementation": "sdpa", "tie_word_embeddings": False}
    if layers:
        kw["num_hidden_layers"] = layers
    model = build_default_model(DEFAULT_PRESET, seed=0, dtype=dtype, **kw)
    with torch.no_grad():  # coordinate 0 of the final-normed state becomes ~constant: lm_head[:, 0] is a bias
        model.model.embed_tokens.weight[:, 0] = 2.0
        model.lm_head.weight[TOKEN_IM_END, 0] = end_bias
    return model


def near_tie(model, prompt: list, ours: list, theirs: list, vocab: torch.Tensor) -> dict:
    """Where two bf16 decodes of ``prompt`` part (module docstring): the first new token that
    differs (``step``), the fp32 logit margin between the two choices there and transformers'
    bf16 logit error e over ``vocab``; ``near_tie``: margin <= 4·e."""
    step = next(i for i, (x, y) in enumerate(zip(ours + [None], theirs + [None])) if x != y)
    if step >= min(len(ours), len(theirs)):  # one stopped where the other went on without <|im_end|>
        return dict(step=step, margin=float("inf"), error=0.0, near_tie=False)
    ids = torch.tensor([prompt + ours[:step]])
    with torch.inference_mode():
        l16 = model(ids, logits_to_keep=1).logits[0, -1].float()
        l32 = model.float()(ids, logits_to_keep=1).logits[0, -1]  # the same weights, upcast exactly
        model.to(torch.bfloat16)  # and back, exactly
    margin = abs(l32[ours[step]] - l32[theirs[step]]).item()
    error = (l16[vocab] - l32[vocab]).abs().max().item()
    return dict(step=step, margin=margin, error=error, near_tie=margin <= 4 * error)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pools", default="10,20,30,50")
    ap.add_argument("--doc-tokens", default="60,380", help="low,high document length in tokens")
    ap.add_argument("--max-select", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together (pool's documents rotated)")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--end-bias", type=float, default=-0.3, help="lm_head[<|im_end|>, 0]; < 0 runs to the cap")
    ap.add_argument("--output", default=os.path.join("results", "bench_setwise"))
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 layers, pools 10,20, 20-60-token docs, 1 run")
    args = ap.parse_args(argv)
    if args.batch < 1:
        ap.error(f"--batch must be >= 1, got {args.batch}")
    warmup = 1
    if args.quick:
        args.pools, args.doc_tokens, args.repeats, args.layers, warmup = "10,20", "20,60", 1, 2, 0
    pools = [int(x) for x in args.pools.split(",")]
    lo, hi = (int(x) for x in args.doc_tokens.split(","))
    dtype = getattr(torch, args.dtype)

    tok = load_qwen3_tokenizer()
    grammar = IdentifierGrammar.from_tokenizer(tok)
    work = make_workload(tok, WorkloadSpec(num_docs=max(pools), doc_tokens=(lo, hi)))
    model = build_model(args.layers, dtype, args.end_bias)
    runner = Qwen3Runner.from_hf(model)
    info = machine_info(torch.device("cpu"))
    layers = model.config.num_hidden_layers

    # one-time costs (lazy imports, op registration, allocator growth) before any timed call
    warm = build_prompt(tok, work.query, work.docs(2), max_select=2, max_length=None).input_ids
    greedy_decode(runner, [warm], grammar, [grammar.start(2, 2)])
    model.generate(torch.tensor([warm]), do_sample=False, max_new_tokens=2, pad_token_id=TOKEN_IM_END)

    rows, lines = [], []
    B = args.batch
    for pool in pools:
        docs = work.docs(pool)
        prompts = [build_prompt(tok, work.query, docs[b % pool:] + docs[:b % pool], max_select=args.max_select,
                                max_length=None).input_ids for b in range(B)]
        n_max = max(len(i) for i in prompts)
        n = sum(len(i) for i in prompts)
        # transformers' batch: left-padded (pad = <|im_end|>, masked out)
        padded = torch.tensor([[TOKEN_IM_END] * (n_max - len(i)) + i for i in prompts])
        mask = torch.tensor([[0] * (n_max - len(i)) + [1] * len(i) for i in prompts])

        phases = []  # (prefill, decode loop) seconds of each call of ours(), timed inside the call

        def ours():
            t0 = time.perf_counter()
            dec = GreedyStepper(runner, prompts, grammar, [grammar.start(pool, args.max_select) for _ in prompts])
            t1 = time.perf_counter()  # the set-up above prefills
            while not dec.done:
                dec.step()
            phases.append((t1 - t0, time.perf_counter() - t1))
            return dec.outputs

        def theirs():
            proc = GrammarLogitsProcessor(grammar, [pool] * B, args.max_select, prompt_len=n_max)
            with torch.inference_mode():
                out = model.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                                     eos_token_id=TOKEN_IM_END, pad_token_id=TOKEN_IM_END, logits_processor=[proc])
            rows = [r[n_max:].tolist() for r in out]
            # a row that ended early is padded after its <|im_end|>: cut there (ours stops at it)
            return [r[:r.index(TOKEN_IM_END) + 1] if TOKEN_IM_END in r else r for r in rows]

        t_ours, t_hf = (time_ms(fn, "cpu", repeats=args.repeats, warmup=warmup) for fn in (ours, theirs))
        out_ours, out_hf = t_ours.result, t_hf.result
        partings = [] if dtype == torch.float32 else [
            (b, near_tie(model, prompts[b], o, h, grammar.vocab)) for b, (o, h) in enumerate(zip(out_ours, out_hf))
            if o != h]
        agree = out_ours == out_hf or all(t["near_tie"] for _, t in partings)
        med_ours, med_hf = t_ours.median, t_hf.median
        timed = phases[-args.repeats:]  # the timed calls' own phases (not the warm-up's)
        med_pre = statistics.median(p for p, _ in timed) * 1e3
        med_loop = statistics.median(dl for _, dl in timed) * 1e3
        new_tokens = sum(len(o) for o in out_ours)
        common = dict(pool=pool, batch=B, prompt_tokens=n, new_tokens=new_tokens, tokens_agree=agree, dtype=args.dtype,
                      layers=layers, **info)
        for name, t in (("acarerank", t_ours), ("transformers", t_hf)):
            med = t.median
            rows.append(dict(common, provider=name, median_ms=med, p10_ms=t.p(10), p90_ms=t.p(90),
                             prompt_tok_per_s=n / med * 1e3, x_vs_transformers=med_hf / med))
        share = med_loop / med_pre
        rows[-2].update(prefill_ms=med_pre, decode_loop_ms=med_loop, decode_share=share)
        lines.append(f"pool {pool:>3}{f' x {B}' if B > 1 else ''}: prompt {n:>6} tok, {new_tokens} new tok | acarerank {med_ours:9.1f} ms "
                     f"(prefill {med_pre:8.1f} + decode loop {med_loop:7.1f} = {share:+.0%}) | transformers "
                     f"{med_hf:9.1f} ms | x {med_hf / med_ours:5.2f} | same tokens: {agree}")
        if partings:
            lines[-1] += " (bf16: near-ties only)" if agree else ""
            for b, t in partings:
                lines.append(f"   prompt {b}: parts at new token {t['step']}: ours {tok.decode(out_ours[b])!r} vs "
                             f"transformers {tok.decode(out_hf[b])!r}; fp32 margin {t['margin']:.3g} "
                             f"{'<=' if t['near_tie'] else '>'} 4 x transformers' bf16 error {t['error']:.3g}")
        elif not agree:
            for b, (o, h) in enumerate(zip(out_ours, out_hf)):
                if o != h:
                    lines.append(f"   prompt {b}: ours {tok.decode(o)!r} vs transformers {tok.decode(h)!r}")

    os.makedirs(args.output, exist_ok=True)
    path = os.path.join(args.output, "bench_setwise.csv")
    write_csv(rows, path, COLUMNS)
    at20 = [r for r in rows if r["pool"] == 20 and r["provider"] == "acarerank"]
    if at20:
        s = at20[0]["decode_share"]
        lines.append(f"decode loop over prefill at pool 20: {s:+.1%} (target <= {DECODE_SHARE_TARGET:.0%}: "
                     f"{'met' if s <= DECODE_SHARE_TARGET else 'NOT met'})")
    png = _plot(rows, os.path.join(args.output, "bench_setwise.png"), layers)
    lines.append(f"machine: {info['device_name']}; torch {info['torch']}, transformers {info['transformers']}; "
                 f"{layers}-layer {DEFAULT_PRESET} shape, random weights, {args.dtype}; wrote {path}"
                 + (f" and {png}" if png else ""))
    print("\n".join(lines))
    return 0 if all(r["tokens_agree"] for r in rows) else 1


def _plot(rows, path, layers):
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, prov in enumerate(("acarerank", "transformers")):
        rs = sorted((r for r in rows if r["provider"] == prov), key=lambda r: r["pool"])
        x = [r["pool"] for r in rs]
        med = [r["median_ms"] for r in rs]
        err = [[m - r["p10_ms"] for m, r in zip(med, rs)], [r["p90_ms"] - m for m, r in zip(med, rs)]]
        ax.errorbar(x, med, yerr=err, marker="o", capsize=3, color=f"C{i}", label=prov)
    pre = sorted((r for r in rows if r["provider"] == "acarerank"), key=lambda r: r["pool"])
    ax.plot([r["pool"] for r in pre], [r["prefill_ms"] for r in pre], ls="--", color="C0",
            label="acarerank prefill only")
    ax.set_xlabel("pool size (documents)")
    ax.set_ylabel("time to first selection (ms)")
    ax.set_title(f"setwise selection, {layers}-layer {DEFAULT_PRESET} shape, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
