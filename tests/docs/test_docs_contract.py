"""The docs as a contract: values README.md and docs/ state — each command's flags and defaults —
are read from the docs and compared with the code, so neither can change alone.

What is read:
- usage lines of ``acarerank SUBCOMMAND`` in fenced shell blocks: every flag of the subcommand must
  be in one, and ``[--flag VALUE]`` with a literal VALUE (not a placeholder such as ``N``, ``PATH``)
  is the flag's default, converted by the flag's own ``type``; a flag with a default other than
  None must be shown with it at least once. Each flag's ``--help`` names its default too.
"""
from __future__ import annotations

import argparse
import re

import pytest

import _repo
from test_docs_commands import DOC_FILES, SHELL_LANGS, fenced_blocks, is_placeholder, shell_commands

ROOT = _repo.ROOT
SUBCOMMANDS = ("score", "select", "bench", "serve")


def _sub(command: str) -> argparse.ArgumentParser:
    from acarerank.cli import build_parser

    parser = build_parser(command)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise LookupError(command)


def _flags(command: str) -> dict:
    """--flag -> its argparse action (help excluded)."""
    return {a.option_strings[-1]: a for a in _sub(command)._actions if a.option_strings and a.dest != "help"}


def usage_lines(command: str):
    """(doc, line, [(flag, value or None, bracketed)]) for each fenced ``acarerank COMMAND`` line."""
    out = []
    for path in DOC_FILES:
        for block in fenced_blocks(path.read_text(), path):
            if block.lang not in SHELL_LANGS:
                continue
            for cmd in shell_commands(block):
                words = cmd.words
                if words[:2] != ["acarerank", command]:
                    continue
                opts, i = [], 2
                while i < len(words):
                    w = words[i]
                    bracketed = w.startswith("[--")
                    flag = w.lstrip("[").rstrip("]")
                    if not flag.startswith("--"):
                        i += 1
                        continue
                    value = None
                    if not w.endswith("]") and i + 1 < len(words) and not words[i + 1].lstrip("[").startswith("--"):
                        value = words[i + 1].rstrip("]") if bracketed else words[i + 1]
                        i += 1
                    opts.append((flag, value, bracketed))
                    i += 1
                out.append((path.relative_to(ROOT), cmd.line, opts))
    return out


def _placeholder(value: str) -> bool:
    """``N``, ``PATH``, and placeholders joined as a value's syntax: ``KEY=VALUE``, ``LOW-HIGH``."""
    return all(is_placeholder(part) for part in re.split(r"[=@-]", value) if part)


def _no_default(action) -> bool:
    """None (set later) or a switch's False (``0 == False``: a default of 0 is a default)."""
    return action.default is None or action.default is False


def _as_default(action, value: str):
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return value
    return action.type(value) if action.type is not None else value


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_flag_is_in_a_usage_line_with_its_default(command):
    """The docs show every flag of ``acarerank COMMAND`` in a usage line, and a literal value there
    is the code's default (so a changed default, or a new flag, changes the docs too)."""
    flags = _flags(command)
    lines = usage_lines(command)
    assert lines, f"no usage line of acarerank {command} in the docs"
    problems, shown, shown_literal = [], set(), set()
    for doc, line, opts in lines:
        for flag, value, bracketed in opts:
            shown.add(flag)
            if not bracketed or value is None or _placeholder(value) or flag not in flags:
                continue
            action = flags[flag]
            shown_literal.add(flag)
            if action.default is None:
                problems.append(f"{doc}:{line}: [{flag} {value}] shows a default, but the code's is None "
                                f"(set later): write a placeholder")
            elif _as_default(action, value) != action.default:
                problems.append(f"{doc}:{line}: [{flag} {value}] is not the default, {action.default!r}")
    for flag, action in flags.items():
        if flag not in shown:
            problems.append(f"acarerank {command} {flag} is in no usage line of the docs")
        elif not _no_default(action) and flag not in shown_literal:
            problems.append(f"acarerank {command} {flag}: no usage line shows its default {action.default!r}")
    assert not problems, "\n".join(problems)


def _default_spellings(default) -> set:
    if isinstance(default, (tuple, list)):
        return {",".join(map(str, default))}
    if isinstance(default, float) and default.is_integer():
        return {str(default), str(int(default)), f"{int(default):,}"}
    if isinstance(default, int) and not isinstance(default, bool):
        return {str(default), f"{default:,}"}
    return {str(default)}


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_flags_help_names_its_default(command):
    """``--help`` is the first doc a user reads: a flag with a default says it."""
    parser = _sub(command)
    missing = []
    for flag, action in _flags(command).items():
        if _no_default(action):
            continue
        text = parser._get_formatter()._expand_help(action)  # with what the formatter class adds
        if not any(s in text for s in _default_spellings(action.default)):
            missing.append(f"{flag} (default {action.default!r}): {action.help!r}")
    assert not missing, f"acarerank {command} --help does not name these defaults:\n" + "\n".join(missing)
