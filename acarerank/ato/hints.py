"""Reward-conditioned hint routing and hint texts of ATO (AdaTutoRank (2026), Eq. 8, Algorithm 1 lines 20–35, Fig. 3).

Three hint kinds, of increasing specificity: ``"rubric"`` (h*, the query's rubrics alone),
``"reflection"`` (ĥ, a corrective reflection contrasting the rollout with the sibling set)
and ``"sibling"`` (h̄, the self-selector's sibling set itself). Both ĥ and h̄ build on the
sibling set, so they pass the *sibling-set gate*: they are delivered only when the sibling
set outscores the rollout (u(h̄) > r_i, zero margin, Appendix C.4); otherwise the rollout
falls back to the rubric hint.

The hint text is inserted into the student prompt right after the user's request (before the
turn closes), so the teacher sees "student prompt + hint" (Fig. 3: teacher prompt = student
system & user prompt, then the hint).
"""
from __future__ import annotations

import numbers
from typing import List, Mapping, Optional, Sequence, Union

import torch

from .._validate import check_token_ids

HINT_RUBRIC = "rubric"
HINT_REFLECTION = "reflection"
HINT_SIBLING = "sibling"
HINT_KINDS = (HINT_RUBRIC, HINT_REFLECTION, HINT_SIBLING)

#: separates the student's user text from the hint (a pre-tokenizer boundary for Qwen3, so a
#: hint tokenized on its own equals the joint tokenization)
HINT_SEPARATOR = "\n\n"


def _floats(x, name) -> List[float]:
    if isinstance(x, (str, bytes, bytearray)):  # float() of each character: "56" was rewards [5.0, 6.0]
        raise TypeError(f"{name} must be numbers, got a {type(x).__name__}")
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().flatten().tolist()
    elif hasattr(x, "tolist"):  # a numpy scalar or array: Python numbers (np.float32 is no float)
        x = x.tolist()
    if isinstance(x, numbers.Real):
        x = [x]
    out = [float(v) for v in x]
    bad = [v for v in out if v != v]
    if bad:
        raise ValueError(f"{name} contains NaN")
    return out


def route_hints(rewards, sibling_reward, tau1: float = 6.0, tau2: float = 3.0) -> List[str]:
    """Hint kind of each rollout — Algorithm 1, lines 20–35, literally:

        if r_i ≥ τ1:            rubric       (strong rollout: criteria only)
        elif r_sib ≤ r_i:       rubric       (the gate rejects the sibling set)
        elif τ2 < r_i < τ1:     reflection   (corrective reflection)
        else (r_i ≤ τ2):        sibling      (the sibling set itself)

    Boundaries: r = τ1 = 6 is a rubric rollout; r = τ2 = 3 gets the sibling set (Eq. 8:
    sibling for 0 ≤ r ≤ τ2, reflection for τ2 < r < τ1). A malformed rollout (r = −1, Eq. 6)
    is routed like any r ≤ τ2, but its format mask m_i = 0 keeps the hint from taking effect
    (Appendix A); route it anyway so the batch stays rectangular.

    A contradiction in the paper: Table 5 (RAG query) shows a *sibling-set* hint for a rollout
    scoring 3.67, but Eq. 8 and Algorithm 1 with τ2 = 3 route 3.67 to a *reflection* (3 < 3.67
    < 6). We follow the equations; the thresholds are parameters, so ``tau2`` ≥ 3.67
    reproduces the table's routing if that was the intent.

    Args:
      rewards: [G] judge rewards r_i (sequence or tensor).
      sibling_reward: u(h̄ | q), a float for the whole group, a [G] sequence (one per rollout,
        e.g. a packed batch of several queries), or None when no sibling set exists (the gate
        then rejects everywhere: every rollout below τ1 gets the rubric hint).
      tau1 > tau2: thresholds (paper: 6 and 3).
    Returns: list of "rubric" | "reflection" | "sibling", one per rollout.
    """
    if not tau1 > tau2:
        raise ValueError(f"need tau1 > tau2, got tau1={tau1}, tau2={tau2}")
    r = _floats(rewards, "rewards")
    if sibling_reward is None:
        sib = [float("-inf")] * len(r)
    else:
        sib = _floats(sibling_reward, "sibling_reward")
        if len(sib) == 1:
            sib = sib * len(r)
        if len(sib) != len(r):
            raise ValueError(f"sibling_reward has {len(sib)} values for {len(r)} rewards "
                             "(give one, or one per rollout)")
    kinds = []
    for ri, si in zip(r, sib):
        if ri >= tau1:
            kinds.append(HINT_RUBRIC)
        elif si <= ri:
            kinds.append(HINT_RUBRIC)
        elif tau2 < ri < tau1:
            kinds.append(HINT_REFLECTION)
        else:
            kinds.append(HINT_SIBLING)
    return kinds


