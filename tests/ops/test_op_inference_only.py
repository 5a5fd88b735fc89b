"""The layer ops have no backward (docs/api.md, "Ops and backends"). Called under grad mode with an
input that requires grad, each still runs (an inference call that forgot no_grad works, with the
values it gives under no_grad) and a loss backpropagated through its output raises
InferenceOnlyError naming the op and the differentiable reference to train through; so does a loss
through a tensor the op updates in place (fused_add_rms_norm's residual, qk_norm_rope's caches). The backward
used to fail with torch's "no autograd formula was registered" for an internal op name. Under
no_grad / inference_mode they run and match their reference.
"""
import functools
import gc
import weakref

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from _ext import NATIVE_MISSING

from acarerank.ops import (BackendError, InferenceOnlyError, fused_add_rms_norm, fused_add_rms_norm_ref, linear,
                           linear_ref, merge_attention_states, merge_attention_states_ref, prefix_shared_attention,
                           prefix_shared_attention_paged, prefix_shared_attention_paged_ref,
                           prefix_shared_attention_ref, prepare_linear_weight, qk_norm_rope, qk_norm_rope_ref,
                           rms_norm, rms_norm_ref, silu_and_mul, silu_and_mul_ref)

T, HQ, HKV, D = 5, 4, 2, 16
_GEN = torch.Generator().manual_seed(7)


def _r(*shape):
    return torch.randn(*shape, generator=_GEN)


def _cases():
    """name -> (the op, its reference, the tensors the grad may be asked of, call(tensors) -> op args)."""
    i32 = dict(dtype=torch.int32)
    cu, grp = torch.tensor([0, 2, 5], **i32), torch.tensor([0, 0], **i32)
    attn = dict(q=_r(T, HQ, D), k=_r(T, HKV, D), v=_r(T, HKV, D), prefix_k=_r(3, HKV, D), prefix_v=_r(3, HKV, D))
    paged = dict(q=_r(T, HQ, D), k=_r(T, HKV, D), v=_r(T, HKV, D), k_cache=_r(2, 16, HKV, D),
                 v_cache=_r(2, 16, HKV, D))
    table, plens = torch.tensor([[1, 0]], **i32), torch.tensor([3], **i32)
    return {
        "rms_norm": (rms_norm, rms_norm_ref, dict(x=_r(T, D), weight=_r(D)), lambda t: (t["x"], t["weight"], 1e-6)),
        "fused_add_rms_norm": (
            fused_add_rms_norm, lambda x, r, w, e: fused_add_rms_norm_ref(x, r.clone(), w, e)[0],
            dict(x=_r(T, D), residual=_r(T, D), weight=_r(D)),
            # a copy of the residual each call (the op adds into it); a copy of one that requires grad does too
            lambda t: (t["x"], t["residual"].clone(), t["weight"], 1e-6)),
        "silu_and_mul": (silu_and_mul, silu_and_mul_ref, dict(x=_r(T, 2 * D)), lambda t: (t["x"],)),
        "qk_norm_rope": (qk_norm_rope, qk_norm_rope_ref,
                         dict(qkv=_r(T, (HQ + 2 * HKV) * D), q_weight=_r(D), k_weight=_r(D), cos=_r(T, D),
                              sin=_r(T, D)),
                         lambda t: (t["qkv"], t["q_weight"], t["k_weight"], t["cos"], t["sin"], HQ, HKV, 1e-6)),
        "merge_attention_states": (merge_attention_states, merge_attention_states_ref,
                                   dict(o_a=_r(T, HQ, D), lse_a=_r(T, HQ), o_b=_r(T, HQ, D), lse_b=_r(T, HQ)),
                                   lambda t: (t["o_a"], t["lse_a"], t["o_b"], t["lse_b"])),
        "prefix_shared_attention": (
            prefix_shared_attention, prefix_shared_attention_ref, attn,
            lambda t: (t["q"], t["k"], t["v"], cu, t["prefix_k"], t["prefix_v"], torch.tensor([0, 3], **i32), grp)),
        "prefix_shared_attention_paged": (
            prefix_shared_attention_paged, prefix_shared_attention_paged_ref, paged,
            lambda t: (t["q"], t["k"], t["v"], cu, t["k_cache"], t["v_cache"], table, plens, grp)),
    }


