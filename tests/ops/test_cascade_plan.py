"""The flash-attn cascade baseline's plan/run split (acarerank/ops/cascade.py), on CPU.

References: indices worked out by hand from the layout; ``prefix_shared_attention_ref``
(through the stand-in flash-attn of test_ext_merge_states); a count of the Tensor methods
that hand values to the host (.item(), .tolist(), int(), bool(), ...: host syncs on a GPU).
"""
import math

import pytest
import torch

from test_op_merge_states import cascade  # noqa: F401  (fixture: the module over a stand-in flash-attn)

from acarerank.ops import prefix_shared_attention_ref


def _batch(prefix_lens, seg_lens, groups, dtype=torch.bfloat16, Hq=4, Hkv=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T, P = sum(seg_lens), sum(prefix_lens)
    mk = lambda n, h: torch.randn(n, h, d, generator=gen).to(dtype)  # noqa: E731
    cu = lambda xs: torch.tensor([0] + torch.tensor(xs).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    return (mk(T, Hq), mk(T, Hkv), mk(T, Hkv), cu(seg_lens), mk(P, Hkv), mk(P, Hkv), cu(prefix_lens),
            torch.tensor(groups, dtype=torch.int32))


def _module(cascade_fn):
    import sys
    return sys.modules[cascade_fn.__module__]


def test_plan_indices_by_hand(cascade):  # noqa: F811
    mod = _module(cascade)
    # prefixes 7, 2, 9; segments (len, group): (2, 2) (5, 0) (3, 1) (1, 2) (4, 0) -> rows 0-1, 2-6, 7-9, 10, 11-14
    q, k, v, cu, pk, pv, cp, sg = _batch([7, 2, 9], [2, 5, 3, 1, 4], [2, 0, 1, 2, 0])
    plan = mod.plan_flash_cascade(cu, cp, sg, q.shape[0])
    assert plan.perm.tolist() == [2, 3, 4, 5, 6, 11, 12, 13, 14, 7, 8, 9, 0, 1, 10]  # group 0, then 1, then 2
    assert plan.cu_q.tolist() == [0, 9, 12, 15] and plan.cu_k.tolist() == [0, 7, 9, 18]
    assert (plan.max_q, plan.max_k, plan.max_seg) == (9, 9, 5)
    assert plan.cu_q.dtype == plan.cu_k.dtype == torch.int32
    # one group, segments in order: the prefix pass reads q as it is (no permutation)
    q, k, v, cu, pk, pv, cp, sg = _batch([6], [3, 4], [0, 0])
    plan = mod.plan_flash_cascade(cu, cp, sg, q.shape[0])
    assert plan.perm is None and plan.cu_q.tolist() == [0, 7] and plan.cu_k.tolist() == [0, 6]
    # an empty prefix group and an empty segment: its rows and the empty one stay out of the prefix pass
    q, k, v, cu, pk, pv, cp, sg = _batch([6, 0, 4], [3, 0, 5, 2], [0, 0, 1, 2])
    plan = mod.plan_flash_cascade(cu, cp, sg, q.shape[0])
    assert plan.perm.tolist() == [0, 1, 2, 8, 9] and plan.cu_q.tolist() == [0, 3, 5]
    # no prefix at all: no prefix pass
    q, k, v, cu, pk, pv, cp, sg = _batch([0], [3, 2], [0, 0])
    assert not mod.plan_flash_cascade(cu, cp, sg, q.shape[0]).has_prefix_pass


def test_one_plan_serves_every_layer(cascade):  # noqa: F811
    """A plan built once gives, for new q/k/v each 'layer', what plan + run per call gives,
    and that matches the fp32 reference."""
    mod = _module(cascade)
    prefix_lens, seg_lens, groups = [7, 2, 9], [2, 5, 3, 1, 4], [2, 0, 1, 2, 0]
    _, _, _, cu, _, _, cp, sg = _batch(prefix_lens, seg_lens, groups)
    plan = mod.plan_flash_cascade(cu, cp, sg, sum(seg_lens))
    for layer in range(3):
        q, k, v, _, pk, pv, _, _ = _batch(prefix_lens, seg_lens, groups, seed=10 + layer)
        got = mod.run_flash_cascade(plan, q, k, v, pk, pv, 0.25)
        assert torch.equal(got, cascade(q, k, v, cu, pk, pv, cp, sg, 0.25)), layer
        want = prefix_shared_attention_ref(q.float(), k.float(), v.float(), cu, pk.float(), pv.float(), cp, sg,
                                           softmax_scale=0.25)
        assert (got.float() - want).abs().max() < 3e-2, layer
    with pytest.raises(ValueError, match="plan is for 15 tokens"):
        mod.run_flash_cascade(plan, q[:3], k[:3], v[:3], pk, pv, 0.25)


def _stub_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    """The varlen kernel's shapes only, no host reads."""
    return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])


_READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


def _count_host_reads(monkeypatch):
    """Wrap every Tensor method that hands a value to the host (on a GPU: a sync); return the log."""
    seen = []
    for name in _READS:
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=orig, _n=name, **kw: (seen.append(_n), _o(self, *a, **kw))[1])
    return seen


def test_run_reads_nothing_back_from_the_device(cascade, monkeypatch):  # noqa: F811
    """run_flash_cascade does device work only: no .item()/.tolist()/int() of a tensor (each is a
    host sync on a GPU); the plan does its reads once."""
    mod = _module(cascade)

    monkeypatch.setattr(mod, "_varlen_kernel", _stub_kernel)
    q, k, v, cu, pk, pv, cp, sg = _batch([7, 2, 9], [2, 5, 3, 1, 4], [2, 0, 1, 2, 0])
    reads = _count_host_reads(monkeypatch)
    plan = mod.plan_flash_cascade(cu, cp, sg, q.shape[0])
    assert reads, "the plan reads the metadata (else this counter proves nothing)"
    reads.clear()
    out = mod.run_flash_cascade(plan, q, k, v, pk, pv, 1 / math.sqrt(16))
    assert out.shape == q.shape and reads == [], f"host reads in run: {reads}"


def test_attention_plan_metadata_plans_the_cascade_once(cascade, monkeypatch):  # noqa: F811
    """With the AttentionPlan's host metadata, the first layer builds the cascade plan and the
    next layers reuse it: no host read, no new plan; new metadata makes a new plan."""
    mod = _module(cascade)
    q, k, v, cu, pk, pv, cp, sg = _batch([7, 2, 9], [2, 5, 3, 1, 4], [2, 0, 1, 2, 0])
    host_meta = torch.cat([cu, cp, sg])  # what AttentionPlan.host_meta holds (CPU int32)
    first = cascade(q, k, v, cu, pk, pv, cp, sg, 0.25, host_meta=host_meta)
    plan = mod._last_plan[1]
    assert torch.equal(first, cascade(q, k, v, cu, pk, pv, cp, sg, 0.25))  # the one-call path agrees
    monkeypatch.setattr(mod, "_varlen_kernel", _stub_kernel)  # the stand-in flash-attn reads; the glue must not
    reads = _count_host_reads(monkeypatch)
    cascade(q, k, v, cu, pk, pv, cp, sg, 0.25, host_meta=host_meta)
    assert mod._last_plan[1] is plan and reads == [], reads
    cascade(q, k, v, cu, pk, pv, cp, sg, 0.25, host_meta=host_meta.clone())
    assert mod._last_plan[1] is not plan
