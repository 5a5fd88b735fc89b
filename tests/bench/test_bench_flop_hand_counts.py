"""The FLOPs the benchmarks credit a provider with, against hand counts and the runner's own work.

References: hand counts on a tiny shape (H = 8, I = 16, 2 layers, 2/1 heads, d = 4, V = 50),
each GEMM [m, k] x [k, n] = 2·m·n·k and each attended (query, key) pair 4·d·Hq (QKᵀ and PV);
and the linear calls and attended pairs of acarerank's runner itself, counted while it scores.
Per token and layer: q 2·8·8 = 128, k + v 2·2·8·4 = 128, o 128, MLP 3·2·8·16 = 768, so
1,152 in all (q/k/v 256, o + MLP 896); a pair is 4·4·2 = 32 per layer.
"""
import os
import sys

import pytest
import torch

from acarerank.benchmark import agent, peers, report
from acarerank.benchmark.peers import Target
import _repo

sys.path.insert(0, os.path.join(str(_repo.ROOT), "bench"))  # bench_serve

SH = report.Shapes(hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=50)
P, SEGS = 5, [3, 2]  # shared tokens, segment lengths


def test_least_work_flops_against_a_hand_count():
    # the shared part once, both documents packed (acarerank's runner):
    #   linear: layer 1 on all 10 tokens 11,520 + last layer's q/k/v on 10 2,560 + its o+MLP on
    #           the 2 scored rows 1,792 = 15,872
    #   attn:   prefix 5·6/2 = 15 pairs in layer 1 only (480); segments 3·5 + 6 = 21 and
    #           2·5 + 3 = 13 pairs in both layers (34·2·32 = 2,176)
    #   head:   [no, yes] rows 2·8·2 per document, 64
    assert report.least_work_flops(SH, P, SEGS) == 15_872 + 480 + 2_176 + 64
    # no documents: the prefix pass alone, layer 1's linears on 5 tokens, the last layer's q/k/v, 15 pairs
    assert report.least_work_flops(SH, P, []) == 5 * 1_152 + 5 * 256 + 480


@pytest.mark.parametrize("api", ["acarerank", "vllm", "llama.cpp", "tei"])
def test_every_peer_is_credited_with_the_least_work(monkeypatch, api):
    """acarerank bench credits a peer server with the least work, as bench/bench_serve.py credits
    every server (docs/benchmarks.md): a vLLM, llama.cpp or TEI peer was credited with its full
    prompts one at a time, 34,560 + 4,096 + 1,600 FLOPs here (the two 8- and 7-token prompts
    through both layers, and the full-vocabulary head), so its GFLOP/s read 2.2x an acarerank
    server's at the same latency."""
    from acarerank.benchmark.harness import BenchConfig, credited_flops

    monkeypatch.setattr(peers, "resolve", lambda t: (t, ""))
    monkeypatch.setattr(peers, "served_model", lambda url: "m")
    p = peers.PeerProvider(Target("p", "http://x", api))
    assert credited_flops(p, SH, P, SEGS, BenchConfig()) == report.least_work_flops(SH, P, SEGS) == 18_592


def test_bench_serve_credits_a_request_with_the_least_work(qwen3_tokenizer, monkeypatch):
    """bench_serve's per-request FLOPs are the same function's, on the request's own split."""
    import _repo
    from acarerank.benchmark.baselines import split_prompt_ids

    monkeypatch.syspath_prepend(str(_repo.ROOT / "bench"))
    import bench_serve

    body = dict(query="what is a reranker", documents=["one short document", "a second one"],
                question="why", trace="an earlier step")
    (req,) = bench_serve.with_tokens(qwen3_tokenizer, [bench_serve.Req(body)], SH)
    shared, segs = split_prompt_ids(qwen3_tokenizer, body["query"], body["documents"], body["question"], body["trace"])
    assert req.flops == report.least_work_flops(SH, len(shared), [len(s) for s in segs]) > 0