CASES = _cases()


def _outputs(x):
    return x if isinstance(x, tuple) else (x,)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_layer_op_runs_under_grad_and_its_backward_names_the_reference(name):
    op, ref, tensors, args = CASES[name]
    with torch.no_grad():
        plain = _outputs(op(*args({n: x.detach() for n, x in tensors.items()})))
    for which in tensors:
        t = {n: x.detach().requires_grad_(n == which) for n, x in tensors.items()}
        got = _outputs(op(*args(t)))
        for g, p in zip(got, plain):   # the forward under grad mode: the no_grad values, requiring grad
            torch.testing.assert_close(g, p, atol=0, rtol=0)
        first = next(g for g in got if g.is_floating_point())
        assert first.requires_grad, which
        with pytest.raises(InferenceOnlyError, match=rf"^{name} is inference-only \(no backward\): a loss was "
                                                     rf"backpropagated .* train through {name}_ref "):
            first.float().sum().backward()
    # the same inputs under no_grad / inference_mode: the op's result, as its reference's
    for ctx in (torch.no_grad, torch.inference_mode):
        t = {n: x.detach().requires_grad_(True) for n, x in tensors.items()}
        with ctx():
            got, want = _outputs(op(*args(t))), _outputs(ref(*args(t)))
        for g, w in zip(got, want):
            assert not g.requires_grad
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    # inputs that do not require grad: outputs that do not either, with grad mode on
    assert not any(g.requires_grad for g in _outputs(op(*args({n: x.detach() for n, x in tensors.items()}))))


