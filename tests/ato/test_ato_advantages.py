"""grpo_advantage (Eq. 7) and ato_advantage (Eq. 10 + format mask) against plain formulas."""
import math
import statistics

import numpy as np
import pytest
import torch

from acarerank.ato import ato_advantage, grpo_advantage


def _plain_grpo(rewards, groups, eps, unbiased):
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        if len(members) == 1 or max(members) == min(members):
            out.append(0.0)
            continue
        sd = statistics.stdev(members) if unbiased else statistics.pstdev(members)
        out.append((r - statistics.fmean(members)) / (sd + eps))
    return torch.tensor(out)


def test_grpo_table5_group():
    """The three RAG rollouts of Table 5 as one group (9.25, 4.00, 3.67), verl's defaults."""
    r = [9.25, 4.00, 3.67]
    mean = (9.25 + 4.00 + 3.67) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in r) / 2)  # unbiased
    want = torch.tensor([(x - mean) / (sd + 1e-6) for x in r])
    got = grpo_advantage(r, [0, 0, 0])
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-6), (got, want)


# numpy's bools are flags too (np.True_ was refused under NumPy 2, whose bool type is named "bool")
@pytest.mark.parametrize("unbiased", [True, False, np.True_, np.False_], ids=["True", "False", "np.True_", "np.False_"])
def test_grpo_interleaved_groups_and_edge_cases(unbiased):
    rewards = [1.0, 8.5, -1.0, 3.0, 3.0, 7.25, 0.1, 9.0, 3.0, 0.1, 0.1]
    groups = [7, 3, 7, 5, 5, 3, 2, 7, 5, 2, 2]  # 5: zero variance, 2: 0.1 × 3 (mean would leave 1e-17)
    rewards.append(4.0)
    groups.append(11)  # a singleton group
    got = grpo_advantage(torch.tensor(rewards), torch.tensor(groups), eps=1e-6, unbiased=unbiased)
    want = _plain_grpo(rewards, groups, 1e-6, unbiased)
    err = (got - want).abs()
    assert err.max() < 1e-6, f"max err {err.max():.3e} at {err.argmax().item()}"
    assert torch.all(got[[3, 4, 8, 6, 9, 10, 11]] == 0), "zero-variance and singleton groups must give exactly 0"


def test_grpo_bad_input():
    with pytest.raises(ValueError, match="group_index must be"):
        grpo_advantage([1.0, 2.0], [0])
    with pytest.raises(ValueError, match="NaN"):
        grpo_advantage([1.0, float("nan")], [0, 0])
    with pytest.raises(TypeError, match="integer"):
        grpo_advantage([1.0, 2.0], torch.tensor([0.0, 0.0]))
    assert grpo_advantage([], []).shape == (0,)
    # a flag is a bool: "false" is truthy, and gave the unbiased std with no word
    for flag in ("false", 0, None):
        with pytest.raises(TypeError, match="grpo_advantage: unbiased must be a bool"):
            grpo_advantage([1.0, 2.0, 4.0], [0, 0, 0], unbiased=flag)


def test_ato_advantage_formula_and_format_mask():
    """A = λ·A_grpo + (1−λ)·m·A_atd; a malformed rollout (m=0, r=−1) gets the outcome part only,
    even when its ATD values are not finite (Algorithm 1 line 41, Appendix A)."""
    a_grpo = torch.tensor([1.2, -0.4, -1.1])
    a_atd = torch.tensor([[0.5, -2.0, 0.0], [1.0, 0.25, -0.75], [float("-inf"), float("nan"), 3.0]])
    m = torch.tensor([True, True, False])
    got = ato_advantage(a_grpo, a_atd, m, lam=0.7)
    want = torch.tensor([[0.7 * 1.2 + 0.3 * 0.5, 0.7 * 1.2 + 0.3 * -2.0, 0.7 * 1.2],
                         [0.7 * -0.4 + 0.3 * 1.0, 0.7 * -0.4 + 0.3 * 0.25, 0.7 * -0.4 + 0.3 * -0.75],
                         [0.7 * -1.1] * 3])
    assert torch.allclose(got, want, atol=1e-6), got
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    got_m = ato_advantage(a_grpo, a_atd, m, lam=0.7, response_mask=mask)
    assert torch.allclose(got_m, torch.where(mask, want, torch.zeros(())), atol=1e-6)
    assert torch.all(got_m[~mask] == 0)
    assert torch.equal(ato_advantage(a_grpo, a_atd, m, lam=0.7, response_mask=mask.tolist()), got_m)  # nested list
    # λ = 1: pure GRPO; λ = 0: pure distillation (m = 1 rows)
    assert torch.allclose(ato_advantage(a_grpo, a_atd, m, lam=1.0), a_grpo[:, None].expand(3, 3))
    assert torch.allclose(ato_advantage(a_grpo, a_atd, m, lam=0.0)[:2], a_atd[:2])


