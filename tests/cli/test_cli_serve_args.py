"""``acarerank serve``'s listening address and API key are checked before the model loads: one
line on stderr, exit 2 (cli/__init__.py), never a server that listens where it was not asked to,
or that no client can pass."""
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from _optional import require
from acarerank.cli import main

require("fastapi", "uvicorn", "pydantic", "prometheus_client", "msgspec")


class ModelLoaded(BaseException):
    """Raised where the model would load (not an Exception: main cannot swallow it)."""


@pytest.fixture()
def no_load(monkeypatch):
    import acarerank.server.build as build

    def boom(*a, **kw):
        raise ModelLoaded()

    monkeypatch.setattr(build, "build_service", boom)
    monkeypatch.delenv("ACARERANK_API_KEY", raising=False)


def serve(capsys, argv):
    rc = main(["serve"] + argv)
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and not x.startswith(("NOTE:", "dtype:"))]
    return rc, err


@pytest.fixture()
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("host, needle", [
    ("", "--host is empty, which would listen on every interface"),  # asyncio: '' is every interface
    ("bogus host", "--host 'bogus host' is not an address or a name this machine resolves"),
    ("192.0.2.1", "cannot listen on 192.0.2.1 port"),  # TEST-NET-1 (RFC 5737): no machine's own address
])
def test_a_host_that_cannot_listen_is_refused_before_loading(capsys, no_load, host, needle):
    """They loaded the whole model, then uvicorn logged its error and exited 3; '' listened on
    0.0.0.0 and :: (``--host "$UNSET"`` served the network)."""
    rc, err = serve(capsys, ["--host", host, "--port", "0"])
    assert rc == 2 and len(err) == 1 and err[0].startswith("acarerank serve: error: ") and needle in err[0], (rc, err)


def test_a_port_in_use_is_refused_before_loading(capsys, no_load, busy_port):
    rc, err = serve(capsys, ["--port", str(busy_port)])
    assert rc == 2 and err == [f"acarerank serve: error: --host 127.0.0.1 --port {busy_port}: cannot listen on "
                               f"127.0.0.1 port {busy_port}: address already in use"], (rc, err)


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_max_pass_timeout_that_is_no_duration_is_refused_before_loading(capsys, no_load, value):
    """--max-pass-timeout is a timeout flag as the others: 0, a negative number or NaN would make
    every step a fault or none; one line naming the flag, exit 2."""
    rc, err = serve(capsys, ["--max-pass-timeout", value, "--port", "0"])
    assert rc == 2 and err == [f"acarerank serve: error: --max-pass-timeout must be a number > 0 (seconds; inf: no "
                               f"limit), got {float(value)!r}"], (rc, err)


# run in a child process: acarerank serve's bounded stop exits the process (os._exit) while any
# non-daemon thread runs, and a pytest process holds other tests' threads
_TAKE_PORT_WHILE_LOADING = textwrap.dedent("""
    import socket, sys
    import acarerank.server.build as build
    from acarerank.cli import main

    port, real, taker = int(sys.argv[1]), build.build_service, socket.socket()

    def build_then_take(config):
        service = real(config)
        taker.bind(("127.0.0.1", port))
        taker.listen()
        return service

    build.build_service = build_then_take
    sys.exit(main(["serve", "--port", str(port), "--dtype", "float32", "--log-level", "warning"]))
""")


def test_a_port_taken_while_the_model_loads_is_refused_as_before_it():
    """The check before the load passes, then another process takes the port while the model
    loads: uvicorn bound it itself, logged its error over several lines and exited 3. Now the
    server binds it: the check's one line, exit 2 — through the service's stop, not past it (a
    stop cut short exits 0 or 70 from inside it)."""
    from acarerank.server.launch import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "ACARERANK_API_KEY"}
    r = subprocess.run([sys.executable, "-c", _TAKE_PORT_WHILE_LOADING, str(port)], capture_output=True, text=True,
                       timeout=300, env=env)
    err = [x for x in r.stderr.splitlines() if x.strip() and not x.startswith(("NOTE:", "dtype:"))]
    assert r.returncode == 2 and len(err) == 2 and err[0].startswith("acarerank serve: model "), (r.returncode, err)
    assert err[1] == (f"acarerank serve: error: --host 127.0.0.1 --port {port}: cannot listen on 127.0.0.1 port "
                      f"{port}: address already in use"), err