def test_agent_call_flops_follow_what_each_provider_computes():
    # acarerank after a 2-token cache hit: 3 new shared tokens
    #   linear: layer 1 on 3 + 5 tokens 9,216 + last layer's q/k/v on 8 2,048 + o+MLP on 2 rows 1,792
    #   attn:   new shared 3·2 + 3·4/2 = 12 pairs in layer 1 (384); segments 34 pairs, 2 layers (2,176)
    assert agent._call_flops(SH, P, 2, SEGS) == 9_216 + 2_048 + 1_792 + 384 + 2_176
    # transformers+prefix-cache (batch 16): all 5 shared tokens through both layers, then one batch
    # of 2 rows padded to 3 tokens, every layer on every row
    #   linear: (5 + 2·3)·2·1,152 = 25,344; attn: 15·64 + 2·(3·5 + 6)·64 = 960 + 2,688
    assert agent._call_flops(SH, P, 0, SEGS, padded_batch=16) == 25_344 + 960 + 2_688
    with pytest.raises(ValueError, match="cached"):
        report.packed_flop_parts(SH, P, SEGS, cached=P + 1)


def test_packed_flop_parts_equal_the_runners_own_work_after_a_cache_hit(monkeypatch, qwen3_tokenizer):
    """Every linear call's 2·m·n·k and every attention call's (query, key) pairs while a
    PointwiseReranker with its prefix cache scores a context that extends one it scored."""
    import acarerank.model.runner as runner
    from acarerank import PointwiseReranker
    from acarerank.model.default import build_default_model
    from acarerank.prompts import encode_pointwise

    model = build_default_model("tiny-cpu", num_hidden_layers=2)
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, backend="torch", prefix_cache=True)
    docs = ["a short document about rivers", "another one, on mountains and the snow on them"]
    trace = "Thought: the user asks about water. Search: rivers of Europe. " * 8
    rr.score_encodings([encode_pointwise(qwen3_tokenizer, "rivers", docs, question="Which river?", trace=trace)])

    counted = {"linear": 0.0, "pairs": 0.0}
    lin, att = runner.linear, runner.prefix_shared_attention_paged

    def counting_linear(x, w, *a, **kw):
        y = lin(x, w, *a, **kw)
        counted["linear"] += 2.0 * x.shape[0] * x.shape[-1] * y.shape[-1]
        return y

    def counting_attention(q, k, v, cu, kp, vp, bt, prefix_lens, groups, **kw):  # one call per layer
        ends, pl = cu.tolist(), prefix_lens.tolist()
        for s, g in enumerate(groups.tolist()):
            counted["pairs"] += report.attended_pairs(ends[s + 1] - ends[s], pl[g])
        return att(q, k, v, cu, kp, vp, bt, prefix_lens, groups, **kw)

    monkeypatch.setattr(runner, "linear", counting_linear)
    monkeypatch.setattr(runner, "prefix_shared_attention_paged", counting_attention)
    enc = encode_pointwise(qwen3_tokenizer, "rivers", docs, question="Which river?",
                           trace=trace + "Observation: the Danube flows east. " * 4)
    _, (hit,) = rr.score_encodings([enc])
    assert 0 < hit < len(enc.shared_ids)
    sh = report.Shapes.from_config(model.config)
    parts = report.packed_flop_parts(sh, len(enc.shared_ids), [len(s) for s in enc.segment_ids], cached=hit)
    assert counted["linear"] == pytest.approx(parts["linear"], rel=1e-12)
    assert 4.0 * sh.heads * sh.head_dim * counted["pairs"] == pytest.approx(parts["attn"], rel=1e-12)


