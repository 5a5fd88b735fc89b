"""The ops as torch.library custom ops: schema, fake (meta) functions, AOT dispatch, torch.compile.

``torch.library.opcheck`` runs each op for real and under fake tensors / AOT autograd and
compares; the torch backend on CPU, the triton backend under TRITON_INTERPRET=1 (tiny shapes).
With a GPU every test runs on CUDA tensors (and is marked ``cuda``); the compiled extension's
backend is "cuda" there and "cpp" on CPU.
"""
import pytest
import torch

from acarerank.ops import (prefix_shared_attention, prefix_shared_attention_op, prefix_shared_attention_ref,
                           yes_no_score, yes_no_score_op, yes_no_score_ref)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []
EXT_BACKEND = "cuda" if DEVICE == "cuda" else "cpp"  # acarerank._C's backend for this device


def _attn_args():
    q, k, v = torch.randn(10, 4, 16), torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    pk, pv = torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    cp = torch.tensor([0, 5, 6], dtype=torch.int32)
    sg = torch.tensor([0, 1, 1], dtype=torch.int32)
    return tuple(t.to(DEVICE) for t in (q, k, v, cu, pk, pv, cp, sg))


def _head_args():
    return tuple(t.to(DEVICE) for t in (torch.randn(3, 32), torch.rand(32) + 0.5, torch.randn(32), torch.randn(32)))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck_prefix_shared_attention(backend):
    torch.library.opcheck(prefix_shared_attention_op, (*_attn_args(), 0.25, backend))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck_yes_no_score(backend):
    torch.library.opcheck(yes_no_score_op, (*_head_args(), 1e-6, backend))


def test_ops_are_registered_under_torch_ops():
    assert torch.ops.acarerank.prefix_shared_attention.default is not None
    assert torch.ops.acarerank.yes_no_score.default is not None


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_public_ops_compile_in_one_graph(backend):
    """fullgraph=True: the public functions trace without a graph break (validate=False skips the host sync)."""
    attn_args, head_args = _attn_args(), _head_args()

    def f(attn_args, head_args):
        out = prefix_shared_attention(*attn_args, backend=backend, validate=False)
        score, diff = yes_no_score(*head_args, backend=backend)
        return out * 2, score + 1

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out, score = compiled(attn_args, head_args)
    ref_out = prefix_shared_attention_ref(*attn_args)
    ref_score = yes_no_score_ref(*head_args, 1e-6)[0]
    assert (out - 2 * ref_out).abs().max() <= 2e-5, f"compiled attention err {(out - 2 * ref_out).abs().max():.3e}"
    assert (score - 1 - ref_score).abs().max() <= 1e-5, f"compiled head err {(score - 1 - ref_score).abs().max():.3e}"


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("backend", ["torch", EXT_BACKEND])
def test_opcheck_merge_attention_states(backend, layout):
    """``transposed``: o_a, o_b views of [H, N, d] buffers and lse_a, lse_b flash-attn's [H, N] passed
    as ``lse.t()`` (the docstring allows any strides). The outputs are contiguous, as the fake says:
    the torch backend returned the inputs' strides and opcheck's fake-tensor check failed."""
    if backend != "torch":
        pytest.importorskip("acarerank._C")
    from acarerank.ops.merge_states import merge_attention_states_op
    N, H, d = 5, 3, 16
    if layout == "contiguous":
        args = (torch.randn(N, H, d), torch.randn(N, H), torch.randn(N, H, d), torch.randn(N, H))
    else:
        args = (torch.randn(H, N, d).transpose(0, 1), torch.randn(H, N).t(), torch.randn(H, N, d).transpose(0, 1),
                torch.randn(H, N).t())
    args = tuple(t.to(DEVICE) for t in args)
    torch.library.opcheck(merge_attention_states_op, (*args, backend))
    out, lse = merge_attention_states_op(*args, backend)
    assert (out.stride(), lse.stride()) == ((H * d, d, 1), (H, 1)), (out.stride(), lse.stride())


def test_opcheck_prefix_shared_attention_with_a_plan():
    """The plan's work list / host metadata travel through the registered op as optional tensors."""
    from acarerank.ops import plan_prefix_shared_attention
    args = _attn_args()
    q, k, v, cu, pk, pv, cp, sg = args
    for backend in ("torch", "triton"):
        plan = plan_prefix_shared_attention(cu, cp, sg, num_tokens=10, num_q_heads=4, num_kv_heads=2, head_dim=16,
                                            dtype=q.dtype, backend=backend)
        torch.library.opcheck(prefix_shared_attention_op, (*args, 0.25, backend, plan.work, plan.host_meta))


def _projection_args(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 16, generator=g, dtype=dtype)
    w = torch.randn(37, 16, generator=g, dtype=dtype)
    tg = torch.tensor([0, 36, 5, 5, 17])
    return h, w, tg


