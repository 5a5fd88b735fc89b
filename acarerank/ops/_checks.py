"""Input checks shared by several ops: floating-point tensors on one device (the layer ops,
merge_attention_states, yes_no_score) and the vocabulary-projection ops' inputs (topk_logprobs,
its cores, linear_logprob)."""
from __future__ import annotations

import math
import numbers
import struct
from typing import List

import torch
import torch.autograd.forward_ad as forward_ad

from .._validate import is_bool, positive_int


def finite_real(x) -> bool:
    """Whether ``x`` is a finite real scalar: int, float or a numpy one (np.float32 is not a
    Python float), never a bool. Comparisons, not math.isfinite: torch.compile(dynamic=True) makes a
    float argument (a default included) a SymFloat, which math.isfinite cannot trace."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and -math.inf < x < math.inf


def as_fp32(x: float) -> float:
    """``x`` rounded to fp32 (±inf beyond its range, 0 below its smallest subnormal)."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:  # struct refuses what rounds to ±inf
        return math.copysign(math.inf, x)


#: the open interval of reals that round (to nearest, ties to even) to a finite fp32 number > 0:
#: 2⁻¹⁵⁰ is half the smallest subnormal (a tie, rounded to 0), 2¹²⁸ − 2¹⁰³ half an ulp past the
#: largest finite fp32 (a tie, rounded to inf)
FP32_POSITIVE = (2.0 ** -150, 2.0 ** 128 - 2.0 ** 103)


def positive_in_fp32(x) -> bool:
    """Whether the real scalar ``x`` is finite and > 0 also as the fp32 number the kernels use
    (1e-50 is 0 there, 1e39 inf). Comparisons only, so torch.compile traces it on a SymFloat."""
    if type(x).__module__ == "numpy":  # np.float32 cast the bound 2¹²⁸ − 2¹⁰³ to float32: an overflow warning
        x = float(x)
    return FP32_POSITIVE[0] < x < FP32_POSITIVE[1]


#: why a row's logits came out inf/NaN: the inputs, or a product h·w (over a small temperature) past
#: fp32's range — a temperature of 1e-45 passes the fp32 check and still overflows every logit
NONFINITE_LOGITS = "non-finite logits (inf/NaN in hidden or weight, or h·w / temperature past fp32's range)"


class InferenceOnlyError(ValueError):
    """The backward of a layer op that has none (docs/api.md, "Ops and backends"): raised when a
    loss is backpropagated through its output. Without it the backward failed with torch's "no
    autograd formula was registered" for an internal op name."""


def _inference_only_message(op: str, ref: str) -> str:
    return (f"{op} is inference-only (no backward): a loss was backpropagated through its output; train "
            f"through {ref} (plain PyTorch, differentiable), or run {op} under torch.no_grad() / "
            f"torch.inference_mode()")


@torch.library.custom_op("acarerank::inference_only_backward", mutates_args=())
def _inference_only_backward(grad: torch.Tensor, inputs: List[torch.Tensor], op: str, ref: str) -> List[torch.Tensor]:
    """The backward of an inference-only op: raises ``InferenceOnlyError`` when it runs. An op (not
    a Python raise in ``_NoBackward.backward``) so that torch.compile traces the backward through
    its fake, and only running it raises: traced, the raise failed every compiled forward whose
    inputs required grad (an nn.Parameter weight with grad mode on) with dynamo's "Observed
    exception". Its results are the inputs' gradients, so a compiled backward cannot drop it as
    unused (it did, when only the unused gradient of ``out`` came from it: no error, no gradients)."""
    raise InferenceOnlyError(_inference_only_message(op, ref))


@_inference_only_backward.register_fake
def _(grad, inputs, op, ref):
    return [torch.empty_like(t) for t in inputs]


@_inference_only_backward.register_vmap
def _(info, in_dims, grad, inputs, op, ref):
    # a backward under torch.func.vmap (of torch.autograd.grad) raises as the plain one, not with
    # torch's "Batching rule not implemented for acarerank::inference_only_backward"
    raise InferenceOnlyError(_inference_only_message(op, ref))


