"""The README and docs/ cannot drift from the code: every command line, flag, script path, link
and Python snippet they show is checked here, and a failure names the file, the line and what
is wrong.

What is read: every fenced block of README.md and docs/*.md.
- Shell blocks (```bash / ```sh / ```console / ```shell): lines joined at a trailing ``\\``,
  ``$ `` prompts and ``# comments`` dropped, heredoc bodies skipped, split at ``&&``, ``||``,
  ``;``, ``|``, ``&``, ``$(...)``; leading ``NAME=value`` assignments dropped. Then:
  ``acarerank ...`` / ``python -m acarerank.cli ...`` parse with the CLI's own parser
  (``acarerank.cli.build_parser``), every ``--flag`` spelled exactly as the parser defines it
  (argparse would accept an abbreviation; a doc should not); ``bash scripts/main.sh ...`` is
  ``acarerank bench ...``; ``python bench/X.py --flag`` names flags that ``bench/X.py --help``
  prints; a shell script given by path exists and is given only flags its ``case`` parser
  (or that of a file it sources) accepts; every argument naming a path in the repository
  (``bench/``, ``scripts/``, ``tests/``, ...) exists.
- Commands quoted inline in prose (a code span starting ``acarerank ``, ``python -m acarerank.cli``,
  ``python bench/X.py``, ``bash ``, ``bench/X.sh`` or ``scripts/X.sh``; a span may wrap lines):
  the same checks of flag names and paths, but no full parse, since prose quotes fragments
  (`` `acarerank score` `` alone, `` `--skip pytest --also peers` `` after a command named before).
- Placeholders are values, never flags: ``PATH``, ``N``, ``KEY`` (upper-case words),
  ``...``, ``$VAR``; optional parts written ``[--flag VALUE]`` are checked like the rest.
- Python blocks, run or not: each ``from acarerank... import NAME`` resolves, and the calls and
  attributes of those names (and of objects built from them: ``rr = PointwiseReranker(...)``,
  then ``rr.score(...)``) exist and bind to the code's signatures.
- Python blocks: each is compiled; each runs (in a subprocess, with a timeout) unless the
  line before its fence is a marker ``<!-- docs-test: REASON -->`` with a REASON from
  ``SKIP_REASONS`` (a block that needs a checkpoint, a GPU, a running server, a cluster, or
  that runs a model). An unknown REASON is an error, so a typo cannot skip a block.
- Links ``[text](path)`` and images outside code: a relative path resolves to a file or folder;
  ``#anchor`` names a heading of the target Markdown file (GitHub's anchor rule).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pytest

import _repo

ROOT = _repo.ROOT
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "console", "shell"}
SKIP_REASONS = {"needs checkpoint", "needs gpu", "needs server", "needs cluster", "runs a model"}
#: top-level folders of the repository whose paths a command may name (they must exist)
REPO_DIRS = ("acarerank/", "bench/", "csrc/", "docs/", "examples/", "scripts/", "tests/")
#: shell scripts whose flags are another command's: main.sh passes them to `acarerank bench`;
#: test.sh passes them to pytest (not checked)
FORWARDS_TO = {"scripts/main.sh": ["bench"], "scripts/test.sh": None}
HELP_TIMEOUT_S = 120
RUN_TIMEOUT_S = 120

_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")
_SEPARATORS = {"&&", "||", ";", ";;", "|", "&", "(", ")", "$(", "|&"}
_REDIRECTS = {">", ">>", "<", ">&", "&>", "<<<", "2>", "2>>", "&>>"}
_PREFIX_WORDS = {"env", "time", "nohup", "exec", "command"}


# --------------------------------------------------------------------------- reading the docs

@dataclass
class Block:
    path: Path
    line: int            # 1-based line of the block's first content line
    lang: str
    text: str
    marker: Optional[str]  # the docs-test marker on the line before the fence, if any


def fenced_blocks(text: str, path: Path) -> List[Block]:
    """Every fenced code block of a Markdown text, with its language and marker."""
    lines = text.split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(2), m.group(3).lower()
        marker = None
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j >= 0:
            mm = _MARKER.match(lines[j])
            marker = mm.group(1) if mm else None
        body, k = [], i + 1
        while k < len(lines) and not lines[k].strip().startswith(fence):
            body.append(lines[k])
            k += 1
        blocks.append(Block(path, i + 2, lang, "\n".join(body), marker))
        i = k + 1
    return blocks


@dataclass
class Command:
    line: int             # 1-based line in the doc file
    words: List[str]


def shell_commands(block: Block) -> List[Command]:
    """The simple commands of a shell block (see the module docstring for the rules)."""
    raw = block.text.split("\n")
    logical, i = [], 0
    heredoc_end = None
    while i < len(raw):
        start, line = i, raw[i]
        i += 1
        if heredoc_end is not None:
            if line.strip() == heredoc_end:
                heredoc_end = None
            continue
        stripped = line.lstrip()
        if block.lang == "console":
            if not stripped.startswith("$ "):
                continue  # output, not a command
        if stripped.startswith("$ "):
            stripped = stripped[2:]
        text = stripped
        while text.rstrip().endswith("\\") and i < len(raw):
            text = text.rstrip()[:-1] + " " + raw[i].strip()
            i += 1
        m = _HEREDOC.search(text)
        if m:
            heredoc_end = m.group(2)
            text = text[:m.start()]
        logical.append((block.line + start, text))
    commands = []
    for line_no, text in logical:
        lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens = list(lexer)
        except ValueError as e:  # unbalanced quotes
            commands.append(Command(line_no, ["<unparsable>", str(e), text]))
            continue
        words: List[str] = []
        skip_next = False
        for tok in tokens + [";"]:
            if skip_next:
                skip_next = False
                continue
            if tok in _REDIRECTS or (tok and set(tok) <= set("<>&") and tok != "&"):
                skip_next = True
                continue
            if tok in _SEPARATORS or (tok and set(tok) <= set(";&|()")):
                if words:
                    commands.append(Command(line_no, words))
                words = []
                continue
            if tok.endswith("=$"):  # NAME=$(...): the assignment goes, the command inside stays
                continue
            words.append(tok)
    return [c for c in (_drop_prefixes(c) for c in commands) if c.words]


def _drop_prefixes(cmd: Command) -> Command:
    words = list(cmd.words)
    while words and (_ASSIGN.match(words[0]) or words[0] in _PREFIX_WORDS or words[0] in ("export", "sudo")):
        if words[0] == "export" and len(words) > 1 and _ASSIGN.match(words[1]):
            words = []
            break
        words = words[1:]
    return Command(cmd.line, words)


def is_placeholder(word: str) -> bool:
    """A value written as a placeholder: PATH, N, KEY, DIR, "...", $VAR, <name>."""
    w = word.strip("[]")
    return (bool(re.fullmatch(r"[A-Z][A-Z0-9_]*", w)) or "..." in w or "…" in w or w.startswith("$")
            or (w.startswith("<") and w.endswith(">")))


def _unbracket(words: List[str]) -> List[str]:
    """``[--flag VALUE]`` (optional parts of a usage line) read as ``--flag VALUE``."""
    out = []
    for w in words:
        w = w[1:] if w.startswith("[-") else w             # "[--flag" -> "--flag"
        w = w[:-1] if w.endswith("]") and not w.startswith("[") else w  # "VALUE]" -> "VALUE"; "[4]" stays
        if w:
            out.append(w)
    return out


# --------------------------------------------------------------------------- the CLI's parser

class _Tolerant:
    """An argparse ``type``/``choices`` wrapper that lets placeholders through unconverted."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, value):
        return value if is_placeholder(value) else self.inner(value)

    def __contains__(self, value):
        return (isinstance(value, str) and is_placeholder(value)) or value in self.inner

    def __iter__(self):
        return iter(self.inner)


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise LookupError(name)


