"""``acarerank`` command line: one module per subcommand.

Each module in ``SUBCOMMANDS`` defines ``add_parser(subparsers)`` (registering its parser
with ``set_defaults(run=...)``) and a ``run(args) -> int``.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ("score", "select", "bench", "serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="acarerank", description="Prefix-shared Qwen3 rerankers: score, select, bench, serve.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"acarerank.cli.{name}").add_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        print(f"acarerank {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
