"""The engine's fault side: a failed pass narrowed to the request that broke it, the canary, dying.

Faults (docs/serving.md, "Internal faults and probes"). A packed pass that raises, or returns a
score that is not a finite number, is retried in halves so one bad request fails alone
(``_bisect``); a failed prefill or selection step fails its own request only (a prefill or a
selection's prefill chunk that runs out of memory is first retried once at half the tokens per
pass); each failure is an ``EngineFault`` with an error id, one log line and
``acarerank_engine_failures_total{stage}``. A scheduler iteration that raises outside that
handling (a bug of ours) fails every job it held — scoring, selections, queued calls — and the
loop goes on. ``canary_after`` requests failed by the model in a row (no scoring pass or selection
step succeeded in between), or as many failed iterations in a row, run the ``canary`` request alone
(``_run_canary``): if it fails too, the engine is broken, not the requests (a canary out of memory
runs once more after cached memory is freed). Anything that escapes
the loop itself (``BaseException`` included: ``KeyboardInterrupt``, ``SystemExit``, a failed
canary) kills the engine: every waiting and later job fails with ``EngineDead`` at once and
``on_dead`` callbacks run.

``_FaultIsolation`` is a mixin of ``Engine`` (``engine.py``, the scheduler): the methods above,
on the engine's own state. Module-level: ``_Broken``, ``_is_oom``, ``_free_cached_memory``, the
rate-limited ``_FailureLog``, ``run_on_dead`` and ``_halves_by_tokens``.
"""
from __future__ import annotations

import concurrent.futures
import gc
import logging
import math
import sys
import threading
import time
import traceback
import uuid
from typing import Callable, Optional

from .engine_jobs import EngineDead, EngineFault, EngineStopped, _ScoreJob, _settle

log = logging.getLogger("acarerank.server")


class _Broken(BaseException):
    """The canary failed after ``canary_after`` failures in a row: raised on the scheduler thread so it
    escapes every per-request handler and ends the loop through ``_run`` → ``_die`` (the message is
    the dead engine's reason). A ``BaseException`` like ``KeyboardInterrupt``: nothing on the way catches it."""


def _is_oom(exc: BaseException) -> bool:
    """An out-of-memory error (host ``MemoryError`` or torch's device ``OutOfMemoryError``), or an
    ``EngineFault`` that one caused."""
    if isinstance(exc, EngineFault):
        exc = exc.__cause__
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


def _free_cached_memory() -> None:
    """Collect garbage and give torch's cached device blocks back (``torch.cuda.empty_cache``) when
    torch has initialised CUDA: after out-of-memory errors the caching allocator can hold enough
    free but fragmented blocks that a small request fails while the device has room for it."""
    gc.collect()
    torch = sys.modules.get("torch")   # no import: the engine itself never needs torch
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class _FailureLog:
    """At most ``burst`` failure lines per ``every`` seconds, then one line saying how many were
    left out (the error ids stay in the responses and the counter counts every failure)."""

    def __init__(self, burst: int = 10, every: float = 10.0):
        self.burst, self.every = burst, every
        self.window_start = -math.inf
        self.lines = 0
        self.dropped = 0
        self._lock = threading.Lock()

    def __call__(self, msg: str, *args, exc_info=None) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self.window_start >= self.every:
                if self.dropped:
                    log.error("%d more engine failure line(s) left out in the last %g s", self.dropped, self.every)
                self.window_start, self.lines, self.dropped = now, 0, 0
            if self.lines >= self.burst:
                self.dropped += 1
                return
            self.lines += 1
        log.error(msg, *args, exc_info=exc_info)


def run_on_dead(callbacks, reason: str) -> None:
    """Call every ``on_dead`` callback with ``reason``, in order, each once. One that raises is
    logged and the next still runs: ``acarerank serve``'s own callback (it ends the process with
    ``EXIT_ENGINE_DEAD``) is never skipped because an embedder's ran first and failed. A
    ``BaseException`` that is no ``Exception`` (an embedder's ``sys.exit``, a ``KeyboardInterrupt``)
    is raised again after the last callback, the first one if several, on the thread that noticed
    the death (docs/serving.md, "A dead engine is loud")."""
    pending: Optional[BaseException] = None
    for fn in list(callbacks):
        try:
            fn(reason)
        except BaseException as e:  # noqa: BLE001 - every callback runs; a BaseException is raised below
            log.error("on_dead callback failed: %r", fn, exc_info=e)
            if pending is None and not isinstance(e, Exception):
                pending = e
    if pending is not None:
        raise pending