class _NoBackward(torch.autograd.Function):
    """Identity on ``out``, joined to the grad-requiring ``inputs`` of an op without a backward:
    the forward runs (an inference call that forgot no_grad still works), the backward raises.
    A separate ``setup_context`` and a generated vmap rule, so it runs under torch.func.vmap (an
    nn.Parameter weight of a vmapped call; torch's "must override the setup_context staticmethod"
    before)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(op: str, ref: str, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        # the inputs' shapes, dtypes and devices, not the inputs: saved, one the op then updated in
        # place (fused_add_rms_norm's residual, by the next layer) made the backward autograd's
        # "modified by an inplace operation" error instead of InferenceOnlyError, and held its memory
        op, ref, _, *tensors = inputs
        ctx.op, ctx.ref = op, ref
        ctx.likes = [(t.shape, t.dtype, t.device) for t in tensors]

    @staticmethod
    def backward(ctx, grad):
        # a batched backward (torch.autograd.functional.jacobian(vectorize=True): autograd.grad with
        # is_grads_batched=True, torch's legacy vmap, which no register_vmap rule reaches) raises as the
        # plain one: it was "Batching rule not implemented for acarerank::inference_only_backward"
        if not torch.compiler.is_compiling() and torch._C._functorch.is_legacy_batchedtensor(grad):
            raise InferenceOnlyError(_inference_only_message(ctx.op, ctx.ref))
        likes = [torch.empty((), dtype=dtype, device=device).expand(shape) for shape, dtype, device in ctx.likes]
        return (None, None, None, *_inference_only_backward(grad, likes, ctx.op, ctx.ref))


#: the input of every in-place join's no-backward node (``_join_in_place``): a leaf of no elements,
#: made once (torch.compile cannot make a tensor that requires grad); its backward raises first,
#: so no gradient ever reaches it
_JOIN_LEAF = torch.empty(0, requires_grad=True)


def _join_in_place(t: torch.Tensor, op: str, ref: str) -> None:
    """Join ``t``, which an inference-only op is about to update in place, to a no-backward node:
    an in-place copy into an empty slice of it, so autograd rebases the whole tensor's history on
    that update and a loss through any of its elements raises (it kept its old history: no error,
    the gradients of what flowed into it dropped). The node's input is a private empty leaf, not
    the op's inputs: a KV cache joined on every step of a loop held every step's graph. Once per
    history (a cache updated step after step is joined once). Not joinable, left as before: an
    inference tensor, and a view made under no_grad (torch refuses an in-place op with grad on it)."""
    def join():
        t.narrow(-1, 0, 0).copy_(_NoBackward.apply(op, ref, t.new_empty(0), _JOIN_LEAF))

    if torch.compiler.is_compiling():   # neither is_inference() nor a tensor attribute traces
        join()
        return
    # a view (a layer's pages of a pool) gets a new grad_fn at each access once its base changed:
    # the mark goes on the base, whose history the join rebased
    base = t._base if t._base is not None else t
    if t.dim() == 0 or t.is_inference() or (base.grad_fn is not None
                                            and getattr(base, "_acarerank_joined", None) is base.grad_fn):
        return
    try:
        join()
    except RuntimeError:   # a view made under no_grad / inference mode: nothing was written
        return
    base._acarerank_joined = base.grad_fn


def _transform_message(op: str, ref: str) -> str:
    return (f"{op} is inference-only (no derivative): torch.func.grad / jvp / jacrev / jacfwd / hessian and "
            f"forward-mode AD cannot differentiate it (a jvp came out 0 with no error); use {ref} (plain "
            f"PyTorch, which every transform takes), or call {op} outside the transform")


def _forward_mode_active() -> bool:
    """Whether a forward-mode derivative is being taken: forward_ad's dual level, or a jvp level
    (torch.func.jvp, jacfwd, hessian's inner one) in functorch's stack."""
    if forward_ad._current_level >= 0:
        return True
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == torch._C._functorch.TransformType.Jvp for i in retrieve_all_functorch_interpreters())


def func_transformed(*tensors) -> bool:
    """Whether one of ``tensors`` (non-tensors skipped) is differentiated by a torch.func transform:
    at some level of functorch's wrappers (at any depth under vmap's batched ones), a grad-tracking
    wrapper that requires grad at that level (grad, jacrev, vjp: the argument, or what was computed
    from it) or carries a forward tangent (jvp, jacfwd); or a tensor with a forward-mode tangent
    (torch.autograd.forward_ad). A constant of the transform is not: under torch.func.grad every
    tensor the function makes is a grad-tracking wrapper, one made from no argument (or detached)
    included, and the op's output is then a constant whose derivative nobody asks for. Plain vmap
    is neither. With a forward-mode level anywhere (a jvp/jacfwd transform, or forward_ad's
    dual_level) every grad-tracking wrapper counts: under a grad level above it a wrapper's tangent
    reads None and requires_grad False even where the jvp's primal reaches it, and such a tangent
    came out 0 with no error (jvp of a function taking torch.func.grad inside)."""
    F = torch._C._functorch
    forward = _forward_mode_active()
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        while F.is_functorch_wrapped_tensor(t):
            if F.is_gradtrackingtensor(t) and (forward or t.requires_grad or
                                               forward_ad.unpack_dual(t).tangent is not None):
                return True
            t = F.get_unwrapped(t)
        if forward_ad.unpack_dual(t).tangent is not None:
            return True
    return False


#: the innermost active torch.func transform, None outside them (bound once: inference_only tests it
#: on every call)
_peek_interpreter_stack = torch._C._functorch.peek_interpreter_stack


def vmapped(t) -> bool:
    """Whether ``t`` is a tensor batched by torch.func.vmap (at any depth of functorch's wrappers)."""
    F = torch._C._functorch
    while isinstance(t, torch.Tensor) and F.is_functorch_wrapped_tensor(t):
        if F.is_batchedtensor(t):
            return True
        t = F.get_unwrapped(t)
    return False


def inference_only(op: str, ref: str, tensors, run, mutated=()):
    """``run()`` (the op's call; a tensor or a tuple) for an op without a backward. Where grad mode
    is on and one of ``tensors`` (None and non-tensors skipped) requires grad, it runs under
    no_grad and each floating-point output comes back requiring grad, its backward an
    ``InferenceOnlyError`` naming ``op`` and its differentiable twin ``ref``. ``mutated``: the
    ``(name, tensor)`` pairs (tensor None when not given) the op updates in place; each is joined
    the same way (a loss through the updated residual or KV cache raises too), and one that is a
    leaf requiring grad is refused before anything runs (ValueError; torch refuses an in-place op
    on it too). A torch.func gradient transform (grad, jvp, jacrev, jacfwd) or a forward-mode tangent
    on one of ``tensors`` (``func_transformed``: one that depends on what is differentiated) is an
    ``InferenceOnlyError`` before anything runs (docs/api.md, "Ops and backends"), under no_grad too;
    plain vmap runs, but of an op with ``mutated`` tensors it is a RuntimeError naming the op (vmap
    cannot batch an update in place). Outside those: two reads of transform state, then one
    ``torch.is_grad_enabled()`` test under no_grad / inference_mode."""
    # first, and under no_grad too: forward-mode AD ignores grad mode, and a tangent sets no
    # requires_grad, so the op ran and its tangent came out 0 (or None).
    # No transform active (the runner's every call): no tensor is looked at
    if (forward_ad._current_level >= 0 or _peek_interpreter_stack() is not None) and not torch.compiler.is_compiling():
        if func_transformed(*tensors):
            raise InferenceOnlyError(_transform_message(op, ref))
        updated = [name for name, t in mutated if t is not None]
        if updated and any(vmapped(t) for t in tensors):
            # an update in place has no batching rule: torch's error named an internal op ("the fallback
            # path doesn't work on out= or view ops")
            raise RuntimeError(f"{op}: no torch.func.vmap (it updates {' and '.join(updated)} in place, which vmap "
                               f"cannot batch); call it once on the whole batch, or vmap {ref}")
    if not torch.is_grad_enabled():
        return run()
    need = [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]
    if not need:
        return run()
    mutated = [(name, t) for name, t in mutated if t is not None]
    compiling = torch.compiler.is_compiling()
    for name, t in mutated:
        base = t if compiling or t._base is None else t._base
        if t.requires_grad and base.is_leaf and base.requires_grad:
            raise ValueError(f"{op}: {name} is updated in place and is a leaf tensor that requires grad (or a "
                             f"view of one); pass a copy ({name}.clone()) or call it under torch.no_grad()")
    for _, t in mutated:   # before the op: a refusal of torch's then comes before anything is written
        _join_in_place(t, op, ref)
    with torch.no_grad():
        out = run()

    def join(o):
        return _NoBackward.apply(op, ref, o, *need) if isinstance(o, torch.Tensor) and o.is_floating_point() else o
    return tuple(join(o) for o in out) if isinstance(out, tuple) else join(out)


def check_flag(op: str, name: str, x) -> None:
    """TypeError unless ``x`` is a bool (Python's or numpy's): a truthy value such as the string
    "no" would switch the flag on without a word."""
    if not is_bool(x):
        raise TypeError(f"{op}: {name} must be a bool, got {type(x).__name__} {x!r}")


def check_eps(op: str, eps) -> None:
    """ValueError unless ``eps`` (an RMSNorm epsilon) is a finite real number >= 0, as
    ``config.rms_norm_eps`` is held to (acarerank.model.arch): a NaN or negative one gives NaN
    outputs with no error (rsqrt of a mean of squares plus it)."""
    if not finite_real(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")


def check_float_tensors(op: str, *named) -> None:
    """Each ``(name, tensor)`` of ``named`` is a floating-point tensor on the first one's device;
    else TypeError (not a tensor, not floating point) / ValueError (device) naming ``op`` and it."""
    first, dev = named[0][0], getattr(named[0][1], "device", None)
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be floating point, got {t.dtype}")
        if t.device != dev:
            raise ValueError(f"{op}: {name} is on {t.device}, {first} is on {dev}")


def check_projection_inputs(hidden, weight, targets, op: str, temperature=1.0, chunk=None, shard=False) -> int:
    """hidden [T, H] and weight [V, H] of one floating dtype, targets [T] int64/int32 ids in
    [0, V) (``check_target_range``, called by the ops themselves), all on one device;
    temperature finite > 0; chunk a positive int or None.

    ``shard=True``: weight is one rank's rows of a vocabulary-parallel lm_head
    (``vocab_parallel``): it may be empty and targets are global ids, range-checked there.
    Raises TypeError/ValueError naming ``op`` and the problem; returns V. No host sync: only
    shapes, dtypes and devices are read, so torch.compile traces it without a graph break.
    """
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"{op}: hidden must be [T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be [V, H], got shape {tuple(weight.shape)}")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise TypeError(f"{op}: hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"{op}: hidden is {hidden.dtype} but weight is {weight.dtype}; cast one of them")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{op}: hidden has H={hidden.shape[1]} but weight has H={weight.shape[1]}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{op}: targets must be int64 (or int32) token ids, got {targets.dtype}")
    if targets.dim() != 1 or targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"{op}: targets must be [T={hidden.shape[0]}], got shape {tuple(targets.shape)}")
    for name, t in (("weight", weight), ("targets", targets)):
        if t.device != hidden.device:
            raise ValueError(f"{op}: {name} is on {t.device}, hidden is on {hidden.device}")
    V = weight.shape[0]
    if V == 0 and not shard:
        raise ValueError(f"{op}: weight has an empty vocabulary")
    positive_int(f"{op}: chunk", chunk, allow_none=True)
    # fp32 too: logits are divided by fp32(τ), and a τ of 1e-50 (0 there) made every logit
    # inf/NaN, refused as "non-finite logits (inf/NaN in hidden or weight)"
    if not finite_real(temperature) or temperature <= 0 or not positive_in_fp32(temperature):
        raise ValueError(f"{op}: temperature must be a finite number > 0 (in float32 too), got {temperature!r}")
    return V


