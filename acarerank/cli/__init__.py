"""``acarerank`` command line: one module per subcommand.

Each module in ``SUBCOMMANDS`` defines ``add_parser(subparsers)`` (registering its parser
with ``set_defaults(run=...)``) and a ``run(args) -> int``.

Failures: one line on stderr, ``acarerank <command>: error: <what>``, never a traceback.
Exit status 2 for bad usage or input (arguments, files, checkpoint, a backend that cannot
run), 1 for a failure while running (anything else), 130 on Ctrl-C. Arguments and input
files are checked before the model loads.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ("score", "select", "bench", "serve")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (its default prints the whole usage block first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="acarerank", description="Prefix-shared Qwen3 rerankers: score, select, bench, serve.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"acarerank.cli.{name}").add_parser(sub)
    return parser


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text


def main(argv=None) -> int:
    from ..ops._backend import BackendError

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # usage error (one line already printed, 2) or --help (0)
        return e.code if isinstance(e.code, int) else 2
    try:
        return int(args.run(args) or 0)
    except (ValueError, TypeError, OSError, BackendError) as e:  # bad input: one clear line, no traceback
        # OSError covers missing / unreadable files and folders (FileNotFoundError, IsADirectoryError, ...)
        print(f"acarerank {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"acarerank {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a failure while running: still one line
        print(f"acarerank {args.command}: runtime error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
