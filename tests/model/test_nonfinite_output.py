"""Non-finite weights and outputs: refused at load, and never returned as a score, a token or a log-prob.

A finite hidden state (tests/model/test_nonfinite_hidden.py) still gives a NaN/inf score when the
output layer or the final norm weight is NaN/inf, or overflows: a NaN in lm_head's "yes" row once
scored every document NaN, an inf in the final norm weight scored every one exactly 1.0, and NaN
grammar rows made setwise selection emit "[1] [2]" (the first allowed tokens) — all with no error.

* Loading (``from_pretrained`` and an in-memory model alike) refuses a NaN/inf in any weight with a
  ``CheckpointError`` naming the file and the tensor.
* Weights changed after loading (an in-memory model's tensors are the runner's), or finite weights
  whose product overflows fp32: ``NonFiniteOutputError`` naming the request and document / query /
  rollout token, from the pointwise scores, each greedy step and ``ato.rescore``'s log-probs.
* Clean models score as transformers does (the reference below), so the checks change no value.
"""
import copy

import pytest
import torch
from _tiny import random_qwen3, tiny_seq_cls

from acarerank import PointwiseReranker, ScoreRequest, SetwiseReranker
from acarerank.ato import RescoreQuery, ato_advantage, rescore, split_student_prompt
from acarerank.model import CheckpointError, Qwen3Runner
from acarerank.model.numerics import NonFiniteError, NonFiniteHiddenError, NonFiniteOutputError
from acarerank.tokenizer import TOKEN_NO, TOKEN_YES

QUERY = "which passage explains tutoring optimization"
DOCS = ["tutor hints help the reranker", "zebras graze on the savanna", "a search agent's trace"]
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def model():
    # untied (lm_head its own tensor), norms off 1, yes/no rows spread: scores over (0, 1)
    return random_qwen3(seed=3, spread_yes_no=30, perturb_norms=True, hidden=64, intermediate=96, layers=2,
                        heads=4, kv_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def clean(model):
    return PointwiseReranker(model=model)


def _reference_scores(model, rr, query, docs):
    """transformers: softmax([logit_no, logit_yes]) at each full prompt's last token, fp32."""
    enc = rr.encode(ScoreRequest(query, docs))
    out = []
    with torch.no_grad():
        for seg in enc.segment_ids:
            logits = model(torch.tensor([list(enc.shared_ids) + list(seg)]), logits_to_keep=1).logits[0, -1].float()
            out.append(logits[[TOKEN_NO, TOKEN_YES]].softmax(-1)[1].item())
    return out


def _assert_close(got, want, what, tol=1e-5):
    diff = [abs(a - b) for a, b in zip(got, want)]
    assert len(got) == len(want) and max(diff) <= tol, f"{what}: |got - transformers| = {diff}"


def _poisoned(model, name, index, value=NAN):
    m = copy.deepcopy(model)
    with torch.no_grad():
        dict(m.named_parameters())[name][index] = value
    return m


# -- loading -------------------------------------------------------------------------------------
PLACES = [  # (parameter, index): the few rows a score reads, and any other weight
    ("lm_head.weight", (TOKEN_YES, 5)),
    ("lm_head.weight", (TOKEN_NO, 0)),
    ("model.norm.weight", (7,)),
    ("model.layers.1.mlp.down_proj.weight", (3, 4)),
    ("model.embed_tokens.weight", (1000, 2)),
]


@pytest.mark.parametrize("name, index", PLACES)
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_load_refuses_a_nonfinite_weight_in_memory(model, clean, name, index, value):
    m = _poisoned(model, name, index, value)
    kind = "NaN" if value != value else "inf"
    for make in (lambda: PointwiseReranker(model=m), lambda: SetwiseReranker(model=m)):
        with pytest.raises(CheckpointError) as e:
            make()
        msg = str(e.value)
        assert f"'{name}'" in msg and kind in msg and f"first at index {list(index)}" in msg, msg
    # the clean model (built before) still scores as transformers does
    _assert_close(clean.score(QUERY, DOCS), _reference_scores(model, clean, QUERY, DOCS), "clean model")


@pytest.mark.parametrize("name, index", PLACES[:3])
def test_load_refuses_a_nonfinite_weight_from_disk(model, name, index, tmp_path):
    _poisoned(model, name, index).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError) as e:
        PointwiseReranker.from_pretrained(tmp_path, dtype=torch.float32)
    assert "model.safetensors" in str(e.value) and f"'{name}'" in str(e.value), str(e.value)