#: appended to a negative target's error: cross_entropy's ignore_index=-100 padding has no
#: counterpart here (docs/api.md, "Training modes")
PADDING_HINT = ("; there is no ignore_index: leave padding rows out, or give them any id in [0, V) and "
                "drop them with the loss's mask")


def check_target_range(targets: torch.Tensor, V: int, op: str) -> None:
    """ValueError naming ``op`` and an id of ``targets`` outside [0, V) (a negative one with
    ``PADDING_HINT``, -100 being cross_entropy's ignore_index padding). One host sync, so the
    single-process ops call it inside their registered custom ops' bodies, which run on the real
    tensors in eager and compiled code alike: in the Python wrapper it was a data-dependent
    branch, a graph break under torch.compile and an error under fullgraph=True."""
    if targets.numel():
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= V:
            raise ValueError(f"{op}: target id {lo if lo < 0 else hi} is out of range [0, V={V})"
                             + (PADDING_HINT if lo < 0 else ""))


def refuse_func_transforms(message: str, *tensors) -> None:
    """RuntimeError(``message``) when a tensor is differentiated by a torch.func gradient transform
    (grad, jvp, jacrev, ...) or carries a forward-mode tangent (torch.autograd.forward_ad; both:
    ``func_transformed``; a constant of the transform passes): for an op whose only derivative is
    a registered reverse-mode formula. Without it torch.func.grad failed deep in torch ("an
    autograd.Function ... must override the setup_context staticmethod", naming no op) and a jvp
    or forward-AD tangent was silently 0."""
    if torch.compiler.is_compiling():  # dynamo traces transforms on its own terms; these checks read no tensor data
        return
    if func_transformed(*tensors):
        raise RuntimeError(message)