# ----------------------------------------------------------------------------- hint texts (Fig. 3)
RUBRIC_HINT_TEMPLATE = (
    "Below are the scoring dimensions and key points that the optimal document subset for this query should cover "
    "(a higher weight means more important):\n{rubric}\nStrictly follow the rubrics above and select the optimal "
    "document subset."
)
REFLECTION_HINT_TEMPLATE = (
    "Your current selection is not yet optimal. Below is a concrete corrective idea for revising it toward the "
    "optimal document subset:\n{corrective_reflection}\nApply the corrective idea above and select the optimal "
    "document subset."
)
SIBLING_HINT_TEMPLATE = (
    "Below is an example optimal document subset for this query (scored {reward} out of 10 by the judge); use it as "
    "a concrete reference:\n{sibling_set}\nLearn from the reference example above and select the optimal document "
    "subset."
)

#: dimension -> level, the nine meta-rubric dimensions of Appendix C.1
DIMENSION_LEVEL = {
    "Relevance": "doc", "Authenticity": "doc", "Quality": "doc",
    "Complementarity": "set", "Redundancy": "set", "Conflict": "set",
    "Completeness": "global", "Density": "global", "Reachability": "global",
}
_LEVEL_TITLE = {"doc": "[Doc-level rubrics]", "set": "[Set-level rubrics]", "global": "[Global-level rubrics]"}


def format_rubrics(rubrics: Mapping[str, Sequence[Mapping]]) -> str:
    """Rubric set R_q (Appendix F.3 JSON: {dimension: [{"rubric": str, "weight": int}, ...]}) as
    Fig. 3 shows it: one block per level, one line "- Dimension (weight w): question" per rubric.
    Unknown dimensions go to the set level (they are rated once for the whole set)."""
    if not isinstance(rubrics, Mapping):
        raise TypeError(f"rubrics must be a mapping {{dimension: [{{'rubric': ..., 'weight': ...}}]}}, "
                        f"got {type(rubrics).__name__}")
    lines = {lvl: [] for lvl in _LEVEL_TITLE}
    for dim, items in rubrics.items():
        if isinstance(items, (str, bytes, Mapping)):
            raise TypeError(f"rubrics[{dim!r}] must be a list of rubric objects, got {type(items).__name__}")
        for i, it in enumerate(items or []):
            # the hint shows both fields: a missing one is the caller's data, named (not a KeyError)
            text, w = (it.get("rubric"), it.get("weight")) if isinstance(it, Mapping) else (None, None)
            if not isinstance(text, str) or isinstance(w, bool) or not isinstance(w, numbers.Real):
                raise ValueError(f"rubrics[{dim!r}][{i}] must be {{'rubric': str, 'weight': number}}, got {it!r:.200}")
            lines[DIMENSION_LEVEL.get(dim, "set")].append(f"- {dim} (weight {w}): {text}")
    return "\n".join(f"{_LEVEL_TITLE[lvl]}\n" + "\n".join(ls) for lvl, ls in lines.items() if ls)


def format_selection(ids: Sequence[int]) -> str:
    """1-based identifiers as the policy writes them: "[2] [14]"."""
    return " ".join(f"[{int(i)}]" for i in ids)


def _short(v) -> str:
    """``v``'s repr for a message, cut to 80 characters."""
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _python_scalar(x):
    """A 0-d tensor or numpy value (``sib[i]`` of the [G] tensor ``route_hints`` takes, an item of
    ``list(torch.tensor([1, 3]))``) as its Python number, as ``acarerank._validate.check_token_ids``
    reads one (a bool tensor stays a bool, a float one a float); anything else unchanged."""
    return x.tolist() if hasattr(x, "tolist") and getattr(x, "ndim", None) == 0 else x


def _check_ids(selected, name: str = "selected") -> list:
    """A list of distinct 1-based int ids (0-d integer tensors / numpy ints too); TypeError for a str
    or non-int items (bools and floats included), ValueError for < 1 or repeats."""
    if isinstance(selected, (str, bytes, Mapping)) or not isinstance(selected, Sequence):
        raise TypeError(f"{name} must be a ParsedSelection, a list of int document ids or None, "
                        f"got {type(selected).__name__}")
    ids = []
    for i in selected:
        v = _python_scalar(i)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name}: document ids must be ints, got {_short(i)} ({type(i).__name__})")
        ids.append(int(v))
    if any(i < 1 for i in ids):
        raise ValueError(f"{name}: document ids are 1-based, got {min(ids)}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name}: repeated document id(s) in {ids[:20]}")
    return ids


