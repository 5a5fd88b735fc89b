"""Thin glue over ``acarerank._C``: tensors in, raw pointers / sizes / strides out.

``acarerank._C`` never sees a torch type (so a CPU-only torch cannot break its build): every
function here checks what would corrupt memory (dtype, layout, device), makes the layout
the kernel wants, allocates the outputs and passes ``data_ptr()`` integers.

  * ``*_cpp``  the C++ CPU twins, fp32 math (non-fp32 inputs are upcast here by torch)
  * ``*_cuda`` the CUDA kernels, fp32/fp16/bf16 read natively, launched on torch's
    current stream of the tensors' device

Importing this module raises ImportError when the extension was not built; the op modules
turn that into ``BackendError``. On a build without CUDA the ``*_cuda`` functions raise
``BackendError`` saying so.
"""
from __future__ import annotations

import torch

from ._backend import BackendError

try:
    from acarerank import _C
except ImportError as e:  # not built, or built for another Python
    raise ImportError(
        f"acarerank._C is not available ({e}); build it with `pip install -e .` (needs cmake>=3.24, ninja, pybind11)"
    ) from e

#: dtype codes shared with csrc/common.cuh (enum DType)
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def has_cuda() -> bool:
    """Whether the CUDA kernels were compiled into this build of acarerank._C."""
    return bool(_C.has_cuda)


def build_info() -> dict:
    """has_cuda, cuda_archs, cuda_compiler_version, cuda_runtime (live), no_cuda_reason, openmp, ..."""
    return dict(_C.build_info())


def require_cuda(op: str, *tensors: torch.Tensor) -> None:
    """Raise BackendError unless this build has CUDA and every tensor is on a CUDA device."""
    if not _C.has_cuda:
        reason = _C.build_info()["no_cuda_reason"]
        raise BackendError(
            f"{op}: backend 'cuda' unavailable: acarerank._C was built without CUDA ({reason}); "
            "rebuild with nvcc on PATH (or CUDA_HOME set) and ACARERANK_NO_CUDA unset"
        )
    for t in tensors:
        if not t.is_cuda:
            raise BackendError(f"{op}: backend 'cuda' needs CUDA tensors, got one on {t.device}")


def require_cpu(op: str, *tensors: torch.Tensor) -> None:
    """The C++ twins read host memory: refuse device tensors instead of crashing."""
    for t in tensors:
        if t.device.type != "cpu":
            raise BackendError(f"{op}: backend 'cpp' needs CPU tensors, got one on {t.device}")


def _launch(t: torch.Tensor) -> dict:
    """Device index and torch's current stream there, for a CUDA launch."""
    dev = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return {"device": dev, "stream": torch.cuda.current_stream(dev).cuda_stream}


def _threads() -> int:
    return torch.get_num_threads()


def _rows_unit_stride(x: torch.Tensor) -> torch.Tensor:
    """2-D view with unit column stride and a row stride >= row length (else a copy)."""
    if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]):
        return x.contiguous()
    return x


def _native(x: torch.Tensor) -> torch.Tensor:
    """x if the CUDA kernels read its dtype, else an fp32 copy."""
    return x if x.dtype in DTYPE_CODES else x.float()


# ---------------------------------------------------------------- yes/no head
def _yes_no(hidden_last, norm_weight, w_yes, w_no, eps, cuda: bool):
    h = _rows_unit_stride(_native(hidden_last) if cuda else hidden_last.float())
    S, H = h.shape
    nw, wy, wn = (w.float().contiguous() for w in (norm_weight, w_yes, w_no))
    score = torch.empty(S, dtype=torch.float32, device=h.device)
    diff = torch.empty(S, dtype=torch.float32, device=h.device)
    kw = dict(hidden=h.data_ptr(), dtype=DTYPE_CODES[h.dtype], rows=S, H=H, row_stride=h.stride(0),
              norm_w=nw.data_ptr(), w_yes=wy.data_ptr(), w_no=wn.data_ptr(), eps=float(eps),
              score=score.data_ptr(), logit_diff=diff.data_ptr())
    if cuda:
        _C.yes_no_cuda(**kw, **_launch(h))
    else:
        _C.yes_no_cpu(**kw, num_threads=_threads())
    return score, diff


