"""Hierarchical rubric reward of ATO (AdaTutoRank (2026), Eq. 4–6, Appendix C.1, judge format of Appendix F.5/F.6).

For a selected set S and the query's rubrics R_q (each criterion c with weight w_c):

    doc-level c:        F(c, S) = (1/|S|) Σ_{d∈S} J(c, d)                          (Eq. 4)
    set/global-level c: J(c, S)
    u(S | q) = Σ_c w_c · score_c / Σ_c w_c   over the applicable criteria          (Eq. 5)
    r = u(S | q) ∈ [0, 10] if the output format is correct, else −1               (Eq. 6)

A criterion the judge returns as ``null`` (its applicability prerequisite is unmet, e.g.
Conflict with fewer than two comparable statements) is dropped from both numerator and
denominator, so the weights renormalise over the applicable criteria (Appendix C.1). Null is
read as "inapplicable" at two levels: a whole dimension (``"Conflict": null``, F.5's form) makes
each of its criteria inapplicable; a single criterion (its entry ``null``, ``"per_doc": null``,
``"set_level": null`` or ``"set_level": {"score": null}``) is inapplicable alone — C.1 defines
null per criterion. Two nulls are errors (``JudgeOutputError``, naming the rubric): a
per-document score (F.5: "no N/A or empty per-item values") and any Relevance criterion
("Relevance is never null", C.1 and F.5 — dropping it would score the set without relevance);
so is a null Completeness or Reachability criterion once a selected document scores Relevance
>= 1 on every Relevance rubric (F.5's CASE B: they are 0 then, "NEVER null").

Inputs:
  rubrics  Appendix F.3 JSON: {"Relevance": [{"rubric": "...", "weight": 5}, ...], ...};
           a dimension with [] has no criteria.
  judge    Appendix F.5 JSON: {"score": {"Relevance": {"level": "doc", "rubrics": [
           {"rubric": "...", "per_doc": [{"doc_id": 9, "score": 10}, ...]}]},
           "Complementarity": {"level": "set", "rubrics": [{"rubric": "...", "set_level":
           {"score": 8}}]}, "Conflict": null, ...}}
           The i-th judge rubric of a dimension scores the i-th input rubric of it (F.5: "the
           number and order of rubrics must match the input").
"""
from __future__ import annotations

import json
import math
import numbers
import re
from fractions import Fraction
from typing import Mapping, Optional, Sequence, Union

from ..setwise.selection import ParsedSelection
from .hints import DIMENSION_LEVEL, _check_ids, _short  # one rule for document ids (sibling_ids too)

MALFORMED_REWARD = -1.0  # Eq. 6
#: dimensions F.5 says are never null once a document is relevant (CASE B)
_NEVER_NULL_WHEN_RELEVANT = ("Completeness", "Reachability")


class JudgeOutputError(ValueError):
    """The judge's output does not follow the Appendix F.5 format (retry the judge call).

    The one exception type ``rubric_reward`` / ``criterion_scores`` raise for anything wrong with
    the judge's output; TypeError / ValueError are kept for the caller's own arguments."""


def _load_judge(judge_output) -> Mapping:
    if isinstance(judge_output, (bytes, bytearray, str)):
        if isinstance(judge_output, (bytes, bytearray)):
            try:
                text = bytes(judge_output).decode("utf-8")
            except UnicodeDecodeError as e:
                raise JudgeOutputError(f"judge output is not valid JSON: not UTF-8 ({e.reason} at byte {e.start})") \
                    from None
        else:
            text = judge_output
        text = text.strip()
        fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, flags=re.S)  # judges add fences despite F.5
        if fence:
            text = fence.group(1)
        try:
            judge_output = json.loads(text)
        except ValueError as e:  # JSONDecodeError, an over-long integer literal
            raise JudgeOutputError(f"judge output is not valid JSON: {e}") from None
        except RecursionError:
            raise JudgeOutputError("judge output is not valid JSON: nested too deeply") from None
    if not isinstance(judge_output, Mapping) or not isinstance(judge_output.get("score"), Mapping):
        raise JudgeOutputError('judge output must be a JSON object with a "score" object')
    return judge_output["score"]


def _score_value(v, where: str) -> Optional[float]:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 10 or not math.isfinite(v):
        raise JudgeOutputError(f"{where}: score must be a number in [0, 10] or null, got {_short(v)}")
    return float(v)


