"""The scheduler alone, over a fake step API (no model): pass budget, scores routed to the right
request and document, prefixes pinned exactly while needed, failures and cancellation isolated."""
import concurrent.futures
import threading
from dataclasses import dataclass

import pytest
from _optional import require

require("fastapi")  # acarerank.server's package imports its app

from acarerank.server.engine import Engine, EngineStopped


@dataclass
class Enc:
    shared_ids: list
    segment_ids: list


class FakeSteps:
    """score(segment) = a value that names its request and document: request_tag + len/1000."""

    def __init__(self, fail_on_tag=None):
        self.pinned = set()
        self.passes = []
        self.fail_on_tag = fail_on_tag
        self.released = []
        self.gate = threading.Event()
        self.gate.set()
        self._tag = {}

    def acquire_prefix(self, enc):
        handle = Handle(prompt_tokens=1 + sum(map(len, enc.segment_ids)))
        self.pinned.add(id(handle))
        self._tag[id(handle)] = enc.shared_ids[0]
        return handle

    def score_segments(self, items):
        assert self.gate.wait(30)
        for h, _ in items:
            assert id(h) in self.pinned, "a segment was scored against a released prefix"
        tags = [self._tag[id(h)] for h, _ in items]
        self.passes.append(sum(len(s) for _, s in items))
        if self.fail_on_tag in tags:
            raise RuntimeError("boom")
        return [t + len(s) / 1000 for t, (_, s) in zip(tags, items)]

    def release_prefix(self, handle):
        self.pinned.discard(id(handle))
        self.released.append(id(handle))


@dataclass(eq=False)
class Handle:
    prompt_tokens: int
    cached_tokens: int = 0


def enc(tag, lengths):
    return Enc(shared_ids=[tag], segment_ids=[[1] * n for n in lengths])


def test_scores_routed_budget_kept_prefixes_released():
    steps = FakeSteps()
    eng = Engine(steps, max_batch_tokens=10, max_running=3).start()
    try:
        lengths = {t: [(t * 7 + i) % 9 + 1 for i in range(t + 2)] for t in range(1, 9)}
        lengths[4] = [25, 1, 3]  # one segment longer than the budget runs alone
        jobs = {t: eng.submit(enc(t, ls)) for t, ls in lengths.items()}
        for t, job in jobs.items():
            res = job.future.result(30)
            assert res.scores == [t + n / 1000 for n in lengths[t]], f"request {t}: {res.scores}"
    finally:
        eng.stop()
    assert all(p <= 10 or p == 25 for p in steps.passes), steps.passes
    assert not steps.pinned, "prefixes left pinned"
    assert len(steps.released) == len(set(steps.released)) == 8, "each prefix released exactly once"
    assert jobs[3].future.result().prompt_tokens == 1 + sum(lengths[3])


def test_failed_pass_fails_its_requests_only_and_serving_goes_on():
    steps = FakeSteps(fail_on_tag=2)
    eng = Engine(steps, max_batch_tokens=4, max_running=1).start()   # one request per pass
    try:
        bad, good = eng.submit(enc(2, [3, 3])), eng.submit(enc(5, [2, 2]))
        with pytest.raises(RuntimeError, match="boom"):
            bad.future.result(30)
        assert good.future.result(30).scores == [5.002, 5.002]
        assert eng.submit(enc(6, [1])).future.result(30).scores == [6.001]
    finally:
        eng.stop()
    assert not steps.pinned


def test_cancel_drops_remaining_work_and_stop_fails_queued():
    steps = FakeSteps()
    steps.gate.clear()
    eng = Engine(steps, max_batch_tokens=2, max_running=1).start()
    long = eng.submit(enc(1, [2] * 20))
    for _ in range(3000):  # until its prefix is pinned (its first pass waits at the gate)
        if steps.pinned:
            break
        threading.Event().wait(0.01)
    assert steps.pinned, "the first pass never started"
    eng.cancel(long)
    steps.gate.set()
    with pytest.raises(concurrent.futures.CancelledError):
        long.future.result(30)
    assert len(steps.passes) <= 2, f"cancelled work kept running: {len(steps.passes)} passes"
    assert not steps.pinned
    steps.gate.clear()
    running = eng.submit(enc(3, [2, 2]))
    queued = eng.submit(enc(4, [2]))
    stopper = threading.Thread(target=eng.stop)
    stopper.start()
    steps.gate.set()
    stopper.join(30)
    for job in (running, queued):
        exc = job.future.exception(30)
        assert exc is None or isinstance(exc, EngineStopped), exc
    with pytest.raises(EngineStopped):
        eng.submit(enc(5, [1]))
    assert not steps.pinned


