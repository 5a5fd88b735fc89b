"""The HTTP front: uvicorn with nginx-like connection hygiene, and SIGTERM as a bounded drain.

uvicorn alone leaves a client that sends half a header connected forever (its keep-alive timer
runs only between requests, and its first byte of a request cancels it), has no body timeout,
no cap on open connections (``limit_concurrency`` answers 503 only once a request's head has
arrived, so idle sockets still pile up until descriptors run out), and answers a malformed
request in ``text/plain``. Rather than change servers (Hypercorn and Granian have header
timeouts but not all of the rest, and the app, the drain and the tests are uvicorn's), the
missing pieces are added at the layer that owns them: the protocol (below) for the head of a
request and the connection count, the gate (``app.py``) for the body.

Per connection (``guarded_protocol``), around uvicorn's own HTTP protocol (httptools or h11):

* ``header_timeout``: from the connection's start, and again after each response on a kept-alive
  connection, the head of the next request must arrive within this many seconds, else 408 and
  close (nginx's ``client_header_timeout``);
* a head still arriving may take at most ``MAX_HEAD_BYTES`` (431 past it; h11's own limit,
  which httptools lacks; a head that arrived whole is measured by the gate);
* ``max_connections`` open at once (kept under the process's descriptor limit): one more is
  closed as soon as it is accepted, with one log line per ``LOG_EVERY_S`` at most, so running
  out of descriptors never happens and never floods the log (nginx's ``worker_connections``);
* a malformed request (bad syntax, duplicate ``Content-Length``) is answered with the JSON
  error shape.

Idle keep-alive connections close after ``keepalive_timeout`` (uvicorn's ``timeout_keep_alive``).

SIGTERM (``DrainingServer``): ``/ready`` and new API requests answer 503 at once; requests in
flight get up to ``drain_timeout`` seconds, then each one still running is answered 503 and its
work dropped; then uvicorn closes every connection (a client still sending a body included) and
the process exits. SIGINT (Ctrl+C) is uvicorn's usual graceful stop.
"""
from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import sys
import threading
import time

from .config import MAX_HEAD_BYTES, ServeConfig
from .errors import error_bytes

log = logging.getLogger("acarerank.server")

LOG_EVERY_S = 10.0               # at most one "connection cap reached" line per this many seconds
FD_RESERVE = 128                 # descriptors kept for everything but client connections (model files, pools, logs)
SHUTDOWN_GRACE_S = 1.0           # after the drain deadline: time for the 503s to be written
HEAD_GRACE_S = 0.1               # a head timer that fires gets this long for bytes already received


