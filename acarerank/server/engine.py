"""The scheduler: one thread owns the model and runs continuous batching over queued requests.

The HTTP side validates, tokenizes (thread pool) and calls ``submit`` / ``submit_select``;
nothing else touches the model (it is not thread-safe). Each loop iteration of the scheduler
thread is one pass budget of ``max_batch_tokens`` tokens:

1. takes newly submitted jobs (FIFO) and drops the work of cancelled ones (client gone);
2. runs at most one queued call job (``submit_call``: any function that needs the model);
3. runs one packed scoring pass of the budget's segment tokens, less the half a prefilling
   selection takes (always at least one segment), in two rounds (below);
4. advances the oldest selection (setwise, ``submit_select``) by one step: a chunk of at most
   half the budget of its prompt prefill, or one greedy decode step (a few tokens). Selections
   run one at a time, in arrival order; a scoring request that arrives mid-selection waits for
   the step in flight only (at most half a pass), never for the whole selection — and a
   selection gets half of every pass.

The scoring pass's two rounds. Policy "shortest" (the default): first one document of
each newly arrived job (so a request that arrives mid-stream joins at the next pass) and of
each job no pass moved for ``STARVATION_PASSES`` passes; then documents of the jobs with the
fewest remaining documents first (arrival order on ties), so a short request never waits for
a long one and a pass holds few requests' prefixes (on the 2-core CPU box the same 16
requests of depth 20 all at once took 30.9–33.4 s this way and 34.3–36.0 s with
"round_robin", which takes one document of every running job first, then fills in arrival
order). A job's prefix is prefilled (``acquire_prefix``) when its first document enters a
pass and released as soon as its last document is scored — then its future completes, not
at the end of a batch.

Per pass: ``steps.score_segments`` = one forward over all its segments (the step API of
``PointwiseReranker``: docs/ARCHITECTURE.md, "A served request"); a selection's steps are
``SetwiseReranker``'s (``start_select`` / ``prefill_select`` / ``decode_select`` /
``finish_select`` / ``release_select``: docs/ARCHITECTURE.md, "A setwise call").

Faults — a failed pass narrowed to the request that broke it, the canary, dying — are
``engine_faults.py`` (``_FaultIsolation``, a mixin of ``Engine``); the job and result types and
the engine's errors are ``engine_jobs.py``. Every name other modules use is importable from here.
"""
from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import math
import threading
import time
from typing import Callable, Optional

from .._validate import check_seconds
# EngineDead, EngineFault, EngineStopped, ScoreResult, run_on_dead: the service and the tests import them from here
from .engine_faults import _FailureLog, _FaultIsolation, _is_oom, run_on_dead  # noqa: F401
from .engine_jobs import (EngineDead, EngineFault, EngineStopped, QueueClock, ScoreResult,  # noqa: F401
                          _CallJob, _ScoreJob, _SelectJob, _settle)

log = logging.getLogger("acarerank.server")

#: requests whose prefixes are held at once (bounds pinned KV; the rest wait in arrival order)
DEFAULT_MAX_RUNNING = 64
#: "shortest" policy: a running request that no pass moved for this many passes gets a segment
STARVATION_PASSES = 8
POLICIES = ("shortest", "round_robin")
#: requests failed by the model (or scheduler iterations) in a row before the canary runs (``--canary-after-failures``)
DEFAULT_CANARY_AFTER = 3


def _request_of(job):
    """The request a job is part of, as a set key: its ``clock`` (shared by an N-to-N ``/score``
    request's groups), else the job itself."""
    return job.clock if getattr(job, "clock", None) is not None else job


def _since(clock: Optional[QueueClock]) -> float:
    """When a job's queue time starts: its request's admission (``clock``), else now."""
    return clock.since if clock is not None else time.perf_counter()


