"""``acarerank`` command line: one module per subcommand, imported only when it is chosen.

``SUBCOMMANDS`` is the static table of names and one-line helps the top-level parser shows,
so ``acarerank --help`` imports no torch, no transformers and no server stack. Each module
defines ``add_parser(subparsers)`` (registering its parser with ``set_defaults(run=...)``) and a
``run(args) -> int``; only the chosen one is imported.

Failures: one line on stderr, ``acarerank <command>: error: <what>``, never a traceback.
Exit status 2 for bad usage or input (arguments, files, checkpoint, a backend that cannot
run, an optional package the command needs that is not installed — the line names the
``pip install 'acarerank[extra]'`` that brings it —, ``score``/``select`` started with stdout closed), 1 for a failure while running (anything
else), 130 on Ctrl-C, 141 (128 + SIGPIPE, as a shell reports a process its closed pipe killed)
without a message when stdout's reader has gone (``| head``). Arguments and input files are
checked before the model loads.
"""
from __future__ import annotations

import _thread
import argparse
import importlib
import os
import signal
import sys
import threading

from .. import __version__

#: subcommand -> one-line help (its module is acarerank.cli.<name>)
SUBCOMMANDS = {
    "score": "score documents against a query (ACARe / Qwen3-Reranker)",
    "select": "select and rank a subset of documents (AdaTutoRank setwise)",
    "bench": "latency vs reranking depth: transformers, transformers+prefix-cache, acarerank",
    "serve": "HTTP rerank server: /v1/rerank (Cohere/Jina/vLLM/TEI bodies), /v1/select",
}

