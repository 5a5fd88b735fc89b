"""What the CLI says besides results and errors: ``--version``, and the NOTE for a context flag
given with no text in it (docs/api.md reads "" and whitespace as absent, so it changes the mode)."""
import importlib.metadata
import json

import pytest

from _tiny import tiny_causal
import acarerank
from acarerank.cli import main


def test_version_prints_the_package_version_and_exits_0(capsys):
    rc = main(["--version"])  # argparse's SystemExit(0) is main's return value
    cap = capsys.readouterr()
    assert rc == 0, (rc, cap.err)
    assert cap.out.strip() == f"acarerank {acarerank.__version__}", cap.out
    # the installed distribution's version (setup.py) is the same string
    assert importlib.metadata.version("acarerank") == acarerank.__version__


@pytest.fixture(scope="module")
def ckpt_and_docs(tmp_path_factory):
    d = tmp_path_factory.mktemp("notes")
    tiny_causal(seed=4, tie=True).save_pretrained(d / "ckpt")
    (d / "docs.jsonl").write_text('"first document"\n"second document"\n')
    (d / "empty.txt").write_text("")
    (d / "blank.txt").write_text(" \n\t\n")
    (d / "trace.txt").write_text("Searched for the answer.\n")
    return d


def _score(capsys, d, *extra):
    rc = main(["score", "--model", str(d / "ckpt"), "--dtype", "float32", "--query", "q",
               "--docs", str(d / "docs.jsonl"), *extra])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    notes = [line for line in cap.err.splitlines() if line.startswith("NOTE:")]
    return [json.loads(line)["score"] for line in cap.out.splitlines()], notes


@pytest.mark.parametrize("trace_name, question, mode", [
    ("empty.txt", None, "M0"), ("blank.txt", None, "M0"), ("empty.txt", "the question", "M2")])
def test_a_trace_file_with_no_text_is_noted_with_the_mode_scored(capsys, ckpt_and_docs, trace_name, question, mode):
    d = ckpt_and_docs
    q_flags = ["--question", question] if question else []
    scores, notes = _score(capsys, d, "--trace-file", str(d / trace_name), *q_flags)
    assert len(notes) == 1 and trace_name in notes[0] and f"mode {mode}" in notes[0], notes
    plain, plain_notes = _score(capsys, d, *q_flags)  # what it scored: the same call without the flag
    assert scores == plain and not plain_notes, (scores, plain, plain_notes)


def test_a_blank_question_and_trace_are_one_note(capsys, ckpt_and_docs):
    d = ckpt_and_docs
    _, notes = _score(capsys, d, "--question", "  ", "--trace-file", str(d / "empty.txt"))
    assert len(notes) == 1 and "--question and --trace-file" in notes[0] and "mode M0" in notes[0], notes


def test_context_with_text_gives_no_note(capsys, ckpt_and_docs):
    d = ckpt_and_docs
    _, notes = _score(capsys, d, "--question", "the question", "--trace-file", str(d / "trace.txt"))
    assert notes == [], notes


@pytest.mark.parametrize("command, fields", [("score", ("index", "score")), ("select", ("rank", "index"))])
def test_a_documents_own_field_that_the_output_replaces_is_noted(capsys, ckpt_and_docs, command, fields):
    """A document's own "index" (a corpus position, or a previous ``score``'s output piped in) was
    replaced by the line number with no sign: a join on it then picked other documents."""
    d = ckpt_and_docs
    docs = d / f"own-fields-{command}.jsonl"
    docs.write_text("\n".join(json.dumps(x) for x in (
        {"text": "a", "index": 5012, "score": 3.5, "rank": 9}, "plain", {"text": "c", "index": 7})) + "\n")
    rc = main([command, "--model", str(d / "ckpt"), "--dtype", "float32", "--query", "q", "--docs", str(docs)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    notes = [line for line in cap.err.splitlines() if line.startswith("NOTE:") and "own" in line]
    want = {"index": "2 documents (index 0, 2)", "score": "1 document (index 0)", "rank": "1 document (index 0)"}
    assert len(notes) == len(fields), notes
    for field, note in zip(fields, notes):
        assert note.startswith(f"NOTE: {want[field]}") and f'own "{field}"' in note, (field, note)
    rows = [json.loads(line) for line in cap.out.splitlines()]
    assert all(r["index"] in (0, 1, 2) for r in rows), rows  # the output's own, as documented


def test_documents_without_those_fields_give_no_note(capsys, ckpt_and_docs):
    d = ckpt_and_docs
    _, notes = _score(capsys, d)
    assert notes == [], notes
