"""The MLP's gate/up projection with SiLU·up fused (acarerank/ops/gate_up_silu.py,
csrc/cpu/gate_up_amx.cpp) against the exact value, the unfused layer and the runner.

Bound: tests/ops/_gate_up_bounds.py (shared with the emulated-AMX build's test).
"""
import threading

import pytest
import torch

from _ext import needs_native
from acarerank.ops import (BackendError, BackendLimitError, InferenceOnlyError, PackedGateUpWeight, gate_up_silu,
                           gate_up_silu_ref, linear, prepare_gate_up_weight, prepare_linear_weight, silu_and_mul)
from acarerank.ops import _native
from acarerank.ops.amx_weights import pack_gate_up
from acarerank.ops.gate_up_silu import OP, resolve_gate_up_backend, why_not_native
from _gate_up_bounds import check_silu, exact, gate_up_data

AMX = _native.available() and _native.amx_tiles_kernel()
needs_amx = pytest.mark.skipif(not AMX, reason="the kernel runs on AMX-BF16 tiles, which this process does not use "
                                               "(its refusal is tested in test_refused_without_amx)")
BF16 = torch.bfloat16


# -- the packed layout ------------------------------------------------------------------------
def test_pack_is_the_documented_layout_and_unpacks_bitwise():
    I, K = 32, 64
    w = torch.randn(2 * I, K).to(BF16)
    p = pack_gate_up(w).view(I // 16, K // 32, 2, 16, 16, 2)
    for b, s, h, kp, c, e in [(0, 0, 0, 0, 0, 0), (1, 1, 1, 15, 15, 1), (0, 1, 1, 3, 7, 0), (1, 0, 0, 9, 2, 1)]:
        assert p[b, s, h, kp, c, e] == w[h * I + 16 * b + c, 32 * s + 2 * kp + e], (b, s, h, kp, c, e)
    if AMX:
        pw = PackedGateUpWeight(w)
        assert torch.equal(pw.unpack(), w) and pw.shape == (2 * I, K) and pw.dtype == BF16
        assert pw.nbytes == w.numel() * 2


# -- against the exact value --------------------------------------------------------------------
@needs_amx
@pytest.mark.parametrize("M,K,I", [(1, 32, 16), (2, 64, 48), (31, 96, 16), (32, 32, 144), (33, 1024, 160),
                                   (257, 288, 272), (600, 64, 48), (5, 1024, 3072)])
def test_fused_within_its_bound_of_the_exact_value(M, K, I):
    """M across the 32-row blocks and the 256-row chunks, K across the 256-k chunks, I across the
    256-column macros (2·I = 320, 544: a short last macro)."""
    x, w = gate_up_data(M, K, I, seed=M + K + I)
    pw = PackedGateUpWeight(w)
    y = gate_up_silu(x, pw)
    assert y.shape == (M, I) and y.dtype == BF16
    check_silu(y, x, w, f"M={M} K={K} I={I}")


@needs_amx
@pytest.mark.parametrize("M,K,I", [(1, 32, 16), (33, 1024, 160), (257, 288, 272)])
def test_as_a_linear_weight_within_the_linear_bound(M, K, I):
    """linear(x, packed) = x·[W_g; W_u]ᵀ in [gate | up] order, one rounding."""
    x, w = gate_up_data(M, K, I, seed=1)
    y = linear(x, PackedGateUpWeight(w))
    assert y.shape == (M, 2 * I) and y.dtype == BF16
    want = x.double() @ w.double().T
    bound = 2 * K * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T) + 2.0 ** -8 * want.abs()
    err = (y.double() - want).abs()
    assert (err <= bound).all(), f"max |diff| {err.max():.3e}, worst excess {(err - bound).max():.3e}"
    with pytest.raises(ValueError, match="takes no bias"):
        linear(x, PackedGateUpWeight(w), torch.zeros(2 * I, dtype=BF16))


