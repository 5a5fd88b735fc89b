"""``acarerank serve`` under hostile or careless clients: one server process (the CLI itself, a
tiny checkpoint) with short timeouts and small limits, driven over raw loopback sockets.

The server runs with a descriptor limit of 256 (``RLIMIT_NOFILE``), so its connection cap is
lowered to 256 - 128 = 128; a test opens more connections than that. Timeouts: header 2 s,
body 3 s, keep-alive 2 s, send 2 s. Every bound is checked against a wall clock with a margin for a
loaded 2-core machine.
"""
import asyncio
import json
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

import pytest
from _optional import require

require("httpx", "prometheus_client", "fastapi", "uvicorn")

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from serve_util import free_port, rss_mb, serve_subprocess, tiny_model, wait_until  # noqa: E402

from acarerank.server.protocol import PROBE_RESERVE  # noqa: E402

HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 3.0
KEEPALIVE_TIMEOUT = 2.0
SEND_TIMEOUT = 2.0
NOFILE = 256
CAP = NOFILE - 128            # front.FD_RESERVE
MAX_QUEUE = 16
MAX_SALT = 64
MAX_CHARS = 200_000
MARGIN = 3.0                  # seconds of slack on a loaded machine


def _low_nofile():
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-ckpt")
    tiny_model().save_pretrained(path)
    with serve_subprocess("--model", str(path), "--dtype", "float32", "--max-batch-tokens", "256",
                          "--cache-budget", "512", "--max-queue", str(MAX_QUEUE), "--max-salt-chars", str(MAX_SALT),
                          "--max-request-chars", str(MAX_CHARS), "--header-timeout", str(HEADER_TIMEOUT),
                          "--body-timeout", str(BODY_TIMEOUT), "--keepalive-timeout", str(KEEPALIVE_TIMEOUT),
                          "--send-timeout", str(SEND_TIMEOUT),
                          "--log-level", "info", preexec_fn=_low_nofile) as (base, proc):
        port = int(base.rsplit(":", 1)[1])
        yield dict(base=base, proc=proc, port=port)


# ``acarerank serve`` on uvicorn's h11 protocol: what "auto" picks where httptools is not installed
# (the serve extra asks for it, but it has no wheel everywhere); argv: MODEL PORT HEADER_TIMEOUT
_H11_SERVE = """
import sys
import acarerank.server.front as front
from uvicorn.protocols.http.h11_impl import H11Protocol
def h11():
    print("serving with", H11Protocol.__name__, flush=True)
    return H11Protocol
front.uvicorn_http_protocol = h11
from acarerank.cli import main
sys.exit(main(["serve", "--model", sys.argv[1], "--dtype", "float32", "--port", sys.argv[2],
               "--max-batch-tokens", "256", "--cache-budget", "512", "--header-timeout", sys.argv[3],
               "--log-level", "info"]))
"""


@pytest.fixture(scope="module")
def h11_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-ckpt-h11")
    tiny_model().save_pretrained(path)
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-c", _H11_SERVE, str(path), str(port), str(HEADER_TIMEOUT)],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def output() -> str:
        log.seek(0)
        return log.read()

    proc.output = output
    try:
        wait_until(base + "/ready", timeout=120, proc=proc)
        assert "serving with H11Protocol" in output(), output()[-2000:]
        yield dict(base=base, proc=proc, port=port)
    finally:
        proc.kill()
        proc.wait(30)
        log.close()


# -- helpers --------------------------------------------------------------------------------------
def connect(port) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_until_closed(s: socket.socket, limit: float) -> tuple:
    """(bytes received, seconds until the server closed); seconds is None if still open after ``limit``."""
    s.settimeout(0.05)
    t0 = time.monotonic()
    data = b""
    while time.monotonic() - t0 < limit:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return data, time.monotonic() - t0
        if not chunk:
            return data, time.monotonic() - t0
        data += chunk
    return data, None


def parse_response(raw: bytes) -> tuple:
    """(status, headers dict, body bytes) of one HTTP/1.1 response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    return status, headers, body


def expect_json_error(raw: bytes, code: int, words=()) -> dict:
    assert raw, "the server closed without a response"
    status, headers, body = parse_response(raw)
    assert status == code, f"expected {code}, got {status}: {raw[:300]!r}"
    assert headers.get("content-type") == "application/json", headers
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "code"} and err["code"] == code, err
    for w in words:
        assert w in err["message"], f"{w!r} not in {err['message']!r}"
    return err


def request_head(path="/v1/rerank", length=None, extra="") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{extra}"
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + "\r\n").encode()


def post_raw(port, body: bytes, extra="") -> bytes:
    with connect(port) as s:
        s.sendall(request_head(length=len(body), extra=extra + "Connection: close\r\n") + body)
        data, _ = read_until_closed(s, 30)
        return data


CLOSED_AT_CAP = ("acarerank_connections_closed_total", (("reason", "max_connections"),))
CLOSED_UNREAD = ("acarerank_connections_closed_total", (("reason", "send_timeout"),))


def metrics(base) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out



def health_ok(base) -> bool:
    return httpx.get(base + "/health", timeout=10).status_code == 200


# -- slow and idle clients ------------------------------------------------------------------------------
def test_half_sent_header_idle_and_keepalive_connections_close(server):
    port = server["port"]
    # the four connections wait out their timeouts side by side (each is its own connection)
    with connect(port) as half, connect(port) as silent, connect(port) as kept, connect(port) as second:
        half.sendall(b"POST /v1/rerank HTTP/1.1\r\nHost: t\r\nContent-Le")
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        # after a response, the next head on the same connection has the header timeout again
        second.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\nGET /heal")
        second_sent = time.monotonic()
        data, took = read_until_closed(half, HEADER_TIMEOUT + MARGIN)
        assert took is not None, f"a half-sent header stayed open {HEADER_TIMEOUT + MARGIN} s"
        expect_json_error(data, 408, ["header-timeout"])
        data, took = read_until_closed(silent, HEADER_TIMEOUT + MARGIN)
        assert took is not None and data == b"", f"a connection that sent nothing stayed open ({data!r})"
        # a kept-alive connection: answered, then closed once idle for the keep-alive timeout
        data, took = read_until_closed(kept, KEEPALIVE_TIMEOUT + MARGIN)
        assert took is not None, "an idle keep-alive connection stayed open"
        assert parse_response(data)[0] == 200
        # the same bound as when it was read alone: counted from its own send
        data, took = read_until_closed(second, HEADER_TIMEOUT + KEEPALIVE_TIMEOUT + MARGIN
                                       - (time.monotonic() - second_sent))
        assert took is not None, "a half-sent second head on a kept-alive connection stayed open"
        assert data.startswith(b"HTTP/1.1 200"), data[:100]
    assert health_ok(server["base"])


def test_slow_body_gets_408(server):
    port = server["port"]
    body = json.dumps(dict(query="q", documents=["d"])).encode()
    with connect(port) as s:
        s.sendall(request_head(length=len(body)))
        t0 = time.monotonic()
        for byte in body[:20]:   # 1 byte per 0.25 s: the whole body would take 7 s
            s.sendall(bytes([byte]))
            s.settimeout(0.25)
            try:
                if s.recv(65536, socket.MSG_PEEK):
                    break
            except socket.timeout:
                pass
        data, took = read_until_closed(s, BODY_TIMEOUT + MARGIN)
        assert took is not None, "a slow body was never cut off"
        expect_json_error(data, 408, ["body-timeout"])
        assert time.monotonic() - t0 <= BODY_TIMEOUT + MARGIN


def test_a_client_that_never_reads_its_response_is_cut_off(server):
    """A response of ~10 MB (an object document's other key, sent back with return_documents) to a
    client that reads nothing: once the socket's buffers are full (~4 MB here), the rest waits in
    the server's memory; --send-timeout later the connection is aborted. Before, the keep-alive
    timer's close waited for the buffer to drain, forever: connection and memory held for good."""
    port = server["port"]
    counted_before = metrics(server["base"]).get(CLOSED_UNREAD, 0)
    junk = b"[" + b"[]," * 3_300_000 + b"[]]"
    body = b'{"query": "q", "documents": [{"text": "d", "junk": %s}], "return_documents": true}' % junk
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # before connecting: a small window
        s.settimeout(10)
        s.connect(("127.0.0.1", port))
        s.sendall(request_head(length=len(body)) + body)
        time.sleep(SEND_TIMEOUT + KEEPALIVE_TIMEOUT + MARGIN)   # the answer, then the timeout, then slack
        data, status = b"", None
        try:
            while True:
                chunk = s.recv(1 << 20)
                if not chunk:
                    break
                data += chunk
        except ConnectionResetError:
            status = "reset"
    head, _, got = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), data[:300]
    length = int(parse_response(head + b"\r\n\r\n")[1]["content-length"])
    assert length > len(body) - 1000, (length, len(body))
    assert len(got) < length, (f"the whole {length}-byte response was still there after {SEND_TIMEOUT} s "
                               f"unread (--send-timeout): the connection was held ({status})")
    assert "response unread" in server["proc"].output(), server["proc"].output()[-2000:]
    assert health_ok(server["base"])
    counted = metrics(server["base"]).get(CLOSED_UNREAD, 0) - counted_before
    assert counted == 1, f"{counted} connections counted closed for --send-timeout, one was"


