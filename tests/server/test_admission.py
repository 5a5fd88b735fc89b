"""``TokenBudget`` (``acarerank/server/admission.py``) alone, on an event loop, against a plain model
of the rule: tokens are granted in arrival order, never past the budget, and a waiter that
leaves (given up, or granted and then cancelled) lets the ones behind it in."""
import asyncio
import random

import pytest

from acarerank.server.admission import TokenBudget


@pytest.mark.parametrize("seed", [0, 1, 7, 59])
def test_grants_follow_arrival_order_and_never_pass_the_budget(seed):
    """800 random acquires, releases and abandons: after each, ``held`` is within the budget, equals
    the tokens of the requests granted and not yet released, the grants came in arrival order
    (a request that fits never goes before one waiting), and the head of the queue does not fit."""
    rng = random.Random(seed)
    budget = 97

    async def run():
        seen = []
        gate = TokenBudget(budget, on_change=lambda held, waiting: seen.append((held, waiting)))
        holding, waiting, granted_order, arrivals = {}, [], [], 0   # waiting: (id, tokens, future), oldest first
        for _ in range(800):
            op = rng.random()
            if op < 0.5:
                tokens = rng.choice([1, 7, 13, 59, 97])
                fut = gate.acquire(tokens)
                if fut is None:
                    assert not waiting, "taken at once while others waited"
                    holding[arrivals] = tokens
                    granted_order.append(arrivals)
                else:
                    waiting.append((arrivals, tokens, fut))
                arrivals += 1
            elif op < 0.8 and holding:
                rid = rng.choice(sorted(holding))
                gate.release(holding.pop(rid))
            elif waiting:
                rid, tokens, fut = waiting.pop(rng.randrange(len(waiting)))
                gate.abandon(fut, tokens)
            # the futures granted by that call, in the order the queue had them
            for rid, tokens, fut in list(waiting):
                if fut.done():
                    waiting.remove((rid, tokens, fut))
                    holding[rid] = tokens
                    granted_order.append(rid)
            assert gate.held == sum(holding.values()) <= budget, (gate.held, holding)
            assert gate.waiting == len(waiting)
            if waiting:
                assert gate.held + waiting[0][1] > budget, "the head fits and still waits"
            assert not seen or seen[-1] == (gate.held, gate.waiting)   # the gauges read what holds
        # granted in arrival order: at once only when nobody waited, from the queue oldest first
        assert granted_order == sorted(granted_order), granted_order
        return granted_order

    order = asyncio.run(run())
    assert len(order) > 100


def test_a_granted_waiter_that_is_abandoned_gives_its_tokens_back():
    """Granted at the moment its wait was given up (client gone, deadline, drain): its tokens come
    back and the next waiter gets them."""
    async def run():
        gate = TokenBudget(10)
        assert gate.acquire(8) is None
        a, b = gate.acquire(5), gate.acquire(5)
        assert not a.done() and gate.ahead_of(b) == 1
        gate.release(8)            # a and b both fit now: granted in order
        assert a.done() and b.done() and gate.held == 10
        gate.abandon(a, 5)         # a's task was cancelled as it was granted
        assert gate.held == 5 and gate.waiting == 0
        gate.abandon(a, 5)         # again (its give-up, then hold_tokens' own): once only
        assert gate.held == 5 and gate.entering == 1
        c = gate.acquire(6)
        assert not c.done() and gate.ahead_of(c) == 0
        gate.abandon(c, 6)         # c leaves while waiting: out of the queue, nothing held for it
        assert c.cancelled() and gate.held == 5 and gate.waiting == 0 and gate.ahead_of(c) == 0
        with pytest.raises(ValueError, match="exceed the budget"):
            gate.acquire(11)

    asyncio.run(run())


@pytest.mark.parametrize("excess, released, waited, want", [
    (450, 100, 0.5, 3),      # 200 tokens/s given back: 450 more take 2.25 s
    (1000, 1000, 30.0, 30),  # 33 tokens/s: 30 s
    (10, 10_000, 30.0, 1),   # drains at once: the least
    (0, 0, 30.0, 1),         # fits now that the others left: at once, whatever the rate
    (-5, 100, 1.0, 1),
    (10, 1, 30.0, 60),       # 300 s at that rate: the most
    (10, 0, 30.0, 60),       # nothing given back during the whole wait: the most
])
def test_retry_after_is_the_time_the_queue_takes_to_make_room(excess, released, waited, want):
    """``retry_after_s``: ceil(excess / (released / waited)) clamped to [1, 60] s."""
    from acarerank.server.admission import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S, retry_after_s

    assert (RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S) == (1, 60)
    assert retry_after_s(excess, released, waited) == want


