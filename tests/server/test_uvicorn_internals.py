"""The uvicorn internals ``acarerank/server/protocol.py`` and ``front.py`` touch are where they were.

``HTTPProtocolWithLimits`` subclasses uvicorn's HTTP protocol classes (httptools and h11) and
reads or writes ``server_state.connections``, ``cycle`` / ``cycle.response_complete``,
``transport``, ``loop`` and ``timeout_keep_alive_task``, and overrides nine of their methods (and
repeats httptools' ``data_received``: ``_parse``);
``DrainingServer`` overrides ``uvicorn.Server.handle_exit`` and ``serve`` and sets ``should_exit``.
A uvicorn release that moves any of them fails here, by name, before a connection misbehaves;
the installed versions must also be inside setup.py's pins (the versions these tests ran on)."""
import asyncio
import importlib.metadata
import inspect
import re
from pathlib import Path

import pytest
from _optional import require

require("uvicorn", "httptools", "h11")
import uvicorn  # noqa: E402
from uvicorn.protocols.http.h11_impl import H11Protocol  # noqa: E402
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # noqa: E402
from uvicorn.server import ServerState  # noqa: E402

from acarerank.server.config import ServeConfig  # noqa: E402
from acarerank.server.protocol import http_protocol_with_limits, uvicorn_http_protocol  # noqa: E402

OVERRIDDEN = ("connection_made", "connection_lost", "data_received", "on_response_complete",
              "timeout_keep_alive_handler", "send_400_response", "pause_writing", "resume_writing",
              "_unsupported_upgrade_warning")
SETUP = Path(__file__).resolve().parents[2] / "setup.py"


def _inside(version: str, ranges: str) -> bool:
    """``version`` inside ``ranges`` of the form ">=A.B,<C.D" (the only form setup.py's pins use)."""
    v = tuple(int(x) for x in re.findall(r"\d+", version)[:3])
    for clause in ranges.split(","):
        op, bound = re.match(r"\s*(>=|<)\s*([\d.]+)", clause).groups()
        b = tuple(int(x) for x in bound.split("."))
        if (op == ">=" and v[:len(b)] < b) or (op == "<" and v[:len(b)] >= b):
            return False
    return True


def test_installed_versions_are_inside_the_pins():
    pins = re.search(r"^UVICORN = \[(.*)\]$", SETUP.read_text(), re.M)
    assert pins, "setup.py lost its UVICORN pin list"
    for spec in re.findall(r'"([^"]+)"', pins.group(1)):
        name, ranges = re.match(r"([A-Za-z0-9_.-]+)(.*)", spec).groups()
        have = importlib.metadata.version(name)
        assert _inside(have, ranges), f"{name} {have} is outside setup.py's pin {spec}: check protocol.py"


async def _app(scope, receive, send):  # never called: the protocols are only constructed
    raise AssertionError("not served")


class _Transport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.closed = False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True

    def write(self, data):
        pass

    def set_protocol(self, protocol):
        pass


@pytest.mark.parametrize("base", [HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def test_protocol_internals_exist(base):
    for name in OVERRIDDEN:
        assert callable(getattr(base, name, None)), f"uvicorn's {base.__name__}.{name} is gone"
    assert list(inspect.signature(base.connection_made).parameters) == ["self", "transport"]
    assert list(inspect.signature(base.send_400_response).parameters) == ["self", "msg"]
    loop = asyncio.new_event_loop()
    try:
        config = uvicorn.Config(_app, timeout_keep_alive=5)
        config.load()
        state = ServerState()
        cls = http_protocol_with_limits(base, ServeConfig(header_timeout=30.0))
        assert cls.__name__ == "HTTPProtocolWithLimits" and issubclass(cls, base)
        proto = cls(config=config, server_state=state, app_state={}, _loop=loop)
        for attr in ("cycle", "timeout_keep_alive_task", "server_state", "loop"):
            assert hasattr(proto, attr), f"uvicorn's {base.__name__} no longer sets self.{attr}"
        assert proto.server_state is state and isinstance(state.connections, set)
        proto.connection_made(_Transport())
        assert proto in state.connections and proto.transport is not None, "connection bookkeeping moved"
        # a pipelined head (protocol.py): h11's unparsed buffer, httptools' end-of-message and head
        # callbacks, and the flow control both pause reading with
        assert callable(proto.flow.pause_reading), f"uvicorn's {base.__name__} lost flow.pause_reading"
        if base is H11Protocol:
            assert proto.conn.trailing_data == (b"", False), "h11's Connection.trailing_data moved"
        else:
            # an upgrade offer served with its body (protocol.py ``_parse``: uvicorn's data_received
            # with the parser it makes in __init__, and the methods that one calls)
            for name in ("on_message_complete", "on_headers_complete", "_unset_keepalive_if_required",
                         "_should_upgrade", "handle_websocket_upgrade"):
                assert callable(getattr(base, name, None)), f"uvicorn's {base.__name__}.{name} is gone"
            for name in ("should_upgrade", "get_method", "get_http_version", "set_dangerous_leniencies"):
                assert callable(getattr(proto.parser, name, None)), f"httptools' parser lost {name}"
            # a malformed body of a request queued behind whole ones (protocol.py ``_unqueue``)
            assert list(proto.pipeline) == [] and callable(proto.pipeline.remove), \
                "uvicorn's HttpToolsProtocol.pipeline (its queue of (cycle, app)) moved"
            assert "self.pipeline.appendleft((self.cycle, app))" in inspect.getsource(base.on_headers_complete), \
                "uvicorn's HttpToolsProtocol queues a pipelined request otherwise: check _unqueue"
            source = inspect.getsource(base.data_received)
            for line in ("self.parser.feed_data(data)", "except httptools.HttpParserUpgrade:",
                         "self._unsupported_upgrade_warning()", "self.send_400_response(msg)"):
                assert line in source, f"uvicorn's {base.__name__}.data_received moved ({line}): check _parse"
            assert "lenient_data_after_close=True" in inspect.getsource(base.__init__), "check _parse's parser"
        assert proto._head_timer is not None, "the head timer was not armed on connection_made"
        proto.connection_lost(None)
        assert proto not in state.connections
    finally:
        loop.close()
    cycle = inspect.getsource(inspect.getmodule(base).RequestResponseCycle.__init__)
    assert "self.response_complete" in cycle, f"{base.__name__}'s cycle lost response_complete"


def test_server_and_config_internals_exist():
    params = inspect.signature(uvicorn.Config.__init__).parameters
    for name in ("http", "h11_max_incomplete_event_size", "timeout_keep_alive", "timeout_graceful_shutdown", "ws"):
        assert name in params, f"uvicorn.Config lost {name}="
    assert list(inspect.signature(uvicorn.Server.handle_exit).parameters) == ["self", "sig", "frame"]
    assert "sockets" in inspect.signature(uvicorn.Server.serve).parameters
    assert hasattr(uvicorn.Server(uvicorn.Config(_app)), "should_exit")
    assert uvicorn_http_protocol() is HttpToolsProtocol, "httptools is installed: uvicorn's auto choice is it"