def test_queue_gauges_are_current_during_a_pass_and_zero_once_idle():
    """``acarerank_queue_size`` / ``acarerank_requests_running`` at a scrape during a held pass
    count what is queued and running then, and return to 0 once the cancelled work is dropped.
    They were set at the end of each iteration only: every arrival during a long pass read 0."""
    from acarerank.server.metrics import ServerMetrics

    def gauges():   # as a scrape reads them
        return tuple(metrics.registry.get_sample_value(name) for name in
                     ("acarerank_queue_size", "acarerank_requests_running"))

    steps = FakeSteps()
    steps.gate.clear()
    metrics = ServerMetrics()
    eng = Engine(steps, max_batch_tokens=2, max_running=2, metrics=metrics).start()
    try:
        first = eng.submit(enc(1, [2, 2]))
        for _ in range(3000):  # until its first pass waits at the gate, its prefix pinned
            if steps.pinned:
                break
            threading.Event().wait(0.01)
        assert steps.pinned, "the first pass never started"
        later = [eng.submit(enc(10 + i, [1])) for i in range(3)]   # arrive during the held pass
        assert gauges() == (3, 1), f"(waiting, running) during a held pass: {gauges()}, want (3, 1)"
        for job in [first, *later]:
            eng.cancel(job)
        steps.gate.set()
        for job in [first, *later]:
            with pytest.raises(concurrent.futures.CancelledError):
                job.future.result(30)
        for _ in range(3000):
            if eng.num_jobs == 0:
                break
            threading.Event().wait(0.01)
        assert gauges() == (0, 0), f"(waiting, running) once every job was dropped: {gauges()}"
    finally:
        steps.gate.set()
        eng.stop(5)
    assert not steps.pinned


def test_queue_gauges_leave_the_canary_out():
    """The canary (the engine's own check, run as an iteration's only job) is no request: the
    gauges do not count it, as no request metric does."""
    from acarerank.server.engine import _ScoreJob

    eng = Engine(FakeSteps(), max_batch_tokens=2, max_running=2)   # not started: the lists alone
    canary = _ScoreJob(enc=enc(1, [2]), future=concurrent.futures.Future(), submitted=0.0, scores=[0.0],
                       handle=object(), rid="canary", canary=True)
    eng._active = [canary]
    assert eng.depth() == (0, 0), eng.depth()
    eng._active = [canary, _ScoreJob(enc=enc(2, [1]), future=concurrent.futures.Future(), submitted=0.0,
                                     scores=[0.0])]
    assert eng.depth() == (1, 0), eng.depth()


def test_request_gauges_and_pass_sizes_count_requests_not_jobs():
    """The groups of one N-to-N ``/score`` request (jobs sharing one ``QueueClock``) are one request
    in ``acarerank_queue_size``, ``acarerank_requests_running`` and ``acarerank_batch_requests``
    (docs/serving.md, "Metrics": it is admitted as one request), and the canary's pass (the warm-up)
    is in no pass metric. One 300-query request read up to 32 running, 29-32 queued, and passes
    "shared by" 32 requests; a fresh server showed the warm-up's pass."""
    from acarerank.server.engine import QueueClock
    from acarerank.server.metrics import ServerMetrics

    def sample(name):
        return metrics.registry.get_sample_value(name)

    steps = FakeSteps()
    metrics = ServerMetrics()
    eng = Engine(steps, max_batch_tokens=100, max_running=8, metrics=metrics).start()
    try:
        eng.submit(enc(9, [1]), rid="warm-up", canary=True).future.result(30)
        assert sample("acarerank_batch_requests_count") == 0 and sample("acarerank_batch_tokens_count") == 0, \
            ("the warm-up's pass was counted: batch_requests count "
             f"{sample('acarerank_batch_requests_count')}, batch_tokens count {sample('acarerank_batch_tokens_count')}")
        steps.gate.clear()
        clock = QueueClock(since=0.0)
        groups = [eng.submit(enc(1 + i, [1, 1]), clock=clock) for i in range(6)]   # one request's groups
        for _ in range(3000):  # until the first pass (all six groups: within max_running) waits at the gate
            if len(steps.pinned) == 6:
                break
            threading.Event().wait(0.01)
        assert len(steps.pinned) == 6, f"{len(steps.pinned)} groups pinned, want 6"
        other = eng.submit(enc(20, [1]))   # a second request, arriving during the held pass
        got = (sample("acarerank_queue_size"), sample("acarerank_requests_running"))
        assert got == (1, 1), f"(waiting, running) with one 6-group request running and one queued: {got}, want (1, 1)"
        steps.gate.set()
        for job in [*groups, other]:
            job.future.result(30)
        n = sample("acarerank_batch_requests_count")
        over = n - metrics.registry.get_sample_value("acarerank_batch_requests_bucket", {"le": "2.0"})
        assert n >= 1 and over == 0, f"{over:g} of {n:g} passes shared by more than the 2 requests there are"
    finally:
        steps.gate.set()
        eng.stop(5)
    assert not steps.pinned


