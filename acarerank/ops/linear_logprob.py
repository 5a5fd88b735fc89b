"""Fused policy log-probs of sampled tokens, with backward, never holding [T, V] (ATO, Eq. 12).

For rows t with hidden state h_t (after the final norm), lm_head W (V×H), target y_t and
temperature τ:

    z_t        = (h_t · Wᵀ) / τ
    logprob_t  = z_ty − logsumexp_j z_tj                         (log π(y_t | ·))
    entropy_t  = logsumexp_j z_tj − Σ_j p_tj z_tj,   p_t = softmax(z_t)      (optional)
               = log s_t − a_t / s_t,
                 m_t = max_j z_tj,  s_t = Σ_j e^{z_tj − m_t},  a_t = Σ_j e^{z_tj − m_t} (z_tj − m_t)

(the second form is the one computed: every term is relative to the row's max, so a common
offset of a row's logits does not cost precision; the first lost ~|offset| · 2⁻²⁴).

Gradients, with g = ∂L/∂logprob and e = ∂L/∂entropy per row:

    ∂L/∂z_tj = g_t (𝟙[j = y_t] − p_tj) − e_t p_tj (z_tj − E_p[z_t])
    ∂L/∂h_t  = (1/τ) Σ_j ∂L/∂z_tj W_j,      ∂L/∂W_j = (1/τ) Σ_t ∂L/∂z_tj h_t

Forward and backward both walk the vocabulary in chunks of ``chunk`` rows of W: one [T, C]
fp32 logits buffer, reused by every chunk (the backward recomputes the logits: one extra
GEMM instead of keeping [T, V]; ∂W is written by the GEMM straight into its rows). Forward
saves only hidden, weight, targets and three [T] vectors: the row max m, lse − m and E_p[z] − m.
The backward takes its softmax terms relative to m (p = exp((z − m) − (lse − m)), z − E_p[z] =
(z − m) − (E_p[z] − m)): z − m is exact near the max, so a common offset c of a row's logits
costs no precision (lse and E_p[z] rounded to fp32 carried ~c · 2⁻²⁴ into every p: gradients
1,000× the materialised path's error at c = 1e4).
Both directions are registered custom ops (``acarerank::linear_logprob`` and
``acarerank::linear_logprob_backward``, joined by ``register_autograd``), opaque to torch.compile.
Peers: Liger's fused linear cross-entropy and verl's ``linear_cross_entropy`` chunk the same
way. Liger computes the gradients already in the forward (3 GEMMs, but ∂W [V, H] is held
from the forward until the backward runs); here the backward recomputes the logits (4 GEMMs:
1.23× three bare GEMMs at T=512, H=1024, V=151,669 on CPU) and nothing of size [V, H] is
allocated before the backward.

Precision rule: all math in fp32. fp16/bf16 inputs are upcast one chunk at a time (the
product of two bf16 numbers is exact in fp32) — on a CPU with AVX512_BF16 the bf16 logits
instead come from ``acarerank::mm_bf16_f32`` (fp32 products and sums of the bf16 rows, another
summation order; csrc/cpu/logits_gemm.cpp) where acarerank._cpu is built — so outputs equal the
fp32 reference on the same (rounded) inputs to fp32 tolerance; gradients are accumulated in fp32
and rounded once to the input dtype, i.e. they are within one rounding (2⁻⁸ relative for bf16)
of the fp32 gradient of the same inputs.

One exception, where that GEMM runs (bf16 on a CPU with AVX512_BF16): the two gradient GEMMs
take ∂L/∂z rounded to bf16 — ∂h chunk by chunk through ``mm_bf16_f32`` (fp32 out, summed over
the chunks in fp32), ∂W through torch's bf16 ``mm`` (fp32 sums, rounded once) — at the bf16
GEMM's rate, where the fp32 GEMMs of ∂z and an upcast chunk take ~4.5× it (docs/benchmarks.md,
"Ops and kernels"). Each gradient entry then moves by at most 2⁻⁷ · Σ_j |∂z_tj| |W_j| (∂h) or
2⁻⁷ · Σ_t |∂z_tj| |h_t| (∂W) beyond its one rounding, and against the fp32 reference the
gradients stay within 2× the error of plain bf16 autograd (``log_softmax(hidden @ weight.T)`` in
bf16), in max and in norm: 0.07–0.72× its max error and 0.10–0.61× its norm error, the norm
error 1.2–1.7× the fp32-∂z path's (tests/ops/test_op_linear_logprob.py's cases).
``ACARERANK_LINEAR_LOGPROB_FP32_GRAD=1``, read at each backward, keeps fp32 ∂z there
(``grad_gemms_bf16``).

The rule holds inside a ``torch.autocast`` region too: the passes turn autocast off, which
would otherwise run the chunk GEMMs in bf16/fp16.

First derivatives only: a second backward through the gradients (``torch.autograd.grad(...,
create_graph=True)`` then a backward of those gradients) raises a RuntimeError naming the op;
use ``linear_logprob_ref`` where second derivatives are needed. Reverse mode through
torch.autograd only: under torch.func.grad / jvp / jacrev or with a forward-mode AD tangent the
op raises a RuntimeError naming it (``NO_FUNC_TRANSFORM``); torch.func.vmap works (torch's
per-sample fallback loop).
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from . import _backend
from ._checks import NONFINITE_LOGITS, check_flag, check_projection_inputs, check_target_range, refuse_func_transforms
from ._logits_gemm import native_bf16_gemm_for

DEFAULT_CHUNK = 2048  # vocabulary rows per step: [T, 2048] fp32 is 1.35 % of [T, 151,669]


def _check(hidden, weight, targets, temperature, chunk, return_entropy):
    check_projection_inputs(hidden, weight, targets, "linear_logprob", temperature=temperature, chunk=chunk)
    check_flag("linear_logprob", "return_entropy", return_entropy)   # "no" returned the entropy too


def fp32_math(device):
    """Autocast off on ``device`` for the body of a pass: under ``torch.autocast`` an out-of-place
    GEMM (``x.T @ h32``, ``torch.mm(h, w.t())``) would run in bf16/fp16 whatever its fp32
    inputs, against the precision rule (module doc; ``topk_logprobs`` uses it too)."""
    return torch.autocast(torch.device(device).type, enabled=False)


def compute_copy(x):
    """The compute copy: fp64 stays fp64 (gradcheck), everything else is fp32."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class _Chunks:
    """Reused scratch for the vocabulary walk: a [T, C] logits buffer (+ a second one for the
    entropy terms) and, for half-precision weights, a [C, H] upcast buffer. Allocated once per
    pass: no per-chunk malloc/free (page faults, heap growth) in the loop.

    bf16 on a CPU with AVX512_BF16: the logits come from ``acarerank::mm_bf16_f32`` (fp32 out of
    the bf16 rows, at the bf16 GEMM's rate; ``_logits_gemm``) with h32 rounded back to bf16 —
    exact, h32 is the upcast of a bf16 hidden state. There the backward (``grads``) also runs its
    two gradient GEMMs on bf16 ∂z (``grad_gemms_bf16``); with ``ACARERANK_LINEAR_LOGPROB_FP32_GRAD=1``
    they take fp32 ∂z and the upcast weight chunk (``w``), as everywhere else."""

    def __init__(self, h32, weight, chunk, second: bool, grads: bool = False):
        T, H = h32.shape
        self.h32, self.weight, self.T, self.H, self.chunk = h32, weight, T, H, min(chunk, weight.shape[0])
        C, dev, cd = self.chunk, h32.device, h32.dtype
        self.xbuf = torch.empty(T * C, dtype=cd, device=dev)
        self.ebuf = torch.empty(T * C, dtype=cd, device=dev) if second else None
        self.upcast, self.wbuf = weight.dtype != cd, None  # wbuf: allocated by the first w()
        self.hb, self.bf16_gemm, self.bf16_grads = None, None, False
        if weight.dtype == torch.bfloat16 and cd == torch.float32:
            # exact: h32 is the upcast of a bf16 hidden state. Contiguous rows, as the kernel takes
            # them: .float() and .to() keep a transposed hidden's strides (1, T)
            hb = h32.to(torch.bfloat16, memory_format=torch.contiguous_format)
            self.bf16_gemm = native_bf16_gemm_for(hb, weight)
            self.hb = hb if self.bf16_gemm is not None else None
        if grads and grad_gemms_bf16() and self.bf16_gemm is not None:  # the variable is checked on every path
            self.bf16_grads = True
            Ce = C + C % 2  # the GEMM takes K (here the chunk's columns) in pairs: an odd chunk gets a zero column
            self.dzbuf = torch.empty(T * Ce, dtype=torch.bfloat16, device=dev)  # ∂z rounded to bf16
            self.wtbuf = torch.empty(H * Ce, dtype=torch.bfloat16, device=dev)  # W[c0:c1]ᵀ, rows along the chunk
            self.ghbuf = torch.empty(T * H, dtype=torch.float32, device=dev)    # one chunk's ∂h, fp32

    def __iter__(self):
        V = self.weight.shape[0]
        for c0 in range(0, V, self.chunk):
            yield c0, min(V, c0 + self.chunk)

    def w(self, c0, c1):
        """Rows [c0, c1) of the weight in the compute dtype (a copy into the reused buffer)."""
        w = self.weight[c0:c1]
        if not self.upcast:
            return w
        if self.wbuf is None:
            self.wbuf = torch.empty(self.chunk * self.H, dtype=self.h32.dtype, device=self.h32.device)
        return self.wbuf[:(c1 - c0) * self.H].view(c1 - c0, self.H).copy_(w)

    def logits(self, c0, c1, temperature):
        """z = h · W[c0:c1]ᵀ / τ, [T, c1 − c0] in the compute dtype, in the reused buffer."""
        x = self.xbuf[:self.T * (c1 - c0)].view(self.T, c1 - c0)
        if self.bf16_gemm is not None:
            self.bf16_gemm(self.hb, self.weight[c0:c1], x)
        else:
            torch.mm(self.h32, self.w(c0, c1).T, out=x)
        if temperature != 1.0:
            x.div_(temperature)
        return x

    def second(self, n):
        return self.ebuf[:self.T * n].view(self.T, n)

    def grads_bf16(self, dz, c0, c1, grad_h, grad_w):
        """The chunk's share of both gradients from ∂z [T, c1 − c0] fp32 (``bf16_grads`` only):

            grad_h += bf16(∂z) · W[c0:c1]        fp32 out (mm_bf16_f32), summed over chunks in fp32
            grad_w[c0:c1] = bf16(∂z)ᵀ · h        torch's bf16 mm: fp32 sums, rounded once to bf16

        bf16(∂z) is the one rounding this adds (module doc, precision rule); the products of bf16
        numbers are exact in fp32. grad_h / grad_w None: not asked for."""
        T, H, n = self.T, self.H, c1 - c0
        ne = n + n % 2
        dzb = self.dzbuf[:T * ne].view(T, ne)
        dzb[:, :n].copy_(dz)
        if ne != n:
            dzb[:, n].zero_()
        if grad_h is not None:
            # the kernel reads b's rows along K: W's chunk transposed, [H, n] (a bf16 copy, as the
            # fp32 path's upcast copy of the chunk)
            wt = self.wtbuf[:H * ne].view(H, ne)
            wt[:, :n].copy_(self.weight[c0:c1].T)
            if ne != n:
                wt[:, n].zero_()
            gh = self.ghbuf.view(T, H)
            self.bf16_gemm(dzb, wt, gh)
            grad_h.add_(gh)
        if grad_w is not None:
            torch.mm(dzb[:, :n].T, self.hb, out=grad_w[c0:c1])