@pytest.mark.parametrize("rows", [1, 2])
def test_load_refuses_a_nonfinite_score_head(model, clean, rows, tmp_path):
    seq = tiny_seq_cls(random_qwen3(seed=3, spread_yes_no=30), rows)
    good = PointwiseReranker(model=seq)  # the conversion scores like its causal LM (tests/test_input_validation.py)
    assert all(0.0 < s < 1.0 for s in good.score(QUERY, DOCS))
    with torch.no_grad():
        seq.score.weight[rows - 1, 9] = NAN
    with pytest.raises(CheckpointError, match=r"'score\.weight' holds NaN"):
        PointwiseReranker(model=seq)
    seq.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'score\.weight' holds NaN"):
        PointwiseReranker.from_pretrained(tmp_path, dtype=torch.float32)


def test_load_names_a_float16_cast_that_overflows(model, tmp_path):
    m = copy.deepcopy(model)
    with torch.no_grad():
        m.model.norm.weight[2] = 1e5  # finite in fp32, past float16's 65,504
    m.save_pretrained(tmp_path)
    PointwiseReranker.from_pretrained(tmp_path, dtype=torch.float32)  # fine where it fits
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' holds inf .* after the cast from float32 to "
                                              r"float16"):
        PointwiseReranker.from_pretrained(tmp_path, dtype=torch.float16)


# -- pointwise scores ----------------------------------------------------------------------------
def _runner(model):
    return Qwen3Runner.from_hf(copy.deepcopy(model))


@pytest.mark.parametrize("where, value, needle", [
    ("yes", NAN, "lm_head row 9693 ('yes') holds NaN/inf"),   # every score NaN, once
    ("no", -INF, "lm_head row 2152 ('no') holds NaN/inf"),
    ("norm", INF, "the final norm weight holds NaN/inf"),     # every score exactly 1.0, once
])
def test_pointwise_refuses_a_nonfinite_score_naming_request_and_document(model, where, value, needle):
    r = _runner(model)
    rr = PointwiseReranker(runner=r)
    if where == "norm":
        r.weights.final_norm[4] = value
    else:
        r.weights.lm_head[TOKEN_YES if where == "yes" else TOKEN_NO, 4] = value
    reqs = [ScoreRequest(QUERY, DOCS[:1]), ScoreRequest("another query", DOCS)]
    for call in (lambda: rr.score_batch(reqs), lambda: rr.score(QUERY, DOCS), lambda: rr.rerank(QUERY, DOCS)):
        with pytest.raises(NonFiniteOutputError) as e:
            call()
        assert needle in str(e.value) and isinstance(e.value, NonFiniteError), str(e.value)
    with pytest.raises(NonFiniteOutputError) as e:
        rr.score_batch(reqs)
    assert e.value.rows == [(0, 0), (1, 0), (1, 1), (1, 2)], e.value.rows
    assert str(e.value).startswith("no score for request 0 document 0"), str(e.value)


def test_pointwise_refuses_a_score_whose_head_product_overflows(model, clean):
    m = copy.deepcopy(model)
    with torch.no_grad():  # finite weights (loading takes them) whose product is past fp32: diff = ±inf
        m.model.norm.weight.mul_(1e20)
        m.lm_head.weight[TOKEN_YES].mul_(1e20)
    rr = PointwiseReranker(model=m)
    with torch.no_grad():  # what transformers makes of it: logit_yes = ±inf, a score of exactly 0 or 1
        enc = rr.encode(ScoreRequest(QUERY, DOCS[:1]))
        logits = m(torch.tensor([list(enc.shared_ids) + list(enc.segment_ids[0])])).logits[0, -1]
    assert torch.isinf(logits[TOKEN_YES]), "not the overflow this test is about"
    with pytest.raises(NonFiniteOutputError, match="finite: their product overflows fp32") as e:
        rr.score(QUERY, DOCS)
    assert e.value.rows == [(0, 0), (0, 1), (0, 2)], e.value.rows


