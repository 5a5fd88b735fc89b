"""The HTTP front: uvicorn with nginx-like connection hygiene, and SIGTERM as a bounded drain.

uvicorn lacks a header timeout, a body timeout, a send timeout and a connection cap, and answers
malformed HTTP in ``text/plain``. Rather than change servers (Hypercorn and Granian have header
timeouts but not all of the rest, and the app, the drain and the tests are uvicorn's), the
missing pieces are added at the layer that owns them: the protocol (``protocol.py``) for the
head of a request, a response the client leaves unread and the connection count, the gate
(``gate.py``) for the body. Here: the uvicorn configuration, the connection cap kept under the
process's descriptor limit, repeated log lines kept to one per 10 s, and the drain.

Idle keep-alive connections close after ``keepalive_timeout`` (uvicorn's ``timeout_keep_alive``).

SIGTERM (``DrainingServer``): ``/ready`` and new API requests answer 503 at once; requests in
flight get up to ``drain_timeout`` seconds, then each one still running is answered 503 and its
work dropped; then uvicorn closes every connection (a client still sending a body included) and
the process exits. SIGINT (Ctrl+C) is uvicorn's usual graceful stop.

A dead engine (``RerankService.dead``: the scheduler loop ended on an exception) answers every
request 503 at once; ``DEAD_GRACE_S`` later uvicorn stops and the process exits with
``EXIT_ENGINE_DEAD``, so a supervisor restarts it (docs/serving.md, "Internal faults and probes").
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import sys
import threading
import time

from .config import MAX_HEAD_BYTES, ServeConfig
from .gate import LOG_EVERY_S
from .listen import listen_sockets
from .protocol import http_protocol_with_limits, uvicorn_http_protocol

log = logging.getLogger("acarerank.server")

FD_RESERVE = 128                 # descriptors kept for everything but client connections (model files, pools, logs)
SHUTDOWN_GRACE_S = 1.0           # after the drain deadline: time for the 503s to be written
DEAD_GRACE_S = 1.0               # after the engine died: time for the 503s (and a probe or two) to be answered
EXIT_ENGINE_DEAD = 70            # the process's exit status after its engine died (sysexits' EX_SOFTWARE)


def fit_connections_to_descriptors(config: ServeConfig) -> ServeConfig:
    """Raise the soft descriptor limit toward ``max_connections + FD_RESERVE`` (up to the hard
    limit); if it still falls short, lower ``max_connections`` to fit and say so in one line."""
    want = config.max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < want:
        fit = soft - FD_RESERVE
        if fit < 1:
            raise ValueError(f"the descriptor limit ({soft}, ulimit -n) leaves no room for client connections")
        print(f"acarerank serve: --max-connections {config.max_connections} lowered to {fit} to stay under the "
              f"descriptor limit ({soft}, ulimit -n)", file=sys.stderr)
        config = config.replace(max_connections=fit)
    return config


class _OncePerInterval(logging.Filter):
    """Drops repeats of one log message within ``every`` seconds (asyncio's accept errors, uvicorn's
    line per malformed request); ``only``: the messages it applies to (None: all).

    ``seen`` maps each message let through to when, oldest first, and keeps only those of the last
    ``every`` seconds (an older one no longer stops a repeat), at most ``max_keys`` of them: the key
    is the message as logged, and asyncio's exception handler logs text that names the task or
    the connection, so a long-running server met a new key with every such error and the map grew
    for as long as the process lived. Past ``max_keys`` distinct messages in one interval the
    oldest is forgotten (its repeat may be logged once more)."""

    def __init__(self, every: float = LOG_EVERY_S, only=None, max_keys: int = 1024):
        super().__init__()
        self.every = every
        self.only = only
        self.max_keys = max_keys
        self.seen = {}
        self._lock = threading.Lock()   # filters run on whichever thread logs

    def filter(self, record: logging.LogRecord) -> bool:
        if self.only is not None and record.msg not in self.only:
            return True
        key = (record.name, record.msg)
        now = time.monotonic()
        with self._lock:
            # insertion order is the order they were let through: the stale ones are at the front
            while self.seen:
                oldest = next(iter(self.seen))
                if now - self.seen[oldest] < self.every:
                    break
                del self.seen[oldest]
            if key in self.seen:   # let through less than `every` seconds ago
                return False
            self.seen[key] = now
            if len(self.seen) > self.max_keys:
                del self.seen[next(iter(self.seen))]
            return True


def uvicorn_config(app, config: ServeConfig, metrics=None):
    """uvicorn's configuration for ``app``; ``metrics`` (the service's ``ServerMetrics``) count the
    error responses the HTTP protocol writes itself (``protocol.py``)."""
    import uvicorn

    logging.getLogger("asyncio").addFilter(_OncePerInterval())
    logging.getLogger("uvicorn.error").addFilter(_OncePerInterval(only={"Invalid HTTP request received."}))
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level, access_log=False,
                          http=http_protocol_with_limits(uvicorn_http_protocol(), config, metrics),
                          h11_max_incomplete_event_size=2 * MAX_HEAD_BYTES,
                          # no WebSocket route: an upgrade is served as HTTP (a JSON 404/405), where
                          # uvicorn's WebSocket layer refused it in its own shape with two log lines
                          ws="none",
                          timeout_keep_alive=config.keepalive_timeout,
                          timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    # the server's own lines (drain, uploads cut short, the connection cap) go where uvicorn's go
    ours = logging.getLogger("acarerank.server")
    ours.handlers = logging.getLogger("uvicorn").handlers
    ours.setLevel(logging.getLogger("uvicorn.error").getEffectiveLevel())
    ours.propagate = False
    return uv


class DrainingServer:
    """uvicorn's Server with SIGTERM turned into a bounded drain (module docstring)."""

    def __new__(cls, uv_config, state, drain_timeout: float):
        import uvicorn

        class _Server(uvicorn.Server):
            async def serve(self, sockets=None):
                self.loop = asyncio.get_running_loop()
                await super().serve(sockets)

            async def startup(self, sockets=None):
                await super().startup(sockets)
                for sock in sockets or ():  # uvicorn names only the addresses it bound itself
                    host, port = sock.getsockname()[:2]
                    log.info("listening on http://%s:%d (Press CTRL+C to quit)",
                             f"[{host}]" if ":" in host else host, port)

            async def shutdown(self, sockets=None):
                await super().shutdown(sockets)
                if self.force_exit:
                    # a second Ctrl-C: uvicorn skips the app's lifespan shutdown, and the loop's end
                    # then cancels the lifespan task still waiting for it, which starlette logged as a
                    # ~40-line traceback before our "interrupted" line. Ours is quick (the parse pool,
                    # not waited for); bounded all the same, the user asked to quit
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.lifespan.shutdown(), SHUTDOWN_GRACE_S)

            def handle_exit(self, sig, frame):
                if sig == signal.SIGTERM:
                    if not state.draining:
                        state.draining = True
                        threading.Thread(target=self._drain, name="acarerank-drain", daemon=True).start()
                    else:   # passed to uvicorn it ended the drain at once and the process died by the signal
                        log.info("SIGTERM again: already draining (--drain-timeout %g s)", drain_timeout)
                    return
                state.stopping = True   # SIGINT: uvicorn's stop; what it cancels gets our 503
                super().handle_exit(sig, frame)

            def _drain(self):
                deadline = time.monotonic() + drain_timeout
                while state.in_flight > 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                if state.in_flight > 0:
                    log.warning("drain: %d request(s) still in flight after %g s (--drain-timeout): answering 503",
                                state.in_flight, drain_timeout)
                    self.loop.call_soon_threadsafe(state.expire)
                    grace = time.monotonic() + SHUTDOWN_GRACE_S
                    while state.in_flight > 0 and time.monotonic() < grace:
                        time.sleep(0.02)
                self.should_exit = True

        return _Server(uv_config)


