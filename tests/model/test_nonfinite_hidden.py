"""A final hidden state the model cannot score is an error, never a score (acarerank/model/numerics.py).

With a NaN in a document's own tokens (a NaN embedding row stands for broken weights), or with
activations past fp32's RMSNorm range, transformers' forward and the ops give a score of NaN or
exactly 0.5: a wrong answer with no error. The runner refuses such rows instead
(``NonFiniteHiddenError`` naming them): the pointwise reranker, setwise selection and the
server's engine, where the one request whose document holds the NaN fails alone (a 500 with its
cause) and the others of its packed pass keep their scores.
"""
import copy

import pytest
import torch
from _optional import require

from acarerank import PointwiseReranker, ScoreRequest, SetwiseReranker
from acarerank.model import Qwen3Runner
from acarerank.model.numerics import NonFiniteHiddenError, check_scorable
from acarerank.tokenizer import TOKEN_NO, TOKEN_YES
from serve_util import tiny_model

QUERY = "which passage explains tutoring optimization"
DOCS = ["tutor hints help the reranker", "zebras graze on the savanna", "a search agent's trace", "prefix cache pages"]
POISONED = 1  # DOCS[1] holds a token no other part of the prompt has; its embedding row becomes NaN


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def clean(model):
    return PointwiseReranker(model=model)


def _own_token(rr) -> int:
    """A token id of DOCS[POISONED]'s segment that the shared part and the other documents lack."""
    enc = rr.encode(ScoreRequest(QUERY, DOCS))
    others = set(enc.shared_ids).union(*(enc.segment_ids[i] for i in range(len(DOCS)) if i != POISONED))
    own = [t for t in enc.segment_ids[POISONED] if t not in others]
    assert own, "the poisoned document shares every token with the rest of the prompt"
    return own[0]


@pytest.fixture(scope="module")
def poisoned(model, clean):
    """A runner whose embedding row of the poisoned document's own token is NaN. Set after
    loading: loading refuses NaN weights (tests/model/test_nonfinite_output.py), but an in-memory
    model's tensors are shared with the runner and may change later."""
    runner = Qwen3Runner.from_hf(copy.deepcopy(model))
    runner.weights.embed[_own_token(clean)] = float("nan")
    return runner


def test_check_scorable_names_the_bad_rows():
    h = torch.randn(5, 64)
    check_scorable(h)  # finite and in range: nothing raised
    check_scorable(h * 1e15)  # large but its squares still fit fp32
    h[1, 3] = float("nan")
    h[3] *= 1e30  # finite, but the sum of squares overflows fp32
    with pytest.raises(NonFiniteHiddenError) as e:
        check_scorable(h)
    assert e.value.rows == [1, 3], e.value.rows
    assert "NaN" in str(e.value) and "[1, 3]" in str(e.value), str(e.value)
    with pytest.raises(NonFiniteHiddenError, match=r"max \|h\| = 1\.\d+e\+3\d"):
        check_scorable(h[2:4])  # no NaN there: the message gives the size instead
    check_scorable(torch.zeros(0, 64))  # an empty pass has nothing to refuse


def test_pointwise_refuses_the_nan_document_and_scores_the_others(clean, poisoned):
    rr = PointwiseReranker(runner=poisoned)
    with pytest.raises(NonFiniteHiddenError) as e:
        rr.score(QUERY, DOCS)
    assert e.value.rows == [(0, POISONED)], f"refused rows {e.value.rows}, the NaN is only in document {POISONED}"
    assert f"request 0 document {POISONED}" in str(e.value), str(e.value)
    # the NaN row stays in its own segment: the other documents score as on the clean model
    rest = [d for i, d in enumerate(DOCS) if i != POISONED]
    got, want = rr.score(QUERY, rest), clean.score(QUERY, rest)
    diff = max(abs(a - b) for a, b in zip(got, want))
    assert diff <= 1e-6, f"documents beside a refused one: max |poisoned model - clean| = {diff:.3g}"