class ThreadRecordingSteps(FakeSteps):
    """FakeSteps that records which thread runs each model call."""

    def __init__(self):
        super().__init__()
        self.threads = set()

    def acquire_prefix(self, enc):
        self.threads.add(threading.current_thread().name)
        return super().acquire_prefix(enc)

    def score_segments(self, items):
        self.threads.add(threading.current_thread().name)
        return super().score_segments(items)


def test_model_thread_runs_the_loop_where_the_model_was_built():
    """With a ModelThread, every model call runs on the thread that built the model (one OpenMP
    team for all model work), and stop() ends the loop so the thread can exit."""
    from acarerank.server.model_thread import ModelThread

    mt = ModelThread(name="test-model-thread")
    builder = mt.call(lambda: threading.current_thread().name)
    steps = ThreadRecordingSteps()
    eng = Engine(steps, max_batch_tokens=4, model_thread=mt).start()
    try:
        jobs = [eng.submit(enc(t, [2, 3, 1])) for t in range(1, 6)]
        assert [j.future.result(30).scores for j in jobs] == [[t + 0.002, t + 0.003, t + 0.001] for t in range(1, 6)]
        call = eng.submit_call(lambda: threading.current_thread().name)
        assert call.future.result(30) == builder
    finally:
        eng.stop()
    assert steps.threads == {builder}, f"model calls ran on {steps.threads}, the model was built on {builder}"
    # the loop returned: the model thread takes new work again
    assert mt.call(lambda: 7) == 7
    mt.shutdown()
    with pytest.raises(RuntimeError):
        mt.call(lambda: 0)


def test_shortest_policy_finishes_short_requests_first_and_starves_none():
    """Policy "shortest": a pass fills with the requests that have the fewest documents left, a
    new request joins at the next pass, and a long request still moves at least every
    STARVATION_PASSES + 1 passes."""
    from acarerank.server.engine import STARVATION_PASSES

    steps = FakeSteps()
    steps.gate.clear()
    order = []
    eng = Engine(steps, max_batch_tokens=2, max_running=8)
    long = eng.submit(enc(1, [1] * 40))
    eng.start()
    for _ in range(3000):  # the long request's first pass is waiting at the gate
        if steps.pinned:
            break
        threading.Event().wait(0.01)
    shorts = [eng.submit(enc(t, [1] * 3)) for t in (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)]
    for j in [long] + shorts:
        j.future.add_done_callback(lambda f, j=j: order.append(j))
    tags = []
    orig = steps.score_segments

    def spy(items):
        tags.append(sorted({steps._tag[id(h)] for h, _ in items}))
        return orig(items)

    steps.score_segments = spy
    steps.gate.set()
    try:
        assert long.future.result(30).scores == [1.001] * 40
        for t, j in zip(range(2, 13), shorts):
            assert j.future.result(30).scores == [t + 0.001] * 3
    finally:
        eng.stop()
    assert order[-1] is long, "the long request finished before short ones that arrived later"
    last = 0
    for p, ts in enumerate(tags):
        if 1 in ts:
            assert p - last <= STARVATION_PASSES + 1, f"the long request waited {p - last} passes: {tags}"
            last = p
    assert not steps.pinned


