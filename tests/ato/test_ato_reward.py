"""rubric_reward (Eq. 4–6, Appendix C.1) on the judge's own worked case (Appendix F.5 "Scoring example")."""
import json

import pytest

from acarerank.ato import JudgeOutputError, parse_selection, rubric_reward

# Appendix F.5 case: Doc A, B, C (ids 9, 18, 3 here, as the judge must use original ids).
A, B, C = 9, 18, 3
WEIGHTS = {"Relevance": 5, "Authenticity": 4, "Quality": 2, "Complementarity": 5, "Redundancy": 3,
           "Conflict": 5, "Completeness": 5, "Density": 2, "Reachability": 4}
RUBRICS = {d: [{"rubric": f"{d} question about the Rams' 1999 record", "weight": w}] for d, w in WEIGHTS.items()}


def _doc(scores):
    return {"level": "doc", "rubrics": [{"rubric": "", "per_doc": [{"doc_id": d, "score": s} for d, s in scores.items()]}]}


def _set(score):
    return {"level": "set", "rubrics": [{"rubric": "", "set_level": {"score": score}}]}


def _case_judge():
    """Scores of the paper's worked example: Rel A10 B5 C0, Aut A10 B5 C0, Qua A10 B8 C0,
    Cmp 3, Red 5, Con null, Cpl 10, Den 8, Rea 10."""
    return {"score": {
        "Relevance": _doc({A: 10, B: 5, C: 0}), "Authenticity": _doc({A: 10, B: 5, C: 0}),
        "Quality": _doc({A: 10, B: 8, C: 0}),
        "Complementarity": _set(3), "Redundancy": _set(5), "Conflict": None,
        "Completeness": _set(10), "Density": _set(8), "Reachability": _set(10)}}


def test_paper_worked_case_with_null_renormalisation():
    # doc-level (Eq. 4): Rel (10+5+0)/3 = 5, Aut 5, Qua (10+8+0)/3 = 6
    # Eq. 5 without Conflict (null): (5·5 + 4·5 + 2·6 + 5·3 + 3·5 + 5·10 + 2·8 + 4·10) / (5+4+2+5+3+5+2+4) = 193 / 30
    got = rubric_reward(json.dumps(_case_judge()), RUBRICS, [A, B, C])
    assert got == pytest.approx(193 / 30, abs=1e-12)
    # had the judge scored Conflict 10 ("nothing to contradict"), the reward would be (193 + 50) / 35
    judged = _case_judge()
    judged["score"]["Conflict"] = _set(10)
    assert rubric_reward(judged, RUBRICS, [A, B, C]) == pytest.approx(243 / 35, abs=1e-12)


def test_doc_level_averages_over_the_selected_documents_only():
    # selected S = {A, B}; the judge also scored C — C must not enter Eq. 4's average
    # Rel 7.5, Aut 7.5, Qua 9: (5·7.5 + 4·7.5 + 2·9 + 15 + 15 + 50 + 16 + 40) / 30
    got = rubric_reward(_case_judge(), RUBRICS, [B, A])
    assert got == pytest.approx((37.5 + 30 + 18 + 15 + 15 + 50 + 16 + 40) / 30, abs=1e-12)


def test_case_a_all_irrelevant_scores_zero():
    judged = {"score": {d: None for d in WEIGHTS}}
    judged["score"]["Relevance"] = _doc({A: 0, B: 0})
    assert rubric_reward(judged, RUBRICS, [A, B]) == 0.0


def test_several_rubrics_per_dimension_and_rubric_level_null():
    rubrics = {"Relevance": [{"rubric": "r1", "weight": 5}, {"rubric": "r2", "weight": 1}],
               "Conflict": [{"rubric": "c1", "weight": 5}, {"rubric": "c2", "weight": 2}],
               "Density": []}
    judged = {"score": {
        "Relevance": {"level": "doc", "rubrics": [
            {"rubric": "r1", "per_doc": [{"doc_id": 2, "score": 10}, {"doc_id": 5, "score": 6}]},
            {"rubric": "r2", "per_doc": [{"doc_id": 2, "score": 0}, {"doc_id": 5, "score": 4}]}]},
        "Conflict": {"level": "set", "rubrics": [{"rubric": "c1", "set_level": {"score": None}},
                                                 {"rubric": "c2", "set_level": {"score": 9}}]}}}
    # (5·8 + 1·2 + 2·9) / (5 + 1 + 2): the null criterion c1 leaves numerator and denominator
    assert rubric_reward(judged, rubrics, [5, 2]) == pytest.approx(60 / 8, abs=1e-12)