def _raw_error(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP/1.1 error response with the JSON error body; the connection closes after it."""
    body = error_bytes(status, message)
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


class _RateLimited:
    """One log line per ``every`` seconds, with the count of events since the last line."""

    def __init__(self, every: float = LOG_EVERY_S):
        self.every = every
        self.last = -float("inf")
        self.count = 0

    def __call__(self, message: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.every:
            log.warning("%s (%d since the last such line)", message, self.count)
            self.last, self.count = now, 0


def guarded_protocol(base, config: ServeConfig):
    """A subclass of uvicorn's HTTP protocol ``base`` with the module docstring's limits."""
    refused_log = _RateLimited()

    class GuardedHTTP(base):
        _refused = False
        _head_timer = None
        _head_for = None       # the request cycle that was current when the timer was armed
        _head_bytes = 0
        _head_grace = False
        _keepalive_grace = False

        def connection_made(self, transport):
            if len(self.server_state.connections) >= config.max_connections:
                self._refused = True
                refused_log(f"{config.max_connections} connections open (--max-connections): closing new ones")
                transport.abort()
                return
            super().connection_made(transport)
            self._arm_head_timer()

        def connection_lost(self, exc):
            if self._refused:
                return
            self._cancel_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            waiting = self._head_timer is not None
            super().data_received(data)
            if not waiting:
                return
            if self.cycle is not self._head_for:   # a request's head arrived
                self._cancel_head_timer()
                return
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self._cancel_head_timer()
                self.transport.write(_raw_error(431, "Request Header Fields Too Large",
                                                f"request line and headers exceed {MAX_HEAD_BYTES} bytes"))
                self.transport.close()

        def on_response_complete(self) -> None:
            self._keepalive_grace = False
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm_head_timer()   # kept alive: the next head has header_timeout seconds

        def timeout_keep_alive_handler(self) -> None:
            if not self._keepalive_grace:   # the same grace as the head timer's (_head_timed_out)
                self._keepalive_grace = True
                self.timeout_keep_alive_task = self.loop.call_later(HEAD_GRACE_S, self.timeout_keep_alive_handler)
                return
            super().timeout_keep_alive_handler()

        def send_400_response(self, msg: str) -> None:
            self._cancel_head_timer()
            self.transport.write(_raw_error(400, "Bad Request", f"malformed HTTP request: {msg} (e.g. bad syntax, "
                                                                "a duplicate Content-Length, headers over "
                                                                f"{MAX_HEAD_BYTES} bytes)"))
            self.transport.close()

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_for = self.cycle
            self._head_bytes = 0
            self._head_grace = False
            self._head_timer = self.loop.call_later(config.header_timeout, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.cycle is not self._head_for:
                return
            if not self._head_grace:
                # After a stall of the event loop, a timer can run before the reads that were
                # due first (libuv runs timers before polling): one more short wait lets bytes
                # that already arrived be parsed before the connection is judged.
                self._head_grace = True
                self._head_timer = self.loop.call_later(HEAD_GRACE_S, self._head_timed_out)
                return
            if self._head_bytes:   # part of a head arrived: say why (nginx answers 408 too)
                self.transport.write(_raw_error(408, "Request Timeout", f"request headers not received within "
                                                f"{config.header_timeout:g} s (--header-timeout)"))
            self.transport.close()

    return GuardedHTTP


def _uvicorn_http_protocol():
    """uvicorn's "auto" choice: httptools when installed, else h11."""
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol
        return H11Protocol


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
    line per malformed request); ``only``: the messages it applies to (None: all)."""

    def __init__(self, every: float = LOG_EVERY_S, only=None):
        super().__init__()
        self.every = every
        self.only = only
        self.seen = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if self.only is not None and record.msg not in self.only:
            return True
        key = (record.name, record.msg)
        now = time.monotonic()
        if now - self.seen.get(key, -float("inf")) < self.every:
            return False
        self.seen[key] = now
        return True


def uvicorn_config(app, config: ServeConfig):
    import uvicorn

    logging.getLogger("asyncio").addFilter(_OncePerInterval())
    logging.getLogger("uvicorn.error").addFilter(_OncePerInterval(only={"Invalid HTTP request received."}))
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level, access_log=False,
                          http=guarded_protocol(_uvicorn_http_protocol(), config),
                          h11_max_incomplete_event_size=2 * MAX_HEAD_BYTES,
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

            def handle_exit(self, sig, frame):
                if sig == signal.SIGTERM and not state.draining:
                    state.draining = True
                    threading.Thread(target=self._drain, name="acarerank-drain", daemon=True).start()
                    return
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


def run_server(service, config: ServeConfig, api_key=None) -> None:
    """Serve ``service`` (started) over HTTP until SIGTERM/SIGINT, then stop it, bounded in time."""
    from .app import GateState, create_app

    config = fit_connections_to_descriptors(config)
    state = GateState()
    app = create_app(service, config, api_key=api_key, state=state)
    server = DrainingServer(uvicorn_config(app, config), state, config.drain_timeout)
    try:
        server.run()
    finally:
        app.state.parse_pool.shutdown(wait=False, cancel_futures=True)
        _stop_bounded(service, SHUTDOWN_GRACE_S + 1.0)


def _stop_bounded(service, timeout: float) -> None:
    """``service.stop()``; if model work still runs after ``timeout`` seconds (a model call is not
    interruptible), exit the process now rather than wait for it: the drain deadline is a bound."""
    service.engine.stop(timeout)
    service.stop()
    deadline = time.monotonic() + timeout
    busy = lambda: [t for t in threading.enumerate()  # noqa: E731
                    if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    while busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    if busy():
        print(f"acarerank serve: exiting with model work still running ({', '.join(t.name for t in busy())})",
              file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
