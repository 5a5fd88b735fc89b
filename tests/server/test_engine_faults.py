"""The scheduler's fault handling over a fake step API (no model): a failing pass is bisected so
one bad request fails alone within the pass bound, an out-of-memory pass (or prefix prefill) is
first retried at half the tokens, and anything escaping the loop (``BaseException`` included) kills the engine
loudly — every job fails at once, new ones are refused, prefixes are released."""
import concurrent.futures
import logging
import math
import threading
import time
from dataclasses import dataclass

import pytest
from _optional import require

require("fastapi")  # acarerank.server's package imports its app

from acarerank.server.engine import Engine, EngineDead, EngineFault  # noqa: E402
from acarerank.server.metrics import ServerMetrics  # noqa: E402


@dataclass
class Enc:
    shared_ids: list
    segment_ids: list


@dataclass(eq=False)
class Handle:
    tag: int
    prompt_tokens: int
    cached_tokens: int = 0


class FaultySteps:
    """score(segment of request t) = t + len/1000; ``fault(tags, tokens)`` returns the exception a
    pass raises (None: it passes); counts passes and pinned prefixes."""

    def __init__(self, fault=None):
        self.fault = fault or (lambda tags, tokens: None)
        self.passes = []          # the request tags of each pass, in order
        self.pinned = set()

    def acquire_prefix(self, enc):
        h = Handle(enc.shared_ids[0], 1 + sum(map(len, enc.segment_ids)))
        self.pinned.add(id(h))
        return h

    def score_segments(self, items):
        tags = [h.tag for h, _ in items]
        self.passes.append(sorted(set(tags)))
        exc = self.fault(set(tags), sum(len(s) for _, s in items))
        if exc is not None:
            raise exc
        return [h.tag + len(s) / 1000 for h, s in items]

    def release_prefix(self, h):
        self.pinned.discard(id(h))


def run_jobs(steps, lengths: dict, budget=1000, metrics=None):
    """Submit every request before the loop starts, so the first pass holds them all."""
    encs = {t: Enc([t], [[1] * n for n in ls]) for t, ls in lengths.items()}
    return run_encodings(Engine(steps, max_batch_tokens=budget, metrics=metrics), encs)


def run_encodings(eng, encs: dict):
    """Submit ``encs`` ({tag: Enc}) to ``eng``, start it, and return {tag: result or EngineFault}."""
    jobs = {t: eng.submit(enc, rid=f"r{t}") for t, enc in encs.items()}
    eng.start()
    try:
        out = {}
        for t, job in jobs.items():
            try:
                out[t] = job.future.result(30)
            except EngineFault as e:
                out[t] = e
    finally:
        eng.stop()
    return out


@pytest.mark.parametrize("exc_type", [RuntimeError, ValueError, KeyError])
@pytest.mark.parametrize("culprit", [1, 5, 8])
def test_one_bad_request_fails_alone_within_the_pass_bound(exc_type, culprit):
    n = 8
    lengths = {t: [t + 1, 3] for t in range(1, n + 1)}
    steps = FaultySteps(lambda tags, tokens: exc_type("bad kernel input") if culprit in tags else None)
    metrics = ServerMetrics()
    out = run_jobs(steps, lengths, metrics=metrics)
    for t, ls in lengths.items():
        if t == culprit:
            assert isinstance(out[t], EngineFault), f"culprit {t}: {out[t]!r}"
            assert isinstance(out[t].__cause__, exc_type) and out[t].stage == "pass"
        else:
            assert not isinstance(out[t], Exception), f"innocent request {t} failed: {out[t]!r}"
            assert out[t].scores == [t + x / 1000 for x in ls], f"request {t}: {out[t].scores}"
    extra = len(steps.passes) - 1
    bound = math.ceil(math.log2(n))
    # log2(n) probes, one pass of the culprit alone when found by elimination, one of the halves set aside
    assert extra <= bound + 2, f"{extra} extra passes for one culprit among {n}: {steps.passes}"
    if culprit == n:  # the last one: every first half passes, found in log2(n) passes, then run alone
        assert extra == bound + 1 and steps.passes[-1] == [n], steps.passes
    assert not steps.pinned, "prefixes left pinned"
    assert metrics.engine_failures.labels("pass")._value.get() == 1


def test_two_bad_requests_both_isolated():
    lengths = {t: [4] for t in range(1, 7)}
    steps = FaultySteps(lambda tags, tokens: RuntimeError("x") if tags & {2, 6} else None)
    out = run_jobs(steps, lengths)
    assert {t for t, r in out.items() if isinstance(r, EngineFault)} == {2, 6}
    assert all(out[t].scores == [t + 0.004] for t in (1, 3, 4, 5))
    assert not steps.pinned


@pytest.mark.parametrize("width", [2, 3, 8])
def test_a_pass_that_fails_only_for_its_mix_fails_nobody(width):
    """A pass that fails for what its requests do together (a kernel's size limit, not any one
    request) scores everyone in smaller passes: a request found by elimination runs alone before
    it is failed. It was once failed without ever running alone (the last of the 8 here)."""
    lengths = {t: [t + 1, 3] for t in range(1, 9)}
    steps = FaultySteps(lambda tags, tokens: RuntimeError("grid too large") if len(tags) >= width else None)
    out = run_jobs(steps, lengths)
    for t, ls in lengths.items():
        assert not isinstance(out[t], Exception), f"request {t} failed with {width}-wide passes: {out[t]!r}"
        assert out[t].scores == [t + x / 1000 for x in ls], f"request {t}: {out[t].scores}"
    assert not steps.pinned


class BadScores(FaultySteps):
    """Passes that hold request ``culprit`` return NaN / inf for its segments, or one score too few."""

    def __init__(self, culprit, how):
        super().__init__()
        self.culprit, self.how = culprit, how

    def score_segments(self, items):
        scores = super().score_segments(items)
        if self.culprit not in {h.tag for h, _ in items}:
            return scores
        if self.how == "short":
            return scores[:-1]
        return [float(self.how) if h.tag == self.culprit else s for (h, _), s in zip(items, scores)]