@pytest.mark.parametrize("form", ["entry", "set_level", "set_level score"])
def test_criterion_level_null_is_inapplicable_in_each_spelling(form):
    """C.1 defines null per criterion: each spelling of one null criterion leaves numerator and
    denominator alone, exactly as the whole dimension's null does (F.5's form)."""
    judged = _case_judge()
    judged["score"]["Conflict"] = {"level": "set", "rubrics": [
        {"entry": None, "set_level": {"rubric": "", "set_level": None},
         "set_level score": {"rubric": "", "set_level": {"score": None}}}[form]]}
    assert rubric_reward(judged, RUBRICS, [A, B, C]) == pytest.approx(193 / 30, abs=1e-12)


@pytest.mark.parametrize("form", ["dimension", "entry", "per_doc"])
def test_relevance_is_never_null(form):
    """Relevance is never null (C.1, F.5): a null Relevance was dropped and the set scored on the
    other dimensions alone — 168 / 25 = 6.72 here, not 193 / 30 = 6.43 — with no error."""
    judged = _case_judge()
    rel = judged["score"]["Relevance"]
    if form == "dimension":
        judged["score"]["Relevance"] = None
    elif form == "entry":
        rel["rubrics"][0] = None
    else:
        rel["rubrics"][0]["per_doc"] = None
    with pytest.raises(JudgeOutputError, match=r"Relevance\[0\] is null; Relevance is never null"):
        rubric_reward(judged, RUBRICS, [A, B, C])


@pytest.mark.parametrize("dim", ["Completeness", "Reachability"])
@pytest.mark.parametrize("form", ["dimension", "entry", "set_level score"])
def test_completeness_and_reachability_are_never_null_once_a_document_is_relevant(dim, form):
    """F.5, CASE B (a document with Relevance >= 1): Completeness and Reachability are "NEVER null"
    (0 when nothing is covered). A null one was dropped and raised the reward: with Doc A relevant
    and Completeness null the set scored (193 - 50) / 25 = 5.72 instead of an error."""
    judged = _case_judge()
    judged["score"][dim] = {"dimension": None, "entry": {"level": "set", "rubrics": [None]},
                            "set_level score": {"level": "set", "rubrics": [{"rubric": "", "set_level": {"score": None}}]}
                            }[form]
    with pytest.raises(JudgeOutputError, match=rf"{dim}\[0\] is null while document\(s\) \[9, 18\] score Relevance >= 1"):
        rubric_reward(judged, RUBRICS, [A, B, C])


def test_completeness_may_be_null_when_no_document_is_relevant_on_every_relevance_rubric():
    """CASE A (no relevant document) nulls every other dimension, Completeness included; and with
    several Relevance rubrics a document relevant on one only is not taken as relevant (F.5 does
    not say how rubrics combine), so a null Completeness is still read as inapplicable there."""
    judged = {"score": {d: None for d in WEIGHTS}}
    judged["score"]["Relevance"] = _doc({A: 0, B: 0})
    assert rubric_reward(judged, RUBRICS, [A, B]) == 0.0
    rubrics = {"Relevance": [{"rubric": "r1", "weight": 1}, {"rubric": "r2", "weight": 1}],
               "Completeness": [{"rubric": "c", "weight": 1}]}
    judged = {"score": {
        "Relevance": {"level": "doc", "rubrics": [{"rubric": "r1", "per_doc": [{"doc_id": 2, "score": 6}]},
                                                  {"rubric": "r2", "per_doc": [{"doc_id": 2, "score": 0}]}]},
        "Completeness": None}}
    assert rubric_reward(judged, rubrics, [2]) == pytest.approx(3.0, abs=1e-12)


def test_malformed_selection_is_minus_one_without_reading_the_judge():
    bad = parse_selection("[4], [2]", n_candidates=20)
    assert not bad.valid
    assert rubric_reward(None, RUBRICS, bad) == -1.0
    assert rubric_reward("not even json", RUBRICS, None) == -1.0
    assert rubric_reward(None, RUBRICS, []) == -1.0
    good = parse_selection("[9] [18] [3]", n_candidates=20)
    assert rubric_reward(_case_judge(), RUBRICS, good) == pytest.approx(193 / 30, abs=1e-12)


def test_judge_json_text_with_fences():
    text = "```json\n" + json.dumps(_case_judge(), indent=1) + "\n```"
    assert rubric_reward(text, RUBRICS, [A, B, C]) == pytest.approx(193 / 30, abs=1e-12)


