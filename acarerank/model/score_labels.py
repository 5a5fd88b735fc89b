"""Which row of a sequence-classification ``score.weight`` is "yes": the config's ``id2label``.

A Qwen3ForSequenceClassification head has no fixed row meaning; ``id2label`` names the rows.
The runner reads a 2-row head as [no, yes] (score = softmax(logits)[yes]) and a 1-row head as
the yes−no direction (score = sigmoid(logit)), so the rows are put in that order once, at load.
The rule (docs/input-safety.md, "A score head's rows follow the config's id2label"):

* labels compared case- and whitespace-insensitively, ``_`` and ``-`` read as spaces;
* yes: "yes", "relevant"; no: "no", "not relevant", "irrelevant" — the tokens the head is
  converted from, and the two names with one reading for a reranker. Other pairs
  ("positive"/"negative", "true"/"false", "entailment"/...) are not guessed at;
* transformers' generic names (``LABEL_<i>`` at index i) or no ``id2label``: label 1 is the
  positive class (the [no, yes] conversion of Qwen3-Reranker; a 1-row head is yes−no);
* anything else, or a label count other than the rows: ValueError naming the labels;
* ``label2id`` beside ``id2label`` must name the rows alike: each of its labels at the row
  ``id2label`` gives that label, or a yes / no name at the row read as yes / no (so "relevant"
  beside "yes" agrees); transformers' generic ``LABEL_<i>`` at i is no claim (it stays in a config
  whose ``id2label`` was renamed after construction). transformers reads only ``id2label``, but a
  config whose two maps disagree was written by someone who meant one of them: ValueError naming both.
"""
from __future__ import annotations

from collections.abc import Mapping

YES = frozenset({"yes", "relevant"})
NO = frozenset({"no", "not relevant", "irrelevant"})

_FIX = {1: "if score.weight is the yes−no direction, label its row 'yes' in config.json: id2label {\"0\": \"yes\"}",
        2: "rename config.json's id2label (and label2id) to 'no' / 'yes' in the order of score.weight's rows, "
           "e.g. {\"0\": \"no\", \"1\": \"yes\"}"}


def _norm(label) -> str:
    return " ".join(str(label).lower().replace("_", " ").replace("-", " ").split())


def _labels(id2label, rows: int) -> list:
    """id2label as a list indexed by row (its keys: ints or their strings, 0..n-1)."""
    if not isinstance(id2label, Mapping):
        raise ValueError(f"id2label must map row indices to label names, got {id2label!r}")
    try:
        by_row = {int(k): v for k, v in id2label.items()}
    except (TypeError, ValueError):
        raise ValueError(f"id2label {dict(id2label)} has keys that are not row indices") from None
    if sorted(by_row) != list(range(len(by_row))) or not all(isinstance(v, str) for v in by_row.values()):
        raise ValueError(f"id2label {dict(id2label)} must map the rows 0..n-1 to label names")
    if len(by_row) != rows:
        raise ValueError(f"id2label {dict(id2label)} names {len(by_row)} labels but score.weight has {rows} "
                         "row(s): the config and the weights disagree (transformers refuses such a checkpoint)")
    return [by_row[i] for i in range(rows)]


def yes_no_rows(id2label, rows: int, label2id=None) -> list:
    """Row indices of ``score.weight`` ([rows, H], rows 1 or 2) in the runner's order:
    [yes] for 1 row, [no, yes] for 2. ``id2label``, ``label2id``: the config's (None when it has none)."""
    order = _yes_no_rows(id2label, rows)
    if id2label is not None and label2id is not None:
        _check_label2id(label2id, _labels(id2label, rows), order)
    return order


def _check_label2id(label2id, labels: list, order: list) -> None:
    """ValueError naming both maps when ``label2id`` puts a label at another row than id2label
    (``labels``, by row) or, for a yes / no name, than the row ``order`` reads as yes / no."""
    if not isinstance(label2id, Mapping):
        raise ValueError(f"label2id must map label names to row indices, got {label2id!r}")
    rows = len(order)
    both = f"label2id {dict(label2id)} disagrees with id2label {dict(enumerate(labels))}"
    for label, idx in label2id.items():
        try:  # JSON keeps ints; transformers' type hint allows their strings too
            row = int(idx) if isinstance(idx, (int, str)) and not isinstance(idx, bool) else None
        except ValueError:
            row = None
        if row is None or not 0 <= row < rows:
            raise ValueError(f"{both}: label2id maps {label!r} to {idx!r}, not a row of score.weight (0..{rows - 1})")
        n = _norm(label)
        if (n in (f"label {row}", _norm(labels[row])) or (n in YES and row == order[-1])
                or (n in NO and rows == 2 and row == order[0])):
            continue
        raise ValueError(f"{both}: label2id maps {label!r} to row {row}, where id2label has {labels[row]!r} "
                         f"(row {order[-1]} is read as 'yes'); make label2id the inverse of id2label")


def _yes_no_rows(id2label, rows: int) -> list:
    if id2label is None:
        return list(range(rows))
    labels = _labels(id2label, rows)
    names = [_norm(v) for v in labels]
    if all(n == f"label {i}" for i, n in enumerate(names)):
        return list(range(rows))  # generic: label 1 (or the only row) is the positive class
    if rows == 1 and names[0] in YES:
        return [0]
    if rows == 2 and {names[0] in YES, names[1] in YES} == {True, False} and any(n in NO for n in names):
        yes = 0 if names[0] in YES else 1
        return [1 - yes, yes]
    raise ValueError(f"id2label {dict(enumerate(labels))} does not say which row of score.weight ({rows} row(s)) "
                     "is the relevance 'yes': the labels must be transformers' generic LABEL_0, LABEL_1 (label 1 = "
                     "yes) or name the answer ('yes' / 'no', 'relevant' / 'not_relevant' or 'irrelevant'); "
                     + _FIX[rows])