@pytest.mark.parametrize("how", ["nan", "inf", "short"])
def test_a_score_that_is_not_a_finite_number_fails_its_request_alone(how):
    """A NaN/inf score, or a pass that returns fewer scores than segments, is a fault of the model:
    that request fails alone (its NaN once went out as the request's scores; a short list left it
    pending for ever while the loop spun), the others keep their scores."""
    lengths = {t: [t + 1, 3] for t in range(1, 6)}
    out = run_jobs(BadScores(3, how), lengths)
    assert isinstance(out[3], EngineFault) and out[3].stage == "pass", out[3]
    assert "finite" in str(out[3]) or "scores for" in str(out[3]), out[3]
    for t in (1, 2, 4, 5):
        assert not isinstance(out[t], Exception), f"innocent request {t} failed: {out[t]!r}"
        assert out[t].scores == [t + x / 1000 for x in lengths[t]], f"request {t}: {out[t].scores}"


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_step_api_returning_array_scores_answers_python_floats(kind):
    """A step API whose ``score_segments`` returns a numpy array or a torch tensor of float32: each
    request gets its scores as Python floats, which the response's JSON encoder takes. Passed on as
    they came, float32 scalars were a bare 500 at encoding (no error id, counted as scored)."""
    import msgspec
    import numpy as np
    import torch

    class ArraySteps(FaultySteps):
        def score_segments(self, items):
            out = np.asarray(super().score_segments(items), dtype=np.float32)
            return out if kind == "numpy" else torch.from_numpy(out)

    out = run_jobs(ArraySteps(), {1: [2, 3], 2: [1]})
    for t, want in ((1, [1.002, 1.003]), (2, [2.001])):
        assert [type(v) for v in out[t].scores] == [float] * len(want), out[t].scores
        assert out[t].scores == pytest.approx(want, rel=1e-6), (t, out[t].scores)
        msgspec.json.encode(out[t].scores)


@pytest.mark.parametrize("oom", [MemoryError, "torch"])
def test_out_of_memory_retries_at_half_the_tokens_and_fails_nobody(oom):
    import torch
    exc_type = torch.OutOfMemoryError if oom == "torch" else oom
    lengths = {t: [10, 10] for t in range(1, 5)}          # 80 tokens in one pass
    steps = FaultySteps(lambda tags, tokens: exc_type("out of memory") if tokens > 40 else None)
    out = run_jobs(steps, lengths)
    for t, ls in lengths.items():
        assert not isinstance(out[t], Exception), f"request {t} failed: {out[t]!r}"
        assert out[t].scores == [t + 0.01, t + 0.01]
    assert len(steps.passes) == 3, f"one failed pass, then two of half the tokens: {steps.passes}"


@pytest.mark.parametrize("alone", [True, False])
def test_a_request_whose_half_runs_out_of_memory_too_is_scored_in_smaller_passes(alone):
    """Memory for 15 segment tokens a pass: a request of 4 documents of 10 tokens ran out of memory
    at 40 tokens and again at 20 (its half), and got a 500 — its other half never run, though each
    document alone scored (docs/serving.md: a pass too large is not a bad request). Its documents
    are now halved until they fit; a document that does not fit alone still fails its request."""
    import torch
    lengths = {1: [10, 10, 10, 10]} if alone else {1: [10, 10, 10, 10], 2: [3], 3: [16]}
    steps = FaultySteps(lambda tags, tokens: torch.OutOfMemoryError("oom") if tokens > 15 else None)
    out = run_jobs(steps, lengths)
    assert not isinstance(out[1], Exception), f"request 1 failed: {out[1]!r} after passes {steps.passes}"
    assert out[1].scores == [1.01] * 4, out[1].scores
    if not alone:
        assert out[2].scores == [2.003]
        assert isinstance(out[3], EngineFault) and isinstance(out[3].__cause__, torch.OutOfMemoryError), out[3]


def test_out_of_memory_of_one_request_isolates_it():
    import torch
    lengths = {1: [5], 2: [50], 3: [5], 4: [5]}
    steps = FaultySteps(lambda tags, tokens: torch.OutOfMemoryError("oom") if 2 in tags else None)
    out = run_jobs(steps, lengths)
    assert isinstance(out[2], EngineFault) and isinstance(out[2].__cause__, torch.OutOfMemoryError)
    assert all(out[t].scores == [t + 0.005] for t in (1, 3, 4))


def test_failure_line_names_request_and_error_id(caplog):
    steps = FaultySteps(lambda tags, tokens: RuntimeError("kernel fault") if 3 in tags else None)
    with caplog.at_level(logging.ERROR, logger="acarerank.server"):
        out = run_jobs(steps, {t: [2] for t in range(1, 5)})
    lines = [r.getMessage() for r in caplog.records if "engine pass failed" in r.getMessage()]
    assert len(lines) == 1, lines
    assert out[3].error_id in lines[0] and "r3" in lines[0] and "RuntimeError: kernel fault" in lines[0], lines[0]


def test_prefill_failure_fails_that_request_only():
    class BadPrefill(FaultySteps):
        def acquire_prefix(self, enc):
            if enc.shared_ids[0] == 2:
                raise RuntimeError("prefill kernel fault")
            return super().acquire_prefix(enc)

    steps = BadPrefill()
    metrics = ServerMetrics()
    out = run_jobs(steps, {t: [3] for t in range(1, 4)}, metrics=metrics)
    assert isinstance(out[2], EngineFault) and out[2].stage == "prefill"
    assert out[1].scores == [1.003] and out[3].scores == [3.003]
    assert metrics.engine_failures.labels("prefill")._value.get() == 1


class OomPrefill(FaultySteps):
    """Prefill chunk 8; request 2's prefill runs out of memory while its chunk exceeds ``fits``
    (None: always); records each call's (tag, chunk_tokens)."""
    prefill_chunk = 8

    def __init__(self, fits=None, exc=None):
        super().__init__()
        self.fits, self.exc, self.calls = fits, exc, []

    def acquire_prefix(self, enc, chunk_tokens=None):
        tag = enc.shared_ids[0]
        self.calls.append((tag, chunk_tokens))
        chunk = min(chunk_tokens or self.prefill_chunk, len(enc.shared_ids))
        if tag == 2 and (self.fits is None or chunk > self.fits):
            import torch
            raise self.exc or torch.OutOfMemoryError("injected out of memory")
        return super().acquire_prefix(enc)


def run_prefix_jobs(steps, prefix_len: int):
    """Requests 1..3 with a ``prefix_len``-token shared part and one 3-token document each."""
    eng = Engine(steps, max_batch_tokens=1000, metrics=ServerMetrics())
    return run_encodings(eng, {t: Enc([t] * prefix_len, [[1] * 3]) for t in (1, 2, 3)}), eng.metrics


