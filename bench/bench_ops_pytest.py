"""CPU microbenchmarks of every op beside its baseline, with pytest-benchmark.

    python -m pytest bench/bench_ops_pytest.py --benchmark-only -p no:cacheprovider \
        --benchmark-columns=median,iqr,rounds --benchmark-group-by=group

Each group times our op and the plain PyTorch way of getting the same numbers, in one run:

  attention   prefix_shared_attention (torch backend) vs SDPA per document over cat(prefix, own)
              — 1,500-token prefix, 32 documents of 60–380 tokens, 6 q / 2 kv heads, d 64
  yes_no      yes_no_score vs full-vocabulary logits + softmax over [no, yes] — 100 rows, H 1024
  topk        topk_logprobs (torch, cpp) vs materialised logits + sort + log_softmax —
              512 tokens, H 1024, V 151,669, k 128 (one ATO query)
  linear      linear_logprob forward+backward vs materialised logits — 512 tokens, H 1024, V 151,669

Throughput and memory: bench_attention.py, bench_topk_logprobs.py and bench_linear_logprob.py
(the GPU figures use ``triton.testing.do_bench`` there). Not collected by the test suite.
"""
import math

import pytest
import torch

from acarerank.ops import prefix_shared_attention, yes_no_score
from acarerank.ops.linear_logprob import linear_logprob, linear_logprob_ref
from acarerank.ops.topk_logprobs import topk_logprobs, topk_logprobs_ref


def _pedantic(benchmark, fn, rounds=3):
    return benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)


@pytest.fixture(scope="module")
def attention_batch():
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(60, 381, (32,), generator=g).tolist()
    T, P, Hq, Hkv, d = sum(lens), 1500, 6, 2, 64
    q = torch.randn(T, Hq, d, generator=g)
    k, v = torch.randn(T, Hkv, d, generator=g), torch.randn(T, Hkv, d, generator=g)
    pk, pv = torch.randn(P, Hkv, d, generator=g), torch.randn(P, Hkv, d, generator=g)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, cu, pk, pv, torch.tensor([0, P], dtype=torch.int32), torch.zeros(32, dtype=torch.int32)


@pytest.mark.benchmark(group="attention")
def test_attention_acarerank_torch(benchmark, attention_batch):
    _pedantic(benchmark, lambda: prefix_shared_attention(*attention_batch, backend="torch"))


@pytest.mark.benchmark(group="attention")
def test_attention_sdpa_per_document(benchmark, attention_batch):
    q, k, v, cu, pk, pv, _, _ = attention_batch
    r, P = q.shape[1] // k.shape[1], pk.shape[0]

    def per_document():
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            L = b - a
            keys = torch.cat([pk, k[a:b]]).repeat_interleave(r, 1).transpose(0, 1)
            vals = torch.cat([pv, v[a:b]]).repeat_interleave(r, 1).transpose(0, 1)
            mask = torch.ones(L, P + L, dtype=torch.bool).tril(diagonal=P)
            outs.append(torch.nn.functional.scaled_dot_product_attention(q[a:b].transpose(0, 1), keys, vals,
                                                                         attn_mask=mask))
        return outs

    _pedantic(benchmark, per_document)


@pytest.fixture(scope="module")
def head_inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(100, 1024, generator=g), torch.rand(1024, generator=g) + 0.5,
            torch.randn(151669, 1024, generator=g) * 0.02)


@pytest.mark.benchmark(group="yes_no")
def test_yes_no_acarerank(benchmark, head_inputs):
    h, nw, lm_head = head_inputs
    wy, wn = lm_head[9693], lm_head[2152]
    _pedantic(benchmark, lambda: yes_no_score(h, nw, wy, wn, eps=1e-6, backend="torch"), rounds=20)


@pytest.mark.benchmark(group="yes_no")
def test_yes_no_full_vocabulary_logits(benchmark, head_inputs):
    h, nw, lm_head = head_inputs

    def full():
        hn = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
        logits = hn @ lm_head.T
        return torch.stack([logits[:, 2152], logits[:, 9693]], 1).log_softmax(1)[:, 1].exp()

    _pedantic(benchmark, full, rounds=5)


@pytest.fixture(scope="module")
def teacher_inputs():
    g = torch.Generator().manual_seed(2)
    V, H, T = 151669, 1024, 512
    return (torch.randn(T, H, generator=g), torch.randn(V, H, generator=g) / math.sqrt(H),
            torch.randint(0, V, (T,), generator=g))


@pytest.mark.benchmark(group="topk")
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_topk_logprobs_acarerank(benchmark, teacher_inputs, backend):
    if backend == "cpp":
        pytest.importorskip("acarerank._C")
    _pedantic(benchmark, lambda: topk_logprobs(*teacher_inputs, k=128, backend=backend))


@pytest.mark.benchmark(group="topk")
def test_topk_logprobs_materialised(benchmark, teacher_inputs):
    _pedantic(benchmark, lambda: topk_logprobs_ref(*teacher_inputs, k=128))


@pytest.mark.benchmark(group="topk")
def test_bare_gemm(benchmark, teacher_inputs):
    h, w, _ = teacher_inputs
    _pedantic(benchmark, lambda: h @ w.T)


@pytest.mark.benchmark(group="linear")
@pytest.mark.parametrize("impl", ["acarerank", "materialised"])
def test_linear_logprob_forward_backward(benchmark, teacher_inputs, impl):
    h0, w0, tg = teacher_inputs
    fn = linear_logprob if impl == "acarerank" else linear_logprob_ref

    def step():
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        fn(h, w, tg).sum().backward()

    _pedantic(benchmark, step)