@pytest.mark.parametrize("mutate,msg", [
    (lambda j: j.__setitem__("score", "x"), '"score" object'),
    (lambda j: j["score"].pop("Density"), "no entry for dimension 'Density'"),
    (lambda j: j["score"]["Relevance"]["rubrics"].append({"rubric": "", "per_doc": []}), "scored 2 rubrics"),
    (lambda j: j["score"]["Relevance"]["rubrics"][0]["per_doc"].pop(0), r"no score for selected document\(s\) \[9\]"),
    (lambda j: j["score"]["Density"]["rubrics"][0]["set_level"].__setitem__("score", 11), r"in \[0, 10\]"),
    (lambda j: j["score"]["Quality"]["rubrics"][0]["per_doc"][1].__setitem__("score", None), "may not be null"),
    (lambda j: j["score"]["Completeness"]["rubrics"][0].pop("set_level"), "needs set_level"),
])
def test_bad_judge_output_raises(mutate, msg):
    judged = _case_judge()
    mutate(judged)
    with pytest.raises(JudgeOutputError, match=msg):
        rubric_reward(judged, RUBRICS, [A, B, C])


def test_bad_json_all_null_and_bad_weights():
    with pytest.raises(JudgeOutputError, match="not valid JSON"):
        rubric_reward("{score: 1", RUBRICS, [A])
    with pytest.raises(JudgeOutputError, match="Relevance is never null"):
        rubric_reward({"score": {d: None for d in WEIGHTS}}, RUBRICS, [A])
    no_relevance = {d: r for d, r in RUBRICS.items() if d != "Relevance"}
    with pytest.raises(JudgeOutputError, match="every criterion is null"):
        rubric_reward({"score": {d: None for d in WEIGHTS}}, no_relevance, [A])
    with pytest.raises(ValueError, match="weights must be numbers > 0"):
        rubric_reward(_case_judge(), {"Relevance": [{"rubric": "r", "weight": 0}]}, [A])


def test_numpy_weights_are_numbers():
    """A weight as a numpy scalar (a rubric table read with numpy or pandas) is the number it holds,
    in rubric_reward and in the rubric hint (acarerank._validate's one rule: numpy ints are ints);
    np.int64(2) was "rubric weights must be numbers > 0"; a bool is still refused."""
    np = pytest.importorskip("numpy")
    from acarerank.ato import format_rubrics
    want = rubric_reward(_case_judge(), RUBRICS, [A, B, C])
    for cast, plain in ((np.int64, int), (np.float32, float)):
        def weighted(c):
            return {d: [{"rubric": r[0]["rubric"], "weight": c(r[0]["weight"])}] for d, r in RUBRICS.items()}
        assert rubric_reward(_case_judge(), weighted(cast), [A, B, C]) == want, cast
        assert format_rubrics(weighted(cast)) == format_rubrics(weighted(plain)), cast
    with pytest.raises(ValueError, match="weights must be numbers > 0"):
        rubric_reward(_case_judge(), {"Relevance": [{"rubric": "r", "weight": True}]}, [A])


def test_a_utility_exactly_at_a_hint_threshold_is_that_value():
    """Eq. 5 over Eq. 4's means in floats: a utility of exactly 3 (τ2) came out 3.0000000000000004
    and routed its rollout to the reflection hint instead of the sibling one (Eq. 8: h̄ for
    0 ≤ r ≤ τ2). Computed exactly (fractions.Fraction), rounded once."""
    from fractions import Fraction

    from acarerank.ato import route_hints

    rubrics = {"Relevance": [{"rubric": "x", "weight": 7}],
               "Authenticity": [{"rubric": "x", "weight": 5}, {"rubric": "x", "weight": 9}],
               "Quality": [{"rubric": "x", "weight": 2}], "Complementarity": [{"rubric": "x", "weight": 10}],
               "Completeness": [{"rubric": "x", "weight": 5}]}

    def per_doc(*s):
        return {"rubric": "x", "per_doc": [{"doc_id": i + 1, "score": v} for i, v in enumerate(s)]}

    def set_level(v):
        return {"rubric": "x", "set_level": {"score": v}}

    judge = {"score": {"Relevance": {"rubrics": [per_doc(8, 1, 9)]},
                       "Authenticity": {"rubrics": [per_doc(6, 5, 6), per_doc(3, 2, 0)]},
                       "Quality": {"rubrics": [per_doc(3, 1, 9)]}, "Complementarity": {"rubrics": [set_level(1)]},
                       "Completeness": {"rubrics": [set_level(2)]}}}
    exact = (7 * Fraction(18, 3) + 5 * Fraction(17, 3) + 9 * Fraction(5, 3) + 2 * Fraction(13, 3) + 10 + 10) / 38
    assert exact == 3
    r = rubric_reward(judge, rubrics, [1, 2, 3])
    assert r == 3.0, repr(r)
    assert route_hints([r], 10.0) == route_hints([3.0], 10.0) == ["sibling"]