def test_prefill_out_of_memory_is_retried_once_at_half_the_chunk():
    steps = OomPrefill(fits=4)
    out, metrics = run_prefix_jobs(steps, prefix_len=20)
    assert all(out[t].scores == [t + 0.003] for t in (1, 2, 3)), out
    assert [c for c in steps.calls if c[0] == 2] == [(2, None), (2, 4)], steps.calls
    assert metrics.engine_failures.labels("prefill")._value.get() == 0


def test_prefill_retry_halves_the_prefix_when_it_is_shorter_than_the_chunk():
    steps = OomPrefill(fits=2)
    out, _ = run_prefix_jobs(steps, prefix_len=5)         # chunk 8 > 5 tokens: half of 5 is 2
    assert out[2].scores == [2.003], out[2]
    assert [c for c in steps.calls if c[0] == 2] == [(2, None), (2, 2)], steps.calls


@pytest.mark.parametrize("case", ["oom twice", "not oom", "one token"])
def test_prefill_that_fails_again_or_not_for_memory_fails_alone(case):
    steps = OomPrefill(exc=RuntimeError("prefill kernel fault") if case == "not oom" else None)
    out, metrics = run_prefix_jobs(steps, prefix_len=1 if case == "one token" else 20)
    assert isinstance(out[2], EngineFault) and out[2].stage == "prefill", out[2]
    assert out[1].scores == [1.003] and out[3].scores == [3.003]
    want = [(2, None), (2, 4)] if case == "oom twice" else [(2, None)]
    assert [c for c in steps.calls if c[0] == 2] == want, steps.calls
    assert metrics.engine_failures.labels("prefill")._value.get() == 1
    assert not steps.pinned


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_base_exception_in_a_pass_kills_the_engine_loudly(exc_type, caplog):
    gate = threading.Event()

    class Deadly(FaultySteps):
        def score_segments(self, items):
            assert gate.wait(30)
            raise exc_type("injected")

    steps = Deadly()
    dead = []
    metrics = ServerMetrics()
    eng = Engine(steps, max_batch_tokens=100, metrics=metrics)
    eng.on_dead.append(dead.append)
    first = eng.submit(Enc([1], [[1, 1]]))
    eng.start()
    waiting = eng.submit(Enc([2], [[1] * 200]))   # longer than the budget: waits for a later pass
    assert eng.health()["state"] in ("idle", "busy")
    with caplog.at_level(logging.CRITICAL, logger="acarerank.server"):
        gate.set()
        for job in (first, waiting):
            with pytest.raises(EngineDead):
                job.future.result(30)
    for _ in range(500):   # the callbacks run right after the futures fail
        if dead:
            break
        threading.Event().wait(0.01)
    assert eng.dead is not None and exc_type.__name__ in eng.dead and "injected" in eng.dead, eng.dead
    assert dead == [eng.dead], "on_dead not called once with the reason"
    assert eng.health()["state"] == "dead" and eng.health()["reason"] == eng.dead
    with pytest.raises(EngineDead):
        eng.submit(Enc([3], [[1]]))
    assert not steps.pinned, "prefixes left pinned by the dead engine"
    assert any("engine dead" in r.getMessage() and "Traceback" in r.getMessage() for r in caplog.records)
    assert metrics.engine_failures.labels("engine")._value.get() == 1
    eng.stop(5)


def test_every_on_dead_callback_runs_and_a_base_exception_is_raised_after_the_last(monkeypatch, caplog):
    """An ``on_dead`` callback that raised SystemExit (an embedder's sys.exit) or KeyboardInterrupt
    stopped the callbacks after it: ``acarerank serve``'s own (which ends the process with status
    70) could be skipped and the server stayed up, answering 503 for ever. Every callback runs now;
    an Exception is logged, and the first BaseException is raised again after the last callback,
    on the thread that noticed (here the scheduler's: its thread ends with it)."""
    from acarerank.server.engine import run_on_dead

    def raiser(exc):
        def fn(reason):
            calls.append((type(exc).__name__, reason))
            raise exc
        return fn

    calls = []
    callbacks = [raiser(SystemExit(3)), raiser(ValueError("bug")), calls.append, raiser(KeyboardInterrupt()),
                 calls.append]
    with pytest.raises(SystemExit) as e:
        run_on_dead(callbacks, "why")
    assert e.value.code == 3
    assert calls == [("SystemExit", "why"), ("ValueError", "why"), "why", ("KeyboardInterrupt", "why"), "why"]
    calls.clear()
    run_on_dead([raiser(ValueError("bug")), calls.append], "why")  # an Exception is logged, not raised
    assert calls == [("ValueError", "why"), "why"]

    class Deadly(FaultySteps):
        def score_segments(self, items):
            raise KeyboardInterrupt("injected")

    ended = []
    monkeypatch.setattr(threading, "excepthook", lambda args: ended.append(args.exc_type))
    calls.clear()
    caplog.clear()
    eng = Engine(Deadly(), max_batch_tokens=100)
    eng.on_dead.extend(callbacks)
    job = eng.submit(Enc([1], [[1, 1]]))
    with caplog.at_level(logging.ERROR, logger="acarerank.server"):
        eng.start()
        with pytest.raises(EngineDead):
            job.future.result(30)
        eng._thread.join(30)
    assert calls == [("SystemExit", eng.dead), ("ValueError", eng.dead), eng.dead, ("KeyboardInterrupt", eng.dead),
                     eng.dead], calls
    assert ended == [SystemExit]
    assert sum("on_dead callback failed" in r.getMessage() for r in caplog.records) == 3
    eng.stop(5)

    # the service's own death (a tokenizer pool that refuses work) runs the same callbacks
    from acarerank.server.service import RerankService

    class Steps(FaultySteps):
        max_batch_tokens = 100

        def cache_stats(self):
            return {}

    svc = RerankService(Steps(), "fake")
    svc.on_dead.extend(callbacks)
    calls.clear()
    with pytest.raises(SystemExit):
        svc._mark_dead("the tokenizer pool cannot run work")
    assert calls == [("SystemExit", svc.dead), ("ValueError", svc.dead), svc.dead, ("KeyboardInterrupt", svc.dead),
                     svc.dead] and "tokenizer pool" in svc.dead, calls
    svc.stop()


def _wait_for_scheduler_end(eng, timeout: float = 10.0) -> None:
    """Until the engine's scheduler thread has ended (its held step returned, its clean-up done)."""
    deadline = time.monotonic() + timeout
    while eng.threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not eng.threads(), "the scheduler thread did not end after its step returned"


