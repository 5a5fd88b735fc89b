"""An ATO training step as a training loop writes it (examples/ato_train_step.py) against the
paper's formulas in plain PyTorch (AdaTutoRank (2026), Eq. 7, 9–12, Algorithm 1 lines 39–43).

The reference holds [T, V] logits of transformers' forward: the policy and the snapshot under the
full-vocabulary softmax (Eq. 12's π_θ and π_old), the teacher truncated to its top-128 logits
(Appendix C.4) with an outside target at the floor of −20 (``topk_logprobs``' "floor"). The
package's side is ``rescore`` + ``grpo_advantage`` + ``ato_advantage`` + ``linear_logprob`` +
``clipped_policy_loss``, none of which holds [T, V].
"""
import copy
import importlib.util
import time

import pytest
import torch

from acarerank.ato import (RescoreQuery, ato_advantage, clipped_policy_loss, grpo_advantage, rescore,
                           split_student_prompt)
from acarerank.model import Qwen3Runner, SourceModelChangedError
from acarerank.setwise.prompts import build_prompt
from acarerank.tokenizer import TOKEN_IM_END
from tests._repo import ROOT
from tests._tiny import random_qwen3

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16)
LAM, EPS, K, FLOOR = 0.7, 0.2, 128, -20.0


def _example():
    spec = importlib.util.spec_from_file_location("ato_train_step", ROOT / "examples" / "ato_train_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def example():
    return _example()


@pytest.fixture(scope="module")
def setup(qwen3_tokenizer):
    tok = qwen3_tokenizer
    prompt = build_prompt(tok, "How tall is the Eiffel Tower?", ["330 metres.", "Paris.", "Built in 1889."],
                          max_select=3).input_ids
    head, tail = split_student_prompt(prompt)
    return prompt, head, tail


def _models(seed=1):
    """(student θ, snapshot θ_old, teacher θ_sft): the student moved off the snapshot, so ratios
    differ from 1 and some are clipped (Eq. 11's both branches)."""
    snap = random_qwen3(seed=seed, **SHAPE)
    teacher = random_qwen3(seed=seed + 1, **SHAPE)
    student = copy.deepcopy(snap)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 2)
        with torch.no_grad():
            for p in student.parameters():
                p.add_(torch.randn_like(p) * p.std().clamp(min=1e-3))
    return student.train(), snap, teacher


def _ref_rows(model, prompt, y):
    """fp32 logit rows of transformers' forward that predict y's tokens ([len(y), V])."""
    logits = model(input_ids=torch.tensor([prompt + y])).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) - 1 + len(y)]


def _reference_loss(student, snap, teacher, head, tail, rollouts, hints, rewards, format_ok):
    """The paper's loss, token-mean over every valid token of the batch (Eq. 11's 𝔼_i,l)."""
    prompt = head + tail
    r = torch.tensor(rewards, dtype=torch.float64)
    std = r.std() if len(rewards) > 1 else torch.tensor(0.0, dtype=torch.float64)
    a_grpo = (r - r.mean()) / (std + 1e-6) if len(rewards) > 1 and std > 0 else torch.zeros_like(r)  # Eq. 7
    terms = []
    for i, (y, h) in enumerate(zip(rollouts, hints)):
        if not y:
            continue
        tg = torch.tensor(y)
        logp = _ref_rows(student, prompt, y).log_softmax(-1).gather(1, tg[:, None])[:, 0]               # π_θ
        with torch.no_grad():
            logp_old = _ref_rows(snap, prompt, y).log_softmax(-1).gather(1, tg[:, None])[:, 0]          # π_old
            z = _ref_rows(teacher, head + list(h) + tail, y)                                          # π_φ(·|h)
            top = torch.sort(z, dim=1, descending=True, stable=True)
            inside = (top.indices[:, :K] == tg[:, None]).any(1)
            lp_t = z.gather(1, tg[:, None])[:, 0] - torch.logsumexp(top.values[:, :K], 1)                # top-128
            lp_t = torch.where(inside, lp_t, torch.full_like(lp_t, FLOOR))
            a_atd = lp_t - logp_old                                                                    # Eq. 9
            adv = LAM * a_grpo[i].float() + (1 - LAM) * (a_atd if format_ok[i] else 0.0)                # Eq. 10
        ratio = torch.exp(logp - logp_old)                                                             # Eq. 12
        terms.append(-torch.minimum(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv))                 # Eq. 11
    if not terms:
        return None
    return torch.cat(terms).mean()