def test_least_work_select_flops_against_a_hand_count():
    # a 5-token prompt, 3 new tokens, a head of 14 rows (the setwise grammar's):
    #   linear: the 4 prompt tokens before the last fill the cache, the 3 fed tokens (the prompt's
    #           last and 2 new ones) run every layer: layer 1 on 7 tokens 8,064 + the last layer's
    #           q/k/v on 7 1,792 + its o+MLP on the 3 fed rows 2,688 = 12,544
    #   attn:   the 4 filled: 4·5/2 = 10 pairs in layer 1 only (320); the fed 3 after 4:
    #           3·4 + 3·4/2 = 18 pairs in both layers (1,152)
    #   head:   2·8·14 per fed row, 672
    assert report.least_work_select_flops(SH, 5, 3, 14) == 12_544 + 320 + 1_152 + 672
    # 2 prompt tokens cached (a batch's common head): 2 filled after them, 2·2 + 3 = 7 pairs in layer 1
    assert report.least_work_select_flops(SH, 5, 3, 14, cached=2) == 5 * 1_152 + 5 * 256 + 3 * 896 + 224 + 1_152 + 672
    # a 1-token prompt and 1 new token: one fed token through both layers, 1 pair each, one head row
    assert report.least_work_select_flops(SH, 1, 1, 14) == 1_152 * 2 + 2 * 32 + 2 * 8 * 14
    for bad in (dict(prompt_len=0, new_tokens=1), dict(prompt_len=5, new_tokens=0), dict(prompt_len=5, new_tokens=1,
                                                                                          cached=5)):
        with pytest.raises(ValueError, match="must be"):
            report.least_work_select_flops(SH, head_width=14, **bad)


def test_bench_serve_credits_an_agent_call_past_its_sessions_previous_call(monkeypatch):
    """bench/bench_serve.py credited every agent call with its whole shared part, though the
    session's previous call left most of it (its trace) in the server's cache: the least work an
    exact server does is less, so GFLOP/s read 116 % of the GEMM peak. Now a session's call is
    credited with its shared tokens past the common prefix with the session's previous call."""
    from acarerank.benchmark import baselines
    from bench_serve import Req, with_tokens

    ids = {"a": [1, 2, 3, 4, 5], "b": [1, 2, 3, 4, 5, 6, 7], "c": [1, 2, 3, 9, 9, 9, 9, 9]}
    monkeypatch.setattr(baselines, "split_prompt_ids",
                        lambda tok, query, documents, *a: (ids[query], [list(range(n)) for n in documents]))
    reqs = [Req(dict(query="a", documents=[3, 2]), session=0), Req(dict(query="b", documents=[3, 2]), session=0),
            Req(dict(query="b", documents=[3, 2]), session=1), Req(dict(query="c", documents=[3, 2]), session=0),
            Req(dict(query="b", documents=[3, 2]))]  # no session (m3): nothing cached
    flops = [r.flops for r in with_tokens(None, reqs, SH)]
    # call 2 of session 0: 5 of its 7 shared tokens cached, 2 new
    #   linear: layer 1 on 2 + 5 tokens 8,064 + last layer's q/k/v on 7 1,792 + its o+MLP on 2 rows 1,792
    #   attn:   the 2 new tokens over 5 cached + 3 pairs = 13, layer 1 only (416); segments
    #           3·7 + 6 = 27 and 2·7 + 3 = 17 pairs in both layers (2,816); head 64
    call2 = 8_064 + 1_792 + 1_792 + 416 + 2_816 + 64
    # call 3 of session 0: 3 of its 8 cached (the common prefix with call 2), 5 new
    #   linear 1,152·10 + 256·10 + 896·2 = 15,872; attn (5·3 + 15)·32 = 960 in layer 1;
    #   segments 3·8 + 6 = 30 and 2·8 + 3 = 19 pairs, 49·2·32 = 3,136; head 64
    call3 = 15_872 + 960 + 3_136 + 64
    want = [report.least_work_flops(SH, 5, [3, 2]), call2, report.least_work_flops(SH, 7, [3, 2]), call3,
            report.least_work_flops(SH, 7, [3, 2])]
    assert flops == want, (flops, want)
