"""Per connection: uvicorn's HTTP protocol (httptools or h11) with nginx-like limits.

uvicorn alone leaves a client that sends half a header connected forever (its keep-alive timer
runs only between requests, and the first byte of a request cancels it), has no cap on open
connections (``limit_concurrency`` answers 503 only once a request's head has arrived, so idle
sockets still pile up until descriptors run out), no head-size limit with httptools, and answers
a malformed request in ``text/plain``. ``http_protocol_with_limits`` subclasses uvicorn's own
protocol class (``HTTPProtocolWithLimits``) and adds:

* ``header_timeout``: from the connection's start, and again after each response on a kept-alive
  connection, the head of the next request must arrive within this many seconds, else 408 (when
  part of a head arrived) and close (nginx's ``client_header_timeout``);
* a head still arriving may take at most ``MAX_HEAD_BYTES`` (431 past it; h11's own limit,
  which httptools lacks; a head that arrived whole is measured by the gate, ``gate.py``). Its
  body is in the shape the gate's would be (TEI's on ``/rerank``: ``errors.error_for``), the path
  read from the request line's first bytes as uvicorn reads it (``_request_path``), so how the
  head's TCP segments fell does not pick the shape. h11 gets a head still arriving in pieces of
  ``MAX_HEAD_BYTES``, so its own limit (twice that, ``front.py``) never answers it first (a 400),
  and a pipelined head h11 holds unparsed while the previous response runs is judged, those bytes
  counted, when that response ends (``_judge_pipelined_head``);
* a chunked body's trailer fields (httptools kept them all, in the request's scope) are dropped,
  and more than ``MAX_HEAD_BYTES`` of them is a 431 and close (h11 holds them within its own
  limit, a 400 past it);
* ``max_connections`` open at once: past them, ``PROBE_RESERVE`` more are accepted for probes only
  (their request line must be a ``GET``/``HEAD`` of ``/health``, ``/ready`` or ``/metrics``,
  within ``PROBE_HEAD_TIMEOUT_S`` and ``HEAD_START_BYTES``; one request each, then close), so idle sockets at the cap do not
  fail a healthy server's liveness probe; any other request there, and one more connection past
  the reserve as soon as it is accepted, is closed, with one log line per ``LOG_EVERY_S`` at most
  (nginx's ``worker_connections``);
* ``send_timeout``: once a response fills the socket's buffers (the transport pauses writing), the
  client must take enough of it for writing to resume within this many seconds, else the
  connection is aborted (nginx's ``send_timeout``). A client that never reads otherwise held its
  connection, and the unsent part of its response in memory, for good: the keep-alive timer's
  close waits for the buffer to drain, and an idle TCP peer is never timed out;
* a malformed request (bad syntax, duplicate ``Content-Length``) is answered with the JSON
  error shape;
* each connection closed for ``max_connections`` or ``send_timeout`` is counted in
  ``acarerank_connections_closed_total{reason}``; each error response written here (400, 408,
  431) is counted in the metrics as the gate counts its own (``_count``): a request the gate never
  saw, its endpoint read from the head's first bytes; one whose body the gate was reading is left
  to the gate, told the status (``ANSWERED_BY_PROTOCOL``);
* a request asking to upgrade its connection (``Upgrade: h2c``, ``websocket``: the server has no
  WebSocket route, front.py) is served as HTTP/1.1 with one log line per ``LOG_EVERY_S`` at most
  (uvicorn wrote one or two per request), its body included: httptools ended such a request at
  its head (an empty body, its bytes then parsed as the next request's), so its head is parsed
  again without the upgrade by a fresh parser (``_parse``);
* a timer that fires after a stall of the event loop gives bytes already received
  ``HEAD_GRACE_S`` more before the connection is closed (uvicorn's keep-alive timer too).
"""
from __future__ import annotations

import json
import logging
import re
import time
import urllib.parse
from typing import Optional

try:   # the parser uvicorn's HttpToolsProtocol drives (uvicorn_http_protocol)
    import httptools
except ImportError:
    httptools = None

from .config import MAX_HEAD_BYTES, ServeConfig
from .errors import ANSWERED_BY_PROTOCOL, error_bytes, error_for, route_path
from .gate import OPEN_PATHS, _endpoint, _RateLimited

log = logging.getLogger("acarerank.server")

