"""`acarerank bench --backends` entries: a name, op=name overrides, or both (harness.bench_preference)."""
import pytest
import torch

from acarerank.benchmark.harness import backend_runs, bench_preference
from acarerank.ops import BackendError, per_op_backends
from acarerank.ops.linear import onednn_why_unavailable, resolve_linear_backend


def test_a_name_is_a_name_and_overrides_make_a_mapping():
    assert bench_preference("torch") == "torch"
    assert bench_preference("linear=torch") == {"linear": "torch"}
    pref = bench_preference("native+gemm=torch")  # an alias names the op too
    assert pref["linear"] == "torch"
    assert {op: b for op, b in pref.items() if op != "linear"} == {
        op: b for op, b in per_op_backends("native").items() if b is not None and op != "linear"}
    assert resolve_linear_backend(pref, "cpu", torch.float32)[0] == "torch"


def test_bad_entries_are_errors_naming_them():
    with pytest.raises(ValueError, match="one backend name at most"):
        bench_preference("native+torch")
    with pytest.raises(BackendError, match="unknown op 'linearr'"):
        bench_preference("native+linearr=torch")
    with pytest.raises(BackendError, match="linear has no 'native' backend"):
        bench_preference("linear=native")


def test_backend_runs_checks_the_linear_layers_too():
    assert backend_runs("linear=torch", torch.device("cpu"), torch.float32) is None
    why = backend_runs("onednn", torch.device("cpu"), torch.bfloat16)
    assert (why is None) == (onednn_why_unavailable(torch.bfloat16) == ""), why