def _transforms(name, op, tensors, args, which):
    """label -> a call differentiating the op's first floating output in ``which`` by a torch.func
    transform or forward-mode AD (under no_grad too: forward AD ignores grad mode)."""
    def f(a):
        t = dict(tensors, **{which: a})
        return next(g for g in _outputs(op(*args(t))) if g.is_floating_point())

    x = tensors[which]

    def dual(ctx):
        with ctx(), fwAD.dual_level():
            return fwAD.unpack_dual(f(fwAD.make_dual(x, torch.ones_like(x)))).tangent

    return {"jvp": lambda: torch.func.jvp(f, (x,), (torch.ones_like(x),)),
            "jacfwd": lambda: torch.func.jacfwd(f)(x),
            "grad": lambda: torch.func.grad(lambda a: f(a).float().sum())(x),
            "jacrev": lambda: torch.func.jacrev(f)(x),
            "forward_ad": lambda: dual(torch.enable_grad),
            "forward_ad under no_grad": lambda: dual(torch.no_grad)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_layer_op_refuses_func_transforms_and_forward_ad(name):
    """docs/api.md, "Ops and backends": differentiating a layer op raises InferenceOnlyError naming
    it and its reference. A jvp / jacfwd / forward-AD tangent through it came out 0 (or None) with
    no error, where the reference gives the real one; torch.func.grad was torch's "must override
    the setup_context staticmethod"; jvp of fused_add_rms_norm "Cannot access storage of
    TensorWrapper" (its overlap check)."""
    op, ref, tensors, args = CASES[name]
    for which in tensors:
        for label, call in _transforms(name, op, tensors, args, which).items():
            with pytest.raises(InferenceOnlyError, match=rf"^{name} is inference-only \(no derivative\): "
                                                         rf"torch.func.grad / jvp .* use {name}_ref "):
                print(f"{name}: {label} in {which} gave no error", call())
    # what the refusal stands for: the reference's tangent in the first input is not 0
    first = next(iter(tensors))
    x = tensors[first]
    _, tangent = torch.func.jvp(lambda a: _outputs(ref(*args(dict(tensors, **{first: a}))))[0], (x,),
                                (torch.ones_like(x),))
    assert tangent.abs().max() > 0, f"{name}_ref: a tangent of 0"


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_layer_op_on_constants_of_a_transform_gives_its_value(name):
    """Inputs that do not depend on what a transform differentiates (made inside the function, or
    detached) are constants of it: the op runs and its output, a constant, is the no_grad one, so
    d/da (a * sum(out)) is sum(out). Under torch.func.grad every tensor the function makes is a
    grad-tracking wrapper, constants too, and each was refused with InferenceOnlyError (docs/api.md,
    "Ops and backends"); an input that depends on ``a`` is still refused (above)."""
    op, ref, tensors, args = CASES[name]
    with torch.no_grad():
        want = next(g for g in _outputs(op(*args(tensors))) if g.is_floating_point()).float().sum()
    a0 = torch.tensor(0.5)
    kinds = {"made inside": lambda a: {n: x * 1.0 for n, x in tensors.items()},
             "detached": lambda a: {n: (x + 0 * a).detach() for n, x in tensors.items()}}
    for kind, consts in kinds.items():
        def f(a):
            out = next(g for g in _outputs(op(*args(consts(a)))) if g.is_floating_point())
            return a * out.float().sum()

        calls = {"grad": lambda: torch.func.grad(f)(a0),
                 "jacrev": lambda: torch.func.jacrev(f)(a0),
                 "grad of grad": lambda: torch.func.grad(lambda b: torch.func.grad(f)(b) * b)(a0)}
        for label, call in calls.items():
            got = call()
            assert torch.equal(got, want), f"{name}, {kind}, {label}: {got.item()!r}, want {want.item()!r}"
        # forward mode: every grad-tracking input is refused, constants too (func_transformed: a
        # tangent under a grad level reads None where it is not 0)
        for label, call in {"jvp": lambda: torch.func.jvp(f, (a0,), (torch.ones_like(a0),)),
                            "jacfwd": lambda: torch.func.jacfwd(f)(a0)}.items():
            with pytest.raises(InferenceOnlyError, match="is inference-only"):
                call()


@pytest.mark.parametrize("straight", [True, False], ids=["passed-straight", "computed"])
def test_a_jvp_of_a_function_taking_grad_inside_is_refused(straight):
    """f(x) = torch.func.grad(a -> a · sum(rms_norm(x)))(a0): the op's input is a constant of the
    inner grad but depends on the jvp's primal x. Its tangent read None under the grad level and the
    constant rule let it through: jvp(f) gave a tangent of 0 with no error (rms_norm_ref: -21.18)."""
    x, w, a0 = _r(4, D), _r(D), torch.tensor(1.0)

    def f(op):
        return lambda xx: torch.func.grad(lambda a: a * op(xx if straight else xx * 1.0, w, 1e-6).sum())(a0)

    want = torch.func.jvp(f(rms_norm_ref), (x,), (torch.ones_like(x),))[1]
    assert want.abs() > 0, "the reference's tangent is 0: the case shows nothing"
    for label, call in {"jvp": lambda: torch.func.jvp(f(rms_norm), (x,), (torch.ones_like(x),)),
                        "jacfwd": lambda: torch.func.jacfwd(f(rms_norm))(x)}.items():
        with pytest.raises(InferenceOnlyError, match="^rms_norm is inference-only"):
            got = call()
            print(f"{label}: {got} where rms_norm_ref's tangent is {want}")


def test_plain_vmap_of_a_layer_op_runs_as_before():
    """vmap without a gradient transform is not refused: vmap(rms_norm) and vmap(silu_and_mul) give
    the op's values on each example, bit for bit."""
    xb, w = _r(3, T, D), _r(D)
    want = torch.stack([rms_norm(x, w) for x in xb])
    torch.testing.assert_close(torch.func.vmap(lambda x: rms_norm(x, w))(xb), want, atol=0, rtol=0)
    torch.testing.assert_close(torch.func.vmap(lambda a: rms_norm(xb[0], a))(torch.stack([w, 2 * w])),
                               torch.stack([rms_norm(xb[0], w), rms_norm(xb[0], 2 * w)]), atol=0, rtol=0)
    torch.testing.assert_close(torch.func.vmap(silu_and_mul)(xb), torch.stack([silu_and_mul(x) for x in xb]),
                               atol=0, rtol=0)


def test_a_batched_backward_raises_inference_only_error():
    """A backward taken for a batch of output gradients at once (torch.autograd.functional.jacobian
    with vectorize=True: autograd.grad with is_grads_batched=True; torch.func.vmap over
    autograd.grad) raises InferenceOnlyError as the plain backward does: it was torch's "Batching
    rule not implemented for acarerank::inference_only_backward"."""
    x, w = _r(T, D), _r(D)
    pattern = r"^rms_norm is inference-only \(no backward\): .* train through rms_norm_ref "
    with pytest.raises(InferenceOnlyError, match=pattern):
        torch.autograd.functional.jacobian(lambda a: rms_norm(a, w), x, vectorize=True)
    with pytest.raises(InferenceOnlyError, match=pattern):
        torch.autograd.functional.jacobian(lambda a: rms_norm(x, a), w, vectorize=True)
    xg = x.clone().requires_grad_()
    y = rms_norm(xg, w)
    with pytest.raises(InferenceOnlyError, match=pattern):
        torch.autograd.grad(y, xg, torch.ones(2, T, D), is_grads_batched=True, retain_graph=True)
    with pytest.raises(InferenceOnlyError, match=pattern):
        torch.func.vmap(lambda g: torch.autograd.grad(y, xg, g, retain_graph=True))(torch.ones(2, T, D))


def test_vmap_with_a_weight_that_requires_grad_runs_and_its_backward_names_the_reference():
    """vmap of a call whose weight is an nn.Parameter (grad mode on): each example's no_grad values,
    an output that requires grad, and a backward that is InferenceOnlyError. It was torch's "an
    autograd.Function ... must override the setup_context staticmethod"."""
    xb, w = _r(3, T, D), torch.nn.Parameter(_r(D))
    with torch.no_grad():
        want = torch.stack([rms_norm(x, w) for x in xb])
    got = torch.func.vmap(lambda x: rms_norm(x, w))(xb)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert got.requires_grad
    with pytest.raises(InferenceOnlyError, match=r"^rms_norm is inference-only \(no backward\)"):
        got.sum().backward()
    assert w.grad is None


def test_vmap_of_an_op_that_updates_in_place_is_refused_by_name():
    """fused_add_rms_norm adds into its residual, which vmap cannot batch: a RuntimeError naming the
    op and its reference before anything runs (the residual untouched). It was torch's "Cannot access
    storage of BatchedTensorImpl" from the op's overlap check, with no op named."""
    xb, rb, w = _r(2, T, D), _r(2, T, D), _r(D)
    before = rb.clone()
    with pytest.raises(RuntimeError, match=r"^fused_add_rms_norm: no torch.func.vmap \(it updates residual in "
                                           r"place.*vmap fused_add_rms_norm_ref"):
        torch.func.vmap(lambda x, r: fused_add_rms_norm(x, r, w))(xb, rb)
    assert torch.equal(rb, before)
    # the advice works: the reference, vmapped, is the op on the whole batch
    want_y, want_r = fused_add_rms_norm_ref(xb, rb.clone(), w, 1e-6)
    got_y, got_r = torch.func.vmap(lambda x, r: fused_add_rms_norm_ref(x, r, w, 1e-6))(xb, rb)
    torch.testing.assert_close(got_y, want_y, atol=0, rtol=0)
    torch.testing.assert_close(got_r, want_r, atol=0, rtol=0)


def test_the_named_reference_is_differentiable():
    """The advice works: rms_norm_ref backpropagates where rms_norm's backward refuses."""
    x, w = _r(T, D).requires_grad_(), _r(D)
    rms_norm_ref(x, w, 1e-6).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_linear_with_a_packed_weight_has_no_backward_and_the_dense_one_trains():
    w, x = _r(12, D), _r(T, D).requires_grad_()
    try:
        packed = prepare_linear_weight(w, "onednn")
    except BackendError as e:   # a torch without oneDNN: only the dense path exists
        pytest.skip(str(e))
    y = linear(x, packed)   # runs; its backward is the error
    with pytest.raises(InferenceOnlyError, match=r"^linear \(oneDNN-packed weight\) is inference-only .* dense weight"):
        y.sum().backward()
    # a jvp's tangent came out 0 with no error (the dense weight's: ones @ wᵀ)
    x0 = x.detach()
    with pytest.raises(InferenceOnlyError, match=r"^linear \(oneDNN-packed weight\) is inference-only \(no derivative\)"):
        print("jvp gave", torch.func.jvp(lambda a: linear(a, packed), (x0,), (torch.ones_like(x0),)))
    with torch.no_grad():
        torch.testing.assert_close(linear(x, packed), linear_ref(x, w), atol=1e-4, rtol=1e-4)
    linear(x, w).sum().backward()    # F.linear: differentiable
    torch.testing.assert_close(x.grad, w.sum(0).expand(T, D))


@pytest.mark.parametrize("name", ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "prefix_shared_attention"])
def test_a_layer_op_compiles_with_inputs_that_require_grad(name):
    """torch.compile(fullgraph=True) of a call whose inputs require grad (an nn.Parameter weight, grad
    mode on, as an inference forward that forgot no_grad): the eager values, and a backward still
    raises InferenceOnlyError. Dynamo traced the backward's raise and failed every such compile
    ("Observed exception"); a backward op whose results fed nothing was dropped from the compiled
    backward (no error, no gradients), so the inputs' gradients come from it. (The attention ops
    compile with validate=False, the paged one with a plan: their checks read values on the host.)"""
    op, ref, tensors, args = CASES[name]
    if name == "prefix_shared_attention":
        op = functools.partial(op, validate=False)
    t = {n: x.detach().requires_grad_(True) for n, x in tensors.items()}
    want = _outputs(op(*args(t)))
    torch._dynamo.reset()
    got = _outputs(torch.compile(lambda t: op(*args(t)), backend="aot_eager", fullgraph=True)(t))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    first = next(g for g in got if g.is_floating_point())
    with pytest.raises(InferenceOnlyError, match=rf"^{name} is inference-only \(no backward\)"):
        first.float().sum().backward()
    assert all(x.grad is None for x in t.values())