FP32_GRAD_ENV_VAR = "ACARERANK_LINEAR_LOGPROB_FP32_GRAD"


def grad_gemms_bf16() -> bool:
    """Whether a bf16 backward that has the bf16 logits GEMM runs its two gradient GEMMs on ∂z
    rounded to bf16 (the default) — False under ``ACARERANK_LINEAR_LOGPROB_FP32_GRAD=1``: fp32 ∂z
    and fp32 GEMMs of the upcast weight chunk, gradients within one bf16 rounding of the fp32
    gradient (module doc, precision rule). Read at each backward, so the two paths can be timed
    interleaved in one process. Any value but unset, "0" or "1" is a ValueError naming it."""
    v = os.environ.get(FP32_GRAD_ENV_VAR, "0")
    if v not in ("0", "1"):
        raise ValueError(f"linear_logprob: {FP32_GRAD_ENV_VAR} must be 0 or 1, got {v!r}")
    return v == "0"


def forward_stats(h32, weight, tg, temperature, chunk, with_entropy):
    """One pass over the rows of ``weight`` [V, H]: per row t of ``h32`` [T, H] (fp32/fp64)

        m_t = max_j z_tj,   s_t = Σ_j exp(z_tj − m_t),
        a_t = Σ_j exp(z_tj − m_t) · (z_tj − m_t)   (entropy only)
        tz_t = z_t,tg_t   for targets tg_t in [0, V); 0 for a target outside (another shard owns it)

    so that log Σ exp z = m + log s, E_p[z] = m + a/s and the entropy log s − a/s: a is built
    from z − m only, so the entropy does not lose precision to a common offset of the logits.

    Returns (m [T] in h32's dtype, s [T] fp64, a [T] fp64 (zeros without entropy), tz [T]). Also
    the per-shard half of ``acarerank.ops.vocab_parallel`` (which combines the ranks' stats).
    """
    with fp32_math(h32.device):
        return _forward_stats(h32, weight, tg, temperature, chunk, with_entropy)