@pytest.mark.parametrize("then", ["returns", "raises"])
def test_a_step_past_max_pass_s_kills_the_engine_once(caplog, then):
    """max_pass_s=0.3 (--max-pass-timeout) and a pass held past it: the watchdog makes the engine
    dead — the job in the pass and one queued behind it fail with EngineDead naming the flag at once,
    health() is dead, a new submit is refused, on_dead runs once. When the held step then returns,
    or raises a BaseException (which alone would kill the engine through _die), the reason stays,
    and nothing is logged, counted or called a second time; the pages are given back."""
    gate = threading.Event()

    class Held(FaultySteps):
        def score_segments(self, items):
            assert gate.wait(30)
            if then == "raises":
                raise SystemExit("the wedged call ends")
            return super().score_segments(items)

    metrics = ServerMetrics(lambda: {})
    steps = Held()
    eng = Engine(steps, max_batch_tokens=100, max_pass_s=0.3, metrics=metrics)
    calls = []
    eng.on_dead.append(calls.append)
    eng.start()
    try:
        first = eng.submit(Enc([1], [[1]]))
        for _ in range(300):   # the first pass holds it before the second arrives
            if eng.health()["state"] == "busy":
                break
            threading.Event().wait(0.01)
        second = eng.submit(Enc([2], [[2]]))
        for job in (first, second):
            with pytest.raises(EngineDead, match=r"in one step for 0\.\d s, more than --max-pass-timeout 0\.3 s"):
                job.future.result(10)
        assert eng.health()["state"] == "dead" and "--max-pass-timeout" in eng.health()["reason"]
        with pytest.raises(EngineDead):
            eng.submit(Enc([3], [[3]]))
        reason = eng.dead
        gate.set()
        eng.stop(10)   # returns at once after a wedge (Engine.stop): wait for the step's own end
        _wait_for_scheduler_end(eng)
        assert eng.dead == reason and calls == [reason], (eng.dead, calls)
        assert metrics.engine_failures.labels("engine")._value.get() == 1
        dead_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine dead:")]
        assert len(dead_lines) == 1 and "in score_segments" in dead_lines[0], dead_lines   # the wedged stack
        assert not steps.pinned, "the dead engine's prefixes were not released"
    finally:
        gate.set()
        eng.stop()


def test_a_step_past_max_pass_s_that_then_fails_runs_no_more_model_work(caplog):
    """Two requests in one pass held past max_pass_s=0.3: the watchdog fails both with EngineDead.
    When the held call then raises an ordinary Exception (a device error after the hang), the dead
    engine runs no culprit search over requests already answered: no further pass, no 'engine pass
    failed' line, no pass failure counted; their pages are given back. Without the watchdog marking
    them dropped, the bisection ran both halves through the model of a dead engine and logged and
    counted a fault for a request whose client already had its 503."""
    gate = threading.Event()

    class Held(FaultySteps):
        def score_segments(self, items):
            first = not self.passes
            out = super().score_segments(items)
            if first:
                assert gate.wait(30)
                raise RuntimeError("the wedged call ends in a device error")
            return out

    metrics = ServerMetrics(lambda: {})
    steps = Held()
    eng = Engine(steps, max_batch_tokens=100, max_pass_s=0.3, metrics=metrics)
    jobs = [eng.submit(Enc([t], [[1]]), rid=f"r{t}") for t in (1, 2)]   # both in the first pass
    eng.start()
    try:
        for job in jobs:
            with pytest.raises(EngineDead, match="--max-pass-timeout 0.3 s"):
                job.future.result(10)
        gate.set()
        eng.stop(10)   # returns at once after a wedge (Engine.stop): wait for the step's own end
        _wait_for_scheduler_end(eng)
        assert steps.passes == [[1, 2]], steps.passes   # the held pass only
        assert metrics.engine_failures.labels("pass")._value.get() == 0
        assert not [r for r in caplog.records if "engine pass failed" in r.getMessage()]
        assert not steps.pinned, "the dead engine's prefixes were not released"
    finally:
        gate.set()
        eng.stop()


class HeldSelect:
    """A setwise step API whose first prefill chunk waits for ``gate``, then raises (a device error after
    a hang); counts the selections it holds."""

    class State:
        prefilling, done = True, False

    def __init__(self, gate):
        self.gate, self.held = gate, set()

    def start_select(self, enc):
        st = self.State()
        self.held.add(id(st))
        return st

    def prefill_select(self, st, chunk):
        assert self.gate.wait(30)
        raise RuntimeError("the wedged call ends in a device error")

    def release_select(self, st):
        self.held.discard(id(st))


@pytest.mark.parametrize("stage", ["select", "prefill"])
def test_a_wedged_select_or_prefill_step_that_then_fails_is_not_counted_again(caplog, stage):
    """A /v1/select step (or a request's prefix prefill) held past max_pass_s=0.3: the watchdog fails
    its job and one queued behind it with EngineDead, and the engine reports no queue and nothing
    running (it is dead: the lists keep the jobs until the step returns). When the held call then
    raises, nothing more is logged or counted for the request already answered 503 (as the scoring
    pass's culprit search: the test above): engine_failures{stage} stays 0, no canary is due, and
    the pages go back. Without it the dead engine logged 'engine select failed' and counted a
    failure for it, and the gauges kept 2 jobs."""
    gate = threading.Event()

    class HeldPrefill(FaultySteps):
        def acquire_prefix(self, enc):
            h = super().acquire_prefix(enc)
            if enc.shared_ids == [1]:
                assert gate.wait(30)
                self.pinned.discard(id(h))   # acquire_prefix gives its pages back when it fails
                raise RuntimeError("the wedged call ends in a device error")
            return h

    metrics = ServerMetrics(lambda: {})
    steps, select = HeldPrefill(), HeldSelect(gate)
    eng = Engine(steps, max_batch_tokens=100, max_pass_s=0.3, metrics=metrics, select_steps=select,
                 canary=Enc([9], [[1]]), canary_after=1)
    first = eng.submit_select(object(), rid="s1") if stage == "select" else eng.submit(Enc([1], [[1]]), rid="r1")
    eng.start()
    try:
        for _ in range(300):   # the first step holds it before the second arrives
            if eng.health()["state"] == "busy":
                break
            threading.Event().wait(0.01)
        second = eng.submit(Enc([2], [[2]]), rid="r2")
        for job in (first, second):
            with pytest.raises(EngineDead, match="--max-pass-timeout 0.3 s"):
                job.future.result(10)
        assert eng.depth() == (0, 0)
        assert metrics.queue_size._value.get() == 0 and metrics.running._value.get() == 0
        gate.set()
        eng.stop(10)   # returns at once after a wedge (Engine.stop): wait for the step's own end
        _wait_for_scheduler_end(eng)
        assert metrics.engine_failures.labels(stage)._value.get() == 0
        assert metrics.engine_failures.labels("engine")._value.get() == 1
        assert eng.model_failures_in_a_row == 0 and metrics.canary.labels("failed")._value.get() == 0
        assert not [r for r in caplog.records if f"engine {stage} failed" in r.getMessage()]
        assert not steps.pinned and not select.held, "the dead engine's pages were not released"
    finally:
        gate.set()
        eng.stop()


