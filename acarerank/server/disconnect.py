"""Waiting for work while watching the client: the one polling loop of the service and the Ray front."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Optional

DISCONNECT_POLL_S = 0.1          # how often a waiting request checks that its client is still there


class ClientGone(Exception):
    """The client disconnected while its request waited; nothing is sent back."""


class DeadlinePassed(Exception):
    """The request's deadline (``--request-timeout``) passed while it waited; its work was dropped."""


async def wait_or_drop(fut: asyncio.Future, is_disconnected: Callable[[], Awaitable[bool]],
                       drop: Callable[[], None], poll_s: float = DISCONNECT_POLL_S,
                       deadline: Optional[float] = None):
    """``await fut``, checking ``is_disconnected()`` every ``poll_s`` seconds meanwhile.

    If the client leaves first, ``drop()`` (give up the work) and raise ``ClientGone``; if the event
    loop's clock (``loop.time()``) reaches ``deadline`` first, ``drop()`` and raise ``DeadlinePassed``;
    if this task is cancelled (shutdown, drain deadline), ``drop()`` and re-raise. Otherwise
    ``fut``'s result (or exception).
    """
    loop = asyncio.get_running_loop()
    try:
        while True:
            wait_s = poll_s if deadline is None else max(0.0, min(poll_s, deadline - loop.time()))
            done, _ = await asyncio.wait({fut}, timeout=wait_s)
            if done:
                return fut.result()
            if deadline is not None and loop.time() >= deadline:
                _forget(fut)
                drop()
                raise DeadlinePassed()
            if await is_disconnected():
                _forget(fut)
                drop()
                raise ClientGone()
    except asyncio.CancelledError:
        _forget(fut)
        drop()
        raise


def _forget(fut: asyncio.Future) -> None:
    """Nobody will await ``fut`` any more: read its outcome when it comes. A dropped job still ends
    (the engine fails a job already in a pass with CancelledError), and an exception nobody read
    is logged by asyncio as "never retrieved", with a traceback, once per client that left."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