@needs_amx
def test_no_worse_than_the_unfused_layer():
    """At a layer's proportions the fused result's largest error against the exact value is at most
    the unfused path's (linear on oneDNN or F.linear, then silu_and_mul: two bf16 roundings), as
    flash-attn's rule asks of a fused kernel."""
    x, w = gate_up_data(300, 512, 768, seed=3)
    fused = check_silu(gate_up_silu(x, PackedGateUpWeight(w)), x, w, "fused")
    G, U, _, _ = exact(x, w)
    unfused = (silu_and_mul(linear(x, w)).double() - G * torch.sigmoid(G) * U).abs().max().item()
    assert fused <= unfused, f"fused max error {fused:.3e} > the unfused path's {unfused:.3e}"


@needs_amx
def test_matches_the_reference_on_odd_inputs():
    """3-D input; rows at a stride (a column slice of a wider tensor); a transposed input (copied);
    an empty one; gate_up_silu_ref (fp64, rounded once) within one bf16 step of it."""
    x, w = gate_up_data(70, 64, 48, seed=4)
    pw = PackedGateUpWeight(w)
    base = gate_up_silu(x, pw)
    assert torch.equal(gate_up_silu(x.view(7, 10, 64), pw), base.view(7, 10, 48))
    wide = torch.zeros(70, 100, dtype=BF16)
    wide[:, 20:84] = x
    assert torch.equal(gate_up_silu(wide[:, 20:84], pw), base)
    assert torch.equal(gate_up_silu(x.T.contiguous().T, pw), base)
    assert gate_up_silu(x[:0], pw).shape == (0, 48)
    ref = gate_up_silu_ref(x, w).float()
    step = ref.abs().clamp_min(2.0 ** -126) * 2.0 ** -7
    assert ((base.float() - ref).abs() <= step + 1e-6).all()


@needs_amx
def test_large_and_non_finite_gates():
    """|g| ~ 100: SiLU(g)·u is ~0 (g ≪ 0: exp(−g) overflows to inf, the quotient to ±0) or g·u;
    a NaN in x makes that row NaN and no other."""
    x, w = gate_up_data(40, 64, 32, seed=5)
    x[3] *= 60
    x[7, 5] = float("nan")
    y = gate_up_silu(x, PackedGateUpWeight(w))
    assert torch.isnan(y[7]).all() and not torch.isnan(torch.cat([y[:7], y[8:]])).any()
    keep = [i for i in range(40) if i != 7]
    check_silu(y[keep], x[keep], w, "large gates")


# -- batch invariance, threads ---------------------------------------------------------------
@needs_amx
def test_a_rows_bits_do_not_depend_on_the_batch_or_the_threads():
    """The runner's batch-invariant mode relies on it: the same row, alone, in a batch of 37 and of
    600 (other blocks, chunks, positions), on 1 to 4 threads: the same bits."""
    x, w = gate_up_data(600, 288, 272, seed=6)
    pw = PackedGateUpWeight(w)
    full = gate_up_silu(x, pw)
    before = torch.get_num_threads()
    try:
        for threads in (1, 3, 4):
            torch.set_num_threads(threads)
            assert torch.equal(gate_up_silu(x, pw), full), f"{threads} threads"
    finally:
        torch.set_num_threads(before)
    for rows in ([0], [599], list(range(300, 337)), [5, 260, 599]):
        assert torch.equal(gate_up_silu(x[rows], pw), full[rows]), rows


@needs_amx
def test_python_threads_at_once():
    x, w = gate_up_data(300, 256, 160, seed=7)
    pw = PackedGateUpWeight(w)
    want = gate_up_silu(x, pw)
    errors = []

    def body(i):
        try:
            for _ in range(5):
                assert torch.equal(gate_up_silu(x, pw), want)
        except Exception as e:  # noqa: BLE001  (recorded, asserted below)
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=body, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# -- bad input, refusals, choice ---------------------------------------------------------------
@needs_amx
def test_bad_input_is_a_clear_error():
    x, w = gate_up_data(4, 64, 32)
    pw = PackedGateUpWeight(w)
    with pytest.raises(ValueError, match="last dim must be the weight's K = 64"):
        gate_up_silu(torch.zeros(4, 32, dtype=BF16), pw)
    with pytest.raises(TypeError, match="input dtype torch.float32 differs"):
        gate_up_silu(x.float(), pw)
    with pytest.raises(TypeError, match="input must be a tensor"):
        gate_up_silu([1.0], pw)
    with pytest.raises(ValueError, match="input is on meta"):
        gate_up_silu(x.to("meta"), pw)
    with pytest.raises(ValueError, match=r"\[2·I, K\]"):
        gate_up_silu(x, torch.zeros(63, 64, dtype=BF16))
    for bad, match in [(w.float(), "runs bfloat16 weights, not torch.float32"), (w.to("meta"), "needs CPU tensors"),
                       (torch.zeros(64, 48, dtype=BF16), "multiple of 32, got 48"),
                       (torch.zeros(40, 64, dtype=BF16), "40 output columns to be a positive multiple of 32")]:
        with pytest.raises(BackendError, match=match):
            PackedGateUpWeight(bad)
    kernel = torch.ops.acarerank.gate_up_amx
    with pytest.raises(RuntimeError, match="packed weight holds 4096 elements, want"):
        kernel(x, pw.packed, 48, True)
    with pytest.raises(RuntimeError, match="rows must be contiguous and not overlap"):
        kernel(x[:1].expand(4, 64), pw.packed, 32, True)
    with pytest.raises(RuntimeError, match="must be BFloat16"):
        kernel(x.float(), pw.packed, 32, True)