def _forward_stats(h32, weight, tg, temperature, chunk, with_entropy):
    T = h32.shape[0]
    dev = h32.device
    m = torch.full((T,), -math.inf, dtype=h32.dtype, device=dev)
    s = torch.zeros(T, dtype=torch.float64, device=dev)   # Σ exp(z − m)
    a = torch.zeros(T, dtype=torch.float64, device=dev)   # Σ exp(z − m) · (z − m)   (entropy only)
    tz = torch.zeros(T, dtype=h32.dtype, device=dev)
    chunks = _Chunks(h32, weight, chunk, second=with_entropy)
    for c0, c1 in chunks:
        x = chunks.logits(c0, c1, temperature)
        rows = ((tg >= c0) & (tg < c1)).nonzero().flatten()
        if rows.numel():
            tz[rows] = x[rows, tg[rows] - c0]
        m_new = torch.maximum(m, x.max(dim=1).values)
        # ±inf max: shift by 0 (as topk_merge's fold). A row whose logits so far are all −inf
        # (products overflowing fp32) made −inf − (−inf) a NaN: an error or not depending on
        # where the chunks start
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        d = (m - shift).double()  # m_old − m_new ≤ 0 (−inf while nothing is held yet)
        scale = torch.exp(d)
        if with_entropy:
            # -- a relative to the new max: Σ e^{z−m_new}(z−m_new) = scale · (a_old + (m_old − m_new) s_old);
            #    terms of z − m, never of z itself: a common offset c of the logits cancels before
            #    any rounding (Σ e^z · z then lse − a/s lost ~c · 2⁻²⁴: 3.5e-3 at c = 1e4, 6× the
            #    materialised path)
            a = scale * (a + torch.where(s > 0, d * s, torch.zeros_like(s)))
            x.sub_(shift[:, None])
            e = torch.exp(x, out=chunks.second(c1 - c0))
            s = s * scale + e.sum(dim=1).double()
            a = a + e.mul_(x).sum(dim=1).double()
        else:
            s = s * scale + x.sub_(shift[:, None]).exp_().sum(dim=1).double()
        m = m_new
    return m, s, a, tz