class _FaultIsolation:
    """``Engine``'s fault handling (the module docstring). No state of its own: it reads and sets
    what ``Engine.__init__`` made (``steps``, ``metrics``, ``canary``, ``canary_after``, the
    ``*_failures_in_a_row`` counts, ``_in_canary``, ``_failure_log``, ``dead``, ``on_dead``; ``_die``
    also the lock and the queues) and calls the scheduler's ``_iteration``, ``_record``,
    ``_fail_all`` and ``_fail_in_flight`` (and ``_step_starts`` before each model call); it runs on the scheduler thread only."""

    # -- dying, and an iteration that raised -----------------------------------------------------
    def _declare_dead(self, reason: str, detail: str) -> bool:
        """Set ``dead`` to ``reason`` (no later job is taken) and, the first time only, log it at
        CRITICAL with ``detail`` (a traceback, or the wedged thread's stack) and count it in
        ``acarerank_engine_failures_total{stage="engine"}``. True the first time: the caller then runs
        ``on_dead``. Any thread: the scheduler's (``_die``) or the watchdog's (``_wedged``)."""
        with self._cv:
            if self.dead is not None:
                return False
            self.dead = reason
            self._stopping = True
            self._cv.notify()
        stop = getattr(self, "_watchdog_stop", None)
        if stop is not None:   # a watchdog asleep until the bound ends now, not up to max_pass_s later
            stop.set()
        log.critical("engine dead: %s; every waiting and later request gets 503\n%s", reason, detail)
        if self.metrics is not None:
            self.metrics.engine_failures.labels("engine").inc()
        return True

    def _die(self, exc: BaseException) -> None:
        """Mark the engine dead, log the traceback, fail every job at once, run ``on_dead`` (``run_on_dead``).
        An engine the watchdog already declared dead (``_wedged``: its step then raised) keeps that
        reason; its jobs' pages are given back here, on the thread that held them, and nothing is
        logged, counted or called a second time."""
        reason = str(exc) if isinstance(exc, _Broken) else \
            f"the model thread's scheduler loop ended on {type(exc).__name__}: {exc}".rstrip(": ")
        first = self._declare_dead(reason, "".join(traceback.format_exception(exc)).rstrip())
        if not first:
            log.error("the step that outlived --max-pass-timeout ended on %s: %s", type(exc).__name__, exc)
        reason = self.dead
        self._step_since = None
        try:
            self._fail_all(EngineDead(reason))
        except BaseException:  # noqa: BLE001 - releasing pages of a dead engine may fail too; the futures matter
            log.exception("failing the jobs of the dead engine")
            for job in list(self._inbox) + list(self._calls) + list(self._selects) + list(self._active):
                _settle(job.future, exc=EngineDead(reason))
        if first:
            run_on_dead(self.on_dead, reason)  # a BaseException from one is raised after all ran: it ends this thread

    def _wedged(self, busy: float) -> None:
        """The watchdog saw one step run ``busy`` seconds, past ``max_pass_s`` (``--max-pass-timeout``):
        the engine is dead as if its loop had ended (docs/serving.md, "A dead engine is loud"). The
        scheduler thread is inside that step and cannot be interrupted, so this runs on the watchdog's
        thread: every job's future fails with ``EngineDead`` now, without giving its pages back (the
        wedged step may still be using them; should it ever return, the loop sees ``_stopping``,
        ends and gives them back), and ``on_dead`` runs here. The log line carries the wedged
        thread's stack, the one clue to where it hangs."""
        reason = (f"the model thread has been in one step for {busy:.1f} s, more than --max-pass-timeout "
                  f"{self.max_pass_s:g} s (a model call that does not return)")
        thread = getattr(self, "_loop_thread", None)
        frame = sys._current_frames().get(thread.ident) if thread is not None else None
        stack = "".join(traceback.format_stack(frame)).rstrip() if frame is not None else "(no stack)"
        if not self._declare_dead(reason, f"stack of the model thread ({thread.name if thread else '?'}):\n{stack}"):
            return
        self._wedged_s = busy   # Engine.stop does not wait for this step
        dead = EngineDead(reason)
        with self._cv:   # copies, each in one step under the GIL (as ``depth``): the scheduler owns the lists
            jobs = list(self._inbox) + list(self._calls) + list(self._selects) + list(self._active)
        call = getattr(self, "_call", None)   # the wedged step may be a call, out of every list while it runs
        if call is not None:
            jobs.append(call)
        for job in jobs:
            _settle(job.future, exc=dead)
            # dropped, as ``Engine.cancel`` drops a job from any thread: should the wedged step end
            # by raising, the culprit search (``_bisect``) skips it rather than running the dead
            # engine's model again for a request already answered; its pages go back in the clean-up
            job.cancelled = True
        run_on_dead(self.on_dead, reason)

    def _iteration_failed(self, exc: Exception) -> None:
        """An iteration raised outside the per-request handling: its state is not to be trusted, so
        every job it held (scoring, selections, queued calls) fails with one ``EngineFault``
        (one rate-limited log line with the traceback); jobs that arrived meanwhile wait in the
        inbox. ``canary_after`` of these in a row run the canary through an iteration of its own."""
        jobs = list(self._active) + list(self._selects) + list(self._calls)
        fault = self._fault("scheduler", exc, jobs, exc_info=exc)
        self._fail_in_flight(fault)
        self._set_in_a_row(iterations=self.iteration_failures_in_a_row + 1)
        if self._canary_due(self.iteration_failures_in_a_row):
            self._run_canary(f"{self.iteration_failures_in_a_row} scheduler iterations failed in a row (the last: "
                             f"{type(exc).__name__}: {exc})", self._canary_iteration)
            self._set_in_a_row(iterations=0)

    # -- the canary: are the failures the requests' or the engine's? -------------------------------
    def _set_in_a_row(self, model: Optional[int] = None, iterations: Optional[int] = None) -> None:
        if model is not None:
            self.model_failures_in_a_row = model
        if iterations is not None:
            self.iteration_failures_in_a_row = iterations
        if self.metrics is not None:
            self.metrics.failures_in_a_row.labels("model").set(self.model_failures_in_a_row)
            self.metrics.failures_in_a_row.labels("iteration").set(self.iteration_failures_in_a_row)

    def _model_ok(self) -> None:
        """A scoring pass or selection step succeeded: the model works (a prefix prefill proves
        nothing, it may be served from the cache without a forward)."""
        if self.model_failures_in_a_row:
            self._set_in_a_row(model=0)

    def _model_failed(self, exc: BaseException) -> None:
        """The model failed a request (before it is answered); the ``canary_after``-th in a row runs
        the canary now, before any more culprit search."""
        self._set_in_a_row(model=self.model_failures_in_a_row + 1)
        if self._canary_due(self.model_failures_in_a_row):
            self._run_canary(f"the model failed {self.model_failures_in_a_row} requests in a row (the last: "
                             f"{type(exc).__name__}: {exc})", self._canary_alone)

    def _canary_due(self, in_a_row: int) -> bool:
        return self.canary is not None and not self._in_canary and in_a_row >= self.canary_after

    def _run_canary(self, why: str, run: Callable[[], None]) -> None:
        """Run the known-good canary request (``run``); if it fails, raise ``_Broken`` (the engine dies
        through ``_die``: 503 everywhere, ``on_dead``); if it passes, the failures were the
        requests' own: the counts start again."""
        self._in_canary = True
        try:
            try:
                run()
            except Exception as e:  # noqa: BLE001 - out of memory: freed, once more; anything else: broken
                if not _is_oom(e):
                    raise
                # memory the failed requests or a neighbour held, or a fragmented cache, is no broken
                # engine: one more run once the cached memory is freed (docs/serving.md, "A broken
                # engine is found"); out of memory again for one short document is
                self._failure_log("engine canary ran out of memory (%s: %s); freeing cached memory and running "
                                  "it once more", type(e).__name__, e)
                _free_cached_memory()
                run()
        except Exception as e:  # noqa: BLE001 - the engine cannot score a request known to score
            if self.metrics is not None:
                self.metrics.canary.labels("failed").inc()
            again = " (run twice: out of memory both times, cached memory freed between)" if _is_oom(e) else ""
            raise _Broken(f"the engine is broken: {why}, then a known-good canary request run alone failed "
                          f"too{again} ({type(e).__name__}: {e})") from e
        finally:
            self._in_canary = False
        if self.metrics is not None:
            self.metrics.canary.labels("passed").inc()
        self._set_in_a_row(model=0)
        self._failure_log("engine canary passed after %s: the failures were the requests' own; serving on", why)

    def _canary_alone(self) -> None:
        """The canary through the model's scoring path in a pass of its own: its prefix prefill, one
        packed pass over its documents (finite scores, one each), its pages given back."""
        self._step_starts()   # each model call is one step of --max-pass-timeout (Engine._step_starts)
        h = self.steps.acquire_prefix(self.canary)
        try:
            self._checked_scores([(h, seg) for seg in self.canary.segment_ids])
        finally:
            self.steps.release_prefix(h)

    def _canary_iteration(self) -> None:
        """The canary as the only job of one scheduler iteration (the failed iteration left no other;
        new arrivals wait in the inbox): the loop's own code, not only the model's, must answer it."""
        # the failed iteration failed every job it held: what is left is a previous run's canary (out of
        # memory, run once more), whose pages go back here
        self._fail_in_flight(EngineStopped("the canary runs again"))
        job = _ScoreJob(enc=self.canary, future=concurrent.futures.Future(), submitted=time.perf_counter(),
                        scores=[0.0] * len(self.canary.segment_ids), rid="canary", canary=True)
        self._active = [job]   # on failure it stays there: _die gives its pages back with the others'
        self._iteration()
        if not job.future.done():
            raise RuntimeError("one iteration left the canary unanswered")
        job.future.result(0)   # the canary's EngineFault, if its prefill or pass failed

    def _fault(self, stage: str, exc: BaseException, jobs, exc_info=None) -> EngineFault:
        """An ``EngineFault`` for ``jobs`` (counted; one rate-limited log line naming them, with the
        traceback of ``exc_info`` if given)."""
        fault = EngineFault(stage, uuid.uuid4().hex[:16], exc)
        if self.metrics is not None:
            self.metrics.engine_failures.labels(stage).inc()
        self._failure_log("engine %s failed (error id %s) for request(s) %s: %s: %s", stage, fault.error_id,
                          ",".join(j.rid for j in jobs) or "-", type(exc).__name__, exc, exc_info=exc_info)
        return fault

    # -- a request's prefill out of memory -------------------------------------------------------
    def _acquire_prefix(self, enc):
        """``steps.acquire_prefix(enc)``; out of memory: once more at half the tokens per pass
        (half of the smaller of the prefill chunk and the prefix), if the steps take a chunk."""
        self._step_starts()   # each model call is one step of --max-pass-timeout (Engine._step_starts)
        try:
            return self.steps.acquire_prefix(enc)
        except Exception as e:  # noqa: BLE001 - out of memory: once more at half; anything else fails the request
            chunk = getattr(self.steps, "prefill_chunk", None)
            half = min(chunk, len(enc.shared_ids)) // 2 if isinstance(chunk, int) else 0
            if not _is_oom(e) or half < 1:
                raise
            log.warning("prefix prefill ran out of memory (%s); retrying at %d tokens per pass", e, half)
            self._step_starts()
            return self.steps.acquire_prefix(enc, chunk_tokens=half)

    # -- a failed pass, narrowed to its request --------------------------------------------------
    def _score(self, items: list) -> list:
        """``_checked_scores(items)``; a success starts the canary's count again (a failure counts
        only once the culprit search fails a request: ``_narrow``)."""
        scores = self._checked_scores(items)
        self._model_ok()
        return scores

    def _checked_scores(self, items: list) -> list:
        """``steps.score_segments(items)`` as Python floats, raising unless it returned one finite number per item: a
        NaN score once left as a bare 500 at JSON encoding (its whole request, no error id, not
        counted), and a short list left its request unanswered while the loop spun."""
        self._step_starts()   # each pass, a culprit search's and the canary's too, is one step (Engine._step_starts)
        # Python floats: a step API's numpy or torch scores (float32 elements) were a bare 500 at the
        # response's JSON encoding, after the request was counted as scored
        scores = [float(v) for v in self.steps.score_segments(items)]
        if len(scores) != len(items):
            raise RuntimeError(f"the model returned {len(scores)} scores for {len(items)} segments")
        bad = [n for n, v in enumerate(scores) if not math.isfinite(v)]
        if bad:
            raise RuntimeError(f"the model returned a score that is not a finite number ({scores[bad[0]]}) "
                               f"for {len(bad)} of the {len(items)} segments of this pass")
        return scores

    def _try_pass(self, entries: list) -> Optional[Exception]:
        """Score ``entries`` (``(job, segment index, (handle, ids))``) in one pass; the exception
        it raised, or None once their scores are recorded. Requests already failed are left out."""
        entries = [e for e in entries if not e[0].cancelled]
        if not entries:
            return None
        try:
            scores = self._score([item for _, _, item in entries])
        except Exception as e:  # noqa: BLE001
            return e
        self._record(entries, scores)
        return None

    def _bisect(self, entries: list, exc: Exception, halved: bool = False) -> None:
        """``entries`` failed together with ``exc``: retry in halves until the failing request is alone.

        The requests are split in two halves (arrival order) and the first half runs. If it
        passes, the culprit is in the second half, which is split again without running it
        whole; if it fails, the search goes on inside it and the second half waits, to run in
        one pass with every other half set aside this way. A request left alone in a failing
        part gets ``EngineFault``; one left alone by elimination runs alone first and fails
        only if that pass fails too (a pass can fail for what its requests do together: a
        kernel's size limit, a transient device error). Every other request keeps its scores.
        For one culprit among n requests: ⌈log₂ n⌉ passes to find it, plus one to run it alone
        when it was found by elimination, plus one for the halves set aside (none when every
        first half passed). The pass set aside is bisected the same way if it fails too (a
        second culprit).

        An out-of-memory error is first retried as two passes of half the tokens each
        (``halved``; whole requests to each): it is a pass too large, not a bad request. Then a
        part that passes proves nothing about the other, so both halves run (no inference,
        nothing set aside): at most 2⌈log₂ n⌉ extra passes for one request that always fails.
        A request alone in a part still out of memory has its documents halved the same way
        (about ⌈log₂ k⌉ more passes for k documents); it fails only when one document alone does
        (or another error comes).
        """
        if _is_oom(exc) and not halved and len(entries) > 1:
            for part in _halves_by_tokens(entries):
                e = self._try_pass(part)
                if e is not None:
                    self._bisect(part, e, halved=True)
            return
        aside: list = []
        self._narrow(entries, exc, aside)
        if aside:
            e = self._try_pass(aside)
            if e is not None:
                self._bisect(aside, e, halved=True)

    def _narrow(self, entries: list, exc: Exception, aside: list, ran: bool = True) -> None:
        """One step of ``_bisect`` on a part known to fail with ``exc``: ``ran`` when this very part
        failed, else inferred (its complement passed beside it)."""
        entries = [e for e in entries if not e[0].cancelled]  # a request failed in another part is done
        jobs = list(dict.fromkeys(job for job, _, _ in entries))
        if not jobs:
            return
        if len(jobs) == 1 and not ran:  # never run alone: the failure may have needed its partners
            exc = self._try_pass(entries)
            if exc is None:
                return
        if len(jobs) == 1 and _is_oom(exc) and len(entries) > 1:
            # a pass too large, not a bad request: the request's own documents in halves, down to
            # one alone (a request whose half ran out of memory too got a 500, its other half
            # never run, though each document alone scored)
            for part in _halves_by_tokens(entries):
                e = self._try_pass(part)
                if e is not None:
                    self._narrow(part, e, aside)
            return
        if len(jobs) == 1:
            self._model_failed(exc)   # first: if the canary fails too, this request gets the 503
            fault = self._fault("pass", exc, jobs)
            _settle(jobs[0].future, exc=fault)
            jobs[0].cancelled = True  # its pages go back in _pass's clean-up
            return
        first = set(jobs[:len(jobs) // 2])
        a = [e for e in entries if e[0] in first]
        b = [e for e in entries if e[0] not in first]
        e_a = self._try_pass(a)
        if _is_oom(exc) or (e_a is not None and _is_oom(e_a)):
            if e_a is not None:
                self._narrow(a, e_a, aside)
            e_b = self._try_pass(b)
            if e_b is not None:
                self._narrow(b, e_b, aside)
        elif e_a is None:
            self._narrow(b, exc, aside, ran=False)  # a passed: the culprit is in b
        else:
            self._narrow(a, e_a, aside)       # the culprit is in a; b runs later with the others set aside
            aside.extend(b)


def _halves_by_tokens(entries: list) -> list:
    """``entries`` cut in two non-empty parts of about half the segment tokens each: whole requests
    to each part when there are several (so a failing part holds about half of them), else
    consecutive segments of the one request."""
    tokens: dict = {}
    for job, _, item in entries:
        tokens[job] = tokens.get(job, 0) + len(item[1])
    if len(tokens) > 1:
        keys, total = list(tokens), sum(tokens.values())
        cut, acc = 1, 0
        for n, job in enumerate(keys[:-1]):
            acc += tokens[job]
            cut = n + 1
            if acc * 2 >= total:
                break
        first = set(keys[:cut])
        return [[e for e in entries if e[0] in first], [e for e in entries if e[0] not in first]]
    total = sum(len(item[1]) for _, _, item in entries)
    cut, acc = 1, 0
    for n, (_, _, item) in enumerate(entries[:-1]):
        acc += len(item[1])
        cut = n + 1
        if acc * 2 >= total:
            break
    return [entries[:cut], entries[cut:]]