def check_cli(args: List[str], full_parse: bool = True) -> List[str]:
    """Problems of ``acarerank ARGS`` against the CLI's own parser ([] when it parses). Without
    ``full_parse`` only the subcommand and the flag names are checked (a fragment quoted in prose)."""
    from acarerank.cli import SUBCOMMANDS, build_parser, chosen_command

    args = _unbracket(args)
    command = chosen_command(args)
    if command is None:
        return [] if any(a in ("-h", "--help") for a in args) or not full_parse else ["no subcommand"]
    if is_placeholder(command):  # python -m acarerank.cli ...
        return []
    if command not in SUBCOMMANDS:
        return [f"unknown subcommand {command!r} (known: {', '.join(SUBCOMMANDS)})"]
    parser = build_parser(command)
    sub = _subparser(parser, command)
    problems = []
    for a in args[args.index(command) + 1:]:
        if a == "--":
            break
        if a.startswith("--") and a.split("=", 1)[0] not in sub._option_string_actions:
            problems.append(f"acarerank {command} has no flag {a.split('=', 1)[0]}")
    if problems or not full_parse:
        return problems
    for action in sub._actions:
        if action.type is not None:
            action.type = _Tolerant(action.type)
        if action.choices is not None:
            action.choices = _Tolerant(action.choices)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            parser.parse_args(args)
        except SystemExit as e:
            if e.code not in (0, None):
                return [f"acarerank {command}: {err.getvalue().strip() or 'usage error'}"]
    return []