@pytest.mark.parametrize("then", ["max_pass_s", "base_exception"])
def test_a_call_that_never_returns_or_kills_the_engine_gets_engine_dead(then):
    """A submit_call job is out of every queue while it runs: held past max_pass_s, the watchdog
    failed every other job and left it pending; ending on a BaseException (the engine dies through
    _die) left it pending too. Its waiter got nothing until its own timeout; now EngineDead."""
    gate = threading.Event()

    def call():
        if then == "base_exception":
            raise SystemExit("the call ends the engine")
        assert gate.wait(30)
        return "late"

    eng = Engine(FaultySteps(), max_batch_tokens=100, max_pass_s=0.3 if then == "max_pass_s" else None)
    eng.start()
    try:
        job = eng.submit_call(call)
        with pytest.raises(EngineDead):
            job.future.result(10)
        gate.set()
        if then == "max_pass_s":
            eng.stop(10)
            _wait_for_scheduler_end(eng)   # the late result neither replaces the 503 nor fails the loop
            with pytest.raises(EngineDead):
                job.future.result(0)
    finally:
        gate.set()
        eng.stop()


def test_the_watchdog_ends_when_the_engine_dies_another_way():
    """max_pass_s=600 and a pass that kills the engine at once (a BaseException, through _die): the
    watchdog thread ends with the engine, without a stop(). It slept out the bound first (600 s
    here, the --max-pass-timeout of a deployment), holding the dead engine, its model and pages."""
    class Dying(FaultySteps):
        def score_segments(self, items):
            raise SystemExit("the engine dies")

    before = set(threading.enumerate())
    eng = Engine(Dying(), max_batch_tokens=100, max_pass_s=600)
    eng.start()
    watchdogs = [t for t in set(threading.enumerate()) - before if t.name == "acarerank-watchdog"]
    assert len(watchdogs) == 1, watchdogs
    with pytest.raises(EngineDead):
        eng.submit(Enc([1], [[1]])).future.result(10)
    watchdogs[0].join(10)
    assert not watchdogs[0].is_alive(), "the watchdog outlived its dead engine"
    eng.stop()


def test_a_max_pass_s_past_the_longest_wait_keeps_its_watchdog():
    """max_pass_s=1e10 (--max-pass-timeout 1e10: a number > 0, accepted) keeps a watchdog that runs
    until stop(). Its first wait of the whole bound was past threading.TIMEOUT_MAX (about 9.2e9 s on
    Linux): an OverflowError ended the thread at once, a traceback on stderr and no bound at all."""
    before = set(threading.enumerate())
    eng = Engine(FaultySteps(), max_batch_tokens=100, max_pass_s=1e10)
    eng.start()
    try:
        watchdogs = [t for t in set(threading.enumerate()) - before if t.name == "acarerank-watchdog"]
        assert len(watchdogs) == 1, watchdogs
        assert eng.submit(Enc([1], [[1]])).future.result(10).scores == [1.001]
        watchdogs[0].join(0.3)
        assert watchdogs[0].is_alive(), "the watchdog ended before stop()"
    finally:
        eng.stop()
    watchdogs[0].join(10)
    assert not watchdogs[0].is_alive()


def test_a_step_that_ends_while_the_watchdog_reads_the_clock_is_no_wedge(monkeypatch):
    """The step ends between the watchdog's read of its start and its read of the clock (a thread
    paused there, the step just under the bound): the clock says past the bound, yet no step runs.
    The watchdog declared that engine dead."""
    import acarerank.server.engine as engine_mod

    eng = Engine(FaultySteps(), max_batch_tokens=100, max_pass_s=1.0)
    start = time.monotonic()
    eng._step_since = start

    class Clock:
        @staticmethod
        def monotonic():
            eng._step_since = None   # the step ends here, before the clock is read
            return start + 5.0

    monkeypatch.setattr(engine_mod, "time", Clock)
    eng._watchdog_stop.set()        # its next wait returns at once: _watch ends after one look
    eng._watch()
    assert eng.dead is None, eng.dead


def test_health_reports_how_long_the_current_step_runs():
    gate = threading.Event()

    class Slow(FaultySteps):
        def score_segments(self, items):
            assert gate.wait(30)
            return super().score_segments(items)

    eng = Engine(Slow(), max_batch_tokens=100).start()
    try:
        assert eng.health()["state"] == "idle"
        job = eng.submit(Enc([1], [[1]]))
        for _ in range(300):
            h = eng.health()
            if h["state"] == "busy" and h["busy_s"] > 0.05:
                break
            threading.Event().wait(0.01)
        assert h["state"] == "busy" and h["busy_s"] > 0.05, h
        gate.set()
        assert job.future.result(30).scores == [1.001]
        it = eng.health()["iterations"]
        assert it >= 1
    finally:
        gate.set()
        eng.stop()
    assert eng.health()["state"] == "stopped"


# -- the canary: a sticky fault kills the engine, bad requests do not -----------------------------------
CANARY = Enc([0], [[1, 1]])      # request tag 0: the canary (tags of real requests start at 1)


def canary_runs(metrics) -> dict:
    return {o: metrics.canary.labels(o)._value.get() for o in ("passed", "failed")}


def one_by_one(eng, tags, seg_len=2):
    """Submit one request per tag, each after the previous one is answered: one pass each."""
    out = {}
    for t in tags:
        try:
            out[t] = eng.submit(Enc([t], [[1] * seg_len]), rid=f"r{t}").future.result(30)
        except (EngineFault, EngineDead) as e:
            out[t] = e
    return out