def yes_no_score_cpp(hidden_last, norm_weight, w_yes, w_no, eps):
    """C++ twin of ``yes_no_score``: hidden_last [S, H], weights [H] -> (score fp32 [S], logit_diff fp32 [S])."""
    require_cpu("yes_no_score", hidden_last, norm_weight, w_yes, w_no)
    return _yes_no(hidden_last, norm_weight, w_yes, w_no, eps, cuda=False)


def yes_no_score_cuda(hidden_last, norm_weight, w_yes, w_no, eps):
    """CUDA ``yes_no_score`` (one warp per row); hidden read as fp32/fp16/bf16."""
    require_cuda("yes_no_score", hidden_last, norm_weight, w_yes, w_no)
    return _yes_no(hidden_last, norm_weight, w_yes, w_no, eps, cuda=True)


# ---------------------------------------------------------------- attention-state merge
def _merge(o_a, lse_a, o_b, lse_b, cuda: bool):
    dtype = o_a.dtype
    if cuda:
        oa, ob = _native(o_a), _native(o_b)
    else:
        oa, ob = o_a.float(), o_b.float()
    oa = oa if oa.stride(-1) == 1 else oa.contiguous()
    ob = ob if ob.stride(-1) == 1 else ob.contiguous()
    la, lb = lse_a.float(), lse_b.float()
    N, Hh, d = oa.shape
    out = torch.empty(N, Hh, d, dtype=oa.dtype, device=oa.device)
    lse = torch.empty(N, Hh, dtype=torch.float32, device=oa.device)
    kw = dict(dtype=DTYPE_CODES[oa.dtype], N=N, Hh=Hh, d=d,
              o_a=oa.data_ptr(), o_a_s0=oa.stride(0), o_a_s1=oa.stride(1),
              lse_a=la.data_ptr(), lse_a_s0=la.stride(0), lse_a_s1=la.stride(1),
              o_b=ob.data_ptr(), o_b_s0=ob.stride(0), o_b_s1=ob.stride(1),
              lse_b=lb.data_ptr(), lse_b_s0=lb.stride(0), lse_b_s1=lb.stride(1),
              out=out.data_ptr(), lse_out=lse.data_ptr())
    if cuda:
        _C.merge_states_cuda(**kw, **_launch(oa))
    else:
        _C.merge_states_cpu(**kw, num_threads=_threads())
    return out.to(dtype), lse


def merge_states_cpp(o_a, lse_a, o_b, lse_b):
    """C++ twin of ``merge_attention_states``: o [N, H, d], lse [N, H] (any strides) -> (out, lse fp32)."""
    require_cpu("merge_attention_states", o_a, lse_a, o_b, lse_b)
    return _merge(o_a, lse_a, o_b, lse_b, cuda=False)


def merge_states_cuda(o_a, lse_a, o_b, lse_b):
    """CUDA ``merge_attention_states`` (one warp per (token, head)); o read as fp32/fp16/bf16."""
    require_cuda("merge_attention_states", o_a, lse_a, o_b, lse_b)
    return _merge(o_a, lse_a, o_b, lse_b, cuda=True)


# ---------------------------------------------------------------- streaming top-k merge
def topk_update(state, logits: torch.Tensor, c0: int, cuda: bool, buf_cap: int = 0) -> None:
    """Merge chunk ``logits`` [T, n] (vocabulary ids c0..c0+n-1) into ``state`` in place.

    ``state`` is an ``acarerank.ops.topk_merge.TopKMergeState``; its tensors are contiguous
    and on logits' device (the caller checks). ``buf_cap`` (CPU, tests only) shrinks the
    pass-0 candidate buffer to force the re-read path the GPU takes on a first chunk.
    """
    (require_cuda if cuda else require_cpu)("topk_merge_update", logits, state.values)
    x = _rows_unit_stride(_native(logits) if cuda else logits.float())
    T, n = x.shape
    kw = dict(logits=x.data_ptr(), dtype=DTYPE_CODES[x.dtype], rows=T, n=n, row_stride=x.stride(0), c0=int(c0),
              temperature=float(state.temperature), vals=state.values.data_ptr(), ids=state.ids.data_ptr(),
              k=state.k, row_max=state.row_max.data_ptr(), row_sumexp=state.row_sumexp.data_ptr(),
              targets=state.targets.data_ptr() if state.targets is not None else 0,
              target_logit=state.target_logit.data_ptr())
    if cuda:
        _C.topk_merge_update_cuda(**kw, **_launch(x))
    else:
        _C.topk_merge_update_cpu(**kw, num_threads=_threads(), buf_cap=int(buf_cap))