def test_ato_advantage_bad_input():
    with pytest.raises(ValueError, match="lam"):
        ato_advantage(torch.zeros(2), torch.zeros(2, 3), torch.ones(2, dtype=torch.bool), lam=1.5)
    with pytest.raises(ValueError, match="a_grpo must be"):
        ato_advantage(torch.zeros(3), torch.zeros(2, 3), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="format_ok must be"):
        ato_advantage(torch.zeros(2), torch.zeros(2, 3), torch.ones(3, dtype=torch.bool))
    # λ = True (a bool is a Real) mixed as λ = 1, a NaN λ passed; a soft format mask read 0.5 as 1
    for lam in (True, float("nan"), "0.7", None):
        with pytest.raises(ValueError, match="lam must be a number"):
            ato_advantage(torch.zeros(2), torch.zeros(2, 3), torch.ones(2, dtype=torch.bool), lam=lam)
    with pytest.raises(ValueError, match=r"format_ok must be bool or 0/1.*\(1, 0\.5\)"):
        ato_advantage(torch.zeros(2), torch.zeros(2, 3), torch.tensor([1.0, 0.5]))
    got = ato_advantage(torch.zeros(2), torch.ones(2, 3), torch.tensor([1, 0]), lam=0.5)   # 0/1 ints: as bool
    assert torch.equal(got, torch.tensor([[0.5] * 3, [0.0] * 3])), got


def test_grpo_groups_keyed_by_strings_as_verl_uids():
    """verl keys GRPO groups by a uid string per rollout (a numpy array of str): the same
    advantages as integer ids; strings were torch.as_tensor's 'too many dimensions 'str''."""
    np = pytest.importorskip("numpy")
    rewards, ints = [1.0, 0.0, 3.0, -1.0, 2.0], [7, 3, 7, 3, 7]
    want = _plain_grpo(rewards, ints, 1e-6, True)
    uids = ["q-7", "q-3", "q-7", "q-3", "q-7"]
    for groups in (uids, np.array(uids), np.array(uids, dtype=object), tuple(uids)):
        assert torch.allclose(grpo_advantage(rewards, groups), want.float(), atol=1e-6)
    with pytest.raises(TypeError, match="all integers or all strings"):
        grpo_advantage(rewards, ["q-7", 3, "q-7", 3, "q-7"])


def test_grpo_string_uids_of_an_empty_batch_or_the_wrong_shape():
    """An empty batch's verl uids (a numpy str / bytes array of shape (0,)) give no advantages, as
    an empty integer group_index does: it was torch.as_tensor's "can't convert np.ndarray of type
    numpy.str_". A 2-D uid array is the [N] shape error naming its shape."""
    np = pytest.importorskip("numpy")
    for empty in (np.array([], dtype=str), np.array([], dtype="S4")):
        got = grpo_advantage([], empty)
        assert got.shape == (0,) and got.dtype == torch.float32
    with pytest.raises(ValueError, match=r"group_index must be \[N=2\], got shape \(1, 2\)"):
        grpo_advantage([1.0, 0.0], np.array([["q-1", "q-2"]]))
    assert torch.allclose(grpo_advantage([1.0, 0.0, 3.0], np.array([b"a", b"b", b"a"])),
                          grpo_advantage([1.0, 0.0, 3.0], [0, 1, 0]))


def test_ato_advantage_refuses_a_soft_or_nan_response_mask():
    """response_mask takes bool or 0/1, as format_ok does and clipped_policy_loss's mask: 0.5 and
    NaN were read as True (the token kept its advantage) with no error."""
    a_grpo, a_atd, m = torch.tensor([1.0, -1.0]), torch.ones(2, 3), [1, 1]
    for bad, where in ((0.5, r"\(0, 2\), 0\.5"), (float("nan"), r"\(0, 2\), nan")):
        mask = torch.tensor([[1.0, 1.0, bad], [1.0, 0.0, 0.0]])
        with pytest.raises(ValueError, match=rf"response_mask must be bool or 0/1 per token.*{where}"):
            ato_advantage(a_grpo, a_atd, m, lam=0.5, response_mask=mask)
    got = ato_advantage(a_grpo, a_atd, m, lam=0.5, response_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert torch.equal(got, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))


def test_grpo_refuses_one_string_group_index_and_reads_a_generator_once():
    """One str / bytes is not one id per rollout: "q7" was read per character (groups 'q' and '7',
    advantages [0, 0] where the one group gives ±0.707). A generator of ids was read twice (list(),
    then torch.as_tensor of the spent generator: "Could not infer dtype of generator")."""
    for one in ("q7", b"q7", bytearray(b"q7")):
        with pytest.raises(TypeError, match="group_index must be one id per rollout"):
            grpo_advantage([2.0, 8.0], one)
    with pytest.raises(TypeError, match="group_index must be one id per rollout"):
        grpo_advantage([1.0, 2.0, 3.0, 4.0], "aabb")
    want = _plain_grpo([1.0, 2.0, 3.0, 4.0], [0, 0, 1, 1], 1e-6, True).float()
    for groups in ((g for g in [0, 0, 1, 1]), (u for u in ["a", "a", "b", "b"])):
        got = grpo_advantage([1.0, 2.0, 3.0, 4.0], groups)
        assert torch.allclose(got, want, atol=1e-6), (got, want)
