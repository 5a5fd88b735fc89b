"""The FLOPs the benchmarks credit a provider with, against hand counts and the runner's own work.

References: hand counts on a tiny shape (H = 8, I = 16, 2 layers, 2/1 heads, d = 4, V = 50),
each GEMM [m, k] x [k, n] = 2·m·n·k and each attended (query, key) pair 4·d·Hq (QKᵀ and PV);
and the linear calls and attended pairs of acarerank's runner itself, counted while it scores.
Per token and layer: q 2·8·8 = 128, k + v 2·2·8·4 = 128, o 128, MLP 3·2·8·16 = 768, so
1,152 in all (q/k/v 256, o + MLP 896); a pair is 4·4·2 = 32 per layer.
"""
from acarerank.benchmark import peers, report
from acarerank.benchmark.peers import Target

SH = report.Shapes(hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=50)
P, SEGS = 5, [3, 2]  # shared tokens, segment lengths


def test_an_acarerank_peer_is_credited_with_its_shared_part_once(monkeypatch):
    # acarerank serve runs the shared part once per request, packed, as the in-process runner:
    #   linear: layer 1 on all 10 tokens 11,520 + last layer's q/k/v on 10 2,560 + its o+MLP on
    #           the 2 scored rows 1,792 = 15,872
    #   attn:   prefix 5·6/2 = 15 pairs in layer 1 only (480); segments 3·5 + 6 = 21 and
    #           2·5 + 3 = 13 pairs in both layers (34·2·32 = 2,176)
    #   head:   [no, yes] rows 2·8·2 per document, 64
    # a server sharing nothing (llama.cpp): the two full prompts (8 and 7 tokens) alone:
    #   linear 15·2·1,152 = 34,560; attn (36 + 28)·2·32 = 4,096; head 2·8·50·2 = 1,600
    monkeypatch.setattr(peers, "resolve", lambda t: (t, ""))
    expected = {"acarerank": 15_872 + 480 + 2_176 + 64, "llama.cpp": 34_560 + 4_096 + 1_600}
    for api, flops in expected.items():
        p = peers.PeerProvider(Target("p", "http://x", api))
        assert report.plan_flops(p.flop_plan, SH, P, SEGS, p.flop_batch) == flops, api