def test_the_running_requests_pin_at_most_max_running_tokens_of_shared_parts():
    """max_running_tokens bounds the shared-part tokens the running requests pin together (the
    service sets the prefix cache's budget): a later request waits until those ahead of it end,
    in arrival order, and the first always runs, however long. Without it 8 requests of 50
    shared tokens were all pinned at once against a bound of 120."""
    steps = FakeSteps()
    peak = []
    acquire = steps.acquire_prefix

    def counting_acquire(enc):
        handle = acquire(enc)
        peak.append(sum(pinned_len.get(h, 0) for h in steps.pinned) + len(enc.shared_ids))
        pinned_len[id(handle)] = len(enc.shared_ids)
        return handle

    pinned_len = {}
    steps.acquire_prefix = counting_acquire
    steps.gate.clear()
    eng = Engine(steps, max_batch_tokens=64, max_running=8, max_running_tokens=120)
    huge = eng.submit(Enc(shared_ids=[1] * 500, segment_ids=[[1]]))       # alone over the bound: runs
    jobs = [eng.submit(Enc(shared_ids=[t] + [0] * 49, segment_ids=[[1] * 3] * 4)) for t in range(2, 10)]
    eng.start()
    steps.gate.set()
    try:
        assert huge.future.result(30).scores == [1.001]
        for t, job in zip(range(2, 10), jobs):
            assert job.future.result(30).scores == [t + 0.003] * 4
    finally:
        eng.stop()
    assert peak[0] == 500, peak
    assert max(peak[1:]) <= 120, f"shared tokens pinned at once: {peak}"
    assert not steps.pinned


def test_the_running_requests_are_counted_in_the_steps_whole_pages():
    """The bound is the cache's pool, whole pages: a step API's ``pinned_tokens`` (the pointwise
    reranker's) counts each shared part so. The engine counted tokens: three parts of 17 tokens
    (two 16-token pages each) ran together under a bound of 64, 96 tokens of pages pinned."""
    steps = FakeSteps()
    steps.pinned_tokens = lambda enc: -(-len(enc.shared_ids) // 16) * 16
    peak, pinned_len = [], {}
    acquire = steps.acquire_prefix

    def counting_acquire(enc):
        handle = acquire(enc)
        peak.append(sum(pinned_len.get(h, 0) for h in steps.pinned) + steps.pinned_tokens(enc))
        pinned_len[id(handle)] = steps.pinned_tokens(enc)
        return handle

    steps.acquire_prefix = counting_acquire
    steps.gate.clear()
    eng = Engine(steps, max_batch_tokens=64, max_running=8, max_running_tokens=64)
    jobs = [eng.submit(Enc(shared_ids=[t] + [0] * 16, segment_ids=[[1] * 3] * 2)) for t in range(2, 5)]
    eng.start()
    steps.gate.set()
    try:
        for t, job in zip(range(2, 5), jobs):
            assert job.future.result(30).scores == [t + 0.003] * 2
    finally:
        eng.stop()
    assert max(peak) <= 64, f"page tokens pinned at once: {peak}"
    assert not steps.pinned


def test_max_running_tokens_must_be_a_positive_int():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_running_tokens must be a positive int"):
            Engine(FakeSteps(), max_batch_tokens=2, max_running_tokens=bad)


def test_start_builds_the_tokenizers_head_cut_before_ready():
    """The head-cut regex (a scan of every code point, 0.1-0.3 s) was built by the first long
    document after /ready, on a tokenizer thread holding the GIL: the probes stalled 180-380 ms.
    ``start`` builds it, for the mode the served reranker's tokenizer uses."""
    from acarerank import PointwiseReranker
    from acarerank import tokenizer as tok
    from acarerank.server import RerankService
    from serve_util import tiny_model

    rr = PointwiseReranker(model=tiny_model())
    assert rr.tokenizer._cuttable, "the test needs the Qwen3 tokenizer, whose long texts are cut"
    tok._head_cut_pattern.cache_clear()
    tok._head_cut_classes.cache_clear()
    svc = RerankService(rr, "tiny").start(warmup=False)
    try:
        built = tok._head_cut_pattern.cache_info().currsize
        assert built == 1, f"{built} head-cut patterns built by start(); want the one for {rr.tokenizer.special_tokens!r}"
    finally:
        svc.stop()