def test_a_request_whose_token_wait_ran_out_is_told_when_the_queue_will_have_room():
    """A request refused after --token-wait-timeout gets a Retry-After from the tokens given back
    during its wait: the requests held and waiting, then its own, must fit before its retry can
    (it joins the back). It said 1 s whatever the queue, and a retry 1 s later waited again."""
    from types import SimpleNamespace

    from acarerank.server.errors import APIError
    from acarerank.server.service import RerankService

    stub = SimpleNamespace(cache_stats=lambda: {}, max_batch_tokens=64)   # hold_tokens needs no model
    svc = RerankService(stub, "stub", max_queue_tokens=1000, token_wait_timeout=0.5)

    async def here():
        return False

    async def refused(free_after: float, free: int):
        assert svc._tokens.acquire(100) is None and svc._tokens.acquire(500) is None   # 600 held

        async def answer():
            await asyncio.sleep(free_after)
            svc._tokens.release(free)
        answering = asyncio.ensure_future(answer())
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(APIError) as e:
            async with svc.hold_tokens(950, here):
                pass
        waited = asyncio.get_running_loop().time() - t0
        await answering
        svc._tokens.release(600 - free)
        assert svc._tokens.held == 0 and svc._tokens.waiting == 0
        return e.value, waited
    try:
        # 100 of the 600 held are given back during the 0.5 s wait: the other 500 and its 950 pass
        # the budget by 450, at 200 tokens/s -> 2.25 s (2.7 s if the wait ran to 0.6 s): 3
        err, waited = asyncio.run(refused(0.2, 100))
        assert err.status == 429 and 0.5 <= waited < 0.6, (err.status, waited)
        assert err.headers["Retry-After"] == "3" and "retry in 3 s" in err.message, (err.headers, err.message)
        # nothing given back during the wait: the most
        err, _ = asyncio.run(refused(0.7, 0))
        assert err.status == 429 and err.headers["Retry-After"] == "60", err.headers
    finally:
        svc.stop()


@pytest.mark.parametrize("noticed_on", ["event loop", "scheduler thread"])
def test_a_request_waiting_for_tokens_gets_the_dead_services_503_at_once(noticed_on):
    """The service dies (a tokenizer pool that broke, noticed on the event loop; an engine that
    died, noticed on the scheduler thread) while a request waits for room in --max-queue-tokens
    behind tokens the engine does not give back (it is wedged, or it is the engine that died): the
    waiter gets the 503 a new request gets, at once. It waited out --token-wait-timeout (30 s
    here), then got a 429 inviting a retry; nothing it did not hold is given back."""
    import threading
    from types import SimpleNamespace

    from acarerank.server.errors import APIError
    from acarerank.server.service import RerankService

    stub = SimpleNamespace(cache_stats=lambda: {}, max_batch_tokens=64)   # hold_tokens needs no model
    svc = RerankService(stub, "stub", max_queue_tokens=1000, token_wait_timeout=30.0)
    reason = "the tokenizer pool cannot run work (RuntimeError: broken)"

    async def here():
        return False

    async def die():
        await asyncio.sleep(0.2)
        if noticed_on == "event loop":
            svc._mark_dead(reason)
        else:   # as Engine._die: the reason first, then on_dead on the thread that noticed
            svc.engine.dead = reason
            t = threading.Thread(target=lambda: [fn(reason) for fn in svc.on_dead])
            t.start()
            t.join()

    async def run():
        assert svc._tokens.acquire(600) is None   # held by a request the engine never answers
        dying = asyncio.ensure_future(die())
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(APIError) as e:
            await asyncio.wait_for(svc.hold_tokens(500, here).__aenter__(), 5.0)
        waited = asyncio.get_running_loop().time() - t0
        await dying
        assert svc._tokens.held == 600 and svc._tokens.waiting == 0, (svc._tokens.held, svc._tokens.waiting)
        with pytest.raises(APIError) as later:   # and one that comes after it, before any wait
            await asyncio.wait_for(svc.hold_tokens(10, here).__aenter__(), 5.0)
        return e.value, waited, later.value
    try:
        err, waited, later = asyncio.run(run())
        assert err.status == 503 and reason in err.message and waited < 1.0, (err.status, err.message, waited)
        assert err.headers.get("Connection") == "close", err.headers
        assert later.status == 503 and reason in later.message, later.message
    finally:
        svc.stop()