def backward_chunks(h32, weight, tg, m, lse_m, ez_m, g_lp, g_ent, temperature, chunk, need_h, need_w):
    """∂L/∂h (un-reduced, [T, H] in h32's dtype) and ∂L/∂W ([V, H] in weight's dtype) over the rows
    of ``weight``, given the softmax statistics of the whole vocabulary relative to ``m`` [T] (a
    logit of the row, its max): ``lse_m`` = lse − m and ``ez_m`` = E_p[z] − m (module doc
    formulas). ``g_ent`` None: no entropy term. Targets outside [0, V) get no one-hot term
    (another shard owns them). Also the per-shard half of ``vocab_parallel``."""
    with fp32_math(h32.device):
        return _backward_chunks(h32, weight, tg, m, lse_m, ez_m, g_lp, g_ent, temperature, chunk, need_h, need_w)


def _backward_chunks(h32, weight, tg, m, lse_m, ez_m, g_lp, g_ent, temperature, chunk, need_h, need_w):
    T = h32.shape[0]
    cd = h32.dtype
    grad_h = torch.zeros(T, h32.shape[1], dtype=cd, device=h32.device) if need_h else None
    grad_w = torch.empty_like(weight) if need_w else None
    chunks = _Chunks(h32, weight, chunk, second=g_ent is not None, grads=True)
    for c0, c1 in chunks:
        x = chunks.logits(c0, c1, temperature).sub_(m[:, None])  # z − m, exact near the max (module doc)
        # -- ∂L/∂z for this chunk, built in x's buffer
        if g_ent is not None:
            p = torch.sub(x, lse_m[:, None], out=chunks.second(c1 - c0)).exp_()
            x.sub_(ez_m[:, None]).mul_(g_ent[:, None]).add_(g_lp[:, None]).mul_(p).neg_()  # −p (g + e (z − E z))
        else:
            x.sub_(lse_m[:, None]).exp_().mul_(-g_lp[:, None])  # −g p
        rows = ((tg >= c0) & (tg < c1)).nonzero().flatten()
        if rows.numel():
            x[rows, tg[rows] - c0] += g_lp[rows]
        if temperature != 1.0:
            x.div_(temperature)  # ∂z/∂logits = 1/τ
        if chunks.bf16_grads:
            chunks.grads_bf16(x, c0, c1, grad_h, grad_w)
            continue
        if need_h:
            grad_h.addmm_(x, chunks.w(c0, c1))
        if need_w:
            if grad_w.dtype == cd:
                torch.mm(x.T, h32, out=grad_w[c0:c1])  # straight into the gradient, no [C, H] temporary
            else:
                grad_w[c0:c1] = (x.T @ h32).to(weight.dtype)
    return grad_h, grad_w


