"""bench/soak_serve.py's error-shape check against docs/serving.md "Errors" (the soak itself is a
benchmark, never run here): on /rerank a TEI body's error is TEI's ``{"error", "error_type"}`` with
the status's ``error_type``; a documents body may get either shape (TEI's when refused before its
body is read); every other route ours."""
import collections
import importlib.util
import json
import threading

import pytest

from _repo import ROOT

OURS = {429: {"error": {"message": "busy", "type": "rate_limit_error", "code": 429}},
        422: {"error": {"message": "bad", "type": "validation_error", "code": 422}}}
TEI = {429: {"error": "busy", "error_type": "Overloaded"}, 422: {"error": "bad", "error_type": "Validation"}}


def _soak():
    spec = importlib.util.spec_from_file_location("soak_serve", ROOT / "bench" / "soak_serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    soak = module.Soak.__new__(module.Soak)   # the checker alone: no server
    soak.lock, soak.status, soak.problems, soak.draining = threading.Lock(), collections.Counter(), [], False
    return soak


@pytest.mark.parametrize("path, body, answer, status, ok", [
    ("/rerank", dict(query="q", texts=["a"]), TEI[429], 429, True),
    ("/rerank", dict(query="q", texts=["a"]), OURS[429], 429, False),        # a TEI body in our shape
    ("/rerank", dict(query="q", texts=["a"]), TEI[422], 429, False),   # Validation for a 429
    ("/rerank", dict(query="q", documents=["a"]), TEI[429], 429, True),     # admission: before the body
    ("/rerank", dict(query="q", documents=["a"]), OURS[429], 429, True),
    ("/rerank", dict(query="q", documents=["a"], texts=None), OURS[422], 422, True),
    ("/v1/rerank", dict(query="q", texts=["a"]), OURS[422], 422, True),
    ("/v1/rerank", dict(query="q", documents=["a"]), TEI[422], 422, False),
])
def test_the_soak_checks_the_documented_error_shape(path, body, answer, status, ok):
    """It took either shape on /rerank for any body and any error_type: a TEI body answered in our
    shape, or a 429 typed Validation, passed."""
    soak = _soak()
    soak.record("malformed", status, body, json.dumps(answer), {"retry-after": "1"}, path)   # 422 and 429 allowed
    assert (not soak.problems) == ok, soak.problems