def run_with_canary(steps, tags, metrics):
    """``one_by_one`` on an engine whose canary runs after 3 failures in a row; (engine, answers),
    the engine stopped."""
    eng = Engine(steps, max_batch_tokens=1000, metrics=metrics, canary=CANARY, canary_after=3).start()
    try:
        return eng, one_by_one(eng, tags)
    finally:
        eng.stop(5)


def test_a_sticky_fault_kills_the_engine_after_n_failures_and_a_failed_canary(caplog):
    """Every pass raises (a device-side assert after which every kernel fails): the culprit search
    fails two requests, the third runs the canary, it fails, and the engine dies at once — that
    request and the five others of the pass get EngineDead (503), not a 500 each after a whole
    culprit search; later submissions too."""
    steps = FaultySteps(lambda tags, tokens: RuntimeError("CUDA error: an illegal memory access"))
    metrics = ServerMetrics()
    eng = Engine(steps, max_batch_tokens=1000, metrics=metrics, canary=CANARY, canary_after=3)
    dead = []
    eng.on_dead.append(dead.append)
    with caplog.at_level(logging.ERROR, logger="acarerank.server"):
        jobs = {t: eng.submit(Enc([t], [[1] * 3]), rid=f"r{t}") for t in range(1, 9)}
        eng.start()
        out = {}
        for t, job in jobs.items():
            with pytest.raises((EngineFault, EngineDead)) as e:
                job.future.result(30)
            out[t] = type(e.value).__name__
    assert out == {1: "EngineFault", 2: "EngineFault"} | {t: "EngineDead" for t in range(3, 9)}, out
    assert steps.passes[-1] == [0], f"the canary never ran alone: {steps.passes}"
    assert len(steps.passes) <= 12, f"a whole culprit search before the canary: {steps.passes}"
    assert eng.dead and "failed 3 requests in a row" in eng.dead and "illegal memory access" in eng.dead, eng.dead
    assert eng.health()["state"] == "dead"
    for _ in range(500):   # on_dead runs right after the futures fail
        if dead:
            break
        threading.Event().wait(0.01)
    assert dead == [eng.dead]
    with pytest.raises(EngineDead):
        eng.submit(Enc([9], [[1]]))
    assert canary_runs(metrics) == {"passed": 0, "failed": 1}
    assert metrics.engine_failures.labels("engine")._value.get() == 1
    crit = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(crit) == 1 and "canary" in crit[0].getMessage() and "illegal memory access" in crit[0].getMessage()
    assert not steps.pinned, "prefixes (the canary's included) left pinned"
    eng.stop(5)


def test_a_sticky_prefill_fault_kills_the_engine_too():
    """A device that fails every kernel fails each new request's prefix prefill before any pass:
    prefill failures count toward the canary as pass failures do."""
    class Broken(FaultySteps):
        def acquire_prefix(self, enc):
            raise RuntimeError("device-side assert triggered")

    metrics = ServerMetrics()
    eng = Engine(Broken(), max_batch_tokens=1000, metrics=metrics, canary=CANARY, canary_after=3).start()
    try:
        out = one_by_one(eng, [1, 2, 3])
    finally:
        eng.stop(5)
    assert [type(out[t]).__name__ for t in (1, 2, 3)] == ["EngineFault", "EngineFault", "EngineDead"], out
    assert "canary" in eng.dead and "device-side assert" in eng.dead, eng.dead
    assert canary_runs(metrics) == {"passed": 0, "failed": 1}


def test_a_client_that_sends_only_bad_requests_does_not_kill_the_engine():
    """Every pass holding a poisoned request raises; the canary is clean: each third failure runs it,
    it passes, the count starts again, and a clean request afterwards scores as ever."""
    steps = FaultySteps(lambda tags, tokens: RuntimeError("poisoned input") if tags & set(range(100, 200)) else None)
    metrics = ServerMetrics()
    eng = Engine(steps, max_batch_tokens=1000, metrics=metrics, canary=CANARY, canary_after=3).start()
    try:
        out = one_by_one(eng, range(100, 107))
        assert all(isinstance(out[t], EngineFault) for t in out), out
        assert eng.dead is None and eng.health()["state"] in ("idle", "busy")
        assert canary_runs(metrics) == {"passed": 2, "failed": 0}   # after the 3rd and the 6th
        assert eng.model_failures_in_a_row == 1
        assert metrics.failures_in_a_row.labels("model")._value.get() == 1
        assert one_by_one(eng, [7])[7].scores == [7.002]
        assert eng.model_failures_in_a_row == 0
    finally:
        eng.stop(5)
    assert not steps.pinned


def test_a_success_between_failures_starts_the_count_again():
    """fail, fail, pass, fail, fail with canary_after=3: never three in a row, so no canary runs."""
    steps = FaultySteps(lambda tags, tokens: RuntimeError("poisoned input") if tags & {1, 2, 4, 5} else None)
    metrics = ServerMetrics()
    eng, out = run_with_canary(steps, [1, 2, 3, 4, 5], metrics)
    assert [isinstance(out[t], EngineFault) for t in (1, 2, 3, 4, 5)] == [True, True, False, True, True], out
    assert canary_runs(metrics) == {"passed": 0, "failed": 0}
    assert eng.model_failures_in_a_row == 2 and [0] not in steps.passes, steps.passes


@pytest.mark.parametrize("culprit", [1, 8])
def test_one_culprit_search_runs_no_canary(culprit):
    """One bad request among eight fails four nested passes in a row (the pass, its half, its quarter,
    itself): that is one failed request, not a broken engine — no canary pass is added to the search."""
    lengths = {t: [t + 1, 3] for t in range(1, 9)}
    steps = FaultySteps(lambda tags, tokens: RuntimeError("bad kernel input") if culprit in tags else None)
    metrics = ServerMetrics()
    out = run_encodings(Engine(steps, max_batch_tokens=1000, metrics=metrics, canary=CANARY, canary_after=3),
                        {t: Enc([t], [[1] * n for n in ls]) for t, ls in lengths.items()})
    assert isinstance(out[culprit], EngineFault) and sum(isinstance(r, Exception) for r in out.values()) == 1, out
    assert [0] not in steps.passes and canary_runs(metrics) == {"passed": 0, "failed": 0}, steps.passes


# -- the scheduler's catch-all ---------------------------------------------------------------------------
class BrokenHandle(Handle):
    """A prefix handle whose ``prompt_tokens`` raises: read when the request's result is assembled in
    the pass's clean-up (``Engine._finish``), outside the per-request handling, so the scheduler
    iteration raises (a bug of ours). (A ``release_prefix`` that raises was this bug until it became
    its request's own failure.)"""

    @property
    def prompt_tokens(self):
        raise RuntimeError(f"result bug for request {self.tag}")

    @prompt_tokens.setter
    def prompt_tokens(self, value):
        pass