def _sibling_ids(ids) -> List[int]:
    """``ids`` as a list of distinct 1-based ints (numpy / torch integers too, as
    ``acarerank._validate``'s one integer rule); TypeError for a str or non-int items (a float
    was truncated, "12" read as ids 1 and 2), ValueError for ids < 1 or repeats."""
    if isinstance(ids, torch.Tensor) or type(ids).__module__ == "numpy":
        ids = ids.tolist()  # Python ints (floats, bools stay what they are and are refused below)
    if isinstance(ids, (str, bytes, bytearray, Mapping)) or not isinstance(ids, Sequence):
        raise TypeError(f"sibling_ids must be a list of int document ids, got {type(ids).__name__}")
    return _check_ids(list(ids), "sibling_ids")


def hint_text(kind: str, rubrics: Optional[Mapping] = None, reflection: Optional[str] = None,
              sibling_ids: Optional[Sequence[int]] = None, sibling_reward: Optional[float] = None) -> str:
    """The privileged text of Fig. 3 for one rollout (kind from ``route_hints``).

    ``reflection``: a str; ``sibling_ids``: the sibling set's distinct 1-based document ids
    (a list, or a 1-D numpy / torch integer array); ``sibling_reward``: its judge reward u(h̄ | q),
    a finite number in [0, 10] (``rubric_reward``'s range; a malformed −1 set never passes the gate),
    a 0-d tensor or numpy number too (an item of the [G] tensor ``route_hints`` takes).
    """
    if kind == HINT_RUBRIC:
        if not rubrics:
            raise ValueError("a rubric hint needs the query's rubrics")
        return RUBRIC_HINT_TEMPLATE.format(rubric=format_rubrics(rubrics))
    if kind == HINT_REFLECTION:
        if reflection is not None and not isinstance(reflection, str):
            raise TypeError(f"reflection must be a str, got {type(reflection).__name__}")
        if not reflection:
            raise ValueError("a reflection hint needs the self-reflector's text")
        return REFLECTION_HINT_TEMPLATE.format(corrective_reflection=reflection.strip())
    if kind == HINT_SIBLING:
        ids = None if sibling_ids is None else _sibling_ids(sibling_ids)
        if not ids or sibling_reward is None:
            raise ValueError("a sibling hint needs the sibling set's ids and its judge reward")
        reward = _python_scalar(sibling_reward)
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not 0 <= reward <= 10:  # NaN fails too
            raise ValueError(f"sibling_reward must be a number in [0, 10] (a judge reward), got {sibling_reward!r}")
        return SIBLING_HINT_TEMPLATE.format(reward=f"{float(reward):.2f}", sibling_set=format_selection(ids))
    raise ValueError(f"unknown hint kind {kind!r}; kinds: {', '.join(HINT_KINDS)}")


#: head tokens read back at first to find where the seam's re-tokenization can start (doubled as needed)
SEAM_WINDOW = 32


