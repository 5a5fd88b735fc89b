"""``acarerank serve``: the HTTP rerank server (uvicorn) over one model.

Every flag is a field of ``acarerank.server.config.ServeConfig`` (its defaults, its help);
this module only parses them, checks that the serving extra is installed, and runs
``acarerank.server.front.run_server``. SIGTERM drains (``front.py``): new API requests get 503
and ``/ready`` turns 503 at once, requests already admitted get up to ``--drain-timeout``
seconds (then 503), then the process exits 0. If the engine dies (an exception escapes the model
thread's scheduler loop, or with ``--max-pass-timeout S`` one model step runs longer than S seconds),
at any point up to the final stop, every request gets 503 and the process exits 70
(``front.EXIT_ENGINE_DEAD``; a wedged model thread through ``exit_if_stuck``'s hard exit).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from typing import NoReturn

from ..server.config import ServeConfig, check_api_key
from ..server.listen import listen_sockets

#: what ``acarerank serve`` needs beyond the base install (the ``serve`` extra)
SERVE_MODULES = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "msgspec")


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" where the help does not already say its default, and never
    "(default: None)": an unset flag's help says what unset means."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="HTTP rerank server: /v1/rerank (Cohere/Jina/vLLM/TEI bodies), /v1/select",
                       formatter_class=_DefaultsFormatter)
    ServeConfig.add_cli_args(p)
    p.set_defaults(run=run)


def missing_serve_modules() -> list:
    missing = []
    for name in SERVE_MODULES:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except (ImportError, ValueError):   # a broken install, or an import blocked on purpose
            missing.append(name)
    return missing


def check_listen(host: str, port: int) -> None:
    """Bind ``host``:``port`` as uvicorn will and let go, before the model loads
    (``acarerank.server.listen.listen_sockets``: ValueError, OSError naming the flags). An unknown
    host, a port in use or one this user may not bind failed after the whole load, in uvicorn's
    words and its exit status 3. ``run_server`` binds it again after the load, refusing a port
    taken in between in the same words."""
    for sock in listen_sockets(host, port):
        sock.close()


def _token_wait(seconds) -> str:
    """The start-up line's note on how long a request waits for room in the token budget."""
    return " (a request waits for room with no limit)" if seconds is None else f" (a request waits up to {seconds:g} s)"


def run(args) -> int:
    missing = missing_serve_modules()
    if missing:  # one line, no traceback (cli/__init__.py's rule)
        print(f"acarerank serve: error: {', '.join(missing)} not installed: pip install 'acarerank[serve]'",
              file=sys.stderr)
        return 2
    if sys.stdout is None:  # started with stdout closed (>&-, a daemon's): uvicorn's log formatter asks
        # sys.stdout.isatty() (exit 2 after the whole load, "Unable to configure formatter 'default'"),
        # its access log handler and the exits' flushes write there; serve prints no results to lose
        sys.stdout = open(os.devnull, "w")
    from .. import malloc_tuning
    from ..server.build import build_service
    from ..server.front import run_server
    from .common import check_common

    config = ServeConfig.from_cli_args(args)
    check_common(config)   # dtype/device, backend names, the checkpoint folder: before the model loads
    api_key = config.api_key or os.environ.get("ACARERANK_API_KEY") or None  # never printed
    if api_key is not None and config.api_key is None:  # the flag's value is checked by ServeConfig
        check_api_key(api_key, "ACARERANK_API_KEY")
    check_listen(config.host, config.port)
    malloc = malloc_tuning.apply(config.malloc)   # before the model's first allocation
    t0 = time.perf_counter()
    service = None
    try:
        service = build_service(config)
        service.start(warmup=True)
        print(f"acarerank serve: model {service.model_name!r} ready in {time.perf_counter() - t0:.1f} s "
              f"(max_batch_tokens {service.engine.max_batch_tokens}, max_queue {service.max_queue}, "
              f"max_queue_tokens {service.max_queue_tokens or 'off'}"
              f"{'' if not service.max_queue_tokens else _token_wait(service.token_wait_timeout)}, "
              f"api key {'on' if api_key else 'off'}; malloc {malloc})", file=sys.stderr)
        return run_server(service, config, api_key=api_key, exit_if_stuck=True)  # this process is ours
    except KeyboardInterrupt:   # before uvicorn's own SIGINT handler (which drains) or after its stop
        if service is None or service.threads():   # a model call still runs: the load, or the started service
            _exit_interrupted()
        raise   # everything stopped (run_server's bounded stop): main's exit 130
    except Exception as e:
        if service is not None and service.threads():   # a start that failed with its model call still running
            _exit_failed_start(e)
        raise   # main's one line and status


def _exit_failed_start(e: Exception) -> NoReturn:
    """A start that failed while a model call still runs — a warm-up step past
    ``--max-pass-timeout`` (the engine died, its step did not return): main's line and status for
    ``e``, now — a runtime error and 1, or for a usage error (``ValueError``: a model too short for
    the warm-up request, whose model thread was told to end but had not yet) 'error:' and 2. Python's
    exit would wait for that thread for ever."""
    from . import _one_line, _usage_errors

    usage = isinstance(e, _usage_errors())
    what = f"error: {_one_line(e)}" if usage else f"runtime error: {type(e).__name__}: {_one_line(e)}"
    print(f"acarerank serve: {what}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2 if usage else 1)


def _exit_interrupted() -> NoReturn:
    """Ctrl-C while the model loads or warms up, or before uvicorn took over SIGINT: exit 130 now,
    as ``main`` would after its one line. The model thread's call cannot be interrupted, and
    Python's exit waits for that thread (the whole load; for ever once the started service's loop
    runs on it); nothing has been served, so there is nothing to drain."""
    print("acarerank serve: interrupted", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)