def test_requests_granted_together_reach_the_engine_in_grant_order():
    """Four waiters granted by one release, the first of them checking its client at that moment
    (its poll takes a while): each submits (records itself) in grant order, and one that arrives
    then and fits goes behind them. Resolving the futures in order was not enough: the one in its
    poll woke after the three behind it, and they reached the engine first (a flaky
    test_serve.py::test_a_large_request_is_answered_before_the_small_ones_that_came_after_it).
    A waiter cancelled while it waits for its turn leaves the line and gives its tokens back."""
    from types import SimpleNamespace

    from acarerank.server.service import RerankService

    stub = SimpleNamespace(cache_stats=lambda: {}, max_batch_tokens=64)   # hold_tokens needs no model
    svc = RerankService(stub, "stub", max_queue_tokens=100, token_wait_timeout=30.0)

    async def run(cancel_second: bool):
        order, checking = [], asyncio.Event()

        async def slow_check():   # the first waiter's client check, in progress when the grant comes
            checking.set()
            await asyncio.sleep(0.05)
            return False

        async def here():
            return False

        async def request(k, tokens, check):
            async with svc.hold_tokens(tokens, check):
                order.append(k)   # the body's submit: before its first await
                await asyncio.sleep(0.01)

        assert svc._tokens.acquire(100) is None   # held by a request being answered
        tasks = [asyncio.ensure_future(request(k, 20, slow_check if k == 0 else here)) for k in range(4)]
        while svc._tokens.waiting < 4:
            await asyncio.sleep(0.001)
        await checking.wait()
        svc._tokens.release(100)   # all four fit now: granted together
        assert svc._tokens.waiting == 0 and svc._tokens.entering == 4 and svc._tokens.held == 80
        late = asyncio.ensure_future(request(4, 10, here))   # fits, nobody waits: behind the granted ones
        if cancel_second:
            await asyncio.sleep(0)   # the waiters wake; the second one waits for its turn
            await asyncio.sleep(0)
            tasks[1].cancel()
        results = await asyncio.gather(*tasks, late, return_exceptions=True)
        assert svc._tokens.held == 0 and svc._tokens.entering == 0, (svc._tokens.held, svc._tokens.entering)
        return order, results

    try:
        order, _ = asyncio.run(run(False))
        assert order == [0, 1, 2, 3, 4], order
        order, results = asyncio.run(run(True))
        assert isinstance(results[1], asyncio.CancelledError) and order == [0, 2, 3, 4], (order, results)
    finally:
        svc.stop()


def test_a_waiter_whose_client_check_raises_after_its_grant_does_not_hold_the_line():
    """Two waiters granted by one release; the first one's client check raises (a receive that
    broke) as it is granted. Its request fails with that error, its tokens go back, and the one
    behind it still takes its turn: a grant never used would otherwise have held the line (and
    its tokens) for good."""
    from types import SimpleNamespace

    from acarerank.server.service import RerankService

    stub = SimpleNamespace(cache_stats=lambda: {}, max_batch_tokens=64)   # hold_tokens needs no model
    svc = RerankService(stub, "stub", max_queue_tokens=100, token_wait_timeout=30.0)

    async def run():
        order, checking = [], asyncio.Event()

        async def broken_check():
            checking.set()
            await asyncio.sleep(0.05)
            raise RuntimeError("receive broke")

        async def here():
            return False

        async def request(k, check):
            async with svc.hold_tokens(20, check):
                order.append(k)
                await asyncio.sleep(0.01)

        assert svc._tokens.acquire(100) is None
        tasks = [asyncio.ensure_future(request(k, broken_check if k == 0 else here)) for k in range(2)]
        while svc._tokens.waiting < 2:
            await asyncio.sleep(0.001)
        await checking.wait()
        svc._tokens.release(100)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5.0)
        assert svc._tokens.held == 0 and svc._tokens.entering == 0, (svc._tokens.held, svc._tokens.entering)
        return order, results

    try:
        order, results = asyncio.run(run())
        assert order == [1] and isinstance(results[0], RuntimeError) and results[1] is None, (order, results)
    finally:
        svc.stop()