def run_server(service, config: ServeConfig, api_key=None, *, exit_if_stuck: bool = False) -> int:
    """Serve ``service`` (started) over HTTP until SIGTERM/SIGINT or its death, then stop it,
    bounded in time. Returns the exit status: 0, or ``EXIT_ENGINE_DEAD``. Raises
    ``listen_sockets``' OSError (the service stopped) when ``config``'s address cannot be bound.

    ``exit_if_stuck``: when the service's threads (``service.threads()``: a model call cannot be
    interrupted) still run ``SHUTDOWN_GRACE_S + 1`` s after the stop, exit the process at once
    with that status (``os._exit``) — ``acarerank serve``'s choice, which owns its process. False
    (an application embedding the server): one warning naming those threads, and the status is
    returned; the process and its other threads are the application's (docs/serving.md)."""
    app = None
    try:   # from here on the service is ours to stop, whatever is raised (a Ctrl-C before uvicorn's handler)
        from .app import create_app
        from .gate import GateState

        config = fit_connections_to_descriptors(config)
        state = GateState()
        app = create_app(service, config, api_key=api_key, state=state)
        server = DrainingServer(uvicorn_config(app, config, service.metrics), state, config.drain_timeout)

        def on_dead(reason: str) -> None:  # on the thread that noticed: stop serving after the grace
            log.critical("exiting in %g s with status %d: %s", DEAD_GRACE_S, EXIT_ENGINE_DEAD, reason)
            def stop() -> None:
                state.stopping = True
                server.should_exit = True

            timer = threading.Timer(DEAD_GRACE_S, stop)
            timer.daemon = True
            timer.start()

        service.on_dead.append(on_dead)
        if service.dead is not None:  # died before the callback was in place
            on_dead(service.dead)
        # bound here, not by uvicorn: a port taken since acarerank serve's check (during the
        # model's load) is an OSError naming it, one line and exit 2 as that check's, where
        # uvicorn logged its own error over several lines and exited 3 (docs/serving.md)
        server.run(sockets=listen_sockets(config.host, config.port, backlog=server.config.backlog))
    finally:
        if app is not None:   # the app's lifespan shut its parse pool down, but for a forced exit (uvicorn skips it)
            app.state.parse_pool.shutdown(wait=False, cancel_futures=True)
        _stop_bounded(service, SHUTDOWN_GRACE_S + 1.0, exit_if_stuck)
    # read after the final stop: the engine's last pass runs during it and may kill the engine
    return exit_status(service)


def exit_status(service) -> int:
    """``EXIT_ENGINE_DEAD`` if ``service`` is dead (at any point, its final stop included), else 0."""
    return EXIT_ENGINE_DEAD if service.dead is not None else 0


def _stop_bounded(service, timeout: float, exit_if_stuck: bool = False) -> list:
    """``service.stop()``, then wait up to ``timeout`` seconds for its threads (``service.threads()``;
    a model call is not interruptible). Returns those still running, after one warning naming
    them; with ``exit_if_stuck`` (``acarerank serve``) it exits the process instead, status
    ``exit_status``: the drain deadline is a bound. Only the service's threads are waited for:
    an embedding application's own are none of its business."""
    service.engine.stop(timeout)
    service.stop()
    deadline = time.monotonic() + timeout
    while service.threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    busy = service.threads()
    if busy and exit_if_stuck:
        print(f"acarerank serve: exiting with model work still running ({', '.join(t.name for t in busy)})",
              file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_status(service))
    if busy:
        log.warning("stopped with model work still running after %g s (%s): those threads end when their "
                    "call returns", timeout, ", ".join(t.name for t in busy))
    return busy