def test_connection_cap_under_descriptor_limit_without_log_storm(server):
    port, proc = server["port"], server["proc"]
    assert f"lowered to {CAP}" in proc.output(), proc.output()[-2000:]
    counted_before = metrics(server["base"]).get(CLOSED_AT_CAP, 0)
    socks, closed = [], 0
    try:
        for _ in range(CAP + 150):   # more than the descriptor limit allows
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        time.sleep(0.5)
        for s in socks:
            s.setblocking(False)
            try:
                if s.recv(1) == b"":
                    closed += 1
            except BlockingIOError:
                pass
            except ConnectionResetError:
                closed += 1
    finally:
        for s in socks:
            s.close()
    # past the cap, PROBE_RESERVE more wait for a probe's request line (closed later, silent)
    assert closed >= 150 - PROBE_RESERVE, f"only {closed} of {CAP + 150} connections were refused (cap {CAP})"
    deadline = time.monotonic() + HEADER_TIMEOUT + MARGIN
    while time.monotonic() < deadline:
        try:
            if health_ok(server["base"]):
                break
        except httpx.TransportError:
            time.sleep(0.1)
    assert health_ok(server["base"])
    log = proc.output()
    assert "Traceback" not in log and "Too many open files" not in log, log[-3000:]
    assert log.count("connections open (--max-connections)") <= 2, log[-3000:]
    counted = metrics(server["base"]).get(CLOSED_AT_CAP, 0) - counted_before
    # every connection closed at the cap is counted; the ones the test saw closed are a lower bound
    # (a reset may reach the client after its recv), all it opened past the cap an upper one
    assert closed <= counted <= len(socks), (f"{counted} connections counted closed at the cap, "
                                             f"{closed} seen closed of {len(socks)} opened (cap {CAP})")


def _is_closed(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_probes_are_answered_at_the_connection_cap(server):
    """Idle sockets holding --max-connections: a probe (GET /health, /ready, /metrics) on a new
    connection is still answered, once, then its connection closed; any other request there is
    closed unanswered and counted; past PROBE_RESERVE probe connections a new one is closed at once.
    The probe's connection was closed at accept: 8 idle sockets at --max-connections 8 failed a
    healthy server's liveness probe (docs/serving.md, "What to probe")."""
    port, base = server["port"], server["base"]
    assert health_ok(base)
    counted_before = metrics(base).get(CLOSED_AT_CAP, 0)
    idle, extra = [], []
    try:
        idle = [connect(port) for _ in range(CAP)]   # silent: closed by --header-timeout (2 s)
        time.sleep(0.2)
        for path in ("/health", "/ready"):
            with connect(port) as s:   # kept alive as asked, but one probe a connection at the cap
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: keep-alive\r\n\r\n".encode())
                data, took = read_until_closed(s, 1.0)
            assert data.startswith(b"HTTP/1.1 200"), f"{path} at the cap: {data[:200]!r}"
            assert took is not None, f"{path} at the cap: its connection stayed open after the probe"
        with connect(port) as s:
            s.sendall(request_head(length=2) + b"{}")
            data, took = read_until_closed(s, 1.0)
        assert data == b"" and took is not None, f"a rerank past the cap: {data[:200]!r}, closed after {took}"
        r = httpx.get(base + "/metrics", timeout=1.0)
        assert r.status_code == 200, r.status_code
        counted = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(r.text) for s in fam.samples}.get(CLOSED_AT_CAP, 0)
        assert counted - counted_before == 1, f"{counted - counted_before} closes at the cap counted, want 1"
        still = sum(not _is_closed(s) for s in idle)
        assert still == CAP, f"only {still} of {CAP} idle sockets were open at the checks' end: not at the cap"
        extra = [connect(port) for _ in range(PROBE_RESERVE + 1)]   # the reserve, then one past it
        time.sleep(0.3)
        refused = sum(_is_closed(s) for s in extra)
        assert refused >= 1, f"none of {PROBE_RESERVE + 1} connections past the cap was refused"
    finally:
        for s in idle + extra:
            s.close()
    wait_until(base + "/health", timeout=HEADER_TIMEOUT + MARGIN)


def test_a_probe_connection_sending_only_empty_lines_is_closed_at_once(server):
    """A connection past --max-connections must send its probe's request line in its first 256 bytes
    (HEAD_START_BYTES), empty lines before it included (docs/serving.md, "What to probe"). The bound
    was on the line less its leading CR/LF: a socket sending only CR/LF stayed open until its 2 s
    ran out, every byte buffered and copied again on each read (8 such sockets held a keep-alive
    /health 5.3 s). Now it is closed as soon as 256 bytes hold no line, counted as a close at the
    cap, while a probe after a few empty lines is still answered."""
    port, base = server["port"], server["base"]
    assert health_ok(base)
    counted_before = metrics(base).get(CLOSED_AT_CAP, 0)
    idle = []
    try:
        idle = [connect(port) for _ in range(CAP)]
        time.sleep(0.2)
        with connect(port) as s:
            s.sendall(b"\r\n" * 4 + b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            data, took = read_until_closed(s, 1.0)
        assert data.startswith(b"HTTP/1.1 200") and took is not None, \
            f"a probe after empty lines at the cap: {data[:200]!r}, closed after {took}"
        with connect(port) as s:
            s.sendall(b"\r\n" * 2048)
            data, took = read_until_closed(s, 1.0)   # PROBE_HEAD_TIMEOUT_S (2 s) closed it before
        assert data == b"" and took is not None, \
            f"4 kB of CR/LF past the cap: {data[:200]!r}, still open after 1 s (closed after {took})"
        r = httpx.get(base + "/metrics", timeout=1.0)   # a probe: the cap is still held
        counted = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(r.text) for s in fam.samples}.get(CLOSED_AT_CAP, 0)
        assert counted - counted_before == 1, f"{counted - counted_before} closes at the cap counted, want 1"
    finally:
        for s in idle:
            s.close()
    wait_until(base + "/health", timeout=HEADER_TIMEOUT + MARGIN)