class BadRelease(FaultySteps):
    """The requests tagged in ``bad`` (True: all) get a ``BrokenHandle``: the iteration that
    finishes them raises."""

    def __init__(self, bad):
        super().__init__()
        self.bad = bad

    def acquire_prefix(self, enc):
        h = super().acquire_prefix(enc)
        if self.bad is True or h.tag in self.bad:
            self.pinned.discard(id(h))
            h = BrokenHandle(h.tag, 0)
            self.pinned.add(id(h))
        return h


def test_a_release_that_fails_fails_no_request(caplog):
    """Five requests in one pass; giving request 3's prefix back (``release_prefix``) raises. Every
    request had its scores computed, and every one gets them: the failure is logged with an error id
    naming request 3 and counted once in engine_failures{stage="prefill"}, not a failed iteration.
    It once escaped the pass's clean-up into the scheduler's catch-all: requests 3, 4 and 5 (those
    after it in arrival order) got a 500 although fully scored."""
    class Steps(FaultySteps):
        def release_prefix(self, h):
            super().release_prefix(h)
            if h.tag == 3:
                raise RuntimeError("prefix cache release broke")

    metrics = ServerMetrics(lambda: {})
    eng = Engine(Steps(), max_batch_tokens=1000, metrics=metrics)
    with caplog.at_level(logging.ERROR, logger="acarerank.server"):
        out = run_encodings(eng, {t: Enc([t], [[1, 1]]) for t in range(1, 6)})
    wrong = {t: r for t, r in out.items() if getattr(r, "scores", None) != [t + 0.002]}
    assert not wrong, f"requests without their scores: {wrong}"
    assert metrics.engine_failures.labels("prefill")._value.get() == 1
    assert metrics.engine_failures.labels("scheduler")._value.get() == 0
    lines = [r.getMessage() for r in caplog.records if "engine prefill failed" in r.getMessage()]
    assert len(lines) == 1 and "r3" in lines[0] and "prefix cache release broke" in lines[0], lines


class IdleSelect:
    """A setwise step API whose selections never run: they only wait in the queue."""

    def start_select(self, enc):
        raise AssertionError("the selection ran: the iteration that failed should have failed it")

    def release_select(self, st):
        pass


def test_a_failed_iteration_fails_every_job_it_held_selections_and_calls_included():
    eng = Engine(BadRelease({2}), max_batch_tokens=1000, select_steps=IdleSelect())
    first = eng.submit_call(lambda: "ran")
    second = eng.submit_call(lambda: "ran")           # one call per iteration: this one is still queued
    score = eng.submit(Enc([2], [[1, 1]]), rid="r2")
    select = eng.submit_select(object(), rid="s1")
    eng.start()
    try:
        assert first.future.result(30) == "ran"
        faults = []
        for job in (score, second, select):
            with pytest.raises(EngineFault) as e:
                job.future.result(30)
            faults.append(e.value)
        assert {f.stage for f in faults} == {"scheduler"} and len({f.error_id for f in faults}) == 1, faults
        assert eng.dead is None
    finally:
        eng.stop(5)


def test_failed_iterations_log_at_the_failure_rate_limit(caplog):
    """Fifteen iterations that raise write at most the failure log's burst of lines (each with its
    traceback), not one unlimited ``log.exception`` each."""
    eng = Engine(BadRelease(True), max_batch_tokens=1000)   # no canary: it never dies
    eng._failure_log.every = 3600.0   # one window, however slow the machine
    eng.start()
    try:
        with caplog.at_level(logging.ERROR, logger="acarerank.server"):
            out = one_by_one(eng, range(1, 16))
    finally:
        eng.stop(5)
    assert all(isinstance(r, EngineFault) and r.stage == "scheduler" for r in out.values()), out
    lines = [r for r in caplog.records if r.name == "acarerank.server"]
    assert len(lines) <= eng._failure_log.burst, [r.getMessage() for r in lines]
    sched = [r for r in lines if "engine scheduler failed" in r.getMessage()]
    assert sched and all(r.exc_info for r in sched), "the scheduler's failure line lost its traceback"


def test_iterations_that_fail_whatever_the_input_kill_the_engine_after_the_canary():
    """A scheduler bug that fires on every iteration (the model works: every pass scores) fails
    the canary run through an iteration of its own, so the engine dies instead of running wedged."""
    steps = BadRelease(True)
    metrics = ServerMetrics()
    eng, out = run_with_canary(steps, [1, 2, 3, 4], metrics)
    assert [type(out[t]).__name__ for t in (1, 2, 3)] == ["EngineFault"] * 3, out
    assert isinstance(out[4], EngineDead), out[4]
    assert eng.dead and "3 scheduler iterations failed in a row" in eng.dead and "canary" in eng.dead, eng.dead
    assert steps.passes[-1] == [0], "the canary never ran its pass"
    assert canary_runs(metrics) == {"passed": 0, "failed": 1}


def test_the_canary_iteration_adds_no_request_metrics():
    """The canary is the engine's own check, not a request: its passing iteration adds no queue-time
    sample and no scored documents (only the real requests' do)."""
    bad = set(range(100, 110))
    metrics = ServerMetrics()
    eng = Engine(BadRelease(bad), max_batch_tokens=1000, metrics=metrics, canary=CANARY, canary_after=3).start()
    try:
        out = one_by_one(eng, [100, 101, 102, 7])
    finally:
        eng.stop(5)
    assert out[7].scores == [7.002] and canary_runs(metrics) == {"passed": 1, "failed": 0}, out
    samples = {s.name: s.value for s in metrics.queue_time.collect()[0].samples}
    assert samples["acarerank_queue_time_seconds_count"] == 4, samples   # 4 requests, the canary not one
    assert metrics.documents._value.get() == 1, "the canary's document was counted as scored"


def test_iterations_that_fail_for_one_input_leave_the_engine_serving():
    """The same bug hit only by one client's requests: the canary's own iteration is clean, the
    count starts again, and the engine serves a clean request afterwards."""
    bad = set(range(100, 110))
    metrics = ServerMetrics()
    eng = Engine(BadRelease(bad), max_batch_tokens=1000, metrics=metrics, canary=CANARY, canary_after=3).start()
    try:
        out = one_by_one(eng, range(100, 107))
        assert all(isinstance(r, EngineFault) and r.stage == "scheduler" for r in out.values()), out
        assert eng.dead is None and canary_runs(metrics) == {"passed": 2, "failed": 0}
        assert one_by_one(eng, [7])[7].scores == [7.002]
        assert eng.iteration_failures_in_a_row == 0
    finally:
        eng.stop(5)