#: optional top-level modules -> the setup.py extra that installs them
EXTRA_OF = {"fastapi": "serve", "uvicorn": "serve", "starlette": "serve", "pydantic": "serve",
            "prometheus_client": "serve", "httpx": "serve", "ray": "ray", "matplotlib": "bench", "scipy": "bench"}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (its default prints the whole usage block first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def chosen_command(argv) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (the top level has no
    option taking a value), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with ``command``'s full parser (its module imported) and a stub for each other
    subcommand (name and help only, nothing imported)."""
    parser = _Parser(prog="acarerank", description="Prefix-shared Qwen3 rerankers: score, select, bench, serve.")
    parser.add_argument("--version", action="version", version=f"acarerank {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, help_line in SUBCOMMANDS.items():
        if name == command:
            importlib.import_module(f"acarerank.cli.{name}").add_parser(sub)
        else:
            sub.add_parser(name, help=help_line, add_help=False)
    return parser


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text


def missing_extra(e: BaseException) -> str | None:
    """For an import of an optional package that is not installed: the line that says which
    package and which extra brings it; else None."""
    if not isinstance(e, ModuleNotFoundError) or not e.name:
        return None
    top = e.name.split(".")[0]
    extra = EXTRA_OF.get(top)
    return f"needs {top}, which is not installed: pip install 'acarerank[{extra}]'" if extra else None


def _usage_errors() -> tuple:
    """Exception types that mean bad usage or input (exit 2). BackendError only if the ops were
    imported: a command that never imported them cannot have raised it (and importing them would
    import torch)."""
    types = (ValueError, TypeError, OSError)  # OSError: missing / unreadable files and folders
    backend = sys.modules.get("acarerank.ops._backend")
    return types + (backend.BackendError,) if backend is not None else types


def _interrupted(e: BaseException) -> bool:
    """Whether a KeyboardInterrupt is among ``e``'s causes and contexts."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _stdout_to_devnull() -> None:
    """Point stdout's descriptor at /dev/null, so the interpreter's last flush cannot fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no descriptor (a test's capture): nothing to flush there
        pass


#: the subcommands whose results are the lines they print (the others write files or serve)
_PRINTS_RESULTS = ("score", "select")


def _in_import(frame) -> bool:
    """Whether ``frame`` runs under an import (a frame of importlib's bootstrap on its stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


class _Interrupts:
    """Ctrl-C while a command runs, made an exit 130 wherever it lands.

    A KeyboardInterrupt raised in the middle of an import leaves a half-initialised module: a
    C extension then fails its next import ("cannot load module more than once per process", exit
    1), transformers rewraps it as ModuleNotFoundError with the interrupt off the chain (exit 1),
    and inside torch's import pybind11 turns it into std::terminate (SIGABRT, no message). So a
    SIGINT inside an import is held: a watcher thread re-posts it once the main thread is out of
    the import (checked every ``RETRY_S``); a second Ctrl-C raises at once, inside an import too
    (one that hangs would hold the first for ever). One raised inside a callback whose exceptions
    Python swallows (a weakref callback, ``__del__``) prints "Exception ignored in ..." and is
    lost: ``sys.unraisablehook`` drops it quietly, and every interrupt seen is exit 130 at the end
    (``main``)."""

    RETRY_S = 0.05

    def __init__(self):
        self.seen = False
        self._installed = False
        self._posting = False  # the next SIGINT is the held one, posted by the watcher
        self._stop = threading.Event()
        self._watcher = None

    def _post_after_import(self):
        main = threading.main_thread().ident
        while not self._stop.wait(self.RETRY_S):
            frame = sys._current_frames().get(main)
            if frame is None or not _in_import(frame):
                self._posting = True
                _thread.interrupt_main()
                return

    def _on_sigint(self, signum, frame):
        posted, self._posting = self._posting, False
        if posted and self._stop.is_set():  # the held one, posted as the command ended: it counted already
            return
        if self.seen and not posted:  # a second Ctrl-C
            self._stop.set()  # it raises now: a watcher still holding the first must not post a third while it unwinds
            raise KeyboardInterrupt
        self.seen = True
        if _in_import(frame):
            self._watcher = threading.Thread(target=self._post_after_import, daemon=True, name="acarerank-ctrl-c")
            self._watcher.start()
            return
        raise KeyboardInterrupt

    def _unraisable(self, unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            self.seen = True
            return
        self._previous_hook(unraisable)

    def __enter__(self):
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        # only where Python's own Ctrl-C handler is in place: a shell's background job ignores
        # SIGINT (SIG_IGN), and signal handlers can be set from the main thread only
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def __exit__(self, *exc):
        sys.unraisablehook = self._previous_hook
        self._stop.set()  # a held Ctrl-C is not posted after the command: Python's handler would raise it at exit
        if self._watcher is not None:
            # it may have decided to post just before the stop (at most RETRY_S to notice it): that
            # post is still pending, and signal.signal runs pending handlers before it swaps them,
            # so it reaches _on_sigint, which drops it, never Python's handler (a traceback)
            self._watcher.join()
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)


class _Stderr:
    """``sys.stderr`` while a command runs: the real stream until a write or flush to it fails
    (OSError: a full disk, a reader that has gone), then /dev/null, and the command carries on.

    Its lines (dtype, NOTEs, progress, the error line) are diagnostics: a failed one raised from
    the first ``print`` (the dtype line, before any result), the error handler's own line failed
    again (exit 1), and a BrokenPipeError from stderr read as stdout's reader leaving (exit 141):
    score/select printed nothing, serve never started. The descriptor is pointed at /dev/null too,
    for native code's writes and the interpreter's exit flush of the real stream's buffer.
    Everything else (``isatty``, ``fileno``, ``encoding``) is the current stream's."""

    def __init__(self, stream):
        self._stream = stream

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError:
            self._to_devnull()
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except OSError:
            self._to_devnull()

    def _to_devnull(self):
        failed, self._stream = self._stream, open(os.devnull, "w")
        try:
            os.dup2(self._stream.fileno(), failed.fileno())
        except (OSError, ValueError, AttributeError):  # no descriptor (a test's capture)
            pass


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if sys.stderr is None:  # started with stderr closed (2>&-): print(file=None) writes to stdout, so
        sys.stderr = open(os.devnull, "w")  # the NOTE, dtype and error lines went in among the JSON results
    command = chosen_command(argv)
    real_stderr = sys.stderr
    sys.stderr = _Stderr(real_stderr)
    try:
        with _Interrupts() as interrupts:
            status = _main(argv, command)
        if interrupts.seen and status != 130:  # an interrupt swallowed or rewrapped on its way out
            print(f"{_label(command)}: interrupted", file=sys.stderr)
            return 130
        return status
    finally:
        if isinstance(sys.stderr, _Stderr):
            sys.stderr = real_stderr


def _label(command: str | None) -> str:
    """``acarerank <command>``, the prefix of the command's stderr lines (``acarerank`` before one is chosen)."""
    return f"acarerank {command}" if command in SUBCOMMANDS else "acarerank"


def _main(argv: list, command: str | None) -> int:
    try:
        parser = build_parser(command if command in SUBCOMMANDS else None)
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage error (one line already printed, 2) or --help (0)
        return e.code if isinstance(e.code, int) else 2
    except KeyboardInterrupt:  # Ctrl-C while the chosen subcommand's module imports
        print(f"{_label(command)}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as e:  # the chosen subcommand's parser needs an extra that is absent
        if _interrupted(e):  # Ctrl-C inside an import that rewraps it (transformers' lazy modules)
            print(f"{_label(command)}: interrupted", file=sys.stderr)
            return 130
        hint = missing_extra(e)
        if hint is None:
            raise
        print(f"acarerank {command}: error: {hint}", file=sys.stderr)
        return 2
    if sys.stdout is None and args.command in _PRINTS_RESULTS:  # started with stdout closed (>&-)
        print(f"acarerank {args.command}: error: stdout is closed: the results would be lost", file=sys.stderr)
        return 2
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print(f"acarerank {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader left (| head): nothing more to say to it, no message (stderr's
        # failed writes never get here: _Stderr takes them)
        _stdout_to_devnull()
        return 141
    except Exception as e:
        if _interrupted(e):  # Ctrl-C inside an import that rewraps it (transformers' lazy modules)
            print(f"acarerank {args.command}: interrupted", file=sys.stderr)
            return 130
        hint = missing_extra(e)
        if hint is not None:
            print(f"acarerank {args.command}: error: {hint}", file=sys.stderr)
            return 2
        if isinstance(e, _usage_errors()):  # bad input: one clear line, no traceback
            print(f"acarerank {args.command}: error: {_one_line(e)}", file=sys.stderr)
            return 2
        # a failure while running: still one line
        print(f"acarerank {args.command}: runtime error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