# --------------------------------------------------------------------------- scripts

@functools.lru_cache(maxsize=None)
def python_script_flags(rel: str) -> tuple:
    """(flags that ``python REL --help`` prints, error or None)."""
    try:
        r = subprocess.run([sys.executable, str(ROOT / rel), "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=HELP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return frozenset(), f"python {rel} --help took over {HELP_TIMEOUT_S} s"
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return frozenset(), f"python {rel} --help failed (exit {r.returncode}): {tail[0]}"
    return frozenset(re.findall(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)", r.stdout)), None


_ADD_ARGUMENT = re.compile(r"add_argument\(\s*(?:[\"'](?:-\w)[\"']\s*,\s*)?[\"'](--[\w-]+)[\"']")


def python_flag_problems(rel: str, flags: List[str]) -> List[str]:
    """Flags ``python REL`` does not accept. A flag the script itself declares
    (``add_argument("--flag", ...)`` in its source) needs nothing run; any other is looked up in
    what ``python REL --help`` prints (a parser built elsewhere, or a flag that is gone)."""
    declared = set(_ADD_ARGUMENT.findall((ROOT / rel).read_text()))
    unsure = [f for f in flags if f not in declared]
    if not unsure:
        return []
    known, error = python_script_flags(rel)
    if error:
        return [error]
    return [f"python {rel} has no flag {f}" for f in unsure if f not in known]


_CASE_FLAG = re.compile(r"^\s*((?:-{1,2}[\w-]+(?:=\*)?\s*\|\s*)*-{1,2}[\w-]+(?:=\*)?)\s*\)", re.M)
_SOURCE = re.compile(r"^\s*(?:source|\.)\s+[^\n]*?([\w.-]+\.sh)\b", re.M)


@functools.lru_cache(maxsize=None)
def shell_script_flags(rel: str) -> frozenset:
    """The options a shell script's ``case`` parser accepts (its own and those of the files it
    sources from its folder)."""
    path = ROOT / rel
    text = path.read_text()
    flags = set()
    for m in _CASE_FLAG.finditer(text):
        for alt in m.group(1).split("|"):
            flags.add(alt.strip().removesuffix("=*"))
    for m in _SOURCE.finditer(text):
        sibling = path.parent / m.group(1)
        if sibling.is_file():
            flags |= shell_script_flags(str(sibling.relative_to(ROOT)))
    return frozenset(flags)


def _flags_of(words: List[str]) -> List[str]:
    return [w.split("=", 1)[0] for w in _unbracket(words) if w.startswith("--") and w != "--"]


def _repo_path(word: str) -> Optional[str]:
    w = word.strip("[]").split("::", 1)[0].rstrip(",")
    if w.startswith("./"):
        w = w[2:]
    return w if w.startswith(REPO_DIRS) and not is_placeholder(w) else None


def check_command(words: List[str], full_parse: bool = True) -> List[str]:
    """Problems of one simple command from a doc ([] when it matches the code); ``full_parse``:
    as ``check_cli``'s."""
    if words[0] == "<unparsable>":
        return [f"cannot split the line: {words[1]}: {words[2]}"]
    problems = []
    for w in words[1:]:
        p = _repo_path(w)
        if p and not (ROOT / p).exists():
            problems.append(f"no such file in the repository: {p}")
    head = words[0]
    if head == "acarerank":
        return problems + check_cli(words[1:], full_parse)
    if head in ("python", "python3") or head.endswith("/python"):
        rest = words[1:]
        if rest[:2] == ["-m", "acarerank.cli"]:
            return problems + check_cli(rest[2:], full_parse)
        if rest and rest[0].endswith(".py") and _repo_path(rest[0]):
            rel = _repo_path(rest[0])
            if not (ROOT / rel).is_file():
                return problems
            return problems + python_flag_problems(rel, _flags_of(rest[1:]))
        return problems  # python -c, python -, python -m pytest ...: not checked
    if head in ("bash", "sh"):
        if len(words) < 2 or words[1].startswith("-"):
            return problems
        script, rest = words[1], words[2:]
    elif head.endswith(".sh"):
        script, rest = head, words[1:]
    else:
        return problems  # curl, ray, kill, cd, ...: not ours
    rel = _repo_path(script) or script
    if not (ROOT / rel).is_file():
        return problems if _repo_path(script) else problems + [f"no such script: {script}"]
    if rel in FORWARDS_TO:
        target = FORWARDS_TO[rel]
        return problems + (check_cli(target + rest, full_parse) if target is not None else [])
    known = shell_script_flags(rel)
    return problems + [f"{rel} accepts no flag {f} (it accepts: {', '.join(sorted(known)) or 'none'})"
                       for f in _flags_of(rest) if f not in known]


# --------------------------------------------------------------------------- links

def github_anchors(text: str) -> set:
    """The anchors GitHub gives a Markdown file's headings (duplicates get -1, -2, ...)."""
    anchors, seen = set(), {}
    in_code = False
    for line in text.split("\n"):
        if _FENCE.match(line):
            in_code = not in_code
            continue
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if in_code or not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(2))  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _prose_lines(text: str) -> List[tuple]:
    """(line number, line) of the text outside fenced blocks."""
    out, in_code = [], False
    for n, line in enumerate(text.split("\n"), 1):
        if _FENCE.match(line):
            in_code = not in_code
            continue
        if not in_code:
            out.append((n, line))
    return out


def _prose(text: str) -> List[tuple]:
    """(line number, line) of the text outside fenced blocks, inline code blanked."""
    return [(n, re.sub(r"`[^`]*`", "", line)) for n, line in _prose_lines(text)]


#: a link or image: its text may wrap onto the next lines of its paragraph (never across a blank
#: line, never holding a bracket), its target may not
_LINK = re.compile(r"!?\[(?:[^\[\]\n]|\n(?![ \t]*\n))*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def check_links(text: str, path: Path) -> List[str]:
    """'LINE: problem' for each relative link or image that does not resolve (LINE: where its
    target is)."""
    prose = [""] * len(text.split("\n"))
    for n, line in _prose(text):
        prose[n - 1] = line
    joined = "\n".join(prose)
    problems = []
    for m in _LINK.finditer(joined):
        target, n = m.group(1), joined.count("\n", 0, m.start(1)) + 1
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{n}: link {target!r}: no such file or folder")
            continue
        if anchor and dest.suffix == ".md" and anchor not in github_anchors(dest.read_text()):
            problems.append(f"{n}: link {target!r}: {dest.name} has no heading with anchor #{anchor}")
    return problems


# --------------------------------------------------------------------------- per-file checks

def command_problems(text: str, path: Path) -> List[str]:
    """'LINE: problem' for every command of every shell block in a Markdown text."""
    problems = []
    for block in fenced_blocks(text, path):
        if block.lang not in SHELL_LANGS:
            continue
        for cmd in shell_commands(block):
            problems += [f"{cmd.line}: {p}   [{' '.join(cmd.words)[:120]}]" for p in check_command(cmd.words)]
    return problems


_INLINE_COMMAND = re.compile(r"^(acarerank |python3? (-m acarerank\.cli|bench/|scripts/)|bash |bench/\S*\.sh|scripts/\S*\.sh)")


def inline_command_problems(text: str, path: Path) -> List[str]:
    """'LINE: problem' for every command quoted in a code span of the prose (flag names and paths;
    LINE: where the span starts)."""
    prose = [""] * len(text.split("\n"))
    for n, line in _prose_lines(text):
        prose[n - 1] = line
    joined = "\n".join(prose)
    problems = []
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", joined):
        span = " ".join(m.group(1).split())
        if not _INLINE_COMMAND.match(span):
            continue
        line = joined.count("\n", 0, m.start()) + 1
        for cmd in shell_commands(Block(path, line, "bash", span, None)):
            problems += [f"{line}: {p}   [`{span[:120]}`]" for p in check_command(cmd.words, full_parse=False)]
    return problems


def python_problems(text: str, path: Path, run: bool = True) -> List[str]:
    """'LINE: problem' for every Python block: a syntax error, an unknown marker, or (unmarked
    blocks) a failure to run."""
    problems = []
    for block in fenced_blocks(text, path):
        if block.lang not in ("python", "py"):
            continue
        try:
            compile(block.text, f"{path.name}:{block.line}", "exec")
        except SyntaxError as e:
            problems.append(f"{block.line + (e.lineno or 1) - 1}: Python syntax error: {e.msg}")
            continue
        if block.marker is not None:
            if block.marker not in SKIP_REASONS:
                problems.append(f"{block.line - 2}: unknown docs-test marker {block.marker!r} "
                                f"(known: {', '.join(sorted(SKIP_REASONS))})")
            continue
        if not run:
            continue
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        try:
            r = subprocess.run([sys.executable, "-c", block.text], cwd=ROOT, capture_output=True, text=True,
                               timeout=RUN_TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired:
            problems.append(f"{block.line}: Python block ran over {RUN_TIMEOUT_S} s (mark it: "
                            f"<!-- docs-test: runs a model -->, or make it only import and construct)")
            continue
        if r.returncode != 0:
            tail = r.stderr.strip().splitlines()[-1:] or ["(no output)"]
            problems.append(f"{block.line}: Python block failed (exit {r.returncode}): {tail[0]}")
    return problems


def _signature(obj):
    """The signature a call of ``obj`` binds to (a class: its ``__init__``'s), or None where it
    cannot say (a builtin, ``**kwargs``: anything goes)."""
    import inspect

    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return sig


def _instance_attribute(cls, name: str) -> bool:
    """Whether a method of ``cls`` (or of a base in the package) sets ``self.NAME``."""
    import inspect

    for base in inspect.getmro(cls):
        if base.__module__.split(".")[0] != "acarerank":
            continue
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]*)?=(?!=)", source):
            return True
    return False


def python_api_problems(text: str, path: Path) -> List[str]:
    """'LINE: problem' for the package names every Python block uses, run or not (a block marked
    ``needs checkpoint`` or ``runs a model`` is only compiled, so a renamed class or keyword there
    passed): each ``from acarerank... import NAME`` resolves, and each call of such a name, of its
    attributes (``PointwiseReranker.from_pretrained``) or of a method of an object one built
    (``rr = PointwiseReranker(...)``, then ``rr.score(...)``) names attributes that exist and binds
    its arguments to the signature (no unknown keyword, no more positional arguments than it takes)."""
    import ast
    import importlib
    import inspect

    problems = []
    for block in fenced_blocks(text, path):
        if block.lang not in ("python", "py"):
            continue
        try:
            tree = ast.parse(block.text)
        except SyntaxError:
            continue  # python_problems reports it
        names = {}      # local name -> an object of the package (module, class, function)
        instances = {}  # local name -> the class of the object it holds

        def where(node):
            return block.line + node.lineno - 1

        def resolve(node):
            """(object, its class when it is an instance built here) for a Name / Attribute, or None."""
            if isinstance(node, ast.Name):
                if node.id in names:
                    return names[node.id], None
                if node.id in instances:
                    return None, instances[node.id]
                return None
            if isinstance(node, ast.Attribute):
                base = resolve(node.value)
                if base is None:
                    return None
                obj, cls = base
                owner = obj if obj is not None else cls
                if hasattr(owner, node.attr):
                    return getattr(owner, node.attr), None
                if obj is None and _instance_attribute(cls, node.attr):
                    return None  # set in a method (self.NAME = ...): no object to look into
                problems.append(f"{where(node)}: {getattr(owner, '__name__', owner)!s} has no attribute "
                                f"{node.attr!r}")
            return None

        def built_class(value):
            """The class an expression builds: ``Cls(...)`` or a classmethod ``Cls.from_x(...)`` of it."""
            if not isinstance(value, ast.Call):
                return None
            f = value.func
            if isinstance(f, ast.Name) and inspect.isclass(names.get(f.id)):
                return names[f.id]
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and inspect.isclass(names.get(f.value.id)):
                cls = names[f.value.id]
                if isinstance(inspect.getattr_static(cls, f.attr, None), classmethod):
                    return cls
            return None

        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "acarerank":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        problems.append(f"{where(node)}: {node.module} has no {alias.name!r}")
                    else:
                        names[alias.asname or alias.name] = getattr(module, alias.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                pairs = []
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        pairs.append((target, node.value))
                    elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs += list(zip(target.elts, node.value.elts))
                for target, value in pairs:
                    cls = built_class(value)
                    if isinstance(target, ast.Name) and cls is not None:
                        instances[target.id] = cls
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        calls = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        for node in ast.walk(tree):   # attributes read or set outside a call (``rr.runner.x = ...``)
            if isinstance(node, ast.Attribute) and id(node) not in inner and id(node) not in calls:
                resolve(node)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            found = resolve(node.func)
            if found is None or found[0] is None:
                continue
            sig = _signature(found[0])
            if sig is None or any(isinstance(a, ast.Starred) for a in node.args):
                continue
            try:
                sig.bind_partial(*node.args, **{k.arg: k.value for k in node.keywords if k.arg})
            except TypeError as e:
                problems.append(f"{where(node)}: {ast.unparse(node.func)}(...): {e}")
    return problems


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _report(path: Path, problems: List[str]) -> str:
    return f"{_rel(path)} does not match the code:\n" + "\n".join(f"  {_rel(path)}:{p}" for p in problems)


@pytest.mark.parametrize("path", DOC_FILES, ids=_rel)
def test_doc_commands_match_the_code(path):
    problems = command_problems(path.read_text(), path)
    assert not problems, _report(path, problems)


@pytest.mark.parametrize("path", DOC_FILES, ids=_rel)
def test_doc_inline_commands_match_the_code(path):
    problems = inline_command_problems(path.read_text(), path)
    assert not problems, _report(path, problems)


@pytest.mark.parametrize("path", DOC_FILES, ids=_rel)
def test_doc_links_resolve(path):
    problems = check_links(path.read_text(), path)
    assert not problems, _report(path, problems)


@pytest.mark.parametrize("path", DOC_FILES, ids=_rel)
def test_doc_python_blocks_use_names_and_arguments_the_package_has(path):
    problems = python_api_problems(path.read_text(), path)
    assert not problems, _report(path, problems)


@pytest.mark.parametrize("path", DOC_FILES, ids=_rel)
def test_doc_python_blocks_run(path):
    problems = python_problems(path.read_text(), path)
    assert not problems, _report(path, problems)


def test_docs_show_commands_at_all():
    """The checks above read something: the README's two commands and the CLI lines are found."""
    readme = ROOT / "README.md"
    seen = [" ".join(c.words) for b in fenced_blocks(readme.read_text(), readme) if b.lang in SHELL_LANGS
            for c in shell_commands(b)]
    assert "bash scripts/main.sh" in seen and "bash scripts/test.sh" in seen, seen
    assert any(s.startswith("acarerank score ") for s in seen), seen
    assert any(s.startswith("acarerank serve") for s in seen), seen


#: the README's first screen: what a newcomer reads before scrolling (a terminal or a GitHub page)
README_FIRST_SCREEN_LINES = 60


def readme_first_screen_problems(text: str, path: Path) -> List[str]:
    """What the README's first ``README_FIRST_SCREEN_LINES`` lines lack: the two set-up commands
    (the main job, the tests), a serve example that asks the server something, and a Python
    example that scores."""
    head = "\n".join(text.split("\n")[:README_FIRST_SCREEN_LINES])
    blocks = fenced_blocks(head + "\n```\n", path)  # a block cut by the limit still counts, closed
    shell = [" ".join(c.words) for b in blocks if b.lang in SHELL_LANGS for c in shell_commands(b)]
    python = [b.text for b in blocks if b.lang in ("python", "py")]
    problems = [f"no `{cmd}`" for cmd in ("bash scripts/main.sh", "bash scripts/test.sh") if cmd not in shell]
    if not any(s.startswith("acarerank serve") for s in shell) or not any(s.startswith("curl ") for s in shell):
        problems.append("no serve example (`acarerank serve` and a request to it)")
    if not any(re.search(r"\.(score|rerank)\(", b) for b in python):
        problems.append("no Python example that scores (`.score(` or `.rerank(`)")
    return [f"first {README_FIRST_SCREEN_LINES} lines: {p}" for p in problems]


def test_readme_first_screen_has_the_two_commands_and_one_serve_and_one_python_example():
    readme = ROOT / "README.md"
    problems = readme_first_screen_problems(readme.read_text(), readme)
    assert not problems, _report(readme, problems)


def test_readme_headline_figures_are_in_benchmarks_md():
    """Every figure of the README's results table (ms, tokens/s, ratios, dates) is in
    docs/benchmarks.md's "Summary" table, whose rows point at the command, versions and machine:
    a re-measured figure changes both."""
    readme = (ROOT / "README.md").read_text()
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    start = text.index("\n## Summary\n")
    bench = text[start:text.index("\n## ", start + 1)]
    rows = [line for line in readme.split("\n") if line.startswith("|") and re.search(r"\*\*[\d.]+×", line)]
    assert rows, "no results table (rows with a **N×** ratio) in README.md"
    missing = []
    for row in rows:
        for figure in re.findall(r"\d{4}-\d{2}-\d{2}|\d+(?:,\d{3})*(?:\.\d+)?×?", row):
            if len(figure.strip("×")) > 1 and figure not in bench:
                missing.append(f"{figure!r} in {row[:90]!r}")
    assert not missing, "README figures not in docs/benchmarks.md's Summary:\n" + "\n".join(missing)


# --------------------------------------------------------------------------- the checker can fail

FAKE = ROOT / "docs" / "fake.md"


def _one_block(lang: str, body: str, marker: str = "") -> str:
    return f"Some text.\n\n{marker}\n```{lang}\n{body}\n```\n"


@pytest.mark.parametrize("body, expected", [
    ("acarerank score --query q --docs d.jsonl --top-k 3", "acarerank score has no flag --top-k"),
    ("acarerank score --query q --docs d.jsonl --top 3", "acarerank score has no flag --top"),  # an abbreviation
    ("acarerank serve --port 8000 \\\n    --max-batch 4", "acarerank serve has no flag --max-batch"),
    ("$ FOO=1 acarerank select --query q --docs d.jsonl --max-selected 3", "acarerank select has no flag --max-selected"),
    ("acarerank score --docs d.jsonl", "the following arguments are required: --query"),
    ("acarerank score --query q --docs d --dtype float64", "invalid choice: 'float64'"),
    ("acarerank rank --query q", "unknown subcommand 'rank'"),
    ("bash scripts/main.sh --quick --depth 10", "acarerank bench has no flag --depth"),
    ("bash bench/gpu_check.sh --plans", "bench/gpu_check.sh accepts no flag --plans"),
    ("URL=$(bench/peers/vllm_cpu.sh --preset tiny-cpu --thread 0-1)", "bench/peers/vllm_cpu.sh accepts no flag --thread"),
    ("bash scripts/mian.sh", "no such file in the repository: scripts/mian.sh"),
    ("python bench/bench_nothing.py --x 1", "no such file in the repository: bench/bench_nothing.py"),
])
def test_checker_reports_a_wrong_flag_or_path(body, expected):
    problems = command_problems(_one_block("bash", body), FAKE)
    assert any(expected in p for p in problems), f"expected {expected!r} in {problems}"
    assert all(p.split(":", 1)[0] == "5" for p in problems), problems  # the line of the command in the doc


@pytest.mark.parametrize("body", [
    "acarerank score --model PATH --query \"...\" --docs docs.jsonl [--question ...] [--top-n N] [--max-length L]",
    "acarerank serve [--model PATH] [--port 8000] [--max-batch-tokens N] [--api-key KEY] &",
    "$ acarerank bench --depths 10,20 --modes M0,M3 --dtype float32,auto   # a comment --not-a-flag",
    "export PYTHON=$(which python)\nM=~/x\nURL_V=$(bench/peers/vllm_cpu.sh --preset qwen3-reranker-0.6b --threads 0-1)",
    "until curl -sf localhost:8000/ready > /dev/null; do sleep 1; done\nkill %1",
    "python - <<'PY'\nimport sys\nprint('--not-a-flag')\nPY",
    "bash bench/gpu_check.sh --skip=bench --also kernels,agent --deadline 900",
])
def test_checker_accepts_what_parses(body):
    assert command_problems(_one_block("bash", body), FAKE) == []


def test_checker_reports_inline_commands():
    """A command quoted in prose: its flags and paths are checked, fragments are not parsed whole."""
    text = ("Run `acarerank score --query q --docs d.jsonl\n--top-k 3` first; `acarerank serve` alone is\n"
            "fine, as is `python -m acarerank.cli ...`; `python bench/bench_setwise.py --pool-size 10` is not,\n"
            "nor `bash scripts/mian.sh`, nor `acarerank bench --depths 10 --depth 20`.\n"
            "```bash\nacarerank score --not-inline 1\n```\n")
    problems = inline_command_problems(text, FAKE)
    assert any(p.startswith("1: acarerank score has no flag --top-k") for p in problems), problems
    assert any(p.startswith("3: python bench/bench_setwise.py has no flag --pool-size") for p in problems), problems
    assert any(p.startswith("4: no such file in the repository: scripts/mian.sh") for p in problems), problems
    assert any(p.startswith("4: acarerank bench has no flag --depth ") for p in problems), problems
    assert len(problems) == 4, problems  # the fenced block is test_doc_commands_match_the_code's


def test_checker_reports_a_python_script_flag():
    """``python bench/X.py --flag``: the flag must be one that the script's --help prints."""
    problems = command_problems(_one_block("bash", "python bench/bench_setwise.py --repeats 2 --pool-size 10"), FAKE)
    assert any("python bench/bench_setwise.py has no flag --pool-size" in p for p in problems), problems
    assert command_problems(_one_block("bash", "python bench/bench_setwise.py --repeats 2"), FAKE) == []


def test_checker_reports_python_blocks():
    bad = _one_block("python", "import acarerank\nraise SystemExit('boom')")
    assert any("Python block failed" in p and "boom" in p for p in python_problems(bad, FAKE)), python_problems(bad, FAKE)
    assert any("syntax error" in p for p in python_problems(_one_block("python", "def f(:"), FAKE))
    typo = _one_block("python", "x = 1", "<!-- docs-test: needs chekpoint -->")
    assert any("unknown docs-test marker" in p for p in python_problems(typo, FAKE))
    skipped = _one_block("python", "raise SystemExit(1)", "<!-- docs-test: needs gpu -->")
    assert python_problems(skipped, FAKE) == []


def test_checker_reports_links():
    text = ("See [serving](serving.md#errors), [gone](nowhere.md), [bad anchor](serving.md#no-such-heading),\n"
            "![plot](bench-tiny-cpu.png) and [web](https://example.com); `[code](not/checked.md)`.\n")
    problems = check_links(text, FAKE)
    assert any("'nowhere.md': no such file" in p for p in problems), problems
    assert any("#no-such-heading" in p for p in problems), problems
    assert len(problems) == 2, problems


def test_checker_reports_links_whose_text_wraps_a_line():
    """Markdown lets a link's text run onto the next line of its paragraph (docs/cpu.md's
    '[ARCHITECTURE.md,\\n"Linear layers"](...)'): such a link is checked like any other, and a
    bracket closed paragraphs later is no link."""
    text = ("See [serving.md, \"A dead\nengine\"](serving.md#no-such-heading) and [the\n"
            "missing file](nowhere.md); [a range, 2**64); past\n\nit ![plot](bench-tiny-cpu.png).\n"
            "[fine,\nwrapped](serving.md#errors)\n")
    problems = check_links(text, FAKE)
    assert any(p.startswith("2: link 'serving.md#no-such-heading'") for p in problems), problems
    assert any(p.startswith("3: link 'nowhere.md': no such file") for p in problems), problems
    assert len(problems) == 2, problems


def test_github_anchors():
    text = "# A b\n## Beside vLLM and llama.cpp\n## `x` (y / z)\n## A b\n```\n# not a heading\n```\n"
    assert github_anchors(text) == {"a-b", "beside-vllm-and-llamacpp", "x-y--z", "a-b-1"}


@pytest.mark.parametrize("drop, expected", [
    ("bash scripts/test.sh", "no `bash scripts/test.sh`"),
    ("acarerank serve", "no serve example"),
    ("rr.rerank(", "no Python example that scores"),
])
def test_checker_reports_a_first_screen_without_an_essential(drop, expected):
    text = ("# x\n\n```bash\nbash scripts/main.sh\nbash scripts/test.sh\n```\n\n"
            "```bash\nacarerank serve --port 8000 &\ncurl -s localhost:8000/v1/rerank\n```\n\n"
            "```python\nprint(rr.rerank(\"q\", docs))\n```\n")
    assert readme_first_screen_problems(text, FAKE) == []
    problems = readme_first_screen_problems(text.replace(drop, "echo"), FAKE)
    assert any(expected in p for p in problems), problems
    pushed_down = "\n" * README_FIRST_SCREEN_LINES + text
    assert len(readme_first_screen_problems(pushed_down, FAKE)) == 4


@pytest.mark.parametrize("body, expected", [
    ("from acarerank import PointwiseRanker", "acarerank has no 'PointwiseRanker'"),
    ("from acarerank import PointwiseReranker\nrr = PointwiseReranker(model=None, max_len=512)",
     "PointwiseReranker(...): got an unexpected keyword argument 'max_len'"),
    ("from acarerank import SetwiseReranker\nsr = SetwiseReranker.from_pretrained('p')\nsr.select('q', [], max_selected=2)",
     "sr.select(...): got an unexpected keyword argument 'max_selected'"),
    ("from acarerank.model import Qwen3Runner\na, b = Qwen3Runner.from_hf(m), Qwen3Runner.from_hf(m)\nb.min_prefill_pass = 4",
     "Qwen3Runner has no attribute 'min_prefill_pass'"),
    ("from acarerank.ato import rescore\nrescore(s, t, q, tok, 128, 'floor', -20.0, True, 1.0, None, None, None, None, 1)",
     "rescore(...): too many positional arguments"),
])
def test_checker_reports_a_python_name_or_argument_the_package_lacks(body, expected):
    """Blocks that never run (a checkpoint, a model run) are checked too: the marker does not hide
    a renamed class, keyword or attribute."""
    text = _one_block("python", body, "<!-- docs-test: needs checkpoint -->")
    problems = python_api_problems(text, FAKE)
    assert any(expected in p for p in problems), f"expected {expected!r} in {problems}"
    ok = _one_block("python", "from acarerank import SetwiseReranker\nsr = SetwiseReranker(model=None)\n"
                              "sr.select('q', ['a'], intent=None, max_select=2)")
    assert python_api_problems(ok, FAKE) == []