def grad_inputs(ctx, g_lp, g_ent, T, device):
    """The incoming gradients in the compute dtype (zeros for an unused log-prob output; None
    for an unused entropy)."""
    cd = torch.float64 if ctx.compute_dtype == torch.float64 else torch.float32
    g_lp = g_lp.to(cd) if g_lp is not None else torch.zeros(T, dtype=cd, device=device)
    g_ent = g_ent.to(cd) if ctx.with_entropy and g_ent is not None else None
    return g_lp, g_ent


# ----------------------------------------------------------------------------- registered ops
@torch.library.custom_op("acarerank::linear_logprob", mutates_args=())
def linear_logprob_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                      chunk: int, with_entropy: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob [T], entropy [T] (zeros without ``with_entropy``), m [T] the row's max logit,
    logsumexp − m [T], E_p[z] − m [T] (zeros without ``with_entropy``)), all in the compute dtype
    (fp32; fp64 for fp64 inputs). The last three are what the backward needs (module doc).

    The checks that read the data — targets in [0, V), finite outputs — are ValueErrors raised
    here, on the real tensors: in the Python wrapper each was a host sync that torch.compile
    cannot trace (two graph breaks; a UserError about a data-dependent guard under fullgraph=True)."""
    check_target_range(targets, weight.shape[0], "linear_logprob")
    h32 = compute_copy(hidden)
    m, s, a, tz = forward_stats(h32, weight, targets.long(), temperature, chunk, with_entropy)
    out = h32.dtype
    log_s = torch.log(s)  # lse − m
    logprob = (tz.double() - (m.double() + log_s)).to(out)
    ez_m = (a / s).to(out) if with_entropy else torch.zeros_like(tz)
    entropy = (log_s - a / s).to(out) if with_entropy else torch.zeros_like(tz)  # shift-free (forward_stats)
    # like topk_logprobs: inf/NaN in hidden or weight is an error, never a silent NaN loss (one host
    # sync). The entropy too: a -inf logit leaves the log-prob finite but makes 0·log 0 a NaN there
    bad = ~torch.isfinite(logprob) | ~torch.isfinite(entropy)
    if bad.any():
        rows = bad.nonzero().flatten().tolist()[:8]
        raise ValueError(f"linear_logprob: {NONFINITE_LOGITS} in rows {rows}")
    return logprob, entropy, m, log_s.to(out), ez_m


@linear_logprob_op.register_fake
def _(hidden, weight, targets, temperature, chunk, with_entropy):
    T = hidden.shape[0]
    out = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    return tuple(hidden.new_empty(T, dtype=out) for _ in range(5))


@torch.library.custom_op("acarerank::linear_logprob_backward", mutates_args=())
def linear_logprob_backward_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, m: torch.Tensor,
                               lse_m: torch.Tensor, ez_m: torch.Tensor, g_lp: torch.Tensor,
                               g_ent: Optional[torch.Tensor], temperature: float, chunk: int, need_h: bool, need_w: bool
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(∂L/∂hidden in hidden's dtype, ∂L/∂weight in weight's dtype); an empty tensor for a
    gradient not asked for. ``g_ent`` None: no entropy term (module doc formulas)."""
    grad_h, grad_w = backward_chunks(compute_copy(hidden), weight, targets.long(), m, lse_m, ez_m, g_lp, g_ent,
                                     temperature, chunk, need_h, need_w)
    grad_h = grad_h.to(hidden.dtype) if need_h else hidden.new_empty(0)
    return grad_h, (grad_w if need_w else weight.new_empty(0))