def test_probes_answer_head_as_get(server):
    """docs/serving.md, "What to probe": a connection past --max-connections is kept for a GET or HEAD
    of /health, /ready or /metrics, but the app answered HEAD 405 (at the cap too): a HEAD is now
    the GET's status and headers without its body."""
    port, base = server["port"], server["base"]
    for path in ("/health", "/ready", "/metrics"):
        got, head = httpx.get(base + path, timeout=10), httpx.head(base + path, timeout=10)
        assert (head.status_code, head.headers.get("content-type"), head.content) == \
            (got.status_code, got.headers.get("content-type"), b""), \
            f"HEAD {path}: {head.status_code} {head.headers.get('content-type')} {head.content[:100]!r}, " \
            f"GET: {got.status_code} {got.headers.get('content-type')}"
    idle = []
    try:
        idle = [connect(port) for _ in range(CAP)]
        time.sleep(0.2)
        with connect(port) as s:
            s.sendall(b"HEAD /ready HTTP/1.1\r\nHost: t\r\n\r\n")
            data, took = read_until_closed(s, 1.0)
        status, headers, body = parse_response(data) if data else (None, {}, b"")
        assert (status, body, took is not None) == (200, b"", True), \
            f"HEAD /ready at the cap: {data[:200]!r}, closed after {took}"
    finally:
        for s in idle:
            s.close()
    wait_until(base + "/health", timeout=HEADER_TIMEOUT + MARGIN)


# -- errors: always the JSON shape -----------------------------------------------------------------------
def test_every_error_is_json(server):
    port = server["port"]
    ok = json.dumps(dict(query="q", documents=["d"])).encode()
    expect_json_error(post_raw(port, ok, extra="X-Big: " + "a" * 20000 + "\r\n"), 431, ["headers"])
    for _ in range(20):   # duplicate Content-Length; uvicorn's line per malformed request is rate-limited
        with connect(port) as s:
            s.sendall(request_head(extra=f"Content-Length: {len(ok)}\r\nContent-Length: {len(ok) + 1}\r\n") + ok)
            expect_json_error(read_until_closed(s, 10)[0], 400, ["malformed HTTP request"])
    assert server["proc"].output().count("Invalid HTTP request received") <= 2, server["proc"].output()[-2000:]
    deep = b'{"query": "q", "documents": ["d"], "x": ' + b"[" * 10000 + b"]" * 10000 + b"}"
    expect_json_error(post_raw(port, deep), 422, ["nested too deeply"])
    expect_json_error(post_raw(port, b'{"query": "q\xff", "documents": ["d"]}'), 422, ["UTF-8"])
    expect_json_error(post_raw(port, b'{"query": "q\\ud800", "documents": ["d"]}'), 422, ["malformed JSON"])
    expect_json_error(post_raw(port, b'{"query": "q", "documents": ["d"], "top_n": ' + b"7" * 5000 + b"}"), 422,
                      ["top_n"])
    expect_json_error(post_raw(port, b'[1, 2]'), 422, ["object"])
    expect_json_error(post_raw(port, b''), 422, ["malformed JSON"])
    assert health_ok(server["base"])


@pytest.mark.parametrize("protocol", ["httptools", "h11"])
def test_an_upgrade_request_is_served_as_http_without_a_log_line_each(request, protocol):
    """docs/serving.md, "Limits and timeouts": the log never floods, and malformed requests get the
    JSON shape. Until 2026-12-07 each ``Upgrade: h2c`` wrote uvicorn's "Unsupported upgrade request."
    line and each WebSocket upgrade two INFO lines (its WebSocket layer, for a server with no
    WebSocket route), one without ``Sec-WebSocket-Key`` a text/plain 400."""
    server = request.getfixturevalue("server" if protocol == "httptools" else "h11_server")
    port, proc = server["port"], server["proc"]
    before = len(proc.output())
    key = "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
    for _ in range(30):
        for upgrade, path, extra in (("h2c", "/health", ""), ("websocket", "/v1/rerank", key),
                                     ("websocket", "/v1/rerank", "")):
            with connect(port) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, close\r\n"
                          f"Upgrade: {upgrade}\r\n{extra}\r\n".encode())
                raw, _ = read_until_closed(s, 10)
            if path == "/health":
                assert parse_response(raw)[0] == 200, raw[:300]
            else:   # the route's own answer to a GET
                expect_json_error(raw, 405, ["Method Not Allowed"])
    log = proc.output()[before:]
    assert len(log.splitlines()) <= 2 and "upgrade" in log, log[-2000:]


