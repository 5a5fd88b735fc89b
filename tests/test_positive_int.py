"""The one positive-int rule (``acarerank._validate.positive_int``) and the arguments built on it."""
import numpy as np
import pytest

from acarerank._validate import is_positive_int, positive_int


@pytest.mark.parametrize("value", [1, 7, 2 ** 40, np.int64(3), np.int32(1), np.uint8(5)])
def test_accepts_integers_numpy_included(value):
    got = positive_int("n", value)
    assert got == int(value) and type(got) is int, (value, got, type(got))
    assert is_positive_int(value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 0, -3, np.int64(0), 2.0, 1.5, "3", None, [1]])
def test_rejects_bools_non_integers_and_non_positive(value):
    assert not is_positive_int(value)
    with pytest.raises(ValueError, match=r"^batch_size must be a positive int, got "):
        positive_int("batch_size", value)


def test_none_only_when_allowed():
    assert positive_int("top_n", None, allow_none=True) is None
    with pytest.raises(ValueError, match=r"top_n must be a positive int or None, got True"):
        positive_int("top_n", True, allow_none=True)


def test_the_callers_agree_on_true():
    """One of the hand-written checks accepted True (WorkloadSpec) and one a float depth; now none does."""
    from acarerank.benchmark.harness import BenchConfig
    from acarerank.benchmark.workload import WorkloadSpec
    from acarerank.setwise.selection import parse_selection
    from acarerank.setwise.grammar import GrammarState

    with pytest.raises(ValueError, match="WorkloadSpec.num_docs must be a positive int, got True"):
        WorkloadSpec(num_docs=True)
    with pytest.raises(ValueError, match="depths must be positive ints"):
        BenchConfig(depths=(10, True)).validate()
    with pytest.raises(ValueError, match="n_candidates must be a positive int, got True"):
        parse_selection("[1]", True)
    with pytest.raises(ValueError, match="max_select must be a positive int, got 2.0"):
        GrammarState(None, 5, 2.0)
    assert WorkloadSpec(num_docs=np.int64(3)).num_docs == 3