def _check_rubrics(rubrics) -> None:
    """TypeError / ValueError (the caller's data, not the judge's) for malformed rubrics."""
    if not isinstance(rubrics, Mapping):
        raise TypeError(f"rubrics must be a mapping {{dimension: [{{'rubric': ..., 'weight': ...}}]}}, "
                        f"got {type(rubrics).__name__}")
    for dim, items in rubrics.items():
        if items is None:
            continue
        if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Sequence):
            raise TypeError(f"rubrics[{dim!r}] must be a list of rubric objects, got {type(items).__name__}")
        for it in items:
            w = it.get("weight") if isinstance(it, Mapping) else None
            if isinstance(w, bool) or not isinstance(w, numbers.Real) or not w > 0 or not math.isfinite(w):
                raise ValueError(f"rubric weights must be numbers > 0; {dim} has {_short(w)}")


def _doc_level_score(entry: Mapping, docs: Sequence[int], where: str) -> Optional[float]:
    got = _per_doc_scores(entry, docs, where)
    return None if got is None else sum(got[d] for d in docs) / len(docs)  # Eq. 4: over the selected documents


def _per_doc_scores(entry: Mapping, docs: Sequence[int], where: str) -> Optional[dict]:
    """{doc id: score} of a doc-level rubric's entry, every selected document scored; None: null."""
    per_doc = entry.get("per_doc")
    if per_doc is None:
        return None
    if not isinstance(per_doc, list):
        raise JudgeOutputError(f"{where}: per_doc must be a list")
    got = {}
    for item in per_doc:
        if not isinstance(item, Mapping) or "doc_id" not in item or "score" not in item:
            raise JudgeOutputError(f"{where}: per_doc entries need doc_id and score, got {_short(item)}")
        doc = item["doc_id"]
        if isinstance(doc, bool) or not isinstance(doc, int):
            raise JudgeOutputError(f"{where}: doc_id must be an integer, got {_short(doc)}")
        if doc in got:
            raise JudgeOutputError(f"{where}: doc_id {doc} is scored twice")
        s = _score_value(item["score"], f"{where} doc {doc}")
        if s is None:
            raise JudgeOutputError(f"{where}: per-document scores may not be null (F.5); doc {doc}")
        got[doc] = s
    missing = [d for d in docs if d not in got]
    if missing:
        raise JudgeOutputError(f"{where}: no score for selected document(s) {missing}")
    return got


def _set_level_score(entry: Mapping, where: str) -> Optional[float]:
    sl = entry.get("set_level")
    if sl is None:
        return None
    if not isinstance(sl, Mapping) or "score" not in sl:
        raise JudgeOutputError(f"{where}: set_level must be an object with a score")
    return _score_value(sl["score"], where)


def criterion_scores(judge_output, rubrics: Mapping[str, Sequence[Mapping]], selected_ids: Sequence[int]):
    """[(dimension, index, weight, score or None)] for every criterion of ``rubrics`` (None: null)."""
    return [(dim, i, w, None if score is None else float(score))
            for dim, i, w, score in _exact_criterion_scores(judge_output, rubrics, selected_ids)]


