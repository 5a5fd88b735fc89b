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
        c = gate.acquire(6)
        assert not c.done() and gate.ahead_of(c) == 0
        gate.abandon(c, 6)         # c leaves while waiting: out of the queue, nothing held for it
        assert c.cancelled() and gate.held == 5 and gate.waiting == 0 and gate.ahead_of(c) == 0
        with pytest.raises(ValueError, match="exceed the budget"):
            gate.acquire(11)

    asyncio.run(run())