def test_the_backward_op_raises_and_its_fake_gives_the_inputs_shapes():
    """``acarerank::inference_only_backward``: run, an InferenceOnlyError naming the op and its
    reference; traced (a fake), one gradient shaped like each input, so a compiled backward keeps it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    grad, inputs = torch.ones(3, 4), [torch.ones(4), torch.ones(2, 5, dtype=torch.bfloat16)]
    with pytest.raises(InferenceOnlyError, match=r"^rms_norm is inference-only .* train through rms_norm_ref "):
        torch.ops.acarerank.inference_only_backward(grad, inputs, "rms_norm", "rms_norm_ref")
    with FakeTensorMode() as mode:
        fakes = torch.ops.acarerank.inference_only_backward(mode.from_tensor(grad), [mode.from_tensor(t) for t in inputs],
                                                            "rms_norm", "rms_norm_ref")
    assert [(f.shape, f.dtype) for f in fakes] == [(t.shape, t.dtype) for t in inputs]


def test_a_chain_that_updates_the_residual_again_still_names_the_op():
    """Two fused_add_rms_norm calls on one residual stream (as two layers) under grad mode: a backward
    through the first is InferenceOnlyError. With the inputs saved for the backward (and held in
    memory), the second call's in-place update of the residual made it autograd's "modified by an
    inplace operation" error."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(4, 16, generator=g).requires_grad_()
    w = torch.nn.Parameter(torch.rand(16, generator=g) + 0.5)
    residual = torch.randn(4, 16, generator=g).requires_grad_().clone()
    first = fused_add_rms_norm(x, residual, w)
    fused_add_rms_norm(first.detach(), residual, w)   # the next layer updates the residual in place
    with pytest.raises(InferenceOnlyError, match=r"^fused_add_rms_norm is inference-only"):
        first.sum().backward()   # through the first call's node, whose inputs the second changed