HEAD_GRACE_S = 0.1               # a head timer that fires gets this long for bytes already received
#: a head's first bytes kept to read its path from: a target whose path decodes to an API path
#: ("/rerank", at most 3 bytes a character percent-encoded) is whole well within them
HEAD_START_BYTES = 256
#: connections past --max-connections accepted for one probe each (GET /health, /ready, /metrics):
#: idle sockets holding the cap failed every probe until --header-timeout closed them, and a
#: liveness probe restarted a healthy server (docs/serving.md, "What to probe")
PROBE_RESERVE = 8
#: seconds a probe-only connection's request line may take (a probe sends it as it connects): the
#: reserve's sockets, held idle, come free this soon
PROBE_HEAD_TIMEOUT_S = 2.0
#: where a head ends (h11's own blank-line pattern)
_HEAD_END = re.compile(b"\n\r?\n")


def _request_path(start: bytes, absolute_form: bool) -> Optional[str]:
    """The path of the request whose head begins with ``start``, as uvicorn gives it in
    ``scope["path"]`` (the target before ``?``, percent-decoded; with httptools, ``absolute_form``,
    an ``http://host/path`` target's path); None when ``start`` holds no whole path (then it is
    none of the API paths: those are whole in ``HEAD_START_BYTES``)."""
    line = start.lstrip(b"\r\n").split(b"\n", 1)[0]
    parts = line.split(b" ")
    if len(parts) < 2 or (len(parts) == 2 and b"?" not in parts[1]):
        return None
    target = parts[1].decode("latin-1")
    if absolute_form and not target.startswith("/"):
        try:
            target = urllib.parse.urlsplit(target).path
        except ValueError:   # "http://[x/": no path to read (it raised inside the 400's and 408's counting)
            return None
    return urllib.parse.unquote(target.partition("?")[0])


