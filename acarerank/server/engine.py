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
"""
from __future__ import annotations

import collections
import concurrent.futures
import gc
import itertools
import logging
import math
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass
class ScoreResult:
    """What a finished scoring job returns. Times in seconds."""
    scores: list
    prompt_tokens: int
    cached_tokens: int
    queue_time: float


@dataclass(eq=False)
class _ScoreJob:
    enc: object                      # PointwiseEncoding: shared_ids, segment_ids
    future: concurrent.futures.Future
    submitted: float
    scores: list = field(default_factory=list)
    next: int = 0                    # next segment to put in a pass
    done: int = 0                    # segments scored
    handle: object = None
    started: Optional[float] = None
    canary: bool = False             # the engine's own check (``_canary_iteration``): no request metrics
    cancelled: bool = False
    moved: int = 0                   # the last pass that scored one of its segments
    rid: str = ""                    # request id (log lines)


@dataclass(eq=False)
class _SelectJob:
    enc: object                      # SelectEncoding: the tokenized prompt
    future: concurrent.futures.Future
    submitted: float
    state: object = None             # SelectState once started (pages pinned)
    cancelled: bool = False
    rid: str = ""


@dataclass(eq=False)
class _CallJob:
    fn: Callable
    future: concurrent.futures.Future
    submitted: float
    cancelled: bool = False
    rid: str = "call"


log = logging.getLogger("acarerank.server")

#: requests whose prefixes are held at once (bounds pinned KV; the rest wait in arrival order)
DEFAULT_MAX_RUNNING = 64
#: "shortest" policy: a running request that no pass moved for this many passes gets a segment
STARVATION_PASSES = 8
POLICIES = ("shortest", "round_robin")
#: requests failed by the model (or scheduler iterations) in a row before the canary runs (``--canary-after-failures``)
DEFAULT_CANARY_AFTER = 3


class EngineStopped(RuntimeError):
    """The engine was stopped before the job ran."""


class EngineDead(EngineStopped):
    """The scheduler loop ended on an exception: the engine serves nothing any more (``reason``)."""


class _Broken(BaseException):
    """The canary failed after ``canary_after`` failures in a row: raised on the scheduler thread so it
    escapes every per-request handler and ends the loop through ``_run`` → ``_die`` (the message is
    the dead engine's reason). A ``BaseException`` like ``KeyboardInterrupt``: nothing on the way catches it."""


class EngineFault(RuntimeError):
    """The model raised while running this job: ``stage`` ("pass", "prefill", "select",
    "scheduler"), ``error_id`` (also in the failure's log line) and the original exception as
    ``__cause__``."""

    def __init__(self, stage: str, error_id: str, exc: BaseException):
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.stage = stage
        self.error_id = error_id
        self.__cause__ = exc


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


def _settle(fut: concurrent.futures.Future, result=None, exc: Optional[BaseException] = None) -> None:
    """Complete ``fut`` unless it is already done (the waiting side may have cancelled it)."""
    try:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:  # cancelled between the check and the set
        pass


class Engine:
    """Owns ``steps`` (the step API over the model) on one scheduler thread.

    Args:
      steps: object with ``acquire_prefix``, ``score_segments``, ``release_prefix`` (``encode``
        and ``cache_stats`` are called from other threads by the service).
      max_batch_tokens: segment tokens per packed pass (a longer single segment runs alone).
      metrics: optional ``ServerMetrics`` (queue time, pass sizes, queue depth, cancellations).
      max_running: requests with a prefilled (pinned) prefix at once; later ones wait their turn.
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
    """

    def __init__(self, steps, max_batch_tokens: int, metrics=None, max_running: int = DEFAULT_MAX_RUNNING,
                 model_thread=None, policy: str = "shortest", select_steps=None, canary=None,
                 canary_after: int = DEFAULT_CANARY_AFTER):
        for name, v in (("max_batch_tokens", max_batch_tokens), ("max_running", max_running),
                        ("canary_after", canary_after)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
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
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop after the current pass; queued and active jobs fail with EngineStopped."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._loop is not None:
            concurrent.futures.wait([self._loop], timeout)
            self._loop = None

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
    def submit(self, enc, rid: Optional[str] = None) -> _ScoreJob:
        """Queue one encoded request; ``job.future`` resolves to a ``ScoreResult`` (or raises
        ``EngineFault`` / ``EngineDead``). rid: the request id its failure line names."""
        job = _ScoreJob(enc=enc, future=concurrent.futures.Future(), submitted=time.perf_counter(),
                        scores=[0.0] * len(enc.segment_ids))
        job.rid = rid or f"job-{next(self._ids)}"
        self._put(job)
        return job

    def submit_select(self, enc, rid: Optional[str] = None) -> _SelectJob:
        """Queue one encoded selection (``SetwiseReranker.encode_select``); ``job.future`` resolves to a
        ``Selection``. Its prefill and decode steps share the scheduler's passes with scoring."""
        if self.select_steps is None:
            raise ValueError("this engine has no setwise model (select_steps)")
        job = _SelectJob(enc=enc, future=concurrent.futures.Future(), submitted=time.perf_counter())
        job.rid = rid or f"job-{next(self._ids)}"
        self._put(job)
        return job

    def submit_call(self, fn: Callable) -> _CallJob:
        """Queue ``fn()`` to run on the scheduler thread (it may use the model); ``job.future`` gets its result."""
        job = _CallJob(fn=fn, future=concurrent.futures.Future(), submitted=time.perf_counter())
        self._put(job)
        return job

    def cancel(self, job) -> None:
        """Drop a job's remaining work (its client is gone, or its deadline passed); its future is cancelled."""
        if not job.cancelled and self.metrics is not None:
            self.metrics.cancelled.inc()
        job.cancelled = True
        with self._cv:
            self._cv.notify()

    def depth(self) -> tuple:
        """``(waiting, running)``: jobs not yet in their first pass or selection step (queued calls
        included), and jobs whose prefix or selection holds pages. Any thread (a metrics scrape):
        it reads copies of the scheduler's lists (each made in one step under the GIL), under the
        lock the loop holds while it moves arrivals out of the inbox, so none is counted twice. The
        canary is the engine's own job, not a request: never counted (as in every request metric)."""
        with self._cv:
            inbox, calls = len(self._inbox), len(self._calls)
            active, selects = list(self._active), list(self._selects)
        active = [j for j in active if not j.canary]
        running = sum(1 for j in active if j.handle is not None) + sum(1 for j in selects if j.state is not None)
        return inbox + calls + len(active) + len(selects) - running, running

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
        try:
            self._loop_until_stopped()
        except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt / SystemExit / a bug: the engine is dead
            self._die(e)
            return
        self._fail_all(EngineStopped("the engine stopped before this request ran"))

    def _die(self, exc: BaseException) -> None:
        """Mark the engine dead, log the traceback, fail every job at once, run ``on_dead`` (``run_on_dead``)."""
        reason = str(exc) if isinstance(exc, _Broken) else \
            f"the model thread's scheduler loop ended on {type(exc).__name__}: {exc}".rstrip(": ")
        with self._cv:
            self.dead = reason
            self._stopping = True
        self._step_since = None
        log.critical("engine dead: %s; every waiting and later request gets 503\n%s", reason,
                     "".join(traceback.format_exception(exc)).rstrip())
        if self.metrics is not None:
            self.metrics.engine_failures.labels("engine").inc()
        try:
            self._fail_all(EngineDead(reason))
        except BaseException:  # noqa: BLE001 - releasing pages of a dead engine may fail too; the futures matter
            log.exception("failing the jobs of the dead engine")
            for job in list(self._inbox) + list(self._calls) + list(self._selects) + list(self._active):
                _settle(job.future, exc=EngineDead(reason))
        run_on_dead(self.on_dead, reason)  # a BaseException from one is raised after all ran: it ends this thread

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
            self._step_since = time.monotonic()
            try:
                self._iteration()
            except Exception as e:  # noqa: BLE001 - a bug of ours: fail what it held, keep the thread
                self._iteration_failed(e)
            else:
                if self.iteration_failures_in_a_row:
                    self._set_in_a_row(iterations=0)
            self.iterations += 1

    def _iteration(self) -> None:
        """One pass budget: drop cancelled work, one call, one scoring pass, one selection step."""
        self._drop_cancelled()
        if self._calls:
            self._run_call(self._calls.popleft())
        if self._active:  # first, so a request that arrived during a selection step waits for that one only
            self._pass(self.max_batch_tokens - self._select_share())
        if self._selects:
            self._select_step()

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
            if self.metrics is not None:
                self.metrics.queue_time.observe(time.perf_counter() - job.submitted)
        t = time.perf_counter()
        used = 0
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
                    used = steps.prefill_select(st, chunk // 2)
            else:
                used = steps.decode_select(st)
            if st.done:
                self._end_select(job, result=steps.finish_select(st))
                self._selects.popleft()
        except Exception as e:  # noqa: BLE001 - fail this selection only (its pages released); a 500
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
        try:
            job.future.set_result(job.fn())
        except Exception as e:  # noqa: BLE001 - the caller maps it to an HTTP error
            job.future.set_exception(e)
        self._busy("call", t)

    def _start(self, job: _ScoreJob) -> bool:
        """Prefill ``job``'s prefix (its first pass); False if it was cancelled or failed."""
        if not job.future.set_running_or_notify_cancel():  # its waiter gave up
            job.cancelled = True
            return False
        job.started = time.perf_counter()  # queue time ends here; the prefill is work
        if self.metrics is not None and not job.canary:
            self.metrics.queue_time.observe(job.started - job.submitted)
        try:
            job.handle = self._acquire_prefix(job.enc)
        except Exception as e:  # noqa: BLE001 - fail this request only (acquire_prefix gave its pages back)
            self._model_failed(e)   # first: if the canary fails too, this request gets the dead engine's 503
            _settle(job.future, exc=self._fault("prefill", e, [job]))
            job.cancelled = True
            return False
        finally:
            self._busy("prefill", job.started)
        return True

    def _acquire_prefix(self, enc):
        """``steps.acquire_prefix(enc)``; out of memory: once more at half the tokens per pass
        (half of the smaller of the prefill chunk and the prefix), if the steps take a chunk."""
        try:
            return self.steps.acquire_prefix(enc)
        except Exception as e:  # noqa: BLE001 - out of memory: once more at half; anything else fails the request
            chunk = getattr(self.steps, "prefill_chunk", None)
            half = min(chunk, len(enc.shared_ids)) // 2 if isinstance(chunk, int) else 0
            if not _is_oom(e) or half < 1:
                raise
            log.warning("prefix prefill ran out of memory (%s); retrying at %d tokens per pass", e, half)
            return self.steps.acquire_prefix(enc, chunk_tokens=half)

    def _busy(self, kind: str, since: float) -> None:
        """Count the model time of one call (``acarerank_model_seconds``: busy ÷ wall = utilisation)."""
        if self.metrics is not None:
            self.metrics.model_seconds.labels(kind).inc(time.perf_counter() - since)

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
        window = self._active[:self.max_running]
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
                    self.metrics.observe_pass(used, len({id(j) for j, _ in owners}))
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

    # -- fault isolation ------------------------------------------------------------------------
    def _score(self, items: list) -> list:
        """``_checked_scores(items)``; a success starts the canary's count again (a failure counts
        only once the culprit search fails a request: ``_narrow``)."""
        scores = self._checked_scores(items)
        self._model_ok()
        return scores

    def _checked_scores(self, items: list) -> list:
        """``steps.score_segments(items)``, raising unless it returned one finite number per item: a
        NaN score once left as a bare 500 at JSON encoding (its whole request, no error id, not
        counted), and a short list left its request unanswered while the loop spun."""
        scores = self.steps.score_segments(items)
        if len(scores) != len(items):
            raise RuntimeError(f"the model returned {len(scores)} scores for {len(items)} segments")
        bad = [n for n, v in enumerate(scores) if not math.isfinite(v)]
        if bad:
            raise RuntimeError(f"the model returned a score that is not a finite number ({scores[bad[0]]}) "
                               f"for {len(bad)} of the {len(items)} segments of this pass")
        return scores

    @staticmethod
    def _record(entries: list, scores: list) -> None:
        for (job, i, _), s in zip(entries, scores):
            job.scores[i] = s
            job.done += 1

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

    def _finish(self, job: _ScoreJob, cancelled: bool = False) -> None:
        """Release the job's prefix and complete its future (result, or cancelled)."""
        if job.handle is not None:
            self.steps.release_prefix(job.handle)
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
        selects, active, calls = self._selects, self._active, self._calls
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