def read_response(s: socket.socket, limit: float = 30) -> bytes:
    """One whole HTTP/1.1 response (its body by ``content-length``) from a kept-alive connection."""
    s.settimeout(limit)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"the server closed after {data[:300]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(parse_response(head + b"\r\n\r\n")[1]["content-length"])
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, f"the server closed in the body of {head[:300]!r}"
        body += chunk
    assert len(body) == length, f"more than one response: {data[:600]!r}"
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize("protocol", ["httptools", "h11"])
def test_an_upgrade_offer_with_a_body_is_served_with_its_body(request, protocol):
    """docs/serving.md, "Limits and timeouts": a request asking to upgrade is served as HTTP/1.1. A
    POST offering h2c (curl --http2 on http://, the JDK HttpClient: Spring RestClient, langchain4j,
    Ktor) was served on httptools with an empty body (422 "malformed JSON body: Input data was
    truncated"), its body then read as a new request ("Invalid HTTP request received", a 400) when
    it came in a later segment. Its scores must be a plain request's, and the connection's next
    request served, for a Content-Length or chunked body, in the head's segment or a later one."""
    server = request.getfixturevalue("server" if protocol == "httptools" else "h11_server")
    port, proc = server["port"], server["proc"]
    body = json.dumps(dict(query="q", documents=["a", "b", "the query q"])).encode()
    plain = request_head(length=len(body)) + body
    status, _, want = parse_response(post_raw(port, body))
    assert status == 200, want
    want = json.loads(want)["results"]
    before = len(proc.output())
    offer = "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
    framings = {"content-length": (request_head(length=len(body), extra=offer), body),
                "chunked": (request_head(extra=offer + "Transfer-Encoding: chunked\r\n"),
                            b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")}
    for framing, (head, payload) in framings.items():
        for how in ("one write", "body 0.3 s later", "pipelined: two offers and a plain request"):
            with connect(port) as s:
                if how == "body 0.3 s later":
                    s.sendall(head)
                    time.sleep(0.3)
                    s.sendall(payload)
                elif how == "one write":
                    s.sendall(head + payload)
                else:
                    s.sendall(head + payload + head + payload + plain)
                    answers = [("the 1st offer", read_response(s)), ("the 2nd offer", read_response(s))]
                if not how.startswith("pipelined"):
                    answers = [("the offer", read_response(s))]
                    s.sendall(plain)   # the next request on the kept-alive connection
                answers.append(("the next request", read_response(s)))
            for which, raw in answers:
                status, _, got = parse_response(raw)
                assert status == 200, f"{protocol}, {framing}, {how}: {which} got {raw[:300]!r}"
                assert json.loads(got)["results"] == want, \
                    f"{protocol}, {framing}, {how}: {which} scored {got[:300]!r}, a plain request {want}"
    log = proc.output()[before:]
    assert "Invalid HTTP request" not in log and len(log.splitlines()) <= 2, log[-2000:]


@pytest.mark.parametrize("protocol", ["httptools", "h11"])
@pytest.mark.parametrize("offer", ["upgrade lines", "connection tokens"])
def test_an_upgrade_offer_past_the_head_limit_is_a_431(request, protocol, offer):
    """A head over MAX_HEAD_BYTES (16 kB) made of Upgrade lines, or of "upgrade" tokens in
    Connection, is a 431 like any other: httptools' head is parsed again without the upgrade, and
    the gate measured only that rebuilt head (a 56 kB head of Upgrade lines was served, 200)."""
    server = request.getfixturevalue("server" if protocol == "httptools" else "h11_server")
    body = json.dumps(dict(query="q", documents=["d"])).encode()
    extra = ("Upgrade: h2c\r\n" * 1500 + "Connection: Upgrade\r\n" if offer == "upgrade lines"
             else "Connection: " + "upgrade," * 2500 + "upgrade\r\nUpgrade: h2c\r\n")
    assert len(extra) > 16_384
    with connect(server["port"]) as s:
        s.sendall(request_head(length=len(body), extra=extra) + body)
        data, _ = read_until_closed(s, 10)
    assert data.startswith(b"HTTP/1.1 431"), f"{protocol}, {offer}: {data[:300]!r}"


def _send_head_in_two_writes(port, path: str, split, big: int = 20_000) -> bytes:
    """A POST to ``path`` whose head (``big`` bytes of one header and ~100 more) goes in two writes
    0.3 s apart, cut at byte ``split`` (None: one write); what the server answered before it closed."""
    body = json.dumps(dict(query="q", texts=["d"])).encode()
    raw = request_head(path, length=len(body), extra="X-Big: " + "a" * big + "\r\nConnection: close\r\n") + body
    with connect(port) as s:
        s.sendall(raw[:split])
        if split is not None:
            time.sleep(0.3)   # the server has read (and judged) the first part alone
            try:
                s.sendall(raw[split:])
            except (BrokenPipeError, ConnectionResetError):   # it answered and closed already
                pass
        return read_until_closed(s, 10)[0]


@pytest.mark.parametrize("protocol", ["httptools", "h11"])
def test_a_431_has_the_routes_shape_however_the_head_arrives(request, protocol):
    """A head over 16 kB is measured by the gate when it arrives whole and by the protocol while it
    arrives: the gate's 431 on TEI's /rerank was TEI's shape, the protocol's ours, so how the
    head's TCP segments fell picked the shape a TEI client got. Both now read the route (the
    protocol from the request line's first bytes): TEI's on /rerank, ours elsewhere. The same on
    uvicorn's h11 protocol, whose own limit (front.py: 32 kB of a head still arriving) answered a
    first read of 45 kB that did not end the head 400 "malformed" where httptools answered 431;
    and a head just under 16 kB is served, whole or in pieces, on both."""
    server = request.getfixturevalue("server" if protocol == "httptools" else "h11_server")
    port = server["port"]
    # whole; past 16 kB in the first write; the request line cut; a 60 kB head whose first 45 kB
    # come in one read (past h11's limit at once)
    for big, split in ((20_000, None), (20_000, 17_000), (20_000, 100), (60_000, 45_000), (60_000, None)):
        status, _, body = parse_response(_send_head_in_two_writes(port, "/rerank", split, big))
        assert status == 431, (big, split, status, body[:200])
        assert json.loads(body) == {"error": json.loads(body)["error"], "error_type": "Validation"}, (split, body)
        assert "16384 bytes" in json.loads(body)["error"], body
        expect_json_error(_send_head_in_two_writes(port, "/v1/rerank", split, big), 431, ["16384 bytes"])
    status, _, body = parse_response(_send_head_in_two_writes(port, "/%72erank?x=1", 17_000))   # as uvicorn decodes it
    assert status == 431 and json.loads(body)["error_type"] == "Validation", body
    for split in (None, 100, 16_000):   # a head of ~16,200 bytes: under the limit, however it arrives
        for path in ("/rerank", "/v1/rerank"):
            status, _, body = parse_response(_send_head_in_two_writes(port, path, split, 16_100))
            assert status == 200, (path, split, status, body[:200])
    assert health_ok(server["base"])
    if protocol == "h11":   # this test alone sends to it: nothing it sent was taken for malformed
        assert "Invalid HTTP request received" not in server["proc"].output(), server["proc"].output()[-2000:]


def test_a_query_string_counts_toward_the_head_limit(server):
    """The gate measured a whole head as its path and headers: a 60 kB query string in one write
    was served (200)."""
    with connect(server["port"]) as s:
        s.sendall(b"GET /v1/models?x=" + b"a" * 60_000 + b" HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        raw, _ = read_until_closed(s, 10)
    expect_json_error(raw, 431, ["16384 bytes"])
    with connect(server["port"]) as s:   # a short one is served
        s.sendall(b"GET /v1/models?x=" + b"a" * 1000 + b" HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        raw, _ = read_until_closed(s, 10)
    assert raw.startswith(b"HTTP/1.1 200 "), raw[:200]


@pytest.mark.parametrize("protocol", ["httptools", "h11"])
def test_trailers_are_bounded_like_a_head(request, protocol):
    """A chunked body's trailer section (after the last chunk) had no bound on httptools: uvicorn
    appended every trailer field to the request's headers, and one connection streaming them grew
    the server by 1.7 GB in 8 s until the body timeout. Past 16 kB it is now a 431 and close
    (h11's own limit: a 400); a short trailer section is still served."""
    server = request.getfixturevalue("server" if protocol == "httptools" else "h11_server")
    body = json.dumps(dict(query="q", documents=["d"])).encode()
    chunked = (b"POST /v1/rerank HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + b"%x\r\n" % len(body) + body + b"\r\n0\r\n")
    with connect(server["port"]) as s:
        s.sendall(chunked + b"X-Checksum: abc\r\n\r\n")
        raw, _ = read_until_closed(s, 30)
    assert raw.startswith(b"HTTP/1.1 200 "), raw[:200]
    line = b"X-T: " + b"a" * 90 + b"\r\n"
    before = metrics(server["base"])
    with connect(server["port"]) as s:
        s.sendall(chunked)
        time.sleep(0.3)   # the gate has the head and waits for the body
        sent = 0
        try:
            for _ in range(100):   # 1 MB at most, in 10 kB writes
                s.sendall(line * 100)
                sent += 1
        except (BrokenPipeError, ConnectionResetError):
            pass
        raw, closed = read_until_closed(s, 10)
    assert closed is not None, "a trailer section of 1 MB was read to its end"
    expect_json_error(raw, 431 if protocol == "httptools" else 400)
    assert health_ok(server["base"])
    if protocol == "httptools":   # counted as the 431 it was, not as a client that left (499)
        after = metrics(server["base"])
        moved = {k: after.get(k, 0) - before.get(k, 0) for k in (
            ("acarerank_requests_total", (("code", "431"), ("endpoint", "/v1/rerank"))),
            ("acarerank_client_disconnects_total", (("endpoint", "/v1/rerank"),)))}
        assert list(moved.values()) == [1, 0], moved
        assert "closed the connection during the upload of POST /v1/rerank" not in server["proc"].output()[-3000:]


def test_whole_pipelined_requests_are_not_taken_for_one_long_head(server):
    """HTTP/1.1 pipelining: 1,000 whole GETs (33 kB) in each of three writes. A read that held
    whole requests and the start of the next was counted as that head's bytes: a false 431 after
    ~800 answers, the rest dropped. Every one is now answered."""
    req = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
    with connect(server["port"]) as s:
        for _ in range(3):
            s.sendall(req * 1000)
            time.sleep(0.2)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        raw, closed = read_until_closed(s, 60)
    assert closed is not None and b" 431 " not in raw, raw[-300:]
    assert raw.count(b"HTTP/1.1 200 ") == 3001, raw.count(b"HTTP/1.1 200 ")


def test_a_pipelined_head_over_the_limit_is_a_431_on_h11(h11_server):
    """A request whose body arrives in the same read as the next request's incomplete head (pipelined):
    uvicorn's h11 protocol holds those bytes unparsed until the first response ends, then parsed them
    with nothing counted. A head of 40 kB in that read was h11's own 400 "malformed" (its limit: 32 kB
    of a head still arriving); one of 20 kB was closed without a word by the keep-alive timer; 10 kB
    there and 10 kB more later were never a 431 (the head timer counted the later bytes only). Each is
    now the 431 a head that arrives alone gets, after the first request's 200; a short pipelined head
    is still served."""
    port = h11_server["port"]
    body = json.dumps(dict(query="q", documents=["d"])).encode()
    first = request_head(length=len(body)) + body
    for there, later in ((40_000, 0), (20_000, 0), (10_000, 10_000)):
        with connect(port) as s:
            s.sendall(first + b"POST /v1/rerank HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * there)
            if later:
                time.sleep(0.3)   # the first response has ended: these bytes come on their own
                s.sendall(b"a" * later)
            raw, closed = read_until_closed(s, 4)
        assert closed is not None and raw.startswith(b"HTTP/1.1 200 "), (there, later, closed, raw[:200])
        second = raw[raw.index(b"HTTP/1.1 ", 1):]
        expect_json_error(second, 431, ["16384 bytes"])
    with connect(port) as s:   # two whole pipelined requests in one write: both served
        s.sendall(first + request_head(length=len(body), extra="X-Pad: " + "a" * 1000 + "\r\nConnection: close\r\n")
                  + body)
        raw, _ = read_until_closed(s, 10)
    assert raw.count(b"HTTP/1.1 200 ") == 2, raw[:400]


def _counted(base) -> dict:
    """The response counters: {(name, labels): value} of requests_total, errors_total, disconnects
    (the scrapes' own /metrics responses left out)."""
    return {k: v for k, v in metrics(base).items()
            if k[0] in ("acarerank_requests_total", "acarerank_errors_total", "acarerank_client_disconnects_total")
            and ("endpoint", "/metrics") not in k[1]}


@pytest.mark.parametrize("protocol", ["httptools", "h11"])
def test_a_malformed_request_pipelined_behind_whole_ones_is_answered_after_them(request, protocol):
    """Whole requests, then a malformed head, in one write: each whole one gets its answer, in order,
    then the 400, and the metrics count what was sent. On httptools (which parses ahead) the 400 was
    written at once and closed the connection: the client's only answer was the 400, while a 200 it
    never got was counted (h11 parses a request only after the previous response)."""
    server = request.getfixturevalue("server" if protocol == "httptools" else "h11_server")
    base, port = server["base"], server["port"]
    body = json.dumps(dict(query="q", documents=["a", "b"])).encode()
    health = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
    malformed = b"POST /v1/rerank HTTP/1.1\r\nHost t\r\n\r\n"   # a header line without its colon
    for whole, endpoints in (([health], ["/health"]), ([request_head(length=len(body)) + body], ["/v1/rerank"]),
                             ([health, request_head(length=len(body)) + body], ["/health", "/v1/rerank"])):
        before = _counted(base)
        _answered_then_400(port, whole, malformed, f"{endpoints} + a malformed head")
        after = _counted(base)
        moved = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)
                 if after.get(k, 0) != before.get(k, 0)}
        want = {("acarerank_requests_total", (("code", "200"), ("endpoint", e))): endpoints.count(e)
                for e in endpoints}
        want.update({("acarerank_requests_total", (("code", "400"), ("endpoint", "other"))): 1,
                     ("acarerank_errors_total", (("code", "400"),)): 1})
        assert moved == want, f"{endpoints} + a malformed head counted {moved}, want {want}"


def _answered_then_400(port: int, whole: list, malformed: bytes, what: str) -> None:
    """``whole`` requests and a ``malformed`` one sent in one write: each whole one answered 200 in
    order, then the malformed one's JSON 400, then the close (h11's order)."""
    with connect(port) as s:
        s.sendall(b"".join(whole) + malformed)
        raw, closed = read_until_closed(s, 10)
    statuses = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", raw)]
    want = [200] * len(whole) + [400]
    assert closed is not None and statuses == want, f"{what}: answers {statuses}, want {want}: {raw[:300]!r}"
    expect_json_error(raw[raw.index(b"HTTP/1.1 400"):], 400, ["malformed"])


@pytest.mark.parametrize("protocol", ["httptools", "h11"])
def test_a_malformed_body_pipelined_behind_whole_requests_is_answered_after_them(request, protocol):
    """As the test above, a request whose chunked body is malformed (chunk size "ZZ") in place of
    the malformed head: on httptools the 400 of that body was written at once (the client's only
    answer), the /health it never got counted and the 400 not; h11 answered [200, 400] and counted
    them. Now both: each whole request's answer, then the 400, counted on the route it was sent to."""
    server = request.getfixturevalue("server" if protocol == "httptools" else "h11_server")
    base, port = server["base"], server["port"]
    health = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
    bad_body = request_head(extra="Transfer-Encoding: chunked\r\n") + b"ZZ\r\n{}\r\n0\r\n\r\n"
    for whole in ([health], [health, health]):
        before = _counted(base)
        _answered_then_400(port, whole, bad_body, f"{len(whole)} x /health + a malformed body")
        want = {("acarerank_requests_total", (("code", "200"), ("endpoint", "/health"))): len(whole),
                ("acarerank_requests_total", (("code", "400"), ("endpoint", "/v1/rerank"))): 1,
                ("acarerank_errors_total", (("code", "400"),)): 1}
        deadline = time.monotonic() + 5   # the gate counts a request in the body once its task ends
        while True:
            after = _counted(base)
            moved = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)
                     if after.get(k, 0) != before.get(k, 0)}
            if moved == want or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert moved == want, f"{len(whole)} x /health + a malformed body counted {moved}, want {want}"


@pytest.mark.parametrize("protocol", ["httptools", "h11"])
def test_the_http_layers_own_errors_are_counted_once(request, protocol):
    """docs/serving.md, "Metrics": every response is in acarerank_requests_total, every error in
    errors_total. The 400 of a malformed request, the 431 of a head still arriving past 16 kB and
    the 408 of a head not received in time are written by the protocol, not the app: until
    2026-12-07 none was counted. One in a request's body (a bad chunk) is counted by the gate,
    reading it, as that 400 (it was a 499, a client gone), and once. (After the tests that read
    the h11 server's whole log: its malformed request logs uvicorn's line.)"""
    server = request.getfixturevalue("server" if protocol == "httptools" else "h11_server")
    base, port = server["base"], server["port"]
    rerank = "/v1/rerank"

    def moved(before, after):
        return {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)
                if after.get(k, 0) != before.get(k, 0)}

    def want(code, endpoint=rerank):
        return {("acarerank_requests_total", (("code", str(code)), ("endpoint", endpoint))): 1,
                ("acarerank_errors_total", (("code", str(code)),)): 1}

    big = ("X-Big: " + "a" * 20_000 + "\r\n").encode()
    cases = {
        "malformed head": ([request_head(extra="Content-Length: 1\r\nContent-Length: 2\r\n")], 400),
        "head past 16 kB, arriving": ([b"POST /v1/rerank HTTP/1.1\r\nHost: t\r\n", big, big], 431),
        "head not received in time": ([b"POST /v1/rerank HTTP/1.1\r\nHost: t\r\nContent-Le"], 408),
        "a bad chunk in the body": ([request_head(extra="Transfer-Encoding: chunked\r\n"),
                                     b"5\r\n{\"que\r\nZZ\r\n"], 400),
    }
    for case, (parts, code) in cases.items():
        before = _counted(base)
        with connect(port) as s:
            for part in parts:
                s.sendall(part)
                time.sleep(0.2)
            raw, took = read_until_closed(s, HEADER_TIMEOUT + MARGIN)
        assert took is not None, f"{case}: the connection stayed open"
        expect_json_error(raw, code)
        deadline = time.monotonic() + 5   # the gate counts a request in the body once its task ends
        while moved(before, _counted(base)) != want(code) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert moved(before, _counted(base)) == want(code), (case, moved(before, _counted(base)))


def test_a_target_with_no_readable_path_still_gets_its_400_and_408(server):
    """httptools hands an absolute-form target over as it is; reading its path for the count
    ("http://[x/": urlsplit raises) failed inside the 400 before it was written (the connection
    closed silently, a traceback logged each time) and inside the 408's timer before the close
    (the connection stayed open, past --header-timeout, for good). Both are answered and counted
    under "other"; so is a malformed request pipelined behind a whole one (it was counted under
    the whole one's endpoint)."""
    base, port = server["base"], server["port"]
    for parts, code in (([b"GET http://[x/health HTTP/1.1\r\nHost: t\r\nbad header line\r\n\r\n"], 400),
                        ([b"GET http://[x/health HTTP/1.1\r\nHost: t\r\n"], 408)):
        before = _counted(base)
        with connect(port) as s:
            for part in parts:
                s.sendall(part)
            raw, took = read_until_closed(s, HEADER_TIMEOUT + MARGIN)
        assert took is not None, f"{code}: the connection stayed open"
        expect_json_error(raw, code)
        key = ("acarerank_requests_total", (("code", str(code)), ("endpoint", "other")))
        assert _counted(base).get(key, 0) - before.get(key, 0) == 1, (code, _counted(base))
    before = _counted(base)
    with connect(port) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n" + b"\x00\x01garbage\r\n\r\n")
        raw, _ = read_until_closed(s, 10)
    assert b"HTTP/1.1 400 " in raw, raw[:300]   # (the parser's error came before the GET's answer)
    after = _counted(base)
    key = ("acarerank_requests_total", (("code", "400"), ("endpoint", "other")))
    assert after.get(key, 0) - before.get(key, 0) == 1, {k: v for k, v in after.items() if "400" in str(k)}


def test_a_pipelined_head_streamed_while_a_request_runs_is_not_read_past_the_limit(server):
    """A request, then the next request's head sent without end while the first one is scored
    (pipelined). httptools parses a head as it comes and keeps a header value whole, grown by copying:
    the head timer runs only between requests, so it read ~75 MB of one header into memory and held
    the event loop for seconds (/health took 2.6 s) before the first response went out. Now it
    stops reading once the head passed 16 kB (the socket's buffers fill and the client's send
    blocks), and answers it 431 after the first request's 200."""
    port = server["port"]
    base_rss = rss_mb(server["proc"].pid)
    body = json.dumps(dict(query="q", documents=["word " * 200] * 150)).encode()
    chunk = b"a" * (1 << 20)
    with connect(port) as s:
        s.sendall(request_head(length=len(body)) + body + b"POST /v1/rerank HTTP/1.1\r\nHost: t\r\nX-Big: ")
        s.settimeout(1.0)
        sent, t0 = 0, time.monotonic()
        while sent < 64 and time.monotonic() - t0 < 4:
            try:
                s.sendall(chunk)
            except socket.timeout:   # the server reads no more
                break
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1
        grown = rss_mb(server["proc"].pid) - base_rss
        raw, _ = read_until_closed(s, 5)
    assert sent < 24 and grown < 24, (sent, grown)   # the socket's buffers (a few MB on loopback), no more
    assert raw.startswith(b"HTTP/1.1 200 "), raw[:200]
    expect_json_error(raw[raw.index(b"HTTP/1.1 ", 1):], 431, ["16384 bytes"])
    assert health_ok(server["base"])


def test_request_limits(server):
    base = server["base"]
    r = httpx.post(base + "/v1/rerank", json=dict(query="q", documents=["d"], cache_salt="s" * (MAX_SALT + 1)))
    assert r.status_code == 422 and str(MAX_SALT) in r.json()["error"]["message"], r.text
    r = httpx.post(base + "/v1/rerank", json=dict(query="q", documents=["x" * (MAX_CHARS // 2)] * 2 + ["y"]))
    err = r.json()["error"]
    assert r.status_code == 413 and str(MAX_CHARS) in err["message"] and "characters" in err["message"], r.text
    r = httpx.post(base + "/v1/select", json=dict(query="q", documents=["x" * MAX_CHARS, "y"]))
    assert r.status_code == 413 and str(MAX_CHARS) in r.json()["error"]["message"], r.text
    # vLLM's chat_template_kwargs instruction wins over the field (request_checks.check_vllm_options),
    # so it is counted as the field is: it went on to the tokenizer uncounted until 2026-12-07
    for path in ("/v1/rerank", "/score"):
        sides = dict(query="q", documents=["d"]) if path == "/v1/rerank" else dict(text_1="q", text_2=["d"])
        r = httpx.post(base + path, json=dict(sides, chat_template_kwargs={"instruction": "x" * (MAX_CHARS + 1)}))
        assert r.status_code == 413 and "--max-request-chars" in r.text, (path, r.status_code, r.text[:300])


def test_bodies_that_bypass_admission_are_capped(server):
    """Only a POST to an API path is admitted (counted against --max-queue), so only it may send a
    body up to --max-body-bytes: any other request (an unknown path, a wrong method) gets 413 at
    its head when it declares more than the lingering-close cap, and when a chunked body goes past
    it. Before, the gate read up to --max-body-bytes for every such request, however many: memory
    bounded by the connection cap times 32 MiB, not by --max-queue."""
    from acarerank.server.gate import LINGER_BYTES

    port = server["port"]
    for path, method in (("/anything", "POST"), ("/v1/models", "POST"), ("/v1/rerank", "PUT")):
        with connect(port) as s:   # the head alone: 413 must come without a byte of the body
            s.sendall(request_head(path, length=8_000_000).replace(b"POST", method.encode(), 1))
            data, took = read_until_closed(s, 10)
            expect_json_error(data, 413, [str(LINGER_BYTES), path])
            assert took is not None, "the connection stayed open after a refused body"
    with connect(port) as s:   # chunked: cut off once past the cap
        s.sendall(request_head("/anything", extra="Transfer-Encoding: chunked\r\n"))
        for _ in range(LINGER_BYTES // 4096 + 2):
            s.sendall(b"1000\r\n" + b"x" * 4096 + b"\r\n")
        expect_json_error(read_until_closed(s, 10)[0], 413, [str(LINGER_BYTES)])
    # a small body still gets the route's own answer; an API POST may still send a large one
    with connect(port) as s:
        s.sendall(request_head("/v1/models", length=2, extra="Connection: close\r\n") + b"{}")
        expect_json_error(read_until_closed(s, 10)[0], 405)
    body = json.dumps(dict(query="q", documents=["d" * 100_000])).encode()
    assert LINGER_BYTES < len(body) and parse_response(post_raw(port, body))[0] == 200


# -- admission once the body is whole; parsing off the event loop -------------------------------------------
def test_stalled_uploads_do_not_fill_the_queue_and_big_bodies_do_not_stall_health(server):
    """--max-queue clients that send half a body and stall hold no queue slot (one of
    --max-uploads each, by default the larger of 64 and --max-queue): a whole request is answered meanwhile. Until 2026-12-06
    they held the queue and every other request got 429 until --body-timeout (the 429 at the head
    of a queue already full: test_gate_uploads.py)."""
    base, port, pid = server["base"], server["port"], server["proc"].pid
    body = json.dumps(dict(query="q", documents=["d"])).encode()
    holders = [connect(port) for _ in range(MAX_QUEUE)]
    try:
        for s in holders:   # their bodies still coming: not admitted yet
            s.sendall(request_head(length=len(body)) + body[:5])
        deadline = time.monotonic() + 10
        while metrics(base).get(("acarerank_requests_uploading", ()), 0) < MAX_QUEUE:
            assert time.monotonic() < deadline, "the stalled uploads were never all in progress"
            time.sleep(0.05)
        assert parse_response(post_raw(port, body))[0] == 200
        for s in holders:
            s.sendall(body[5:])
        for s in holders:
            assert parse_response(read_until_closed(s, 30)[0])[0] == 200
    finally:
        for s in holders:
            s.close()
    # 31 MB of [] in an ignored field: /health answers meanwhile, memory grows little
    junk = b'{"query": "q", "documents": ["d"], "junk": [' + b"[]," * 10_000_000 + b"[]]}"
    r, slowest, grew = _sent_while_probing_health(base, pid, "/v1/rerank", junk)
    assert r.status_code == 200, r.text
    # json.loads of this body takes 2.9 s on a 2-core AMD EPYC (AVX2) (the event loop stalled 5.7 s before);
    # the bound leaves room for a loaded machine
    assert slowest < 2.0, f"/health took {slowest:.2f} s during a 31 MB body"
    assert grew < 300, f"a 31 MB body of ignored [] grew the server by {grew:.0f} MB"


def _sent_while_probing_health(base, pid, path, body):
    """POST ``body`` to ``path`` in a thread while ``/health`` is probed: (the response, the slowest
    /health in s, the server's peak RSS growth in MB)."""
    rss0 = rss_mb(pid)
    out, slowest, peak = {}, [0.0], rss0
    t = threading.Thread(target=lambda: out.setdefault("r", httpx.post(
        base + path, content=body, headers={"content-type": "application/json"}, timeout=60)))
    t.start()
    while t.is_alive():
        t0 = time.monotonic()
        assert health_ok(base)
        slowest.append(time.monotonic() - t0)
        peak = max(peak, rss_mb(pid))
        time.sleep(0.02)
    t.join()
    return out["r"], max(slowest), peak - rss0


def _array(item: bytes, n: int) -> bytes:
    return b"[" + b",".join([item] * n) + b"]"


def _flood(head: bytes, value) -> Callable[[], bytes]:
    """A body ``{<head>, ..., <the JSON ``value()`` gives>}``, built when its test runs."""
    return lambda: b"{" + head + value() + b"}"


RERANK = b'"query": "q", "documents": ["d"], '
# route, body, status, words of the message: lists and an object in known fields, each far past
# --max-documents (the fixture's default 1,000)
_KNOWN_FIELD_FLOODS = {
    "documents of []": ("/v1/rerank", _flood(b'"query": "q", "documents": ', lambda: _array(b"[]", 2_000_000)),
                        413, ["more documents than the limit of 1000"]),
    "ten million empty documents": ("/v1/rerank", _flood(b'"query": "q", "documents": ',
                                                         lambda: _array(b'""', 10_000_000)),
                                    413, ["more documents than the limit of 1000"]),
    "texts of []": ("/rerank", _flood(b'"query": "q", "texts": ', lambda: _array(b"[]", 2_000_000)),
                    413, ["documents"]),
    "rank_fields of []": ("/v1/rerank", _flood(RERANK + b'"rank_fields": ', lambda: _array(b"[]", 2_000_000)),
                          413, ["items in rank_fields"]),
    "model as an array": ("/v1/rerank", _flood(RERANK + b'"model": ', lambda: _array(b"[]", 2_000_000)),
                          413, ["items in model"]),
    "text_2 of []": ("/score", _flood(b'"text_1": "q", "text_2": ', lambda: _array(b"[]", 2_000_000)),
                     413, ["documents"]),
    "a value of chat_template_kwargs": ("/v1/rerank", _flood(RERANK + b'"chat_template_kwargs": ',
                                                             lambda: b'{"x": ' + _array(b"[]", 2_000_000) + b"}"),
                                        400, ["chat_template_kwargs"]),
    # refused at its first key other than instruction (docs/serving.md, "Errors"): until 2026-12-07 the
    # object was read whole for a 413, 33 MB of distinct keys in 5 s, /health waiting
    "keys of chat_template_kwargs": ("/v1/rerank",
                                     _flood(RERANK + b'"chat_template_kwargs": ',
                                            lambda: b"{" + b",".join(b'"%x":0' % i for i in range(2_800_000)) + b"}"),
                                     400, ["chat_template_kwargs ['0'] not supported"]),
    "1,001 documents": ("/v1/rerank", lambda: json.dumps(dict(query="q", documents=["d"] * 1001)).encode(),
                        413, ["1001 documents exceed the limit of 1000"]),
}


@pytest.mark.parametrize("case", _KNOWN_FIELD_FLOODS)
def test_a_known_field_full_of_items_is_refused_before_it_is_read(server, case):
    """A list (or object) field of the schema holding millions of items: refused by its count before
    any item is built, the event loop free meanwhile. Until 2026-12-07 every item was built, then
    validated, and pydantic's error for each turned into a dict in one call that holds the GIL:
    6 MB of [] in documents took 28 s and 3.6 GB, /health waited 20 s; ten million "" documents got
    their 413 after 18.6 s, holding one of the two parse workers."""
    path, make_body, status, words = _KNOWN_FIELD_FLOODS[case]
    body = make_body()
    t0 = time.monotonic()
    r, slowest, grew = _sent_while_probing_health(server["base"], server["proc"].pid, path, body)
    took = time.monotonic() - t0
    assert r.status_code == status and all(w in r.text for w in words), (r.status_code, r.text[:300])
    assert len(r.content) < 2000, f"a {len(r.content)}-byte error body"
    assert took < 5.0, f"{case}: answered after {took:.1f} s"
    assert slowest < 2.0, f"{case}: /health took {slowest:.2f} s"
    assert grew < 300, f"{case}: the server grew by {grew:.0f} MB for a {len(body) / 1e6:.0f} MB body"


def test_upload_cut_short_is_499_logged_once(server):
    """Uploads cut short are 499s, no errors, and logged one line per LOG_EVERY_S at most, with the
    count since the last (docs/serving.md, "Errors"): 2,000 cut uploads in 0.4 s wrote 2,000 lines,
    the only client-triggered line not kept so. The line names the path, escaped."""
    base, port, proc = server["base"], server["port"], server["proc"]
    cut = 30
    before = metrics(base)
    # the line names the path, a client's: a percent-encoded newline or escape in it wrote a forged
    # log line ("...\n2026-12-07 CRITICAL ...") or a terminal escape; now escaped, on its one line
    paths = ["/v1/rerank%0A2026-12-07%20CRITICAL%20FORGED%1B[31m"] + ["/v1/rerank"] * (cut - 1)
    for path in paths:
        with connect(port) as s:
            s.sendall(request_head(path, length=1000) + b'{"query": "q", "docu')
            time.sleep(0.02)
    deadline = time.monotonic() + 10
    key = ("acarerank_requests_total", (("code", "499"), ("endpoint", "/v1/rerank")))
    while time.monotonic() < deadline:
        after = metrics(base)
        if after.get(key, 0) - before.get(key, 0) >= cut - 1:
            break
        time.sleep(0.1)
    moved = {code: after.get(("acarerank_errors_total", (("code", code),)), 0)
             - before.get(("acarerank_errors_total", (("code", code),)), 0) for code in ("499", "500")}
    assert moved == {"499": 0, "500": 0}, moved   # a client that left is no error of the server's
    gone = ("acarerank_client_disconnects_total", (("endpoint", "/v1/rerank"),))
    assert after.get(gone, 0) - before.get(gone, 0) == cut - 1   # the forged path is endpoint "other"
    log = proc.output()
    lines = [ln for ln in log.splitlines() if "closed the connection during the upload" in ln]
    assert len(lines) == 1, f"{len(lines)} lines for {cut} uploads cut short within seconds: {lines[:3]}"
    assert "(1 since the last such line)" in lines[0], lines[0]
    assert "\\n2026-12-07 CRITICAL FORGED\\x1b[31m" in log and "\n2026-12-07 CRITICAL FORGED" not in log, log[-2000:]
    assert "\x1b" not in log, log[-2000:]


def test_a_rate_limited_line_counts_the_events_since_the_last():
    """``_RateLimited``: the first event is logged, the next within ``every`` only counted; the next
    line says how many (the cut-upload line and the protocol's own lines)."""
    import logging

    from acarerank.server.gate import _RateLimited

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append((record.levelno, record.getMessage()))
    logger = logging.getLogger("acarerank.server")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        limited = _RateLimited(every=10.0, level=logging.INFO)
        for _ in range(5):
            limited("an upload was cut short")
        limited.last -= limited.every   # the interval has passed
        limited("an upload was cut short")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert lines == [(logging.INFO, "an upload was cut short (1 since the last such line)"),
                     (logging.INFO, "an upload was cut short (5 since the last such line)")], lines


# -- tenancy: cached_tokens only within a salt --------------------------------------------------------
def test_cached_tokens_only_with_a_salt(server):
    base = server["base"]
    trace = "the agent searched for tutoring rerankers and read three papers. " * 20
    body = dict(query="q", documents=["a", "b"], question="which reranker learns from a tutor?", trace=trace)
    for _ in range(2):
        r = httpx.post(base + "/v1/rerank", json=body, timeout=60)
        assert r.status_code == 200 and "cached_tokens" not in r.json()["usage"], r.json()["usage"]
    salted = dict(body, cache_salt="tenant-1")
    httpx.post(base + "/v1/rerank", json=salted, timeout=60)
    r = httpx.post(base + "/v1/rerank", json=salted, timeout=60)
    assert r.json()["usage"]["cached_tokens"] > 0, r.json()["usage"]


# -- memory: thousands of distinct salts --------------------------------------------------------------
def test_thousands_of_salts_grow_memory_under_a_per_salt_bound(server):
    """Two rounds of 1,000 requests, each with its own salt at the length limit: the server's RSS
    grows by less than 3.2 kB per salt (3.1 MB) in at least one of them; then 200 with 1 MB salts
    (refused) leave it within 64 MB of where it was after the warm-up.

    What is proven is a per-salt bound: state a distinct salt leaves behind (a prefix-cache root,
    pages, a per-salt entry anywhere) must stay under 3.2 kB. A leak grows RSS in every round, so
    it fails both; a one-time step of the allocator (a new arena, a heap high-water mark; +2.5 MB
    then flat on an EPYC, +8.9 MB in one round on CI's machine) lands in one round only, and the
    other round bounds the slope. The bound is per salt, so a round's size sets only how much RSS
    noise a round must stay under (3.1 MB; a round moved +0.1 to +0.9 MB after the warm-up on a
    Xeon), not what it catches: a leak of a 4 kB string per request fails here (+4.0 and +4.2 MB),
    and 200 retained 1 MB salts (200 MB) fail the last bound. Rounds of 2,000 took 6 s each on
    the Xeon and about twice that on CI's 2 cores.
    """
    base, pid = server["base"], server["proc"].pid

    async def send(salts, expect):
        sem = asyncio.Semaphore(MAX_QUEUE)
        # the client lets idle connections go before the server's keep-alive timeout closes them
        limits = httpx.Limits(keepalive_expiry=KEEPALIVE_TIMEOUT / 4)
        async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as c:
            async def one(salt):
                async with sem:
                    r = await c.post("/v1/rerank", json=dict(query="q", documents=["d"], cache_salt=salt))
                    assert r.status_code == expect, r.text
            await asyncio.gather(*(one(s) for s in salts))

    def salt(i, n=MAX_SALT):
        return f"{i:08d}".ljust(n, "s")

    def run(salts, expect):
        try:
            asyncio.run(send(salts, expect))
        except httpx.TransportError as e:
            raise AssertionError(f"{e!r}; server log:\n{server['proc'].output()[-3000:]}") from e

    salts, per_salt_kb, rounds = 1_000, 3.2, 2
    run([salt(i) for i in range(500)], 200)   # warm-up: allocator arenas, caches
    baseline = rss_mb(pid)
    grew, before, first = [], baseline, 500
    for _ in range(rounds):
        t0 = time.monotonic()
        run([salt(i) for i in range(first, first + salts)], 200)
        took, first = time.monotonic() - t0, first + salts
        grew.append(rss_mb(pid) - before)
        before += grew[-1]
        print(f"{salts:,} salts: RSS {grew[-1]:+.1f} MB (from {baseline:.0f} MB after warm-up); {took:.0f} s")
        assert took < 300 * salts / 10_000, f"{salts:,} requests took {took:.0f} s (the bound: 300 s per 10,000)"
    bound = salts * per_salt_kb / 1024
    assert min(grew) < bound, (f"every round of {salts:,} salts grew the server's RSS by over {per_salt_kb} kB per "
                               f"salt ({bound:.2f} MB): {', '.join(f'{g:+.1f} MB' for g in grew)} from {baseline:.0f} MB")
    run([salt(i, 1 << 20) for i in range(200)], 422)
    grown = rss_mb(pid) - baseline
    print(f"200 salts of 1 MB (refused): {grown:+.1f} MB above the baseline")
    assert grown < 64, f"the 1 MB salts left the server {grown:.0f} MB above its baseline ({baseline:.0f} MB)"


def test_the_repeated_line_filter_forgets_what_it_no_longer_needs(monkeypatch):
    """``_OncePerInterval`` (one line per 10 s for asyncio's errors and uvicorn's malformed-request
    line) keyed every message it let through for as long as the process lived; asyncio's lines
    name the task or connection, so each was new and the map grew with every error. It keeps the
    last interval's messages only, at most ``max_keys``, and still drops a repeat within it."""
    import logging
    from types import SimpleNamespace

    from acarerank.server import front

    clock = [1000.0]
    monkeypatch.setattr(front, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    f = front._OncePerInterval(every=10.0, max_keys=64)

    def let_through(msg):
        return f.filter(logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None))

    assert let_through("accept failed") and not let_through("accept failed")
    clock[0] += 9.9
    assert not let_through("accept failed")
    clock[0] += 0.1
    assert let_through("accept failed")   # a repeat once the interval is over
    for k in range(5000):                 # one new message a second: only the last 10 s are kept
        clock[0] += 1.0
        assert let_through(f"Task exception was never retrieved: task {k}")
    assert len(f.seen) == 10, len(f.seen)
    assert not let_through("Task exception was never retrieved: task 4999")
    for k in range(5000):                 # a burst of new messages in one instant: at most max_keys
        assert let_through(f"connection {k} lost")
    assert len(f.seen) == 64, len(f.seen)
    assert not let_through("connection 4999 lost")