class Engine(_FaultIsolation):
    """Owns ``steps`` (the step API over the model) on one scheduler thread.

    Args:
      steps: object with ``acquire_prefix``, ``score_segments``, ``release_prefix`` (``encode``
        and ``cache_stats`` are called from other threads by the service) and optionally
        ``check_encoding(enc)``, which ``submit`` calls on the caller's thread.
      max_batch_tokens: segment tokens per packed pass (a longer single segment runs alone).
      metrics: optional ``ServerMetrics`` (queue time, pass sizes, queue depth, cancellations).
      max_running: requests with a prefilled (pinned) prefix at once; later ones wait their turn.
      max_running_tokens: shared-prefix tokens the running requests pin at once, all together
        (``steps.pinned_tokens(enc)`` each — whole pages —, else ``len(enc.shared_ids)``; counted
        per request even where two share pages: a bound, not an estimate); a later request waits
        its turn, but the first in arrival order always runs, whatever its length. None: only ``max_running`` bounds them. The service sets the
        prefix cache's budget (``--cache-budget``): pinned pages are outside what the cache may
        evict, so without it 64 long contexts held 64 × their KV however small the budget.
      policy: "shortest" or "round_robin": which documents fill a pass (module docstring).
      model_thread: a ``ModelThread`` to run the scheduler loop on — the thread that built the
        model, so one OpenMP team serves every pass (``model_thread.py`` says why); None: a
        thread of the engine's own.
      select_steps: the setwise step API (a ``SetwiseReranker`` on the same model) that
        ``submit_select`` jobs run on; None: ``submit_select`` is refused.
      canary: an encoding known to score (a short query and document, within every limit), run
        alone after ``canary_after`` failures in a row; None: no canary, the engine never
        declares itself broken (the service sets its warm-up request here).
      canary_after: requests failed by the model (a pass's culprit, a prefix prefill, a selection
        step) with no successful scoring pass or selection step in between, or failed scheduler
        iterations in a row, before the canary runs. Requests, not failed calls: one culprit among
        n requests fails ⌈log₂ n⌉ + 1 nested passes in a row, and that is no broken engine.
      max_pass_s: seconds one step (one model call: a packed pass, a prefix prefill, a selection
        step, a call job, each pass of a culprit search and the canary; ``health()``'s ``busy_s``)
        may run; once one has run longer, a watchdog thread declares the engine dead (``_wedged``: every job
        ``EngineDead`` at once, ``on_dead``) — ``--max-pass-timeout``. None or ``inf``: no bound,
        no watchdog (a long pass is legitimate; only ``/health?max_pass_s=`` then reports it).
    """

    def __init__(self, steps, max_batch_tokens: int, metrics=None, max_running: int = DEFAULT_MAX_RUNNING,
                 model_thread=None, policy: str = "shortest", select_steps=None, canary=None,
                 canary_after: int = DEFAULT_CANARY_AFTER, max_running_tokens: Optional[int] = None,
                 max_pass_s: Optional[float] = None):
        for name, v in (("max_batch_tokens", max_batch_tokens), ("max_running", max_running),
                        ("canary_after", canary_after),
                        *((("max_running_tokens", max_running_tokens),) if max_running_tokens is not None else ())):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.max_running_tokens = max_running_tokens
        max_pass_s = check_seconds("max_pass_s", max_pass_s, none=True)
        self.max_pass_s = None if max_pass_s == math.inf else max_pass_s
        self._watchdog_stop = threading.Event()
        self._wedged_s: Optional[float] = None   # set by _wedged: the step it timed never ended
        self._loop_thread: Optional[threading.Thread] = None   # the thread running _run (the watchdog's stack dump)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self._pass_no = 0
        self.steps = steps
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.metrics = metrics
        self._cv = threading.Condition()
        self._inbox: collections.deque = collections.deque()
        self._active: list = []          # score jobs in arrival order (scheduler thread only)
        self._calls: collections.deque = collections.deque()
        self._call: Optional[_CallJob] = None    # the call running now (``_run_call``)
        self._selects: collections.deque = collections.deque()  # selection jobs in arrival order
        self.select_steps = select_steps
        self._stopping = False
        self._model_thread = model_thread
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[concurrent.futures.Future] = None  # the loop's run on model_thread
        self._ids = itertools.count(1)
        self._failure_log = _FailureLog()
        self.dead: Optional[str] = None         # why the loop ended on an exception (None: it did not)
        self.on_dead: list = []                 # callables(reason) run once, on the loop's thread, when it dies
        self._step_since: Optional[float] = None  # monotonic start of the model work in progress (None: idle)
        self.iterations = 0                     # scheduler iterations completed (a heartbeat)
        self.canary = canary
        self.canary_after = canary_after
        self.model_failures_in_a_row = 0        # requests the model failed since the last successful pass or step
        self.iteration_failures_in_a_row = 0    # scheduler iterations that raised since the last clean one
        self._in_canary = False
        if metrics is not None:
            metrics.track_depth(self.depth)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None and self._loop is None:
            if self._model_thread is not None:
                self._loop = self._model_thread.submit(self._run)
            else:
                self._thread = threading.Thread(target=self._run, name="acarerank-scheduler", daemon=True)
                self._thread.start()
                self._scheduler = self._thread   # kept past stop(), which forgets _thread: threads()
            if self.max_pass_s is not None:
                threading.Thread(target=self._watch, name="acarerank-watchdog", daemon=True).start()
        return self

    def _watch(self) -> None:
        """The watchdog (``max_pass_s``): wakes when the step in progress would pass the bound (or,
        idle, ``max_pass_s`` from now: no step that starts later can pass it sooner) and calls
        ``_wedged`` once one has; ends with ``stop()`` or the engine's death. It reads
        ``_step_since`` only, so it never waits for the model thread."""
        bound = self.max_pass_s
        while self.dead is None:
            since = self._step_since
            busy = 0.0 if since is None else time.monotonic() - since
            # the same step still running: one that ended while this thread was paused between its
            # two reads above (just under the bound) is no wedge
            if busy > bound and self._step_since == since:
                self._wedged(busy)
                return
            # at most an hour at a time: a wait past threading.TIMEOUT_MAX (~9.2e9 s) is an
            # OverflowError, and a bound that large (accepted: a number > 0) ended the watchdog
            if self._watchdog_stop.wait(min(bound - busy + 0.01, 3600.0)):
                return

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop after the current pass; queued and active jobs fail with EngineStopped."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._watchdog_stop.set()   # the stop's own bounded wait, not a wedge, ends a step that outlives it
        # a step the watchdog found wedged does not end: waiting for it took the whole timeout for
        # nothing (a failed warm-up's start waited 30 s before it could say so)
        wait = 0.0 if self._wedged_s is not None else timeout
        if self._thread is not None:
            self._thread.join(wait)
            self._thread = None
        if self._loop is not None:
            concurrent.futures.wait([self._loop], wait)
            self._loop = None

    def threads(self) -> list:
        """The scheduler thread of the engine's own while it is alive (none on a ``model_thread``:
        that one is its owner's)."""
        t = getattr(self, "_scheduler", None)
        return [t] if t is not None and t.is_alive() else []

    @property
    def alive(self) -> bool:
        """The scheduler loop runs (started, not stopped, not dead)."""
        running = (self._thread is not None and self._thread.is_alive()) or (
            self._loop is not None and not self._loop.done())
        return running and self.dead is None

    def health(self) -> dict:
        """What ``/health`` reports: ``state`` ("idle", "busy", "dead", "stopped"), ``busy_s`` (how
        long the model work in progress has run; 0 when idle), ``iterations`` (a counter that moves
        while the loop runs) and ``reason`` when dead. Never waits for the model thread."""
        since = self._step_since
        busy = 0.0 if since is None else time.monotonic() - since
        if self.dead is not None:
            return dict(state="dead", reason=self.dead, busy_s=0.0, iterations=self.iterations)
        if not self.alive:
            return dict(state="stopped", busy_s=0.0, iterations=self.iterations)
        return dict(state="idle" if since is None else "busy", busy_s=round(busy, 3), iterations=self.iterations)

    # -- submission (any thread) -------------------------------------------------------------
    def submit(self, enc, rid: Optional[str] = None, clock: Optional[QueueClock] = None,
               canary: bool = False) -> _ScoreJob:
        """Queue one encoded request; ``job.future`` resolves to a ``ScoreResult`` (or raises
        ``EngineFault`` / ``EngineDead``). rid: the request id its failure line names.

        clock: the request's ``QueueClock`` when the job is one of its jobs, or queued after its
        admission: its queue time (``ScoreResult.queue_time``, ``acarerank_queue_time_seconds``:
        one sample per clock) runs from ``clock.since``; None: from now. canary: the engine's own
        job (the warm-up), counted in no request metric.

        An encoding the model would refuse by name (``steps.check_encoding``, where the steps
        have one: built for a longer cap, by another reranker or by hand) is a ValueError or
        TypeError here, the caller's error: queued, it failed in a pass as an ``EngineFault`` and
        counted toward the canary (docs/serving.md, "A broken engine is found")."""
        check = getattr(self.steps, "check_encoding", None)
        if check is not None:
            check(enc)
        job = _ScoreJob(enc=enc, future=concurrent.futures.Future(), submitted=_since(clock),
                        scores=[0.0] * len(enc.segment_ids), clock=clock, canary=canary)
        job.rid = rid or f"job-{next(self._ids)}"
        self._put(job)
        return job

    def submit_select(self, enc, rid: Optional[str] = None, clock: Optional[QueueClock] = None) -> _SelectJob:
        """Queue one encoded selection (``SetwiseReranker.encode_select``); ``job.future`` resolves to a
        ``Selection``. Its prefill and decode steps share the scheduler's passes with scoring.
        clock: as ``submit``'s."""
        if self.select_steps is None:
            raise ValueError("this engine has no setwise model (select_steps)")
        job = _SelectJob(enc=enc, future=concurrent.futures.Future(), submitted=_since(clock), clock=clock)
        job.rid = rid or f"job-{next(self._ids)}"
        self._put(job)
        return job

    def submit_call(self, fn: Callable) -> _CallJob:
        """Queue ``fn()`` to run on the scheduler thread (it may use the model); ``job.future`` gets its result."""
        job = _CallJob(fn=fn, future=concurrent.futures.Future(), submitted=time.perf_counter())
        self._put(job)
        return job

    def cancel(self, job, count: bool = True) -> None:
        """Drop a job's remaining work (its client is gone, or its deadline passed); its future is cancelled.

        ``count``: the job is a request, counted once in ``acarerank_requests_cancelled_total``;
        False for one of several jobs of one request (a ``/score`` request's groups), which the
        caller counts once itself."""
        if count and not job.cancelled and self.metrics is not None:
            self.metrics.cancelled.inc()
        job.cancelled = True
        with self._cv:
            self._cv.notify()

    def depth(self) -> tuple:
        """``(waiting, running)``: requests none of whose jobs holds pages (queued calls included,
        each one), and requests with a job whose prefix or selection holds pages. A request is its
        jobs' ``clock`` (an N-to-N ``/score`` request's groups share one: docs/serving.md, "Metrics",
        it is admitted as one request), else the job itself. Any thread (a metrics scrape):
        it reads copies of the scheduler's lists (each made in one step under the GIL), under the
        lock the loop holds while it moves arrivals out of the inbox, so none is counted twice. The
        canary is the engine's own job, not a request: never counted (as in every request metric).
        A dead engine: ``(0, 0)``."""
        if self.dead is not None:
            # every job of a dead engine has had its EngineDead; after a wedge (``_wedged``) the lists
            # keep them until the held step returns, which may be never: they are no queue
            return 0, 0
        with self._cv:
            inbox, calls = list(self._inbox), len(self._calls)
            active, selects = list(self._active), list(self._selects)
        requests, running = set(), set()
        for j in inbox + active + selects:
            if getattr(j, "canary", False):
                continue
            key = _request_of(j)
            requests.add(key)
            if getattr(j, "handle", None) is not None or getattr(j, "state", None) is not None:
                running.add(key)
        return calls + len(requests) - len(running), len(running)

    @property
    def num_jobs(self) -> int:
        """Jobs submitted and not finished (queued, running, or waiting to be dropped)."""
        with self._cv:
            return len(self._inbox) + len(self._active) + len(self._calls) + len(self._selects)

    def _put(self, job) -> None:
        with self._cv:
            if self.dead is not None:
                raise EngineDead(self.dead)
            if self._stopping:
                raise EngineStopped("the engine is stopping")
            self._inbox.append(job)
            self._cv.notify()

    # -- the scheduler thread ----------------------------------------------------------------
    def _run(self) -> None:
        """The scheduler thread: ``_loop`` until stopped; anything escaping it kills the engine."""
        self._loop_thread = threading.current_thread()
        try:
            self._loop_until_stopped()
        except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt / SystemExit / a bug: the engine is dead
            self._die(e)
            return
        self._fail_all(EngineStopped("the engine stopped before this request ran"))

    def _loop_until_stopped(self) -> None:
        while True:
            with self._cv:
                self._step_since = None
                while not (self._inbox or self._active or self._calls or self._selects or self._stopping):
                    self._cv.wait()
                if self._stopping:
                    break
                while self._inbox:
                    job = self._inbox.popleft()
                    queue = {_CallJob: self._calls, _SelectJob: self._selects}.get(type(job), self._active)
                    queue.append(job)
            self._step_starts()
            try:
                self._iteration()
            except Exception as e:  # noqa: BLE001 - a bug of ours: fail what it held, keep the thread
                self._iteration_failed(e)
            else:
                if self.iteration_failures_in_a_row:
                    self._set_in_a_row(iterations=0)
            self.iterations += 1

    def _step_starts(self) -> None:
        """A model call starts: ``max_pass_s`` and ``health()``'s ``busy_s`` time it from here. Per call,
        not per iteration: an iteration also holds the prefills of every request joining its pass and
        a whole culprit search (about 3 passes for one bad request, and the canary), so the bound sized
        by one pass (docs/serving.md, "What to probe") declared an engine with one poisoned request
        among 8, or 24 long-trace requests arriving together, dead."""
        self._step_since = time.monotonic()

    def _iteration(self) -> None:
        """One pass budget: drop cancelled work, one call, one scoring pass, one selection step."""
        self._drop_cancelled()
        if self._calls:
            self._run_call(self._calls.popleft())
        if self._active:  # first, so a request that arrived during a selection step waits for that one only
            self._pass(self.max_batch_tokens - self._select_share())
        if self._selects:
            self._select_step()

    def _drop_cancelled(self) -> None:
        keep = []
        for job in self._active:
            if job.cancelled:
                self._finish(job, cancelled=True)
            else:
                keep.append(job)
        self._active = keep
        calls = collections.deque()
        for job in self._calls:
            if job.cancelled:
                job.future.cancel()
            else:
                calls.append(job)
        self._calls = calls
        selects = collections.deque()
        for job in self._selects:
            if job.cancelled:
                self._end_select(job, cancelled=True)
            else:
                selects.append(job)
        self._selects = selects

    # -- selections ----------------------------------------------------------------------------
    def _select_share(self) -> int:
        """Tokens of this iteration's budget the oldest selection's next step takes (a prefill
        chunk; a decode step's few tokens are not counted)."""
        if not self._selects:
            return 0
        st = self._selects[0].state
        return self.max_batch_tokens // 2 if st is None or st.prefilling else 0

    def _select_step(self) -> int:
        """Advance the oldest selection by one step; returns the tokens it put through the model.

        Prefill: a chunk of at most half the pass budget (the scoring pass runs before it, so a
        request that arrives during it waits for it only); decode: one greedy step.
        A finished or failed selection completes its future and releases its pages here.
        """
        job = self._selects[0]
        steps = self.select_steps
        if job.state is None:
            if not job.future.set_running_or_notify_cancel():  # its waiter gave up
                self._selects.popleft()
                return 0
            self._queue_time_ends(job, time.perf_counter())
        t = time.perf_counter()
        used = 0
        self._step_starts()
        try:
            if job.state is None:
                job.state = steps.start_select(job.enc)
            st = job.state
            if st.prefilling:
                chunk = max(1, self.max_batch_tokens // 2)
                try:
                    used = steps.prefill_select(st, chunk)
                except Exception as e:  # noqa: BLE001 - out of memory: once more at half the chunk
                    if not _is_oom(e) or chunk == 1:
                        raise
                    self._step_starts()
                    used = steps.prefill_select(st, chunk // 2)
            else:
                used = steps.decode_select(st)
            if st.done:
                self._end_select(job, result=steps.finish_select(st))
                self._selects.popleft()
        except Exception as e:  # noqa: BLE001 - fail this selection only (its pages released); a 500
            # dropped while the step ran (its client left: ``cancel``; or the watchdog answered it 503:
            # ``_wedged``): as the culprit search skips dropped requests, nothing is counted or logged
            # for it and no canary runs through a dead engine's model (docs/serving.md, --max-pass-timeout)
            if job.cancelled:
                self._end_select(job, cancelled=True)
            else:
                self._model_failed(e)   # first: if the canary fails too, this selection gets the dead engine's 503
                self._end_select(job, exc=self._fault("select", e, [job]))
            self._selects.popleft()
        else:
            self._model_ok()
        finally:
            self._busy("call", t)
        return used

    def _end_select(self, job: _SelectJob, result=None, exc: Optional[BaseException] = None,
                    cancelled: bool = False) -> None:
        """Release the selection's pages and complete its future (result, exception or cancelled)."""
        if job.state is not None:
            try:
                self.select_steps.release_select(job.state)
            except Exception:  # noqa: BLE001
                log.exception("release_select failed")
        if cancelled:
            if not job.future.cancel():
                _settle(job.future, exc=concurrent.futures.CancelledError("client disconnected"))
            return
        _settle(job.future, result, exc)

    def _run_call(self, job: _CallJob) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        if self.metrics is not None:
            self.metrics.queue_time.observe(time.perf_counter() - job.submitted)
        t = time.perf_counter()
        # out of every list while it runs: the watchdog (``_wedged``) and a death (``_fail_in_flight``)
        # fail it from here — its waiter got nothing from a call past max_pass_s, or one that ended on
        # a BaseException, until its own timeout
        self._call = job
        self._step_starts()
        try:
            _settle(job.future, job.fn())   # _settle: the watchdog may have failed it meanwhile
        except Exception as e:  # noqa: BLE001 - the caller maps it to an HTTP error
            _settle(job.future, exc=e)
        self._call = None   # not on a BaseException: _die's _fail_in_flight fails it
        self._busy("call", t)

    def _queue_time_ends(self, job, now: float) -> None:
        """``job`` starts at ``now``: its request's queue-time sample, once per request (the first
        of its jobs to start: ``QueueClock``), from its admission; none for the canary or warm-up."""
        clock = job.clock
        if clock is not None:
            if clock.started is not None:   # another job of its request started first
                return
            clock.started = now
        if self.metrics is not None and not job.canary:
            self.metrics.queue_time.observe(now - job.submitted)

    def _start(self, job: _ScoreJob) -> bool:
        """Prefill ``job``'s prefix (its first pass); False if it was cancelled or failed."""
        if not job.future.set_running_or_notify_cancel():  # its waiter gave up
            job.cancelled = True
            return False
        job.started = time.perf_counter()  # queue time ends here; the prefill is work
        self._queue_time_ends(job, job.started)
        try:
            job.handle = self._acquire_prefix(job.enc)
        except Exception as e:  # noqa: BLE001 - fail this request only (acquire_prefix gave its pages back)
            if not job.cancelled:   # dropped while it ran: nothing counted or logged (as in ``_select_step``)
                self._model_failed(e)   # first: if the canary fails too, this request gets the dead engine's 503
                _settle(job.future, exc=self._fault("prefill", e, [job]))
            job.cancelled = True
            return False
        finally:
            self._busy("prefill", job.started)
        return True

    def _busy(self, kind: str, since: float) -> None:
        """Count the model time of one call (``acarerank_model_seconds``: busy ÷ wall = utilisation)."""
        if self.metrics is not None:
            self.metrics.model_seconds.labels(kind).inc(time.perf_counter() - since)

    def _window(self) -> list:
        """The running jobs: the longest run of ``_active`` (arrival order) within ``max_running``
        jobs and ``max_running_tokens`` shared-prefix tokens, never empty while a job is active.
        A prefix of the list: a job already pinned stays in it (the jobs ahead of it only end,
        so the tokens before it only shrink), and a later job never overtakes a waiting one."""
        if self.max_running_tokens is None:
            return self._active[:self.max_running]
        window, tokens = [], 0
        pinned = getattr(self.steps, "pinned_tokens", None)   # whole pages, the pool's unit
        for job in self._active[:self.max_running]:
            tokens += pinned(job.enc) if pinned is not None else len(job.enc.shared_ids)
            if window and tokens > self.max_running_tokens:
                break
            window.append(job)
        return window

    def _pass(self, budget: Optional[int] = None) -> None:
        """Build and run one packed pass of at most ``budget`` segment tokens (default
        ``max_batch_tokens``; always at least one segment). Policy: the module docstring."""
        budget = self.max_batch_tokens if budget is None else budget
        items, owners = [], []
        used = 0

        def take(job) -> bool:
            """Put the job's next segment in the pass; False only when the pass is full."""
            nonlocal used
            seg = job.enc.segment_ids[job.next]
            if items and used + len(seg) > budget:
                return False
            if job.handle is None and not self._start(job):
                return True  # cancelled or failed: nothing to add, the pass is not full
            items.append((job.handle, seg))
            owners.append((job, job.next))
            job.next += 1
            job.moved = self._pass_no
            used += len(seg)
            return True

        def wants(job) -> bool:
            return not job.cancelled and job.next < len(job.scores)

        self._pass_no += 1
        window = self._window()
        if self.policy == "round_robin":
            # round 1: one segment of every running job; round 2: fill in arrival order
            first, fill = window, window
        else:
            # round 1: one segment of each new job (it joins at this pass) and of each job no
            # pass moved for STARVATION_PASSES passes; round 2: fewest remaining segments first
            first = [j for j in window if j.handle is None or self._pass_no - j.moved > STARVATION_PASSES]
            fill = sorted(window, key=lambda j: len(j.scores) - j.next)  # stable: arrival order on ties
        full = False
        for job in first:
            if wants(job) and not take(job):
                full = True
                break
        for job in fill:
            while not full and wants(job):
                full = not take(job)
            if full:
                break
        if items:
            t = time.perf_counter()
            entries = [(job, i, item) for (job, i), item in zip(owners, items)]
            try:
                scores = self._score(items)
            except Exception as e:  # noqa: BLE001 - find the request that fails and fail it alone
                self._bisect(entries, e)
            else:
                if self.metrics is not None:
                    # requests, not jobs: an N-to-N /score request's groups are one (``_request_of``);
                    # the canary and the warm-up are the engine's own, in no request metric
                    requests = {_request_of(j) for j, _ in owners if not j.canary}
                    if requests:
                        self.metrics.observe_pass(used, len(requests))
                self._record(entries, scores)
            self._busy("pass", t)
        keep = []
        for job in self._active:
            if job.cancelled:
                self._finish(job, cancelled=True)
            elif job.done == len(job.scores):
                self._finish(job)
            else:
                keep.append(job)
        self._active = keep

    # -- scores recorded, jobs ended -----------------------------------------------------------
    @staticmethod
    def _record(entries: list, scores: list) -> None:
        for (job, i, _), s in zip(entries, scores):
            job.scores[i] = s
            job.done += 1

    def _finish(self, job: _ScoreJob, cancelled: bool = False) -> None:
        """Release the job's prefix and complete its future (result, or cancelled). A release that
        raises is this job's alone: logged (rate-limited) with an error id and counted in
        ``acarerank_engine_failures_total{stage="prefill"}``, and the job still gets its scores. It
        once escaped the clean-up loop into ``_iteration_failed``, which failed every job still held,
        later requests fully scored included (an ``acquire_prefix`` failure is per request too)."""
        if job.handle is not None:
            try:
                self.steps.release_prefix(job.handle)
            except Exception as e:  # noqa: BLE001 - the pages are the cache's matter; the scores stand
                self._fault("prefill", e, [job])
        if job.future.done():  # failed (its exception is set) or cancelled by its waiter
            return
        if cancelled:
            if not job.future.cancel():  # already running: nobody waits, but never leave it pending
                _settle(job.future, exc=concurrent.futures.CancelledError("client disconnected"))
            return
        h = job.handle
        _settle(job.future, ScoreResult(scores=job.scores, prompt_tokens=h.prompt_tokens,
                                          cached_tokens=h.cached_tokens,
                                          queue_time=(job.started or job.submitted) - job.submitted))
        if self.metrics is not None and not job.canary:
            self.metrics.documents.inc(len(job.scores))

    def _fail_all(self, exc: BaseException) -> None:
        """Fail every job, queued in the inbox or in flight, with ``exc`` (the loop has ended)."""
        with self._cv:
            pending = list(self._inbox)
            self._inbox.clear()
        self._fail_in_flight(exc)
        for job in pending:
            _settle(job.future, exc=exc)

    def _fail_in_flight(self, exc: BaseException) -> None:
        """Fail every job the loop holds (scoring, selections, calls) with ``exc``, pages given back;
        a release that raises is logged (rate-limited) and the futures are failed all the same."""
        selects, active, calls = self._selects, self._active, list(self._calls)
        if self._call is not None:   # a call that ended on a BaseException (``_die``)
            calls.append(self._call)
        self._selects, self._active, self._calls = collections.deque(), [], collections.deque()
        for job in selects:
            self._end_select(job, exc=exc)
        for job in active:
            if job.handle is not None:
                try:
                    self.steps.release_prefix(job.handle)
                except Exception as e:  # noqa: BLE001 - the future matters more than the pages
                    self._failure_log("release_prefix failed for request %s: %s: %s", job.rid, type(e).__name__, e)
        for job in list(active) + list(calls):
            _settle(job.future, exc=exc)