def _package_loss(example, student, snap, teacher, head, tail, rollouts, hints, rewards, format_ok):
    res = rescore(Qwen3Runner.from_hf(snap), Qwen3Runner.from_hf(teacher), [RescoreQuery(head, tail, rollouts, hints)],
                  k=K)
    a_grpo = grpo_advantage(torch.tensor(rewards), torch.zeros(len(rewards), dtype=torch.long))
    adv = ato_advantage(a_grpo, res.atd, torch.tensor(format_ok), lam=LAM, response_mask=res.response_mask)
    logp = example.policy_logprobs(student, head + tail, rollouts, res.logp_old.shape[1])
    return clipped_policy_loss(logp, res.logp_old, adv, res.response_mask, eps_clip=EPS), res


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(got, want, atol, rtol, what):
    err = (got.double() - want.double()).abs()
    bad = err > atol + rtol * want.double().abs()
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} differ, max err {err.max().item():.3e}"


CASES = {
    # rollouts of 4, 2 (shorter than the longest: padding) and 0 tokens; one malformed (m = 0)
    "padded": ([[58, 17, 60, TOKEN_IM_END], [58, 16], [], [1, 2, 3]], [[], [1234, 99], [], [5000]],
               [7.5, 3.0, -1.0, 5.0], [True, True, False, True]),
    "one rollout": ([[58, 17, 60, TOKEN_IM_END]], [[1234, 99]], [6.0], [True]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_loss_and_its_gradient_are_the_papers_formula_fp32(example, setup, case):
    _, head, tail = setup
    rollouts, hints, rewards, ok = CASES[case]
    student, snap, teacher = _models()
    got, res = _package_loss(example, student, snap, teacher, head, tail, rollouts, hints, rewards, ok)
    g_got = _grads(student, got)
    want = _reference_loss(student, snap, teacher, head, tail, rollouts, hints, rewards, ok)
    g_want = _grads(student, want)
    _close(got.detach(), want.detach(), 1e-6, 1e-5, f"{case}: loss")
    assert g_got.keys() == g_want.keys()
    for n in g_want:
        # fp32: 1e-5 of the tensor's largest entry (a row of a weight gradient sums ~V terms)
        _close(g_got[n], g_want[n], 1e-5 * g_want[n].abs().max().item(), 1e-5, f"{case}: grad {n}")
    if case == "padded":  # both branches of the clip are taken, and the malformed rollout has no ATD
        ratio = (example.policy_logprobs(student, head + tail, rollouts, res.logp_old.shape[1]).detach()
                 - res.logp_old)[res.response_mask].exp()
        assert ((ratio < 1 - EPS) | (ratio > 1 + EPS)).any() and ((ratio > 1 - EPS) & (ratio < 1 + EPS)).any()


def test_the_loss_and_its_gradient_under_bf16_autocast(setup):
    """Under ``torch.autocast(bf16)`` the student's layers run in bf16 and ``linear_logprob`` keeps
    its head in fp32: against the same autocast forward with materialised fp32 logits and
    log_softmax over the whole vocabulary, to the package's bf16 rule (2⁻⁸ relative on gradients,
    tests/ops/test_op_linear_logprob.py)."""
    from acarerank.ato import linear_logprob

    _, head, tail = setup
    rollouts, hints, rewards, ok = CASES["padded"]
    student, snap, teacher = _models()
    res = rescore(Qwen3Runner.from_hf(snap), Qwen3Runner.from_hf(teacher), [RescoreQuery(head, tail, rollouts, hints)])
    a_grpo = grpo_advantage(torch.tensor(rewards), torch.zeros(len(rewards), dtype=torch.long))
    adv = ato_advantage(a_grpo, res.atd, torch.tensor(ok), lam=LAM, response_mask=res.response_mask)
    prompt, L = head + tail, res.logp_old.shape[1]
    ids = torch.tensor([prompt + y + [0] * (L - len(y)) for y in rollouts])
    attn = torch.tensor([[1] * (len(prompt) + len(y)) + [0] * (L - len(y)) for y in rollouts])
    rows, cols = res.response_mask.nonzero(as_tuple=True)
    targets = ids[rows, len(prompt) + cols]

    def loss(head_logprob):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = student.model(input_ids=ids, attention_mask=attn).last_hidden_state[rows, len(prompt) - 1 + cols]
            lp = head_logprob(hidden, student.lm_head.weight)
            logp = torch.zeros(res.logp_old.shape, dtype=lp.dtype).index_put((rows, cols), lp)
            return clipped_policy_loss(logp, res.logp_old, adv, res.response_mask, eps_clip=EPS)

    got = loss(lambda h, w: linear_logprob(h, w, targets))
    g_got = _grads(student, got)

    def materialised(h, w):
        with torch.autocast("cpu", enabled=False):
            return (h.float() @ w.float().T).log_softmax(-1).gather(1, targets[:, None])[:, 0]

    want = loss(materialised)
    g_want = _grads(student, want)
    _close(got.detach(), want.detach(), 1e-5, 1e-5, "bf16 autocast: loss")
    # the op's own gradient elementwise; the layers' behind it, which the bf16 backward GEMMs round
    # (a last-bit difference in ∂hidden can flip a bf16 rounding there), in norm
    w = "lm_head.weight"
    _close(g_got[w], g_want[w], 1e-5 * g_want[w].abs().max().item(), 2.0 ** -8, f"bf16 autocast: grad {w}")
    for n in g_want:
        rel = ((g_got[n] - g_want[n]).norm() / g_want[n].norm()).item()
        assert rel <= 2.0 ** -8, f"bf16 autocast: grad {n} differs by {rel:.2e} of its norm"


def test_an_all_masked_batch_gives_a_zero_loss_and_zero_gradients(example, setup):
    """Every rollout empty: no token to train on; the loss is 0 and the step a no-op, never NaN."""
    _, head, tail = setup
    student, snap, teacher = _models()
    got, res = _package_loss(example, student, snap, teacher, head, tail, [[], []], [[], []], [1.0, 2.0], [True, True])
    assert res.logp_old.shape == (2, 0)
    g = _grads(student, got)
    assert got.item() == 0.0 and all(torch.count_nonzero(v) == 0 for v in g.values())


def test_gradient_accumulation_over_micro_batches_equals_the_full_batch(example, setup):
    """docs/api.md, "Gradient accumulation": token-mean micro-batch losses, each weighted by its
    share of the batch's valid tokens, sum to the full batch's gradient (padded to its own L)."""
    _, head, tail = setup
    rollouts, hints, rewards, ok = CASES["padded"]
    student, snap, teacher = _models()
    full, res = _package_loss(example, student, snap, teacher, head, tail, rollouts, hints, rewards, ok)
    g_full = _grads(student, full)
    a_grpo = grpo_advantage(torch.tensor(rewards), torch.zeros(len(rewards), dtype=torch.long))  # the whole group
    adv = ato_advantage(a_grpo, res.atd, torch.tensor(ok), lam=LAM, response_mask=res.response_mask)
    total = res.response_mask.sum()
    student.zero_grad(set_to_none=True)
    for rows in ([0, 2], [1, 3]):
        L = max(res.lengths[i] for i in rows)  # each micro-batch padded to its own longest rollout
        logp = example.policy_logprobs(student, head + tail, [rollouts[i] for i in rows], L)
        m = res.response_mask[rows, :L]
        micro = clipped_policy_loss(logp, res.logp_old[rows, :L], adv[rows, :L], m, eps_clip=EPS)
        (micro * (m.sum() / total)).backward()
    for n, p in student.named_parameters():
        _close(p.grad, g_full[n], 1e-5 * g_full[n].abs().max().item(), 1e-5, f"accumulated grad {n}")


def test_a_runner_refuses_a_pass_after_its_source_model_changed_in_place(setup):
    """A snapshot built with ``from_hf`` from the live policy, then an optimizer step: the runner
    shares some tensors with the model and holds its own packed copy of others, so its passes
    mixed old and new weights (log-probs neither θ_old's nor θ's, no error). Now a
    SourceModelChangedError; a runner built after the step, or from a copy, is unaffected."""
    prompt, head, tail = setup
    student, _, teacher = _models()
    snapshot, kept = Qwen3Runner.from_hf(student), Qwen3Runner.from_hf(copy.deepcopy(student))
    q = [RescoreQuery(head, tail, [[58, 17, 60]], [[]])]
    before = rescore(kept, Qwen3Runner.from_hf(teacher), q).logp_old
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    for p in student.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    with pytest.raises(SourceModelChangedError, match="changed in place after Qwen3Runner.from_hf"):
        rescore(snapshot, Qwen3Runner.from_hf(teacher), q)
    assert torch.equal(rescore(kept, Qwen3Runner.from_hf(teacher), q).logp_old, before)
    fresh = rescore(Qwen3Runner.from_hf(student), Qwen3Runner.from_hf(teacher), q).logp_old
    with torch.no_grad():
        rows = _ref_rows(student, prompt, [58, 17, 60]).log_softmax(-1)
        want = rows.gather(1, torch.tensor([[58], [17], [60]]))[:, 0]
    _close(fresh[0], want, 1e-5, 1e-5, "a runner built after the step")


def test_the_example_runs(example):
    t0 = time.perf_counter()
    losses = example.main(["--steps", "2", "--inner", "2", "--group", "3", "--layers", "1", "--hidden", "32"])
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert time.perf_counter() - t0 < 15


def test_the_step_from_the_hidden_rows_on_compiles(example):
    """docs/api.md: linear_logprob, the scatter and clipped_policy_loss under torch.compile
    (fullgraph, dynamic shapes) give eager's loss and gradients, at ten padded lengths, and compile
    once: the loss's shape check hashed the symbolic sizes into a set, specialising N and L, so each
    new length recompiled and the 9th failed (fullgraph=True's recompile limit)."""
    from torch._dynamo.utils import counters

    from acarerank.ato import linear_logprob

    def step(h, w, tg, rows, cols, logp_old, adv, mask):
        lp = linear_logprob(h, w, tg)
        logp = torch.zeros(logp_old.shape, dtype=lp.dtype).index_put((rows, cols), lp)
        return clipped_policy_loss(logp, logp_old, adv, mask)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(0)
    for L in range(5, 15):
        mask = torch.ones(3, L, dtype=torch.bool)
        mask[1, 3:] = False
        mask[2] = False
        rows, cols = mask.nonzero(as_tuple=True)
        h = torch.randn(rows.numel(), 32, generator=g).requires_grad_()
        w = torch.randn(4099, 32, generator=g).requires_grad_()
        args = (h, w, torch.randint(0, 4099, (rows.numel(),), generator=g), rows, cols,
                torch.randn(3, L, generator=g) - 8, torch.randn(3, L, generator=g), mask)
        got, want = compiled(*args), step(*args)
        for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w))):
            _close(a, b, 1e-6, 1e-6, f"compiled gradient, L={L}")
        _close(got.detach(), want.detach(), 1e-6, 1e-6, f"compiled loss, L={L}")
    # graphs, not backend calls: the first compile calls the backend twice (dynamo restarts its analysis once)
    assert counters["stats"]["unique_graphs"] == 1, f"{counters['stats']['unique_graphs']} graphs for 10 lengths, want 1"


_PEAK = """
import sys, torch
from acarerank.ato import linear_logprob, topk_logprobs
def hwm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
T, V, H = 2048, 151669, 64
g = torch.Generator().manual_seed(0)
h = torch.randn(T, H, generator=g).requires_grad_()
w = (torch.randn(V, H, generator=g) * 0.1).requires_grad_()
tg = torch.randint(0, V, (T,), generator=g)
w.grad = torch.zeros_like(w); h.grad = torch.zeros_like(h)  # the gradients' own memory, before the baseline
base = hwm()
linear_logprob(h, w, tg).sum().backward()
with torch.no_grad():
    topk_logprobs(h.detach(), w.detach(), tg, k=128)
print(hwm() - base, T * V * 4)
"""


def test_neither_op_holds_tokens_times_vocabulary_in_forward_or_backward():
    """T = 2,048, V = 151,669: the policy's forward + backward and the teacher's top-128 raise the
    process's peak (VmHWM, a fresh process) by far less than one fp32 [T, V] (1.2 GiB)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rise, tv = map(int, out.stdout.split())
    assert rise < tv / 8, f"peak rose by {rise / 2**20:.0f} MiB; one [T, V] fp32 is {tv / 2**20:.0f} MiB"
