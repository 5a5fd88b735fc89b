"""``Engine.submit`` refuses, on the caller's thread, an encoding the model would refuse by name
(built for a longer cap, by hand): the caller's error, never a model failure counted toward the
canary (docs/serving.md, "A broken engine is found")."""
import pytest
from _optional import require

require("fastapi")  # acarerank.server's package imports its app

from acarerank import PointwiseReranker, ScoreRequest  # noqa: E402
from acarerank.server.engine import Engine  # noqa: E402
from acarerank.server.metrics import ServerMetrics  # noqa: E402
from serve_util import tiny_model  # noqa: E402

LONG_DOC = "bread and rivers and a tutor who hints " * 40   # ~320 tokens: over a 128-token cap


@pytest.fixture(scope="module")
def rerankers():
    model = tiny_model()
    short = PointwiseReranker(model=model, max_length=128, min_doc_tokens=16)
    long = PointwiseReranker(runner=short.runner, max_length=512, min_doc_tokens=16)   # same weights, a longer cap
    return short, long


def canary_runs(metrics) -> dict:
    return {o: metrics.canary.labels(o)._value.get() for o in ("passed", "failed")}


def test_an_encoding_of_a_longer_cap_is_refused_at_submit_and_never_counted(rerankers):
    short, long = rerankers
    metrics = ServerMetrics(short.cache_stats)
    eng = Engine(short, max_batch_tokens=4096, metrics=metrics, canary=short.encode(ScoreRequest("q", ["d"])),
                 canary_after=1).start()
    try:
        too_long = long.encode(ScoreRequest("which one is about bread?", ["short", LONG_DOC]))
        assert len(too_long.shared_ids) + len(too_long.segment_ids[1]) > 128
        with pytest.raises(ValueError, match=r"document 1 .*over this reranker's max_length=128 .*built for "
                                             r"max_length=512"):
            eng.submit(too_long)
        shared_too_long = long.encode(ScoreRequest(LONG_DOC[:400], ["d"]))   # a query over the cap
        with pytest.raises(ValueError, match=r"shared part of \d+ tokens leaves no room .*max_length=128"):
            eng.submit(shared_too_long)
        with pytest.raises(TypeError, match="PointwiseEncoding"):
            eng.submit(object())
        assert eng.model_failures_in_a_row == 0
        assert canary_runs(metrics) == {"passed": 0, "failed": 0}
        assert metrics.engine_failures.labels("pass")._value.get() == 0
        # the engine still serves, and an encoding of its own cap is taken
        fits = short.encode(ScoreRequest("which one is about bread?", ["short", LONG_DOC]))
        got = eng.submit(fits).future.result(60).scores
        ref = short.score("which one is about bread?", ["short", LONG_DOC])
        assert got == pytest.approx([float(x) for x in ref], abs=1e-6)
    finally:
        eng.stop()