@pytest.mark.parametrize("with_entropy", [False, True])
def test_opcheck_linear_logprob(with_entropy):
    """Forward and the registered backward (register_autograd): schema, fake, AOT dispatch."""
    from acarerank.ops import linear_logprob_op
    h, w, tg = _projection_args()
    torch.library.opcheck(linear_logprob_op, (h.requires_grad_(), w.requires_grad_(), tg, 1.5, 8, with_entropy))


def test_opcheck_linear_logprob_backward():
    from acarerank.ops.linear_logprob import linear_logprob_backward_op, linear_logprob_op
    h, w, tg = _projection_args()
    lp, _, m, lse_m, ez_m = linear_logprob_op(h, w, tg, 1.0, 8, True)
    g = torch.ones_like(lp)
    for need_h, need_w in ((True, True), (True, False), (False, True)):
        args = (h, w, tg, m, lse_m, ez_m, g, 0.5 * g, 1.0, 8, need_h, need_w)
        torch.library.opcheck(linear_logprob_backward_op, args)
    torch.library.opcheck(linear_logprob_backward_op, (h, w, tg, m, lse_m, ez_m, g, None, 1.0, 8, True, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_linear_logprob_backward_strided(dtype):
    """Transposed hidden and weight (hidden states sliced out of a [H, T] buffer): the fake
    kernel's gradients have the real strides, or torch.compile's stride assert fails (it did:
    empty_like copied the transposed hidden's strides, the real gradient is contiguous)."""
    from acarerank.ops.linear_logprob import linear_logprob_backward_op, linear_logprob_op
    h, w, tg = _projection_args(dtype)
    h, w = h.T.contiguous().T, w.T.contiguous().T
    lp, _, m, lse_m, ez_m = linear_logprob_op(h, w, tg, 1.0, 8, True)
    g = torch.ones_like(lp)
    torch.library.opcheck(linear_logprob_backward_op, (h, w, tg, m, lse_m, ez_m, g, 0.5 * g, 1.0, 8, True, True))


@pytest.mark.parametrize("dynamic", [False, True])
def test_projection_ops_compile_in_one_graph(dynamic):
    """A training step compiled with fullgraph=True, static and dynamic shapes: topk_logprobs and
    linear_logprob (log-prob, entropy and both gradients) equal eager and their references, and
    the checks that read the data (target range, non-finite logits) still raise their ValueError,
    from inside the registered ops. The wrappers once made host syncs (a UserError about a
    data-dependent guard under fullgraph=True, two graph breaks each without it), and
    dynamic=True's SymFloat temperature (a default argument too) failed in math.isfinite."""
    from acarerank.ops import linear_logprob, linear_logprob_ref, topk_logprobs, topk_logprobs_ref
    h, w, tg = (t.to(DEVICE) for t in _projection_args())

    def step(h, w, tg, tau):
        teacher = topk_logprobs(h.detach(), w.detach(), tg, k=4, chunk=8, temperature=tau)
        lp, ent = linear_logprob(h, w, tg, temperature=tau, return_entropy=True, chunk=8)
        return lp, ent, teacher

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    # dynamic: a second row count and temperature run the same graph
    for T, tau in ((5, 0.7), (3, 1.3))[:2 if dynamic else 1]:
        hc, wc = h[:T].clone().requires_grad_(), w.clone().requires_grad_()
        he, we = h[:T].clone().requires_grad_(), w.clone().requires_grad_()
        got, want = compiled(hc, wc, tg[:T], tau), step(he, we, tg[:T], tau)
        (got[0].sum() + 0.5 * got[1].sum()).backward()
        (want[0].sum() + 0.5 * want[1].sum()).backward()
        for name, a, b in (("logprob", got[0], want[0]), ("entropy", got[1], want[1]), ("grad h", hc.grad, he.grad),
                           ("grad w", wc.grad, we.grad), *zip(got[2]._fields, got[2], want[2])):
            assert torch.equal(a, b), f"{name} T={T} compiled != eager: max err {(a.float() - b.float()).abs().max()}"
        ref_lp, ref_ent = linear_logprob_ref(h[:T], w, tg[:T], temperature=tau, return_entropy=True)
        torch.testing.assert_close(got[0], ref_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], ref_ent, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[2].topk_ids, topk_logprobs_ref(h[:T], w, tg[:T], k=4, temperature=tau).topk_ids)
    with pytest.raises(ValueError, match=r"topk_logprobs: target id 37 is out of range \[0, V=37\)"):
        compiled(h, w, torch.tensor([0, 1, 2, 3, 37], device=DEVICE), 0.7)
    w_nan = w.clone()
    w_nan[3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"topk_logprobs: non-finite logits .* rows \[0, 1, 2, 3, 4\]"):
        compiled(h, w_nan, tg, 0.7)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_opcheck_topk_merge_update(backend):
    """The in-place update: the schema declares the five state tensors mutated, and only those."""
    if backend == "cpp":
        pytest.importorskip("acarerank._C")
    from acarerank.ops import topk_merge_init, topk_merge_update_op
    targets = torch.tensor([3, 0, 9])
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    for c0, chunk in ((0, logits[:, :6]), (6, logits[:, 6:])):
        st = topk_merge_init(3, 4, "cpu", targets=targets, temperature=2.0)
        torch.library.opcheck(topk_merge_update_op, (st.values, st.ids, st.row_max, st.row_sumexp, st.target_logit,
                                                     st.targets, st.temperature, chunk.contiguous(), c0, backend))


def test_opcheck_topk_merge_ids_lse():
    """The finalize's checked conversion: a complete state, with and without targets."""
    from acarerank.ops import topk_merge_init, topk_merge_update
    from acarerank.ops.topk_merge import topk_merge_ids_lse_op
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    st = topk_merge_init(3, 4, DEVICE, targets=torch.tensor([3, 0, 9], device=DEVICE))
    topk_merge_update(st, logits, 0, backend="torch")
    for has_targets in (True, False):
        torch.library.opcheck(topk_merge_ids_lse_op, (st.ids, st.row_max, st.row_sumexp, st.target_logit, has_targets))


# every torch.ops.acarerank op -> the test that runs torch.library.opcheck on it
OPCHECKED = {
    "prefix_shared_attention": "test_opcheck.py::test_opcheck_prefix_shared_attention",
    "yes_no_score": "test_opcheck.py::test_opcheck_yes_no_score",
    "merge_attention_states": "test_opcheck.py::test_opcheck_merge_attention_states",
    "linear_logprob": "test_opcheck.py::test_opcheck_linear_logprob",
    "linear_logprob_backward": "test_opcheck.py::test_opcheck_linear_logprob_backward",
    "topk_merge_update": "test_opcheck.py::test_opcheck_topk_merge_update",
    "topk_merge_ids_lse": "test_opcheck.py::test_opcheck_topk_merge_ids_lse",
    "topk_logprobs_core": "test_op_topk_logprobs.py::test_core_is_a_checked_custom_op",
    "prefix_shared_attention_paged": "test_op_paged_attention.py::test_registered_op_passes_opcheck",
    # raises whenever it runs (opcheck would run it): its fake and its raise are checked there
    "inference_only_backward": "test_op_inference_only.py::test_the_backward_op_raises_and_its_fake_gives_the_inputs_shapes",
    "rms_norm": "test_op_layer_elementwise.py::test_opcheck",
    "fused_add_rms_norm": "test_op_layer_elementwise.py::test_opcheck",
    "qk_norm_rope": "test_op_layer_elementwise.py::test_opcheck",
    "silu_and_mul": "test_op_layer_elementwise.py::test_opcheck",
    "linear_onednn": "test_op_linear.py::test_opcheck",
    "policy_loss_valid": "ato/test_ato_loss.py::test_opcheck_policy_loss_valid",
    "agg_loss_valid": "ato/test_ato_loss.py::test_opcheck_agg_loss_valid",
}
# the C++ ops of acarerank._cpu (registered when it loads: only where it is built)
OPCHECKED_NATIVE = {
    "prefix_shared_attention_cpu": "test_op_cpu_attention_native.py::test_opcheck_raw_kernel",
    "vec_add": "test_native_ext.py::test_vec_add_opcheck",
    "rms_norm_cpu": "test_op_layer_elementwise.py::test_opcheck_native_kernels",
    "fused_add_rms_norm_cpu": "test_op_layer_elementwise.py::test_opcheck_native_kernels",
    "qk_norm_rope_cpu": "test_op_layer_elementwise.py::test_opcheck_native_kernels",
    "silu_and_mul_cpu": "test_op_layer_elementwise.py::test_opcheck_native_kernels",
    "mm_bf16_f32": "test_logits_gemm.py::test_opcheck_mm_bf16_f32",
    "topk_chunk_update": "test_logits_gemm.py::test_opcheck_topk_chunk_update",
    "topk_gemm_update": "test_topk_gemm_update.py::test_opcheck_topk_gemm_update",
    "gate_up_amx": "test_op_gate_up_silu.py::test_opcheck_gate_up_amx",
}


def test_every_registered_op_is_opchecked():
    """The namespace as the dispatcher sees it: a new custom op fails here until it has an opcheck."""
    import acarerank.ato  # noqa: F401  (registers them, and the loss's policy_loss_valid and agg_loss_valid)
    import acarerank.ops  # noqa: F401
    from acarerank.ops import _native

    expected = {**OPCHECKED, **(OPCHECKED_NATIVE if _native.available() else {})}  # available() loads it
    registered = {n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("acarerank::")}
    assert registered == set(expected), (f"registered but not in OPCHECKED: {sorted(registered - set(expected))}; "
                                         f"in OPCHECKED but not registered: {sorted(set(expected) - registered)}")