BACKENDS = ["torch"] + ([] if NATIVE_MISSING else ["native"])


def _rope_tables(n):
    pos = torch.arange(n, dtype=torch.float32)[:, None] / (1e6 ** (torch.arange(0, D, 2) / D))[None]
    emb = torch.cat([pos, pos], -1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_loss_through_an_argument_updated_in_place_raises(backend):
    """fused_add_rms_norm's residual and qk_norm_rope's written k/v caches, updated in place under
    grad mode with an input that requires grad: their values are the no_grad ones and a loss through
    them raises InferenceOnlyError, as one through the returned output does. They kept their old
    history: residual.sum().backward() finished with no error and x.grad None (the sum's dependence
    on x dropped); a cache, plain or non-leaf, likewise."""
    x, r0, w = _r(T, D), _r(T, D), _r(D)
    want_y, want_res = fused_add_rms_norm_ref(x, r0, w, 1e-6)
    for residual_requires_grad in (False, True):
        xg = x.clone().requires_grad_()
        residual = r0.clone().requires_grad_(residual_requires_grad).clone()   # a non-leaf when it requires grad
        y = fused_add_rms_norm(xg, residual, w, backend=backend)
        torch.testing.assert_close(residual, want_res, atol=0, rtol=0)
        torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
        assert residual.requires_grad, residual_requires_grad
        with pytest.raises(InferenceOnlyError, match=r"^fused_add_rms_norm is inference-only \(no backward\)"):
            residual.sum().backward()
        assert xg.grad is None

    qkv, qw, kw = _r(T, (HQ + 2 * HKV) * D), _r(D), _r(D)
    cos, sin = _rope_tables(T)
    slots = torch.tensor([0, 5, 6, 2, 9])
    _, k_ref, v_ref = qk_norm_rope_ref(qkv, qw, kw, cos, sin, HQ, HKV, 1e-6)
    for cache_requires_grad in (False, True):
        qkv_g = qkv.clone().requires_grad_()
        caches = [torch.zeros(2, 8, HKV, D).requires_grad_(cache_requires_grad).clone() for _ in range(2)]
        qk_norm_rope(qkv_g, qw, kw, cos, sin, HQ, HKV, backend=backend, k_cache=caches[0], v_cache=caches[1],
                     slots=slots)
        for cache, rows in zip(caches, (k_ref, v_ref)):
            torch.testing.assert_close(cache.view(-1, HKV, D)[slots], rows, atol=1e-5, rtol=1e-5)
            with pytest.raises(InferenceOnlyError, match=r"^qk_norm_rope is inference-only \(no backward\)"):
                cache.sum().backward(retain_graph=True)
        assert qkv_g.grad is None


def test_an_argument_updated_in_place_that_is_a_leaf_requiring_grad_is_refused_untouched():
    """A residual or cache that is a leaf requiring grad cannot be joined to the graph after an in-place
    update (torch refuses that for its own in-place ops): refused before the op writes anything, with
    the op and the argument named. Under no_grad the update runs, as torch's in-place ops do."""
    x, w = _r(T, D).requires_grad_(), _r(D)
    residual = _r(T, D).requires_grad_()
    before = residual.detach().clone()
    with pytest.raises(ValueError, match=r"^fused_add_rms_norm: residual is updated in place and is a leaf tensor "
                                         r"that requires grad"):
        fused_add_rms_norm(x, residual, w)
    torch.testing.assert_close(residual.detach(), before, atol=0, rtol=0)
    qkv = _r(T, (HQ + 2 * HKV) * D)
    cos, sin = _rope_tables(T)
    k_cache, v_cache = torch.zeros(2, 8, HKV, D).requires_grad_(), torch.zeros(2, 8, HKV, D)
    with pytest.raises(ValueError, match=r"^qk_norm_rope: k_cache is updated in place and is a leaf tensor"):
        qk_norm_rope(qkv, _r(D), _r(D), cos, sin, HQ, HKV, k_cache=k_cache, v_cache=v_cache,
                     slots=torch.arange(T))
    assert not k_cache.detach().any() and not v_cache.any()
    with torch.no_grad():
        fused_add_rms_norm(x, residual, w)
    torch.testing.assert_close(residual.detach(), before + x.detach(), atol=0, rtol=0)


def _graph_nodes(fn) -> int:
    """The autograd nodes reachable from ``fn``."""
    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        if f is not None and f not in seen:
            seen.add(f)
            todo += [g for g, _ in f.next_functions]
    return len(seen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_joining_in_place_updates_holds_no_graph_and_breaks_no_call_that_ran(backend):
    """The join of an updated argument (above) must not cost what an inference loop that forgot
    no_grad had before it: (1) a KV cache written step after step held every step's graph (its
    join node's edges went to the op's inputs: 50 steps, 50 matmuls' saved activations alive);
    (2) a cache made under inference_mode (as the runner's pool is) or a view of one taken under
    no_grad failed after the op had written it. A view of a leaf that requires grad is refused
    before anything is written, as a leaf is."""
    cos, sin = _rope_tables(T)
    qw, kw = torch.nn.Parameter(_r(D)), torch.nn.Parameter(_r(D))
    k_pool, v_pool = torch.zeros(2, 2, 8, HKV, D), torch.zeros(2, 2, 8, HKV, D)   # [layer, pages, ...]
    W = torch.nn.Parameter(_r((HQ + 2 * HKV) * D, D))
    alive, nodes = [], []
    for step in range(20):
        x = _r(T, D)
        qkv = x @ W.T   # saves x for W's gradient: held as long as the graph is
        alive.append(weakref.ref(x))
        for layer in range(2):   # each layer's pages a fresh view of the pool, as a runner passes them
            qk_norm_rope(qkv, qw, kw, cos, sin, HQ, HKV, backend=backend, k_cache=k_pool[layer],
                         v_cache=v_pool[layer], slots=torch.arange(T) + step % 3)
        nodes.append(_graph_nodes(k_pool.grad_fn))
        del x, qkv
    gc.collect()
    held = sum(r() is not None for r in alive)
    assert held == 0, f"{held} of 20 steps' graphs held by the KV cache they wrote"
    assert nodes[-1] == nodes[0], f"the pool's graph grew with the calls: {nodes} nodes (a view joined each time)"
    with pytest.raises(InferenceOnlyError, match=r"^qk_norm_rope is inference-only"):
        k_pool.sum().backward()

    x0 = _r(T, (HQ + 2 * HKV) * D)
    with torch.inference_mode():
        pool = torch.zeros(2, 8, HKV, D)
    with torch.no_grad():
        view = torch.zeros(4, 8, HKV, D)[:2]
    want = qk_norm_rope_ref(x0, qw.detach(), kw.detach(), cos, sin, HQ, HKV, 1e-6)[1]
    for name, cache in (("an inference tensor", pool), ("a view made under no_grad", view)):
        if backend == "torch" and cache.is_inference():
            continue   # the torch backend's own in-place ops refuse it outside inference_mode, as torch does
        qk_norm_rope(x0, qw, kw, cos, sin, HQ, HKV, backend=backend, k_cache=cache, v_cache=torch.zeros_like(cache),
                     slots=torch.arange(T))
        torch.testing.assert_close(cache.view(-1, HKV, D)[:T], want, atol=1e-5, rtol=1e-5, msg=name)

    leaf = _r(T + 2, D).requires_grad_()
    residual = leaf[:T]
    with pytest.raises(ValueError, match=r"^fused_add_rms_norm: residual is updated in place and is a leaf tensor "
                                         r"that requires grad \(or a view of one\)"):
        fused_add_rms_norm(_r(T, D), residual, qw, backend=backend)
    assert torch.equal(leaf.detach()[:T], residual.detach()), "refused after writing"


@pytest.mark.parametrize("backend", BACKENDS)
def test_qk_norm_rope_writing_pages_compiles_in_one_graph_and_still_refuses_bad_slots(backend):
    """docs/api.md: the layer ops behave the same under torch.compile(fullgraph=True); the page
    write's checks read storage addresses and slot values, which dynamo cannot trace (Unsupported).
    Compiled, they run in the registered op: the same pages as eager, a bad slot refused unwritten."""
    cos, sin = _rope_tables(T)
    qkv, qw, kw = _r(T, (HQ + 2 * HKV) * D), _r(D), _r(D)
    slots = torch.tensor([0, 5, 6, 2, 9])

    def write(qkv, k_cache, v_cache, slots):
        return qk_norm_rope(qkv, qw, kw, cos, sin, HQ, HKV, backend=backend, k_cache=k_cache, v_cache=v_cache,
                            slots=slots)

    want_k, want_v = torch.zeros(2, 8, HKV, D), torch.zeros(2, 8, HKV, D)
    want = write(qkv, want_k, want_v, slots)
    torch._dynamo.reset()
    compiled = torch.compile(write, backend="aot_eager", fullgraph=True)
    k_cache, v_cache = torch.zeros(2, 8, HKV, D), torch.zeros(2, 8, HKV, D)
    got = compiled(qkv, k_cache, v_cache, slots)
    for name, a, b in (("q", got[0], want[0]), ("k", got[1], want[1]), ("k_cache", k_cache, want_k),
                       ("v_cache", v_cache, want_v)):
        assert torch.equal(a, b), f"{name}: compiled differs from eager by {(a - b).abs().max():.3e}"
    k_cache.zero_()
    with pytest.raises(ValueError, match=r"slots\[1\] = 16 is outside the caches' \[0, 16\)"):
        compiled(qkv, k_cache, v_cache, torch.tensor([0, 16, 6, 2, 9]))
    assert not k_cache.any(), "a refused call wrote pages"


def test_a_compiled_fused_add_joins_the_updated_residual_too():
    """Under torch.compile(fullgraph=True) as in eager code: the residual the op updated carries the
    eager values and a loss through it raises InferenceOnlyError (x.grad stays None)."""
    x, r0, w = _r(T, D), _r(T, D), _r(D)
    want_res = fused_add_rms_norm_ref(x, r0, w, 1e-6)[1]
    torch._dynamo.reset()
    step = torch.compile(lambda x, residual, w: fused_add_rms_norm(x, residual, w), backend="aot_eager",
                         fullgraph=True)
    for residual_requires_grad in (False, True):
        xg, residual = x.clone().requires_grad_(), r0.clone().requires_grad_(residual_requires_grad).clone()
        step(xg, residual, w)
        torch.testing.assert_close(residual, want_res, atol=0, rtol=0)
        with pytest.raises(InferenceOnlyError, match=r"^fused_add_rms_norm is inference-only \(no backward\)"):
            residual.sum().backward()
        assert xg.grad is None
