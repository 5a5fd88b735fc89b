"""The engine's job and result types, its errors, and ``_settle`` (complete a job's future once).

``Engine.submit`` / ``submit_select`` / ``submit_call`` (``engine.py``) return a ``_ScoreJob`` /
``_SelectJob`` / ``_CallJob``; a scoring job's future resolves to a ``ScoreResult``, or raises
``EngineFault`` (the model failed it: ``engine_faults.py``), ``EngineStopped`` or ``EngineDead``.
Every name here is importable from ``acarerank.server.engine``.
"""
from __future__ import annotations

import concurrent.futures
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
class QueueClock:
    """One request's queue time, shared by its jobs (an N-to-N ``/score`` request's groups): from
    ``since`` (its admission, ``time.perf_counter()``) to the first start of any of them
    (``started``: a first pass or selection step), one ``acarerank_queue_time_seconds`` sample."""
    since: float
    started: Optional[float] = None


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
    canary: bool = False             # the engine's own check (``_canary_iteration``, the warm-up): no request metrics
    cancelled: bool = False
    moved: int = 0                   # the last pass that scored one of its segments
    rid: str = ""                    # request id (log lines)
    clock: Optional[QueueClock] = None   # its request's (None: the job is a request of its own)


@dataclass(eq=False)
class _SelectJob:
    enc: object                      # SelectEncoding: the tokenized prompt
    future: concurrent.futures.Future
    submitted: float
    state: object = None             # SelectState once started (pages pinned)
    cancelled: bool = False
    rid: str = ""
    clock: Optional[QueueClock] = None
    canary: bool = False             # never: a selection is always a request's


@dataclass(eq=False)
class _CallJob:
    fn: Callable
    future: concurrent.futures.Future
    submitted: float
    cancelled: bool = False
    rid: str = "call"


class EngineStopped(RuntimeError):
    """The engine was stopped before the job ran."""


class EngineDead(EngineStopped):
    """The scheduler loop ended on an exception: the engine serves nothing any more (``reason``)."""


class EngineFault(RuntimeError):
    """The model raised while running this job: ``stage`` ("pass", "prefill", "select",
    "scheduler"), ``error_id`` (also in the failure's log line) and the original exception as
    ``__cause__``."""

    def __init__(self, stage: str, error_id: str, exc: BaseException):
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.stage = stage
        self.error_id = error_id
        self.__cause__ = exc


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
