"""``wait_or_drop``: a request whose client left gives its work up without leaving an exception
behind for asyncio to log as "never retrieved" (one ERROR line with a traceback per disconnect)."""
import asyncio
import concurrent.futures
import gc

import pytest
from _optional import require

require("fastapi")  # acarerank.server's package imports its app

from acarerank.server.disconnect import ClientGone, wait_or_drop  # noqa: E402


@pytest.mark.parametrize("how", ["client gone", "task cancelled"])
def test_a_dropped_wait_leaves_no_unretrieved_exception(how):
    reports = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reports.append(ctx.get("message")))
        job = concurrent.futures.Future()       # the engine's future, completed on its own thread
        job.set_running_or_notify_cancel()      # already in a pass: the drop cannot cancel it

        async def gone():
            return how == "client gone"

        waiter = asyncio.ensure_future(wait_or_drop(asyncio.wrap_future(job), gone, lambda: None, poll_s=0.01))
        if how == "task cancelled":
            await asyncio.sleep(0.05)
            waiter.cancel()
        with pytest.raises(ClientGone if how == "client gone" else asyncio.CancelledError):
            await waiter
        # the engine finishes the dropped job the way Engine._finish does
        job.set_exception(concurrent.futures.CancelledError("client disconnected"))
        await asyncio.sleep(0.05)
        del waiter
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    assert reports == [], reports
