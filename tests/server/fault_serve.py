"""``acarerank serve`` with a test double around the reranker's scoring pass (for
``test_serve_dead_exit.py``; nothing in the package changes): a pass holding a request whose query
contains "poison" raises the ``BaseException`` named by ``FAULT`` (KeyboardInterrupt or SystemExit);
``FAULT=sticky``: that pass raises a ``RuntimeError`` and so does every pass after it (a device
broken for good by a device-side assert), the canary's included. ``FAULT=always``: every pass
raises a ``RuntimeError``, the warm-up's first. ``FAULT=RuntimeError``: only a pass holding a
poisoned request raises a ``RuntimeError`` (a fault the engine's culprit search isolates: that
request gets its 500, every other one its scores; ``bench/soak_serve.py``).
``FAULT=hang``: a pass holding a poisoned request never returns (a model call that hangs);
``FAULT=hang_always``: every pass never returns, the warm-up's first.
``FAULT=at_shutdown``: the poisoned pass waits until uvicorn has stopped (the final
``_stop_bounded`` begins), then raises ``SystemExit``: the engine dies during the shutdown.

    python tests/server/fault_serve.py serve --model DIR --port N ...
"""
import os
import sys
import threading

from acarerank.pointwise import PointwiseReranker
from acarerank.server import front

FAULT = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit, "at_shutdown": SystemExit,
         "sticky": RuntimeError, "always": RuntimeError,
         "RuntimeError": RuntimeError, "hang": RuntimeError,
         "hang_always": RuntimeError}[os.environ.get("FAULT", "SystemExit")]
AT_SHUTDOWN = os.environ.get("FAULT") == "at_shutdown"
HANG = os.environ.get("FAULT") in ("hang", "hang_always")
uvicorn_stopped = threading.Event()
STICKY = os.environ.get("FAULT") == "sticky"
broken = [True] if os.environ.get("FAULT") in ("always", "hang_always") else []
front.DEAD_GRACE_S = 3.0   # long enough for the test's probes on a loaded machine
encode, score_segments = PointwiseReranker.encode, PointwiseReranker.score_segments


def encode_marked(self, request, **kw):
    enc = encode(self, request, **kw)   # the service passes truncate / max_doc_tokens
    enc.poison = "poison" in request.query
    return enc


def score_or_die(self, items):
    if broken or any(getattr(h.encoding, "poison", False) for h, _ in items):
        if STICKY:
            broken.append(True)
        if HANG:
            threading.Event().wait()
        if AT_SHUTDOWN:
            assert uvicorn_stopped.wait(60)
        raise FAULT("injected into the scoring pass")
    return score_segments(self, items)


def stop_after_uvicorn(*args, **kwargs):
    uvicorn_stopped.set()
    return stop_bounded(*args, **kwargs)


stop_bounded = front._stop_bounded
front._stop_bounded = stop_after_uvicorn
PointwiseReranker.encode = encode_marked
PointwiseReranker.score_segments = score_or_die

if __name__ == "__main__":
    from acarerank.cli import main
    sys.exit(main())
