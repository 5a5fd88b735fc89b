"""CUDA kernels of acarerank._C against the same oracles as the CPU twins (GPU machines only).

Run by bench/gpu_check.sh via `pytest -m cuda`. The CPU twins run the same row code
(csrc/*.cuh), so on CPU tests/test_ext_*.py already cover the algorithms; these tests cover
the parallel schedule, native fp16/bf16 reads, streams and devices.
"""
import math

import numpy as np
import pytest
import torch
from _ext import EXT_MISSING

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

V = 151_669


@pytest.fixture(scope="module")
def ext():
    if EXT_MISSING:
        pytest.skip(EXT_MISSING)
    from acarerank.ops import _cpp
    assert _cpp.has_cuda(), f"acarerank._C was built without CUDA: {_cpp.build_info()}"
    return _cpp


def test_build_runs_here(ext):
    info = ext.build_info()
    major, minor = torch.cuda.get_device_capability()
    archs = [int(a.split("-")[0]) for a in info["cuda_archs"].split(",")]
    # SASS for sm_XY runs on sm_XZ (Z >= Y); the highest arch also carries PTX for newer GPUs
    assert any(a <= major * 10 + minor for a in archs), f"no kernel image for sm_{major}{minor} in {archs}"
    assert "device(s)" in info["cuda_runtime"], info["cuda_runtime"]


# ---------------------------------------------------------------- top-k merge
from test_op_topk_merge import CASES, _logits, _merge, _random_chunks, _ref, _targets, assert_topk_equal  # noqa: E402

from acarerank.ops import topk_logprobs_core  # noqa: E402
from acarerank.ops import topk_merge as tm  # noqa: E402


@pytest.mark.parametrize("kind,k,max_chunk,temperature", CASES)
def test_topk_merge_cuda_matches_full_sort(ext, kind, k, max_chunk, temperature):
    gen = torch.Generator().manual_seed(k + len(kind))
    logits = _logits(kind, 6, gen)
    targets = _targets(_ref(logits, k, temperature=temperature).ids, gen)
    want = _ref(logits, k, targets, temperature)
    pieces = _random_chunks(np.random.default_rng(k), V, max_chunk)
    got = _merge(logits.cuda(), k, targets.cuda(), temperature, pieces, "cuda")
    assert_topk_equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topk_merge_cuda_reads_low_precision(ext, dtype):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(64, V, generator=gen) * 4).to(dtype)
    want = _ref(logits, 128)
    pieces = [(a, min(V, a + 16384)) for a in range(0, V, 16384)]
    assert_topk_equal(_merge(logits.cuda(), 128, None, 1.0, pieces, "cuda"), want)


def test_topk_state_cuda_equals_cpp_after_every_chunk(ext):
    gen = torch.Generator().manual_seed(2)
    logits = _logits("ties", 4, gen)
    s_cpu = tm.topk_merge_init(4, 300, "cpu")
    s_gpu = tm.topk_merge_init(4, 300, "cuda")
    for a, b in _random_chunks(np.random.default_rng(2), V, 25_000):
        tm.topk_merge_update(s_cpu, logits[:, a:b], a, backend="cpp")
        tm.topk_merge_update(s_gpu, logits[:, a:b].cuda(), a, backend="cuda")
        assert torch.equal(s_gpu.ids.cpu(), s_cpu.ids) and torch.equal(s_gpu.values.cpu(), s_cpu.values), f"chunk {a}"
        assert torch.equal(s_gpu.row_max.cpu(), s_cpu.row_max)
        torch.testing.assert_close(s_gpu.row_sumexp.cpu(), s_cpu.row_sumexp, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,chunk", [(1, 8192), (77, 4096 + 7), (512, 16384)])
def test_core_cuda_matches_reference(ext, dtype, T, chunk):
    gen = torch.Generator().manual_seed(T)
    hidden = torch.randint(-3, 4, (T, 16), generator=gen).to(dtype)  # integer logits: exact in any GEMM
    weight = torch.randint(-2, 3, (V, 16), generator=gen).to(dtype)
    targets = torch.randint(0, V, (T,), generator=gen)
    logits = hidden.float() @ weight.float().t()
    want = _ref(logits, 128, targets, 0.8)
    vals, ids, target_logit, lse = topk_logprobs_core(hidden.cuda(), weight.cuda(), targets.cuda(), 128, chunk, 0.8,
                                                      backend="cuda")
    assert torch.equal(ids.cpu(), want.ids), f"rows {(ids.cpu() != want.ids).any(1).nonzero().flatten()[:8].tolist()}"
    assert torch.equal(vals.cpu(), want.topk_logits)
    assert torch.equal(target_logit.cpu(), logits.gather(1, targets[:, None])[:, 0] / 0.8)
    torch.testing.assert_close(lse.cpu(), want.logsumexp, atol=1e-6, rtol=0)


@pytest.mark.parametrize("k", [1, 128, 1024, 1025, 2048, 4096])
def test_topk_merge_cuda_every_shared_memory_size(ext, k):
    """k 1,025..2,048 asks for exactly 48 KB of dynamic shared memory; with the kernel's ~7 KB
    of static shared memory that is over the default 48 KB, so the launch needs the opt-in.
    The old opt-in compared the dynamic part alone (48 KB > 48 KB is false) and the launch
    failed ("too many resources requested" / invalid argument) for k = 1,025 and 2,048; k <= 1,024
    (40 KB + 7 KB) and 4,096 (64 KB, opted in) launched before as now."""
    gen = torch.Generator().manual_seed(k)
    logits = torch.randn(3, 20_000, generator=gen) * 2
    targets = torch.randint(0, 20_000, (3,), generator=gen)
    want = _ref(logits, k, targets)
    state = tm.topk_merge_init(3, k, "cuda", targets=targets.cuda())
    for a in range(0, 20_000, 6000):
        tm.topk_merge_update(state, logits[:, a:a + 6000].cuda(), a, backend="cuda")
    torch.cuda.synchronize()
    vals, ids, _, lse = tm.topk_merge_core(state)
    bad = (ids.cpu() != want.ids).any(1).nonzero().flatten().tolist()
    assert not bad, f"k={k}: ids differ in rows {bad}"
    assert torch.equal(vals.cpu(), want.topk_logits)
    torch.testing.assert_close(lse.cpu(), want.logsumexp, atol=1e-6, rtol=2.4e-7)


def test_topk_on_a_side_stream(ext):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, V, generator=gen)
    want = _ref(logits, 128)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = logits.cuda(non_blocking=False)
        got = _merge(x, 128, None, 1.0, [(a, min(V, a + 30_000)) for a in range(0, V, 30_000)], "cuda")
    side.synchronize()
    assert_topk_equal(got, want)