@pytest.mark.parametrize("max_batch_tokens", [4096, 8])
def test_score_batch_names_the_nan_document_by_request_and_document(poisoned, max_batch_tokens):
    """Rows of the pass (or of the call's items) are no use to a caller: the error names the
    (request, document) pair, whichever pass the document ran in (8 tokens: one pass each)."""
    rr = PointwiseReranker(runner=poisoned, max_batch_tokens=max_batch_tokens)
    batch = [ScoreRequest(QUERY, [DOCS[0], DOCS[2]]), ScoreRequest(QUERY, [DOCS[0], DOCS[2], DOCS[POISONED]])]
    with pytest.raises(NonFiniteHiddenError) as e:
        rr.score_batch(batch)
    assert e.value.rows == [(1, 2)], f"refused {e.value.rows}; the NaN is in request 1's document 2"
    assert "request 1 document 2" in str(e.value), str(e.value)


def test_overflowing_activations_are_refused_not_scored_half(model):
    m = copy.deepcopy(model)
    with torch.no_grad():
        m.model.layers[-1].mlp.down_proj.weight.mul_(1e30)  # residual rows ~1e30: finite, squares are not
    ids = PointwiseReranker(model=m).encode(ScoreRequest(QUERY, DOCS[:1]))
    with torch.no_grad():  # what transformers makes of it: RMSNorm's mean square is inf, the score 0.5
        h = m.model(torch.tensor([list(ids.shared_ids) + list(ids.segment_ids[0])])).last_hidden_state[0, -1]
        logits = m.lm_head(h)
    assert torch.isfinite(h).all() and logits[TOKEN_YES] == logits[TOKEN_NO] == 0, "not the overflow this test is about"
    with pytest.raises(NonFiniteHiddenError, match=r"max \|h\|"):
        PointwiseReranker(model=m).score(QUERY, DOCS)


def test_setwise_refuses_a_prompt_whose_last_state_is_nan(poisoned):
    sr = SetwiseReranker(runner=poisoned)
    with pytest.raises(NonFiniteHiddenError):
        sr.select(QUERY, DOCS, max_select=2)


@pytest.mark.parametrize("batch_size", [1, 2, 8])
def test_select_batch_names_the_query_of_a_nan_state(poisoned, batch_size):
    """The error names the query of the call, as pointwise names (request, document). Setwise
    prefills without reading a hidden state, so the NaN is refused in a decode step, whose rows
    are the sequences still running: query 2's pool of one is all forced ("[1]", no step), so
    query 3 is row 0 of its pass at batch_size 1 and 2, row 2 at 8 (those rows were reported)."""
    sr = SetwiseReranker(runner=poisoned)
    queries = ["q zero", "q one", "q two", QUERY]
    docs = [[DOCS[0], DOCS[2]], [DOCS[3], DOCS[0]], [DOCS[2]], [DOCS[0], DOCS[POISONED], DOCS[3]]]
    with pytest.raises(NonFiniteHiddenError) as e:
        sr.select_batch(queries, docs, max_select=2, batch_size=batch_size)
    assert e.value.rows == [3], f"refused query(ies) {e.value.rows}; the NaN is in query 3's documents"
    assert "select_batch: no selection for query(ies) [3]: " in str(e.value) and "NaN" in str(e.value), str(e.value)


def test_engine_fails_the_nan_request_alone(clean, poisoned):
    require("fastapi")
    from acarerank.server.engine import Engine, EngineFault

    rr = PointwiseReranker(runner=poisoned)
    requests = {"a": ScoreRequest("tutoring question", DOCS[:1] + DOCS[2:]),
                "bad": ScoreRequest(QUERY, DOCS),
                "b": ScoreRequest("agent question", DOCS[2:])}
    eng = Engine(rr, max_batch_tokens=4096)
    jobs = {k: eng.submit(rr.encode(r), rid=k) for k, r in requests.items()}  # all queued: one first pass
    eng.start()
    try:
        with pytest.raises(EngineFault) as e:
            jobs["bad"].future.result(60)
        assert isinstance(e.value.__cause__, NonFiniteHiddenError) and "NaN" in str(e.value), repr(e.value)
        for k in ("a", "b"):
            got = jobs[k].future.result(60).scores
            want = clean.score_batch([requests[k]])[0]
            diff = max(abs(x - y) for x, y in zip(got, want))
            assert diff <= 1e-6, f"request {k} beside the refused one: max |engine - clean offline| = {diff:.3g}"
    finally:
        eng.stop()