def hint_ids(tokenizer, text: Union[str, Sequence[int]], lead_token: Optional[int] = None,
             head: Optional[Sequence[int]] = None) -> List[int]:
    r"""Token ids of a hint as it sits in the teacher prompt: HINT_SEPARATOR + text.

    Byte-level BPE can merge across the seam: the F.1/F.2 user text ends in "." and Qwen3
    encodes ".\n\n" as one token (382), not "." (13) + "\n\n". So with ``lead_token`` (the
    last token of the prompt head, which the teacher's segment re-reads anyway) the seam is
    re-tokenized: the result is encode(decode(lead_token) + HINT_SEPARATOR + text) and
    *replaces* that token. Token-id hints pass through (after ``lead_token`` if given).

    ``head`` (the prompt head's ids; its last token is the lead token, ``lead_token`` may then be
    left out) makes the splice checked: ``head[:-1] + result`` is exactly the tokenization of
    head_text + HINT_SEPARATOR + text, or ValueError. The separator joins a punctuation run
    before it into one pre-token (Qwen3's `` ?[^\s\p{L}\p{N}]+[\r\n]*``), and BPE over that
    pre-token can change more than its last token: "x?;" is "x" "?" ";" but "x?;\n\n" is
    "x" "?;\n\n" (and so 2,528 of the 75,894 endings "x" + one to three marks of ASCII
    punctuation and 。，、…»«“”’—).
    Re-tokenizing the lead token alone then gives the teacher a prompt its text never
    tokenizes to, with no error; the teacher's shared prefix (the head but its last token)
    cannot hold such a seam, so it is refused. The check re-tokenizes the head's text from the
    last point where its tokenization provably splits (docs/ARCHITECTURE.md, "A served
    request"; ``acarerank.tokenizer``), a few tokens. Without ``head``, ``lead_token`` alone is
    trusted: exact whenever the head's last pre-token is that one token (text ending in a word,
    or a word and one punctuation mark, as the setwise prompts' "explain.").
    """
    if head is not None:
        head = check_token_ids("hint_ids: head", head)  # 1.7 is no id 1 (docs/api.md: integers only)
        if not head:
            raise ValueError("hint_ids: head is empty (the hint goes after the prompt head's last token)")
        if lead_token is not None and int(lead_token) != head[-1]:
            raise ValueError(f"hint_ids: lead_token {lead_token} is not head's last token {head[-1]}")
        lead_token = head[-1]
    lead = [] if lead_token is None else [int(lead_token)]
    if isinstance(text, (bytes, bytearray)):  # its items are ints: b"ok" would pass as ids 111, 107
        raise TypeError(f"hint_ids: a hint is a str or token ids, got {type(text).__name__} (decode it first)")
    if not isinstance(text, str):
        return lead + check_token_ids("hint_ids: text", text)
    if not text:
        return lead

    from ..tokenizer import TextEncoder

    encoder = TextEncoder.of(tokenizer)  # a private read-only copy: special-token strings stay text

    def enc(s):
        return encoder.user([s])[0]

    if lead_token is None:
        return enc(HINT_SEPARATOR + text)
    if head is not None:
        return _checked_seam(encoder, head, text)
    lead_text = encoder.decode(lead, skip_special_tokens=False)
    if enc(lead_text) != lead:
        raise ValueError(f"the prompt head ends in token {lead_token}, which is not a whole character/pre-token "
                         f"({lead_text!r}); split the prompt elsewhere or pass hint token ids")
    return enc(lead_text + HINT_SEPARATOR + text)


def _checked_seam(encoder, head: List[int], text: str) -> List[int]:
    """``head[-1:]`` re-tokenized with HINT_SEPARATOR + ``text``, checked against the joint
    tokenization of the head's text and the hint (``hint_ids`` with ``head``).

    The head's last ``r`` tokens are re-read as text from ``p``, the last position of the
    window where Qwen3's tokenization provably splits (a letter or digit before it and a stop
    at it: ``acarerank.tokenizer``'s head-cut rule), or from the last control token or the
    head's start; tokens(head_text + sep + hint) is then head[:-r] + tokens(head_text[p:] + sep
    + hint), which must keep head[-r:-1] for the splice to be the joint tokenization.
    """
    from ..tokenizer import _head_cut_pattern

    added = set(encoder.added_tokens.values())
    floor = max((i + 1 for i, t in enumerate(head) if t in added), default=0)  # text after the last control token
    if floor == len(head):
        raise ValueError(f"the prompt head ends in the control token {head[-1]}, not in the user's text; the hint "
                         f"follows the user's text (split_student_prompt) or pass it as token ids")
    cut = _head_cut_pattern(encoder.special_tokens) if encoder._cuttable else None
    window = SEAM_WINDOW
    while True:
        start = max(floor, len(head) - window)
        tail_text = encoder.decode(head[start:], skip_special_tokens=False)
        splits = [m.end() for m in cut.finditer(tail_text)] if cut is not None else []
        if splits or start == floor:
            break
        window *= 2
    if splits:
        tail_text = tail_text[splits[-1]:]
    tail_ids = encoder.user([tail_text])[0]
    r = len(tail_ids)
    if r == 0 or tail_ids != head[len(head) - r:]:
        raise ValueError(f"the prompt head's last tokens {head[-max(r, 1):]} are not the tokenization of their text "
                         f"{tail_text!r} ({tail_ids}); build the prompt with this tokenizer or pass hint token ids")
    joint = encoder.user([tail_text + HINT_SEPARATOR + text])[0]
    if joint[:r - 1] != tail_ids[:-1]:
        raise ValueError(
            f"the hint separator {HINT_SEPARATOR!r} re-tokenizes the prompt head's end {tail_text!r} beyond its last "
            f"token ({tail_ids} becomes {joint[:r + 1]}...), so no teacher prompt that shares the head but its last "
            f"token is the teacher text's tokenization; end the user text with a word or a single punctuation mark "
            f"(as the setwise prompts' \"explain.\") or pass the hint as token ids")
    return joint[r - 1:]


__all__ = ["HINT_RUBRIC", "HINT_REFLECTION", "HINT_SIBLING", "HINT_KINDS", "HINT_SEPARATOR", "DIMENSION_LEVEL",
           "route_hints", "hint_text", "hint_ids", "format_rubrics", "format_selection"]