# ---------------------------------------------------------------- yes/no head, merge
from test_ext_yes_no import _inputs, _ref64  # noqa: E402

from acarerank.ops import yes_no_score  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("S,H", [(1, 1), (7, 97), (200, 1024), (33, 2560)])
def test_yes_no_cuda(ext, dtype, S, H):
    gen = torch.Generator().manual_seed(S + H)
    args = _inputs(S, H, dtype, gen)
    score, diff = yes_no_score(*(a.cuda() for a in args), eps=1e-6, backend="cuda")
    s_ref, d_ref = _ref64(*args)
    # fp32 warp sums over H terms: ~1e-6 relative
    torch.testing.assert_close(diff.cpu(), d_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(score.cpu(), s_ref, atol=1e-6, rtol=1e-5)


from test_op_merge_states import TOL, _states  # noqa: E402

from acarerank.ops.merge_states import merge_attention_states, merge_attention_states_ref  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,H,d", [(1, 1, 1), (7, 3, 128), (1000, 32, 128)])
def test_merge_states_cuda(ext, dtype, N, H, d):
    gen = torch.Generator().manual_seed(N + d)
    st = _states(N, H, d, dtype, gen)
    out, lse = merge_attention_states(*(t.cuda() for t in st), backend="cuda")
    want = merge_attention_states_ref(*st)
    torch.testing.assert_close(out.cpu(), want[0], **TOL[dtype])
    torch.testing.assert_close(lse.cpu(), want[1], atol=1e-6, rtol=1e-6)


def test_flash_attn_cascade_backend():
    pytest.importorskip("acarerank.ops.cascade",
                        reason="no FlashAttention-2 kernel (flash-attn, or PyTorch's in a CUDA build)")
    from acarerank.ops import prefix_shared_attention, prefix_shared_attention_ref
    gen = torch.Generator().manual_seed(5)
    Hq, Hkv, d = 16, 8, 128
    prefix_lens, seg_lens, groups = [300, 0, 41], [17, 5, 64, 1, 9], [0, 0, 2, 1, 2]
    T, P = sum(seg_lens), sum(prefix_lens)
    mk = lambda n, h: torch.randn(n, h, d, generator=gen).to(torch.bfloat16).cuda()  # noqa: E731
    q, k, v, pk, pv = mk(T, Hq), mk(T, Hkv), mk(T, Hkv), mk(P, Hkv), mk(P, Hkv)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")  # noqa: E731
    cu_s = i32([0] + np.cumsum(seg_lens).tolist())
    cu_p = i32([0] + np.cumsum(prefix_lens).tolist())
    sg = i32(groups)
    got = prefix_shared_attention(q, k, v, cu_s, pk, pv, cu_p, sg, backend="flash_attn_cascade")
    want = prefix_shared_attention_ref(q.float(), k.float(), v.float(), cu_s, pk.float(), pv.float(), cu_p, sg)
    ref_err = (prefix_shared_attention_ref(q, k, v, cu_s, pk, pv, cu_p, sg).float() - want).abs().max()
    err = (got.float() - want).abs().max()
    assert err <= 4 * ref_err + 1e-6, f"cascade error {err:.3g} vs reference bf16 error {ref_err:.3g}"
    assert math.isfinite(err)