@needs_amx
def test_backward_is_refused_by_name():
    x, w = gate_up_data(4, 64, 32)
    y = gate_up_silu(x.requires_grad_(), PackedGateUpWeight(w))
    with pytest.raises(InferenceOnlyError, match="gate_up_silu_ref"):
        y.sum().backward()


@needs_native
@pytest.mark.skipif(AMX, reason="this process uses AMX tiles: the refusal needs a CPU without them")
def test_refused_without_amx():
    with pytest.raises(BackendError, match="AMX-BF16 tiles"):
        PackedGateUpWeight(gate_up_data(4, 64, 32)[1])
    assert resolve_gate_up_backend(None, "cpu", BF16, 64, 32) == "torch"


def test_choice():
    """Default: native where the kernel takes the weight; "torch" asked for, or a dtype/shape it
    cannot take: torch; "native" named for this op where it cannot: an error naming why; "native"
    named for every op (fp32 runs the element-wise kernels natively): torch for this one."""
    native = "native" if AMX else "torch"
    assert resolve_gate_up_backend(None, "cpu", BF16, 1024, 3072) == native
    assert resolve_gate_up_backend("torch", "cpu", BF16, 1024, 3072) == "torch"
    assert resolve_gate_up_backend({"gate_up_silu": "torch"}, "cpu", BF16, 1024, 3072) == "torch"
    assert resolve_gate_up_backend(None, "cpu", torch.float32, 1024, 3072) == "torch"
    assert resolve_gate_up_backend("native", "cpu", torch.float32, 1024, 3072) == "torch"
    assert resolve_gate_up_backend(None, "cpu", BF16, 1000, 3072) == "torch"
    assert why_not_native(BF16, 1000, 3072).endswith("got 1000")
    with pytest.raises(BackendLimitError, match="runs bfloat16 weights" if AMX else "gate_up_silu"):
        resolve_gate_up_backend({"gate_up_silu": "native"}, "cpu", torch.float32, 1024, 3072)
    assert "native" in OP.backends and "torch" in OP.backends


@needs_amx
def test_prepare_moves_between_forms_bitwise():
    _, w = gate_up_data(1, 64, 32)
    pw = prepare_gate_up_weight(w, "native")
    assert isinstance(pw, PackedGateUpWeight) and prepare_gate_up_weight(pw, "native") is pw
    assert torch.equal(prepare_gate_up_weight(pw, "torch"), w)
    assert torch.equal(prepare_linear_weight(pw, "torch"), w)
    onednn = prepare_linear_weight(pw, "onednn")
    assert torch.equal(onednn.unpack(), w)
    assert torch.equal(prepare_gate_up_weight(onednn, "native").unpack(), w)
    with pytest.raises(BackendError, match="no 'cuda' backend"):
        prepare_gate_up_weight(w, "cuda")


@needs_amx
def test_opcheck_gate_up_amx():
    x, w = gate_up_data(37, 64, 48)
    pw = PackedGateUpWeight(w)
    for silu in (True, False):
        torch.library.opcheck(torch.ops.acarerank.gate_up_amx.default, (x, pw.packed, 48, silu))