def test_pointwise_scores_a_head_whose_fold_overflows_but_no_logit_does(model):
    """The head folds norm_weight ⊙ (w_yes − w_no): yes/no entries of +2e38 / −2e38 make 4e38, inf in
    fp32, where each logit transformers computes is finite; this was refused as a product overflow.
    The rows whose fold fails are scored from the two logits, as transformers scores them."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        m.lm_head.weight[TOKEN_YES, 0], m.lm_head.weight[TOKEN_NO, 0] = 2e38, -2e38
    rr = PointwiseReranker(model=m)
    enc = rr.encode(ScoreRequest(QUERY, DOCS))
    with torch.no_grad():
        logits = torch.stack([m(torch.tensor([list(enc.shared_ids) + list(seg)])).logits[0, -1, [TOKEN_NO, TOKEN_YES]]
                              for seg in enc.segment_ids])
    assert torch.isfinite(logits).all() and logits.abs().min() > 1e36, f"not the case this test is about: {logits}"
    want = _reference_scores(m, rr, QUERY, DOCS)
    _assert_close(rr.score(QUERY, DOCS), want, "a head whose fold overflows fp32")
    # beside clean documents of another request, in one pass: each row as transformers scores it
    got = rr.score_batch([ScoreRequest(QUERY, DOCS), ScoreRequest("another query", DOCS[:1])])
    _assert_close(got[0] + got[1], want + _reference_scores(m, rr, "another query", DOCS[:1]), "score_batch")


def test_score_segments_names_items_and_only_the_bad_ones(model, clean):
    """score_segments (the server's step API) names its items; the 1-row score head's row too."""
    r = Qwen3Runner.from_hf(tiny_seq_cls(random_qwen3(seed=3, spread_yes_no=30), 1))
    rr = PointwiseReranker(runner=r)
    enc = rr.encode(ScoreRequest(QUERY, DOCS))
    h = rr.acquire_prefix(enc)
    try:
        items = [(h, ids) for ids in enc.segment_ids]
        before = rr.score_segments(items)
        r.weights.score_head[0, 3] = NAN
        with pytest.raises(NonFiniteOutputError, match=r"score_segments: no score for item\(s\) \[0, 1, 2\]: .*"
                                                       r"score\.weight \(its yes row\) holds NaN") as e:
            rr.score_segments(items)
        assert e.value.rows == [0, 1, 2]
    finally:
        rr.release_prefix(h)
    assert all(0.0 < s < 1.0 for s in before)


# -- setwise -------------------------------------------------------------------------------------
def test_setwise_refuses_nan_allowed_logits_naming_the_query(model):
    r = _runner(model)
    sr = SetwiseReranker(runner=r)
    queries = ["first query", "second query"]
    docs = [DOCS[:2], DOCS + ["d4", "d5"]]
    clean = sr.select_batch(queries, docs, max_select=2, batch_size=1)
    # digit "5" (token 20) is allowed only in query 1's pool of 5: query 0 never reads its row
    five = int(sr.grammar.vocab[5])
    assert sr.tokenizer.decode([five]) == "5"
    r.weights.lm_head[five, 1] = NAN
    assert sr.select(queries[0], docs[0], max_select=2) == clean[0]  # a masked NaN refuses nothing
    with pytest.raises(NonFiniteOutputError) as e:
        sr.select_batch(queries, docs, max_select=2, batch_size=1)
    assert e.value.rows == [1] and "select_batch: no selection for query(ies) [1]" in str(e.value), str(e.value)
    assert "allowed by the grammar is nan" in str(e.value), str(e.value)
    with pytest.raises(NonFiniteOutputError, match=r"greedy decoding of prompt\(s\) \[0\]"):
        sr.select(queries[1], docs[1], max_select=2)


@pytest.mark.parametrize("constrained", [True, False])
def test_setwise_refuses_a_nonfinite_final_norm(model, constrained):
    r = _runner(model)
    sr = SetwiseReranker(runner=r, max_new_tokens=8)
    r.weights.final_norm[0] = NAN  # once: "[1] [2]", the grammar's first allowed tokens, with no error
    # constrained, "[" is forced (no step of its own): the first step chooses output token 1
    with pytest.raises(NonFiniteOutputError, match=f"at output token {int(constrained)} "):
        sr.select(QUERY, DOCS, max_select=2, constrained=constrained)


# -- ATO re-scoring ------------------------------------------------------------------------------
def _rescore_inputs(tok):
    from acarerank.setwise.prompts import chat_ids, system_prompt, user_prompt

    prompt = chat_ids(tok, system_prompt(None), user_prompt(QUERY, DOCS, None))
    head, tail = split_student_prompt(prompt)
    rolls = [tok.encode("[2] [1]", add_special_tokens=False), tok.encode("[3]", add_special_tokens=False)]
    return [RescoreQuery(head, tail, rolls, ["", "a hint"])], rolls


def test_rescore_refuses_a_teacher_state_past_fp32_rmsnorm(model, clean):
    snap = _runner(model)
    m = copy.deepcopy(model)
    with torch.no_grad():
        m.model.layers[-1].mlp.down_proj.weight.mul_(1e30)  # finite rows whose squares overflow fp32
    teacher = Qwen3Runner.from_hf(m)
    queries, rolls = _rescore_inputs(clean.tokenizer)
    # once: logits all 0 after the final norm, log-probs of exactly −log V and no error
    with pytest.raises(NonFiniteHiddenError, match=r"rescore: the teacher's final hidden state predicting token 0 of "
                                                   r"rollout 0 \(query 0\)") as e:
        rescore(snap, teacher, queries)
    assert e.value.rows == [(n, pos) for n, y in enumerate(rolls) for pos in range(len(y))], e.value.rows


def test_rescore_refuses_a_minus_inf_teacher_logprob(model, clean):
    """Finite weights (loading takes them) whose product overflows to −inf for the sampled token
    alone: the ops' log-sum-exp stays finite, so "full" gave that token −inf and atd −inf."""
    queries, _ = _rescore_inputs(clean.tokenizer)
    q = queries[0]
    y = clean.tokenizer.encode("[", add_special_tokens=False)[0]
    queries = [RescoreQuery(q.prompt_head, q.prompt_tail, [[y]], [""])]  # one predicting row
    snap, teacher = _runner(model), _runner(model)
    good = rescore(snap, teacher, queries, outside="full")
    assert torch.isfinite(good.atd).all() and torch.isfinite(good.logp_teacher).all()
    with torch.no_grad():  # the final-normed state that predicts y (transformers' Qwen3Model ends with the norm)
        h = model.model(torch.tensor([list(q.prompt_head) + list(q.prompt_tail)])).last_hidden_state[0, -1]
    teacher.weights.lm_head[y] = -3e38 * torch.sign(h)  # every term of h · w negative: the sum is −inf
    with pytest.raises(NonFiniteOutputError, match=r"rescore: the teacher's log-prob of token 0 of rollout 0 "
                                                   r"\(query 0\) is -inf") as e:
        rescore(snap, teacher, queries, outside="full")
    assert e.value.rows == [(0, 0)], e.value.rows
    # the default "floor" gives that out-of-top-k token its floor, as for any other: no error
    assert rescore(snap, teacher, queries).logp_teacher[0, 0] == -20.0


def test_ato_advantage_refuses_a_nonfinite_input_where_used():
    a_grpo = torch.tensor([0.5, -0.5])
    a_atd = torch.tensor([[0.1, NAN], [0.2, 0.3]])
    with pytest.raises(ValueError, match=r"token 1 of rollout 0 .*a_atd nan"):
        ato_advantage(a_grpo, a_atd, torch.tensor([True, True]))
    # not used: a malformed rollout's ATD, or a position outside the response mask
    ok = ato_advantage(a_grpo, a_atd, torch.tensor([False, True]))
    lam = 0.7  # Eq. 10: λ·A^GRPO + (1 − λ)·m·A^ATD; rollout 0 (m = 0) is the outcome term alone, NaN unused
    want = torch.stack([lam * a_grpo[0].expand(2), lam * a_grpo[1] + (1 - lam) * a_atd[1]])
    assert torch.allclose(ok, want, atol=1e-6), (ok, want)
    masked = ato_advantage(a_grpo, a_atd, torch.tensor([True, True]), response_mask=torch.tensor([[1, 0], [1, 1]]).bool())
    assert masked[0, 1] == 0 and torch.isfinite(masked).all()
    with pytest.raises(ValueError, match=r"a_grpo there is inf"):
        ato_advantage(torch.tensor([INF, 0.0]), torch.zeros(2, 2), torch.tensor([False, False]))