def _raw_error(status: int, reason: str, message: str, path: Optional[str] = None) -> bytes:
    """A complete HTTP/1.1 error response with the JSON error body (its shape by ``path``, as the
    gate's: ``errors.error_for``); the connection closes after it."""
    body = error_bytes(status, message) if path is None else \
        json.dumps(error_for({"path": path}, status, message)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


def http_protocol_with_limits(base, config: ServeConfig, metrics=None):
    """``HTTPProtocolWithLimits``: a subclass of uvicorn's HTTP protocol class ``base``
    (``uvicorn_http_protocol()``) with the module docstring's limits, for ``uvicorn.Config(http=...)``.
    metrics: the service's ``ServerMetrics``, which count the error responses written here and the
    connections closed for a limit (None: not counted).

    It reaches into uvicorn's protocol internals — ``server_state.connections``, ``cycle`` (and
    ``cycle.response_complete``), httptools' ``pipeline``, ``transport``, ``loop``, ``timeout_keep_alive_task`` and the
    methods it overrides — which is why setup.py pins ``uvicorn`` (and ``h11``/``httptools``) to the
    versions tested, and a test fails loudly if they move."""
    refused_log = _RateLimited()
    count_log = _RateLimited()
    unread_log = _RateLimited()
    upgrade_log = _RateLimited()

    def _count_close(reason: str) -> None:
        """``acarerank_connections_closed_total{reason}``, after the close it counts."""
        if metrics is None:
            return
        try:
            metrics.connections_closed.labels(reason).inc()
        except Exception as e:  # noqa: BLE001 — logged; the close came first, the count is only a figure
            count_log(f"counting a connection closed for {reason} failed: {type(e).__name__}: {e}")

    absolute_form = base.__name__ == "HttpToolsProtocol"   # h11's scope["path"] is the whole target
    # the most bytes of a head still arriving handed to the parser at once: httptools has no limit
    # of its own; h11's is 2 x MAX_HEAD_BYTES (front.py), so a head judged under MAX_HEAD_BYTES plus
    # one such piece stays within it (data_received)
    head_piece = float("inf") if absolute_form else MAX_HEAD_BYTES

    class HTTPProtocolWithLimits(base):
        _refused = False
        _head_timer = None
        _head_for = None       # the request cycle that was current when the timer was armed
        _head_bytes = 0
        _head_start = b""      # the head's first HEAD_START_BYTES (its path, for the 431's shape)
        _head_t0 = None        # when the head's first byte came (perf_counter; None: none yet)
        _head_grace = False
        _pipelined = None      # httptools: bytes of the next head read since the body before it ended
        _trailer_bytes = None  # httptools: a chunked body's trailer bytes so far (None: not in a body)
        _completed_in_read = False   # httptools: a request ended in the read being parsed
        _keepalive_grace = False
        _send_timer = None
        _probe_wait = None     # past --max-connections: the request line's bytes so far (None: judged, or not one)
        _probe_only = False    # past --max-connections: one probe, then close
        _deferred_400 = None   # (message, head start, path) of a malformed request behind responses still due

        def connection_made(self, transport):
            open_now = len(self.server_state.connections)
            if open_now >= config.max_connections + PROBE_RESERVE:
                self._refused = True
                refused_log(f"{config.max_connections} connections open (--max-connections): closing new ones")
                transport.abort()
                _count_close("max_connections")
                return
            if open_now >= config.max_connections:
                self._probe_only, self._probe_wait = True, b""
            super().connection_made(transport)
            self._arm_head_timer()

        def _judge_probe(self, data: bytes) -> Optional[bytes]:
            """A connection past --max-connections: ``data`` and the bytes before it once they hold a
            whole request line that is a probe (``GET``/``HEAD`` of an ``OPEN_PATHS`` path), to be
            parsed; None while the line is not whole, or when it is no probe (then closed, counted).
            The line, with any empty lines before it, must be whole within ``HEAD_START_BYTES``: the
            bound was on the line less its leading CR/LF, so a socket sending only CR/LF was kept,
            all of it buffered and copied again on each read (quadratic: 32 MiB held the event loop 5 s)."""
            data = self._probe_wait + data
            line = data.lstrip(b"\r\n")[:HEAD_START_BYTES]
            if b"\n" not in line and len(data) < HEAD_START_BYTES:
                self._probe_wait = data   # under HEAD_START_BYTES: judged at the latest one read later
                return None
            self._probe_wait = None
            if line.split(b" ", 1)[0] in (b"GET", b"HEAD") and _request_path(line, absolute_form) in OPEN_PATHS:
                return data
            refused_log(f"{config.max_connections} connections open (--max-connections): closing new ones "
                        f"but probes")
            self._cancel_head_timer()
            self.transport.abort()
            _count_close("max_connections")
            return None

        def connection_lost(self, exc):
            if self._refused:
                return
            self._cancel_head_timer()
            self._cancel_send_timer()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._send_timer is None:
                self._send_timer = self.loop.call_later(config.send_timeout, self._send_timed_out)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._cancel_send_timer()

        def _cancel_send_timer(self) -> None:
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None

        def _send_timed_out(self) -> None:
            self._send_timer = None
            unread_log(f"a client left a response unread for {config.send_timeout:g} s (--send-timeout): "
                       f"connection closed")
            self.transport.abort()   # close() would wait for the buffer to drain
            _count_close("send_timeout")

        def data_received(self, data: bytes) -> None:
            if self._deferred_400 is not None:   # the parser failed: only the 400 is left to send
                return
            if self._probe_wait is not None:
                data = self._judge_probe(data)
                if data is None:
                    return
            if self._head_timer is None or len(data) <= head_piece:
                self._receive(data)
                return
            # h11 refuses an incomplete head over its own limit (front.py: 2 x MAX_HEAD_BYTES) as
            # malformed, a 400, before the 431 below could see it: one read of 40 kB that did not
            # end the head was a 400 on h11 and a 431 on httptools. Fed in pieces of MAX_HEAD_BYTES,
            # a head still arriving is judged here after each one, while under h11's limit.
            for start in range(0, len(data), head_piece):
                self._receive(data[start:start + head_piece])
                if self.transport.is_closing() or self._deferred_400 is not None:
                    return
                if self._head_timer is None:   # the head arrived: the rest is its body (or the next request)
                    if start + head_piece < len(data):
                        self._parse(data[start + head_piece:])
                    return

        def _receive(self, data: bytes) -> None:
            waiting = self._head_timer is not None
            pipelined = self._pipelined is not None   # httptools: this read is all of the next head's
            self._completed_in_read = False
            if waiting:   # before the parser: a 400 it calls for is counted with the head's path (_count)
                if self._head_t0 is None:
                    self._head_t0 = time.perf_counter()
                if len(self._head_start) < HEAD_START_BYTES:
                    self._head_start += data[:HEAD_START_BYTES - len(self._head_start)]
            self._parse(data)
            if not waiting:
                # its head still not whole. A read in which a request ended held that request too
                # (valid pipelining: 1,000 GETs in one write were counted as one head, a false 431
                # that dropped the rest); it is not counted, so a head never ending is stopped
                # at most one read (asyncio's, 256 kB) past the limit.
                if pipelined and self._pipelined is not None and not self._completed_in_read:
                    self._pipelined += len(data)
                    if self._pipelined > MAX_HEAD_BYTES:
                        # no more until this response ends (h11 pauses at the first pipelined byte):
                        # httptools kept a head arriving meanwhile whole in memory, grown by copying
                        # (~100 MB a connection and seconds of the event loop while one request ran)
                        self.flow.pause_reading()
                return
            if self.cycle is not self._head_for:   # a request's head arrived
                self._cancel_head_timer()
                self._head_t0 = None
                return
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self._head_too_large(self._head_start)

        def _parse(self, data: bytes) -> None:
            super().data_received(data)   # h11: uvicorn's own (it serves an upgrade offer as HTTP/1.1)

        if absolute_form:   # httptools: count a pipelined head's bytes (``_pipelined``)
            _upgrade_ignored = False   # the head just parsed offers an upgrade not taken: parsed again

            def _parse(self, data: bytes) -> None:
                """uvicorn's ``data_received``, but a request offering an upgrade the server does not take
                is served with its body. llhttp ends such a request at its head (httptools skips its body
                and raises ``HttpParserUpgrade`` there, after ``on_message_complete``): uvicorn served it
                with an empty body (a 422) and read its body as the next request (a 400). Its head is fed
                again, less the upgrade (``_head_without_upgrade``), to a fresh parser, then the bytes
                after it (``args[0]``: where the head ended in the bytes fed)."""
                self._unset_keepalive_if_required()
                pieces = [data]   # fed last first
                while pieces:
                    piece = pieces.pop()
                    try:
                        self.parser.feed_data(piece)
                    except httptools.HttpParserError:
                        msg = "Invalid HTTP request received."
                        self.logger.warning(msg)
                        self.send_400_response(msg)
                        return
                    except httptools.HttpParserUpgrade as e:
                        if self._should_upgrade():   # never: no WebSocket protocol (front.py, ws="none")
                            self.handle_websocket_upgrade()
                            return
                        self._unsupported_upgrade_warning()
                        if not self._upgrade_ignored:   # CONNECT: uvicorn's handling (the rest dropped)
                            return
                        self._upgrade_ignored = False
                        # measured as the gate measures a head, before the upgrade's fields go: the
                        # gate sees only the rebuilt head (a 56 kB head of Upgrade lines was served)
                        if len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers) > MAX_HEAD_BYTES:
                            self._head_too_large(self._head_start)
                            return
                        head = self._head_without_upgrade()
                        self.parser = httptools.HttpRequestParser(self)
                        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)   # as uvicorn's
                        # a view: many such requests in one read are not each a copy of what follows
                        pieces += [memoryview(piece)[e.args[0]:], head]

            def _head_without_upgrade(self) -> bytes:
                """The head just parsed (``url``, ``headers``: names lower-cased) as bytes, less its
                ``Upgrade`` fields and the ``upgrade`` token of ``Connection`` (the others kept)."""
                version = self.parser.get_http_version().encode()
                lines = [self.parser.get_method(), b" ", self.url, b" HTTP/", version, b"\r\n"]
                for name, value in self.headers:
                    if name == b"upgrade":
                        continue
                    if name == b"connection":
                        value = b",".join(t for t in value.split(b",") if t.strip().lower() != b"upgrade")
                        if not value.strip():
                            continue
                    lines += [name, b": ", value, b"\r\n"]
                lines.append(b"\r\n")
                return b"".join(lines)

            def on_message_complete(self) -> None:
                if self._upgrade_ignored:   # the request is parsed again (_parse): it ends then
                    return
                self._trailer_bytes = None
                self._completed_in_read = True
                super().on_message_complete()
                self._pipelined = 0   # from the next read on, every byte is the next request's head

            def on_headers_complete(self) -> None:
                if (self.parser.should_upgrade() and not self._should_upgrade()
                        and self.parser.get_method() != b"CONNECT"):
                    self._upgrade_ignored = True   # no request yet: its head is parsed again (_parse)
                    return
                self._pipelined = None   # a whole head: the gate measures it (gate.py)
                super().on_headers_complete()
                self._trailer_bytes = 0   # from here on, a header field is a chunked body's trailer

            def on_header(self, name: bytes, value: bytes) -> None:
                if self._trailer_bytes is None:
                    super().on_header(name, value)
                    return
                # A trailer: uvicorn appended it to the headers list the request's scope holds,
                # with no bound (one connection grew the server 1.7 GB in 8 s; only the body
                # timeout ended it). Trailers are dropped — no ASGI app sees them — and counted:
                # past MAX_HEAD_BYTES, 431 (before any response) and close, as a head that long.
                self._trailer_bytes += len(name) + len(value) + 4
                if self._trailer_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                    self._trailers_too_large()

            def _trailers_too_large(self) -> None:
                if self.cycle is not None and not self.cycle.response_started:
                    self.scope[ANSWERED_BY_PROTOCOL] = 431   # the gate counts it so, not as a client gone
                    self.transport.write(_raw_error(431, "Request Header Fields Too Large",
                                                    f"trailer fields exceed {MAX_HEAD_BYTES} bytes",
                                                    self.scope.get("path", "")))
                self.transport.close()

        def on_response_complete(self) -> None:
            self._keepalive_grace = False
            if self._deferred_400 is not None and not self.transport.is_closing():
                if getattr(self, "pipeline", None):   # httptools: more whole requests to answer first
                    super().on_response_complete()
                    self.flow.pause_reading()   # uvicorn resumed it: the parser has failed, read no more
                    return
                self._write_400(*self._deferred_400)   # closing: uvicorn's own returns at once
            if self._probe_only:   # one probe past --max-connections: its socket comes free now
                self.transport.close()   # before uvicorn's (it returns at a closing transport)
            if not self.transport.is_closing():
                self._judge_pipelined_head()   # before h11 parses it (super): its own limit is a 400
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm_head_timer()   # kept alive: the next head has header_timeout seconds

        def timeout_keep_alive_handler(self) -> None:
            if not self._keepalive_grace:   # the same grace as the head timer's (_head_timed_out)
                self._keepalive_grace = True
                self.timeout_keep_alive_task = self.loop.call_later(HEAD_GRACE_S, self.timeout_keep_alive_handler)
                return
            super().timeout_keep_alive_handler()

        def _judge_pipelined_head(self) -> None:
            """h11: the next request's bytes that came with the previous one's (pipelined: h11 holds
            them unparsed until this response ends) are a head over ``MAX_HEAD_BYTES`` that does not
            end within h11's own limit: 431 and close, as when the head arrives alone. h11 answered
            it 400 "malformed" at its limit (front.py: 2 x MAX_HEAD_BYTES) where httptools answers 431."""
            if absolute_form:   # httptools parsed it as it came: the bytes counted since (``_receive``)
                if (self._pipelined or 0) > MAX_HEAD_BYTES:
                    self._head_too_large(self._pipelined_start())
                return
            pending = self.conn.trailing_data[0].lstrip(b"\r\n")
            if len(pending) <= MAX_HEAD_BYTES or _HEAD_END.search(pending, 0, 2 * MAX_HEAD_BYTES):
                return   # short, or a whole head: h11 parses it and the gate measures it (gate.py)
            self._head_too_large(pending[:HEAD_START_BYTES])

        def _pipelined_start(self) -> bytes:
            """httptools: a stand-in for the first bytes of a pipelined head (``_head_start``), read from
            what the parser gave of it: its target once a header has followed it (whole), else bytes
            that name no path (the 431 is then in our shape)."""
            if self.headers and len(self.url) < HEAD_START_BYTES:
                return (b"GET " + self.url + b" HTTP/1.1\r\n").ljust(HEAD_START_BYTES)
            return b" " * HEAD_START_BYTES

        def _head_too_large(self, start: bytes) -> None:
            """431 (the route's shape, read from the head's first bytes ``start``) and close."""
            self._count(431, start)
            self._cancel_head_timer()
            self.transport.write(_raw_error(431, "Request Header Fields Too Large",
                                            f"request line and headers exceed {MAX_HEAD_BYTES} bytes",
                                            _request_path(start, absolute_form) or ""))
            self.transport.close()

        def _unsupported_upgrade_warning(self) -> None:
            # uvicorn's line per request, and with ws="none" a second one advising to install a
            # WebSocket library: 200 requests wrote 200 to 400 lines (docs/serving.md, "Limits and timeouts")
            upgrade_log("a request asked to upgrade its connection (Upgrade header): not supported, "
                        "served as HTTP/1.1")

        def send_400_response(self, msg: str) -> None:
            cycle = self.cycle
            if cycle is not None and cycle.more_body and self._unqueue(cycle):
                # httptools: a malformed body of a request still queued behind whole ones (it parses
                # ahead), so the gate never runs it: as a malformed head there (below), its 400 goes
                # after their answers, counted here, by its path as the gate reads it. It was written
                # at once: the client got only the 400, the answers it never got counted, the 400 not
                self._cancel_head_timer()
                self._defer_400(msg, b"", route_path(cycle.scope))
                return
            if cycle is not None and cycle.more_body:
                # in a request's body: the gate, reading it, counts that request (as this 400 unless
                # it has answered it already: counted once); else a head the gate never saw
                cycle.scope[ANSWERED_BY_PROTOCOL] = 400
                start = None
            else:
                # the head's first bytes name its path only while that head is the one awaited: a
                # malformed request pipelined behind a whole one is not the whole one's
                start = self._head_start if self.cycle is self._head_for else b""
            self._cancel_head_timer()
            if cycle is not None and not cycle.more_body and not cycle.response_complete:
                # pipelined behind whole requests still being answered (httptools parses ahead): the
                # 400 written now took the place of their answers, counted as sent. It goes after
                # them, as h11 (which parses a request only after the previous response) answers it
                self._defer_400(msg, start)
                return
            self._write_400(msg, start)

        def _defer_400(self, msg: str, start: Optional[bytes], path: Optional[str] = None) -> None:
            """``_write_400``'s arguments kept until the responses due before it end (on_response_complete),
            nothing more read meanwhile."""
            self._deferred_400 = (msg, start, path)
            self.flow.pause_reading()

        def _unqueue(self, cycle) -> bool:
            """Whether ``cycle`` was waiting in uvicorn's pipeline (httptools: a request parsed while
            earlier ones are answered), taken out of it: its app is never run."""
            queue = getattr(self, "pipeline", ())
            for item in queue:
                if item[0] is cycle:
                    queue.remove(item)
                    return True
            return False

        def _write_400(self, msg: str, start: Optional[bytes], path: Optional[str] = None) -> None:
            """The 400 of a malformed request, counted (``start``: its head's first bytes, None: the
            gate counts it; ``path``: its path when its head was parsed whole), and close."""
            if start is not None:
                self._count(400, start, path)
            self.transport.write(_raw_error(400, "Bad Request", f"malformed HTTP request: {msg} (e.g. bad syntax, "
                                                                "a duplicate Content-Length, headers over "
                                                                f"{MAX_HEAD_BYTES} bytes)"))
            self.transport.close()

        def _count(self, status: int, start: bytes, path: Optional[str] = None) -> None:
            """The metrics of an error response written here for a request the gate never saw (a
            head still arriving, or malformed): as the gate's (``observe_response``), its endpoint
            by ``path`` (a head parsed whole: ``errors.route_path``) or else the path in the head's
            first bytes ``start`` ("other" without one), its duration from the head's first byte."""
            if metrics is None:
                return
            try:   # the error response and the close after it come first, whatever the counting does
                seconds = 0.0 if self._head_t0 is None else time.perf_counter() - self._head_t0
                if path is None:
                    path = _request_path(start, absolute_form) or ""
                metrics.observe_response(_endpoint(path), status, seconds)
            except Exception as e:  # noqa: BLE001 — logged; a raise here left a 408's connection open for good
                count_log(f"counting a {status} the HTTP layer wrote failed: {type(e).__name__}: {e}")

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_for = self.cycle
            # h11 after a response: the part of the next head that came with the previous request
            # (pipelined) is in h11's buffer, unparsed; it counts toward MAX_HEAD_BYTES (it was not
            # counted: a head of 20 + 10 kB was never a 431 and h11 gave 400 at its own limit)
            # (httptools: the bytes counted since the previous body ended, ``_pipelined``)
            if absolute_form:
                self._head_bytes = self._pipelined or 0
                self._head_start = self._pipelined_start() if self._head_bytes else b""
                self._pipelined = None
            else:
                pending = self.conn.trailing_data[0]
                self._head_bytes = len(pending)
                self._head_start = pending[:HEAD_START_BYTES]
            self._head_t0 = time.perf_counter() if self._head_bytes else None
            self._head_grace = False
            self._head_timeout = min(config.header_timeout, PROBE_HEAD_TIMEOUT_S) if self._probe_only else \
                config.header_timeout
            self._head_timer = self.loop.call_later(self._head_timeout, self._head_timed_out)

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
                self._count(408, self._head_start)
                self.transport.write(_raw_error(408, "Request Timeout", f"request headers not received within "
                                                f"{self._head_timeout:g} s (--header-timeout"
                                                + (", a probe past --max-connections)" if self._probe_only else ")")))
            self.transport.close()

    return HTTPProtocolWithLimits


def uvicorn_http_protocol():
    """uvicorn's "auto" choice: httptools when installed, else h11."""
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol
        return H11Protocol