def _exact_criterion_scores(judge_output, rubrics, selected_ids):
    """``criterion_scores`` with each score an exact ``Fraction`` (Eq. 4's mean unrounded), so Eq. 5
    rounds once: in floats a utility of exactly 3 or 6 — the hint thresholds τ2 and τ1 — came out
    3.0000000000000004 and routed its rollout to the wrong hint (3 of 430 random judge outputs)."""
    _check_rubrics(rubrics)
    docs = _check_ids(selected_ids, "selected_ids")
    scores = _load_judge(judge_output)
    out, relevance = [], []   # relevance: {doc: score} of each Relevance rubric
    for dim, items in rubrics.items():
        items = list(items or [])
        if not items:
            continue
        judged = scores.get(dim, "missing")
        if judged == "missing":
            raise JudgeOutputError(f"judge output has no entry for dimension {dim!r}")
        if judged is None:  # the whole dimension is not applicable
            out.extend((dim, i, float(it["weight"]), None) for i, it in enumerate(items))
            continue
        if not isinstance(judged, Mapping) or not isinstance(judged.get("rubrics"), list):
            raise JudgeOutputError(f"{dim}: expected an object with a 'rubrics' list or null")
        if len(judged["rubrics"]) != len(items):
            raise JudgeOutputError(f"{dim}: judge scored {len(judged['rubrics'])} rubrics, the input has {len(items)}")
        level = DIMENSION_LEVEL.get(dim)
        for i, (it, entry) in enumerate(zip(items, judged["rubrics"])):
            where = f"{dim}[{i}]"
            if entry is None:
                out.append((dim, i, float(it["weight"]), None))
                continue
            if not isinstance(entry, Mapping):
                raise JudgeOutputError(f"{where}: expected an object, got {_short(entry)}")
            is_doc = "per_doc" in entry if level is None else level == "doc"
            if is_doc and "per_doc" not in entry or not is_doc and "set_level" not in entry:
                raise JudgeOutputError(f"{where}: a {'doc' if is_doc else 'set/global'}-level rubric needs "
                                       f"{'per_doc' if is_doc else 'set_level'}")
            if is_doc:
                per_doc = _per_doc_scores(entry, docs, where)
                score = None if per_doc is None else Fraction(sum(map(Fraction, (per_doc[d] for d in docs))),
                                                              len(docs))  # Eq. 4
                if dim == "Relevance" and per_doc is not None:
                    relevance.append(per_doc)
            else:
                score = _set_level_score(entry, where)
                score = None if score is None else Fraction(score)
            out.append((dim, i, float(it["weight"]), score))
    for dim, i, _, score in out:
        if dim == "Relevance" and score is None:
            raise JudgeOutputError(f"Relevance[{i}] is null; Relevance is never null (Appendix C.1, F.5): "
                                   f"dropping it would score the set without its relevance")
    # F.5's CASE B (some document relevant, Relevance >= 1): Completeness and Reachability measure a
    # gap / derivability and are then "NEVER null" (0 when nothing is covered); dropping them
    # would score a set that misses the answer without the two criteria that say so. A document
    # counts as relevant here when every Relevance rubric scores it >= 1, relevant under any way
    # of combining several Relevance rubrics; a set whose documents are relevant only on some
    # rubrics is not judged here (F.5 does not say which combination it means)
    relevant = [d for d in docs if relevance and all(r[d] >= 1 for r in relevance)]
    if relevant:
        for dim, i, _, score in out:
            if dim in _NEVER_NULL_WHEN_RELEVANT and score is None:
                raise JudgeOutputError(f"{dim}[{i}] is null while document(s) {relevant[:10]} score Relevance >= 1: "
                                       f"{dim} is never null then (Appendix F.5, CASE B: 0 when nothing is "
                                       f"covered, not null)")
    return out


def rubric_reward(judge_output, rubrics: Mapping[str, Sequence[Mapping]],
                  selected: Union[ParsedSelection, Sequence[int], None]) -> float:
    """Reward r of one rollout, Eq. 4–6.

    Args:
      judge_output: the judge's reply (JSON text, ```json fences tolerated, or the parsed dict);
        not read when the selection is malformed (no judge call is needed then).
      rubrics: R_q as {dimension: [{"rubric": str, "weight": number > 0}, ...]}.
      selected: the rollout's parsed selection — a ``ParsedSelection`` (strict parse;
        ``valid=False`` means the format is wrong), a list of the selected 1-based document
        ids (= the judge's doc_id), or None for a malformed output.
    Returns: u(S | q) in [0, 10], or −1.0 for a malformed selection (Eq. 6).
    Raises (the only exception types, whatever the input):
      JudgeOutputError (a ValueError) when the judge's output is unusable — not JSON, not UTF-8,
        nested too deeply, not the F.5 shape, a score outside [0, 10], a missing or repeated
        doc_id, a null Relevance criterion (not the rollout's fault: retry the judge) — or when
        every criterion is null (the paper guarantees Relevance never is);
      TypeError for arguments of the wrong type (``selected`` a str — ``"12"`` is not ids [1, 2] —
        or holding non-int ids such as 1.5; ``rubrics`` not a mapping of lists);
      ValueError for bad caller data (repeated or < 1 ids, rubric weights not > 0).
    """
    _check_rubrics(rubrics)
    if selected is None:
        return MALFORMED_REWARD
    if isinstance(selected, ParsedSelection):
        if not selected.valid:
            return MALFORMED_REWARD
        ids = _check_ids(list(selected.ids))
    else:
        ids = _check_ids(selected)
    if not ids:
        return MALFORMED_REWARD  # an empty selection is a format violation (Eq. 2 needs ≥ 1 id)
    num = den = Fraction(0)   # exact, rounded once (_exact_criterion_scores)
    for _, _, w, score in _exact_criterion_scores(judge_output, rubrics, ids):
        if score is None:
            continue  # null: out of numerator and denominator (Appendix C.1)
        num += Fraction(w) * score
        den += Fraction(w)
    if den == 0:
        raise JudgeOutputError("every criterion is null; at least Relevance must be scored (Appendix C.1)")
    return float(num / den)


__all__ = ["MALFORMED_REWARD", "JudgeOutputError", "criterion_scores", "rubric_reward"]