@linear_logprob_backward_op.register_fake
def _(hidden, weight, targets, m, lse_m, ez_m, g_lp, g_ent, temperature, chunk, need_h, need_w):
    # the strides the real op returns: ∂hidden is always contiguous (empty_like would copy a
    # transposed hidden's strides: torch.compile's stride assert then failed), ∂W empty_like(weight)
    return (hidden.new_empty(hidden.shape) if need_h else hidden.new_empty(0),
            torch.empty_like(weight) if need_w else weight.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, temperature, chunk, with_entropy = inputs
    _, _, m, lse_m, ez_m = output
    # targets copied ([T] ids): rollout tokens sampled under torch.inference_mode() are inference
    # tensors, which autograd refuses to save ("Inference tensors cannot be saved for backward")
    ctx.save_for_backward(hidden, weight, targets.clone(), m, lse_m, ez_m)
    ctx.temperature, ctx.chunk, ctx.with_entropy, ctx.compute_dtype = temperature, chunk, with_entropy, m.dtype


def _backward(ctx, g_lp, g_ent, _g_m, _g_lse, _g_ez):
    hidden, weight, targets, m, lse_m, ez_m = ctx.saved_tensors
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    g_lp, g_ent = grad_inputs(ctx, g_lp, g_ent, hidden.shape[0], hidden.device)
    grad_h, grad_w = linear_logprob_backward_op(hidden, weight, targets, m, lse_m, ez_m, g_lp, g_ent,
                                                ctx.temperature, ctx.chunk, need_h, need_w)
    return (grad_h if need_h else None), (grad_w if need_w else None), None, None, None, None


linear_logprob_op.register_autograd(_backward, setup_context=_setup_context)

NO_DOUBLE_BACKWARD = ("linear_logprob: no second derivative — its backward is not differentiable (a backward of "
                      "gradients taken with create_graph=True reached it); use linear_logprob_ref, which "
                      "materialises the logits, where second derivatives are needed")


def _no_double_backward(ctx, *grads):
    raise RuntimeError(NO_DOUBLE_BACKWARD)


# without it the error named the internal op and advised register_autograd
linear_logprob_backward_op.register_autograd(_no_double_backward)


NO_FUNC_TRANSFORM = ("linear_logprob: no torch.func.grad / jvp / jacrev / hessian and no forward-mode AD — its "
                     "backward is a registered autograd formula that these transforms cannot call, and it has no "
                     "forward-mode formula (a jvp came out 0); differentiate it with torch.autograd (loss.backward(), "
                     "torch.autograd.grad), or use linear_logprob_ref, which materialises the logits; "
                     "torch.func.vmap works")


def _refuse_func_transforms(*tensors):
    """``refuse_func_transforms`` with ``NO_FUNC_TRANSFORM``."""
    refuse_func_transforms(NO_FUNC_TRANSFORM, *tensors)


class FirstOrderOnly(torch.autograd.Function):
    """``FirstOrderOnly.apply(anchor, *grads)``: ``grads`` unchanged, joined to the graph through
    ``anchor`` (an input that requires grad) by a node whose backward raises
    ``NO_DOUBLE_BACKWARD``. For an ``autograd.Function`` whose backward runs under no_grad
    (``vocab_parallel``): under create_graph=True its gradients would otherwise carry no graph,
    and a second backward would silently miss this op's part."""

    @staticmethod
    def forward(ctx, anchor, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(NO_DOUBLE_BACKWARD)


INFERENCE_TENSOR = ("linear_logprob: {name} is an inference tensor (made under torch.inference_mode()), and the "
                    "backward needs it saved, which autograd refuses; make it under torch.no_grad() instead, or "
                    "pass {name}.clone() made outside inference mode")


def _refuse_inference_tensors(hidden, weight):
    """ValueError ``INFERENCE_TENSOR`` naming hidden or weight when it is an inference tensor and
    the op will record a backward (either input requires grad, grad mode on): torch's own error
    came from the save, naming neither the op nor the argument. The targets are copied instead
    (``_setup_context``): [T] ids, where hidden and weight may be [V, H]."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not (hidden.requires_grad or
                                                                             weight.requires_grad):
        return
    for name, t in (("hidden", hidden), ("weight", weight)):
        if t.is_inference():
            raise ValueError(INFERENCE_TENSOR.format(name=name))


def linear_logprob(hidden, weight, targets, temperature: float = 1.0, return_entropy: bool = False,
                   chunk: Optional[int] = None, process_group=None, vocab_start: Optional[int] = None,
                   vocab_size: Optional[int] = None):
    """Log-prob of each target under softmax((hidden · weightᵀ) / τ), differentiable, chunked.

    Args:
      hidden: [T, H] hidden states after the final norm (fp32/fp16/bf16; requires_grad as needed).
      weight: [V, H] lm_head weight, same dtype and device.
      targets: [T] int64 (or int32) in [0, V).
      temperature: τ > 0. chunk: vocabulary rows per step (default 2048).
      return_entropy: also return the entropy of softmax(z_t) (differentiable too).
      process_group, vocab_start, vocab_size: ``weight`` is this rank's rows of an lm_head split
        by vocabulary over ``process_group`` (Megatron's layout; defaults as ``topk_logprobs``).
        Collective in forward and backward: hidden's gradient is all-reduced, the shard's
        gradient stays local; see ``acarerank.ops.vocab_parallel``. None: this single-process op.
    Returns: logprob [T] fp32 (and entropy [T] fp32); fp64 inputs give fp64 (for gradcheck).
    Raises ValueError when a row's logits are not finite (inf/NaN in hidden or weight), as
    ``topk_logprobs`` does; RuntimeError under a torch.func gradient transform or forward-mode
    AD (``NO_FUNC_TRANSFORM``: use torch.autograd; vmap works); ValueError when hidden or weight is
    an inference tensor and a backward is recorded (``INFERENCE_TENSOR``; targets may be one).
    Formulas and precision rule: module doc.
    """
    _refuse_func_transforms(hidden, weight)
    if process_group is not None:  # every check happens collectively there, so bad input never hangs a rank
        sharded = _backend.process_group_impl("linear_logprob")  # acarerank.ops.vocab_parallel
        return sharded(hidden, weight, targets, temperature, return_entropy, chunk, process_group=process_group,
                       vocab_start=vocab_start, vocab_size=vocab_size)
    if vocab_start is not None or vocab_size is not None:
        raise ValueError("linear_logprob: vocab_start / vocab_size describe a vocabulary shard; pass process_group too")
    _check(hidden, weight, targets, temperature, chunk, return_entropy)
    _refuse_inference_tensors(hidden, weight)
    lp, entropy, _, _, _ = linear_logprob_op(hidden, weight, targets, float(temperature), chunk or DEFAULT_CHUNK,
                                          bool(return_entropy))
    return (lp, entropy) if return_entropy else lp


def linear_logprob_ref(hidden, weight, targets, temperature: float = 1.0, return_entropy: bool = False):
    """Oracle: materialise fp32 logits [T, V], log_softmax, gather (autograd does the rest)."""
    z = (compute_copy(hidden) @ compute_copy(weight).T) / temperature
    lsm = z.log_softmax(dim=1)
    lp = lsm.gather(1, targets.long()[:, None]).squeeze(1)
    if not return_entropy:
        return lp
    return lp, -(lsm.exp() * lsm).sum(dim=1)


__all__ = ["linear_logprob", "linear_logprob_ref", "linear_logprob_op", "linear_logprob_backward_op",
           "NO_DOUBLE_BACKWARD", "NO_FUNC_TRANSFORM", "INFERENCE_TENSOR"]