def test_serve_started_with_stdout_closed_configures_uvicorn(capsys, monkeypatch):
    """Started with stdout closed (``>&-``, common for daemons), Python has no sys.stdout: the
    model loaded, then uvicorn's log formatter asked ``sys.stdout.isatty()`` and serve exited 2
    with "Unable to configure formatter 'default'". The model is a stand-in here; uvicorn's
    configuration (its logging included) is the real one."""
    from types import SimpleNamespace

    import acarerank.server.build as build
    import acarerank.server.front as front

    monkeypatch.delenv("ACARERANK_API_KEY", raising=False)
    service = SimpleNamespace(start=lambda warmup: None, model_name="stand-in", max_queue=1, max_queue_tokens=None,
                              token_wait_timeout=None, engine=SimpleNamespace(max_batch_tokens=1), threads=lambda: [])
    monkeypatch.setattr(build, "build_service", lambda config: service)
    configured = []
    monkeypatch.setattr(front, "run_server", lambda service, config, **kw: configured.append(
        front.uvicorn_config(lambda scope, receive, send: None, config)) or 0)
    monkeypatch.setattr("sys.stdout", None)
    rc, err = serve(capsys, ["--port", "0"])
    assert rc == 0 and len(configured) == 1, (rc, err)
    assert len(err) == 1 and err[0].startswith("acarerank serve: model 'stand-in' ready in "), err


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_free_address_reaches_the_model(capsys, no_load, host):
    with pytest.raises(ModelLoaded):
        main(["serve", "--host", host, "--port", "0"])


@pytest.mark.parametrize("key, needle", [
    ("", "--api-key is empty"),  # it served with no key at all ('api key off')
    (" s3cr3t", "starts or ends with whitespace"),  # the gate strips the header: every request 401
    ("s3cr3t\n", "starts or ends with whitespace"),
    ("s3cr\u00e9t", "outside printable ASCII (at position 5)"),
    ("s3\tcr3t", "outside printable ASCII (at position 3)"),
])
def test_an_api_key_no_client_can_send_is_refused(capsys, no_load, key, needle):
    rc, err = serve(capsys, ["--port", "0", "--api-key", key])
    assert rc == 2 and len(err) == 1 and needle in err[0] and "--api-key" in err[0], (rc, err)
    assert "s3" not in err[0] and "cr3t" not in err[0], f"the key is never printed: {err[0]}"


def test_the_api_key_variable_is_checked_too(capsys, no_load, monkeypatch):
    monkeypatch.setenv("ACARERANK_API_KEY", "key\r")  # an env file with CRLF line ends
    rc, err = serve(capsys, ["--port", "0"])
    assert rc == 2 and len(err) == 1 and "ACARERANK_API_KEY starts or ends with whitespace" in err[0], (rc, err)
    for value in ("", "a key-with_symbols.~!"):  # empty: unset, an open server (docs/install.md)
        monkeypatch.setenv("ACARERANK_API_KEY", value)
        with pytest.raises(ModelLoaded):
            main(["serve", "--port", "0"])


def test_serve_config_refuses_the_key_for_every_front():
    """ServeConfig is also what the Ray front builds from its options."""
    from acarerank.server.config import ServeConfig

    with pytest.raises(ValueError, match="--api-key is empty"):
        ServeConfig(api_key="")
    assert ServeConfig(api_key="k").api_key == "k"


@pytest.mark.parametrize("seconds,words", [(30.0, "waits up to 30 s"), (0.5, "waits up to 0.5 s"),
                                           (None, "waits for room with no limit")])
def test_the_start_up_line_says_how_long_a_request_waits_for_tokens(seconds, words):
    """With --max-queue-tokens the start-up line names --token-wait-timeout (None: inf)."""
    from acarerank.cli.serve import _token_wait

    assert words in _token_wait(seconds), _token_wait(seconds)