# -- the canary out of memory: freed and run once more, not a broken engine at once ---------------------
class CanaryOom(FaultySteps):
    """Requests tagged 100+ fail: their passes raise (``mode="model"``) or the assembly of their
    result does (``"iteration"``, a scheduler bug: ``BrokenHandle``); the canary's passes (tag 0) run out of memory
    (``oom``) ``canary_ooms`` times, then score."""

    def __init__(self, canary_ooms, mode="model", oom=MemoryError):
        super().__init__(self._fault)
        self.canary_ooms, self.mode, self.oom, self.handles = canary_ooms, mode, oom, []

    def _fault(self, tags, tokens):
        if self.mode == "model" and tags & set(range(100, 200)):
            return RuntimeError("poisoned input")
        if 0 in tags:
            self.canary_ooms -= 1
            if self.canary_ooms >= 0:
                return self.oom("out of memory")
        return None

    def acquire_prefix(self, enc):
        h = super().acquire_prefix(enc)
        if self.mode == "iteration" and h.tag >= 100:
            self.pinned.discard(id(h))
            h = BrokenHandle(h.tag, 0)
            self.pinned.add(id(h))
        self.handles.append(h)
        return h

    def canary_pinned(self):
        return [h for h in self.handles if h.tag == 0 and id(h) in self.pinned]


@pytest.mark.parametrize("oom", [MemoryError, "torch"])
@pytest.mark.parametrize("mode", ["model", "iteration"])
def test_a_canary_out_of_memory_once_is_freed_and_run_again(oom, mode, monkeypatch):
    """Three requests failed in a row, then the canary ran out of memory once (the failed requests'
    memory, a neighbour's, a fragmented cache): the engine died at once, a restart for a transient
    error. Now the engine frees cached memory, runs the canary once more, it scores, and serving goes on."""
    import torch
    from acarerank.server import engine_faults   # where _run_canary reads it
    freed = []
    monkeypatch.setattr(engine_faults, "_free_cached_memory", lambda: freed.append(1))
    steps = CanaryOom(1, mode, torch.OutOfMemoryError if oom == "torch" else oom)
    metrics = ServerMetrics()
    eng = Engine(steps, max_batch_tokens=1000, metrics=metrics, canary=CANARY, canary_after=3).start()
    try:
        out = one_by_one(eng, [100, 101, 102])
        assert all(isinstance(out[t], EngineFault) for t in out), out
        # served after the canary (an iteration's jobs are failed before its canary runs)
        assert one_by_one(eng, [7])[7].scores == [7.002]
        assert eng.dead is None, eng.dead
        assert freed == [1] and [p for p in steps.passes if p == [0]] == [[0], [0]], steps.passes
        assert canary_runs(metrics) == {"passed": 1, "failed": 0}
    finally:
        eng.stop(5)
    assert not steps.canary_pinned(), "the canary's prefixes (its first run's included) left pinned"


@pytest.mark.parametrize("mode", ["model", "iteration"])
def test_a_canary_out_of_memory_twice_is_a_broken_engine(mode):
    """Out of memory again for one short document, cached memory freed: nothing can be served, the
    engine dies (503 everywhere, a restart) and its reason says the canary ran out of memory twice."""
    steps = CanaryOom(2, mode)
    metrics = ServerMetrics()
    eng, out = run_with_canary(steps, [100, 101, 102, 103], metrics)
    assert isinstance(out[103], EngineDead), out
    assert eng.dead and "out of memory both times" in eng.dead and "MemoryError" in eng.dead, eng.dead
    assert [p for p in steps.passes if p == [0]] == [[0], [0]], steps.passes
    assert canary_runs(metrics) == {"passed": 0, "failed": 1}
    assert not steps.canary_pinned(), "the canary's prefixes left pinned"


def test_a_canary_that_fails_otherwise_is_not_run_again():
    """Only out of memory earns the second run: a kernel error of the canary is a broken engine at once."""
    steps = FaultySteps(lambda tags, tokens: RuntimeError("CUDA error: an illegal memory access"))
    eng = Engine(steps, max_batch_tokens=1000, canary=CANARY, canary_after=3).start()
    try:
        one_by_one(eng, [1, 2, 3])
    finally:
        eng.stop(5)
    assert eng.dead and "both times" not in eng.dead
    assert [p for p in steps.passes if p == [0]] == [[0]], steps.passes


@pytest.mark.parametrize("slow", ["culprit_search", "prefills"])
def test_max_pass_s_bounds_each_model_call_not_an_iteration(slow):
    """max_pass_s=0.6 (--max-pass-timeout) and model calls of 0.15 s each, 4x under it: 16 requests
    in one pass, one of them bad (a culprit search of 6 passes), or 8 requests joining one pass (8
    prefix prefills before it). The bound is per model call (docs/serving.md, "What to probe"): the
    bad request gets its EngineFault, every other one its scores, the engine lives. The timer once
    ran over the whole scheduler iteration: 0.9 s and 1.35 s of it made the engine dead, 503 for all."""
    per_call = 0.15

    class Slow(FaultySteps):
        def acquire_prefix(self, enc):
            if slow == "prefills":
                time.sleep(per_call)
            return super().acquire_prefix(enc)

        def score_segments(self, items):
            time.sleep(per_call)
            return super().score_segments(items)

    tags = range(1, 17) if slow == "culprit_search" else range(1, 9)
    steps = Slow(lambda tags, tokens: RuntimeError("request 1 breaks the pass") if 1 in tags else None)
    if slow == "prefills":
        steps.fault = lambda tags, tokens: None
    eng = Engine(steps, max_batch_tokens=1000, max_pass_s=0.6)
    dead = []
    eng.on_dead.append(dead.append)
    out = run_encodings(eng, {t: Enc([t], [[1]]) for t in tags})
    assert not dead and eng.dead is None, f"the engine died: {eng.dead}"
    for t in tags:
        if slow == "culprit_search" and t == 1:
            assert isinstance(out[t], EngineFault), out[t]
        else:
            assert out[t].scores == [t + 0.001], (t, out[t])
