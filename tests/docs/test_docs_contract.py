"""The docs as a contract: values README.md and docs/ state — each command's flags and defaults,
the HTTP endpoints, the response fields, the metric names and labels, the environment variables —
are read from the docs and compared with the code, so neither can change alone.

What is read:
- usage lines of ``acarerank SUBCOMMAND`` in fenced shell blocks: every flag of the subcommand must
  be in one, and ``[--flag VALUE]`` with a literal VALUE (not a placeholder such as ``N``, ``PATH``)
  is the flag's default, converted by the flag's own ``type``; a flag with a default other than
  None must be shown with it at least once. Each flag's ``--help`` names its default too.
- serving.md's "Limits and timeouts" table (`` `--flag` VALUE``, units MiB and s) against ``ServeConfig``.
- serving.md's endpoint table against the routes of ``create_app``; its response shapes against the
  pydantic response models.
- every ``acarerank_*`` metric named in serving.md (``{a,b}`` expanded; a trailing ``{x,y}`` is the
  label names) against ``ServerMetrics``, both ways.
- install.md's environment-variable table against the ``ACARERANK_*`` variables the package,
  setup.py, csrc/, bench/ and scripts/ read, both ways; its "Dependencies" against every lowest
  version setup.py and pyproject.toml ask for.
"""
from __future__ import annotations

import argparse
import re
from types import SimpleNamespace

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


# --------------------------------------------------------------------------- serving.md

SERVING = ROOT / "docs" / "serving.md"


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def _table_rows(section: str):
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.split("\n")
            if line.startswith("|") and not line.startswith("|---")][1:]


# inf: a timeout whose default is no limit (--max-pass-timeout); float() reads it
_LIMIT = re.compile(r"`(--[\w-]+)` (none|inf|[\d,.]+)( MiB| s)?")


def test_limits_table_is_the_serve_defaults():
    from acarerank.server.config import MAX_HEAD_BYTES, ServeConfig

    defaults = ServeConfig()
    rows = _table_rows(_section(SERVING.read_text(), "Limits and timeouts"))
    seen, problems = set(), []
    for row in rows:
        m = _LIMIT.match(row[1])
        if m is None:
            if row[0].startswith("request line"):
                assert row[1].startswith(f"{MAX_HEAD_BYTES // 1024} kB"), row
                seen.add("head")
            continue
        flag, number, unit = m.groups()
        # --max-uploads left out is the larger of 64 and --max-queue: the table gives what that is
        want = defaults.uploads_beside(None) if flag == "--max-uploads" else getattr(defaults, flag[2:].replace("-", "_"))
        got = None if number == "none" else float(number.replace(",", "")) * (2 ** 20 if unit == " MiB" else 1)
        seen.add(flag)
        if got != want:
            problems.append(f"serving.md limits table: {flag} {number}{unit or ''}, "
                            f"but ServeConfig's default is {want!r}")
    assert not problems, "\n".join(problems)
    assert len(seen) == len(rows), (seen, rows)   # every row was read


def _documented_routes() -> set:
    rows = _table_rows(_section(SERVING.read_text(), "Endpoints"))
    routes = set()
    for row in rows:
        method = None
        for span in re.findall(r"`([^`]+)`", row[0]):
            parts = span.split()
            if len(parts) == 2:
                method, path = parts
            else:
                path = parts[0]
            routes.add((method, path.split("?")[0]))
    return routes


def _app():
    from acarerank.server.app import create_app
    from acarerank.server.metrics import ServerMetrics

    return create_app(SimpleNamespace(metrics=ServerMetrics()))


def test_endpoint_table_is_every_route():
    """Each documented endpoint is served with its method, and each route served is documented."""
    pytest.importorskip("fastapi")
    served = {(m, r.path) for r in _app().routes for m in (getattr(r, "methods", None) or ()) if m in ("GET", "POST")}
    documented = _documented_routes()
    assert documented == served, (f"documented, not served: {sorted(documented - served)}; "
                                  f"served, not documented: {sorted(served - documented)}")


def _shape_keys(shape: str) -> set:
    """Top-level keys of a ``{a, b: {...}, c?}`` shape written in the docs."""
    depth, keys, word = 0, set(), ""
    for ch in shape.strip()[1:-1] + ",":
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == "," and depth == 0:
            keys.add(word.split(":")[0].strip().rstrip("?"))
            word = ""
            continue
        if depth == 0 or ch not in "{[":
            word += ch if depth == 0 else ""
    return keys


def test_documented_response_shapes_are_the_schemas():
    pytest.importorskip("pydantic")
    from acarerank.server.schemas import RerankResponse, ScoreData, ScoreResponse, ScoreUsage, SelectResponse, TEIRank

    rows = {row[0]: row[1] for row in _table_rows(_section(SERVING.read_text(), "Endpoints"))}
    rerank = next(v for k, v in rows.items() if "/v1/rerank" in k)
    select = next(v for k, v in rows.items() if "/v1/select" in k)
    shape = re.search(r"Response (`\{.*?\}`), best first", rerank).group(1).strip("`")
    assert _shape_keys(shape) == set(RerankResponse.model_fields), shape
    tei = re.search(r"bare list `\[(\{[^`]*\})\]`", rerank).group(1)
    assert _shape_keys(tei) == set(TEIRank.model_fields), tei
    shape = re.search(r"→ `(\{.*?\})`", select).group(1)
    assert _shape_keys(shape) == set(SelectResponse.model_fields), shape
    usage = re.search(r"usage: (\{[^}]*\})", shape)
    assert usage, f"/v1/select's usage fields are not shown: {shape}"
    usage = usage.group(1)
    assert _shape_keys(usage) == set(SelectResponse.model_fields["usage"].annotation.model_fields), usage
    score = next(v for k, v in rows.items() if "/score" in k)
    shape = re.search(r"Response `(\{.*?\})` \(", score).group(1)
    assert _shape_keys(shape) == set(ScoreResponse.model_fields), shape
    assert _shape_keys(re.search(r"data: \[(\{[^}]*\})\]", shape).group(1)) == set(ScoreData.model_fields), shape
    assert _shape_keys(re.search(r"usage: (\{[^}]*\})", shape).group(1)) == set(ScoreUsage.model_fields), shape


_METRIC = re.compile(r"acarerank_[a-z_]*(?:\{[a-z_,]+\}[a-z_]*)*(?:\{[^}]*\})?")


def _expand(name: str) -> list:
    m = re.search(r"\{([a-z_,]+)\}(?=[a-z_])", name)
    if m is None:
        return [name]
    return [x for alt in m.group(1).split(",") for x in _expand(name[:m.start()] + alt + name[m.end():])]


def documented_metrics() -> dict:
    """metric name -> documented label names (None where the doc names none)."""
    out = {}
    for span in re.findall(r"`([^`]*)`", SERVING.read_text().replace("\n", " ")):
        for m in _METRIC.finditer(span):
            text = m.group(0)
            labels = None
            if text.endswith("}"):
                text, _, inner = text[:-1].rpartition("{")
                if not re.search(r"[a-z_]$", text):   # braces of an expansion, not labels
                    text, inner = m.group(0), None
                if inner is not None:
                    labels = {part.split("=")[0].strip() for part in inner.split(",")} if "=" not in inner else \
                        {re.match(r"\s*([a-z_]+)", inner).group(1)}
            for name in _expand(text):
                out[name] = labels if labels is not None else out.get(name)
    return out


def served_metrics() -> dict:
    """metric name (as it appears at /metrics: counters with _total) -> label names."""
    from acarerank.server.metrics import CACHE_COUNTERS, CACHE_GAUGES, ServerMetrics

    out = {}
    for metric in vars(ServerMetrics()).values():
        name = getattr(metric, "_name", None)
        if name is None:
            continue
        out[name + ("_total" if metric._type == "counter" else "")] = set(metric._labelnames)
    out.update({f"acarerank_prefix_cache_{n}_tokens_total": {"cache"} for n in CACHE_COUNTERS})
    out.update({f"acarerank_prefix_cache_{n}_tokens": {"cache"} for n in CACHE_GAUGES})
    return out


def test_metric_names_and_labels_in_serving_md_are_served():
    pytest.importorskip("prometheus_client")
    from acarerank.server.metrics import ServerMetrics

    documented, served = documented_metrics(), served_metrics()
    # a histogram's own series, as a query names them (rate(acarerank_batch_tokens_sum[5m]))
    series = {f"{m._name}{part}": set(m._labelnames) for m in vars(ServerMetrics()).values()
              if getattr(m, "_type", None) == "histogram" for part in ("_sum", "_count", "_bucket")}
    for name in set(documented) & set(series) - set(served):
        served[name] = series[name]
    assert set(documented) == set(served), (f"documented, not served: {sorted(set(documented) - set(served))}; "
                                            f"served, not documented: {sorted(set(served) - set(documented))}")
    wrong = {n: (labels, served[n]) for n, labels in documented.items() if labels is not None and labels != served[n]}
    assert not wrong, f"documented labels differ from the served ones: {wrong}"


# --------------------------------------------------------------------------- install.md

_READ_ENV = re.compile(r"""(?:environ(?:\.get|\.setdefault|\.pop)?\(?\[?|getenv\()\s*["'](ACARERANK_[A-Z0-9_]+)|"""
                       r"""\$\{?(ACARERANK_[A-Z0-9_]+)|ENV_VAR\s*=\s*["'](ACARERANK_[A-Z0-9_]+)""")
#: what a user sets: the package, its build and its scripts (tests/' own variables are named in the
#: install.md rows that concern users, ACARERANK_REQUIRE_EXT and ACARERANK_FUZZ_EXAMPLES)
_READERS = [("acarerank", "*.py"), ("csrc", "*.cpp"), ("csrc", "*.h"), ("csrc", "*.cu"), ("bench", "*.py"),
            ("bench", "*.sh"), ("scripts", "*.sh"), (".", "setup.py")]


def variables_read(roots=_READERS) -> set:
    names = set()
    for folder, pattern in roots:
        for path in (ROOT / folder).rglob(pattern) if folder != "." else [ROOT / pattern]:
            for m in _READ_ENV.finditer(path.read_text(errors="replace")):
                names.add(m.group(1) or m.group(2) or m.group(3))
    return names


def test_install_md_environment_table_is_what_the_code_reads():
    text = (ROOT / "docs" / "install.md").read_text()
    documented = {v for row in _table_rows(_section(text, "Environment knobs"))
                  for v in re.findall(r"`(ACARERANK_[A-Z0-9_]+)", row[0])}
    read = variables_read()
    in_tests = variables_read([("tests", "*.py"), ("scripts", "*.sh")])
    assert documented - read - in_tests == set(), f"documented, read nowhere: {sorted(documented - read - in_tests)}"
    assert read - documented == set(), f"read, not in install.md's table: {sorted(read - documented)}"


_SPEC = re.compile(r"""["']([A-Za-z0-9_.\-]+(?:\[[a-z,]+\])?)>=([\d.]+)(?:,<([\d.]+))?""")


def version_floors() -> set:
    """(name, lowest version, upper bound or None) of every ``name>=V`` the package asks for: setup.py's
    requirements and extras, pyproject.toml's build requirements."""
    setup = (ROOT / "setup.py").read_text()
    reqs = setup[setup.index("\nRAY = "):setup.index("entry_points=")]
    build = (ROOT / "pyproject.toml").read_text().split("requires = ", 1)[1].split("\n", 1)[0]
    return {m.groups() for m in _SPEC.finditer(reqs + build)}


def test_install_md_names_every_version_floor():
    """A reader of install.md's "Dependencies" learns each lowest version pip will insist on (a
    pinned minor version as ``0.54.x``)."""
    text = " ".join((ROOT / "docs" / "install.md").read_text().split())
    floors = version_floors()
    assert {"torch", "transformers", "uvicorn"} <= {name for name, _, _ in floors}, floors
    missing = []
    for name, low, high in sorted(floors):
        said = (re.escape(f"{low}.x") if high else rf"(?:≥ |>=){re.escape(low)}(?![\d.])")
        if not re.search(rf"{re.escape(name)}`?\W{{0,3}}(?:\w+ ){{0,4}}{said}", text):
            missing.append(f"{name}>={low}" + (f",<{high}" if high else ""))
    assert not missing, f"docs/install.md does not state: {', '.join(missing)}"


def test_engine_failure_stages_in_serving_md_are_the_ones_counted():
    """``acarerank_engine_failures_total{stage=...}``: the values serving.md lists are those the
    server counts (an alert written from the docs matches a series that exists)."""
    m = re.search(r'acarerank_engine_failures_total\{stage=([^}]*)\}', SERVING.read_text())
    documented = set(re.findall(r'"(\w+)"', m.group(1)))
    source = "".join(p.read_text() for p in (ROOT / "acarerank" / "server").glob("*.py"))
    counted = set(re.findall(r'_fault\("(\w+)"', source))
    counted |= set(re.findall(r'engine_failures\.labels\("(\w+)"\)', source))
    assert documented == counted, f"serving.md lists {sorted(documented)}, the server counts {sorted(counted)}"


def test_the_kubernetes_example_covers_the_load_with_a_startup_probe():
    """``acarerank serve`` listens only after the load and the warm-up (``run_server`` binds after
    the service started), so no probe is answered meanwhile: the example's probes must leave the
    load to a ``startupProbe`` longer than the liveness probe's budget (a load past
    periodSeconds x failureThreshold = 30 s was killed before it listened, again and again), and
    "What to probe" must not promise a 503 while ``acarerank serve`` loads."""
    text = SERVING.read_text()
    section = text[text.index("### What to probe"):text.index("## Past one machine")]
    probes = {}
    for kind, fields in re.findall(r"^\s*(\w+Probe):\s*\{(.*)\}", section, flags=re.M):
        nums = dict((k, int(v)) for k, v in re.findall(r"(periodSeconds|failureThreshold):\s*(\d+)", fields))
        # Kubernetes' defaults: periodSeconds 10, failureThreshold 3
        probes[kind] = nums.get("periodSeconds", 10) * nums.get("failureThreshold", 3)
    assert "livenessProbe" in probes, f"no livenessProbe in the example: {sorted(probes)}"
    assert probes.get("startupProbe", 0) > probes["livenessProbe"], \
        f"the example's probes (seconds each allows before a restart): {probes}; the load needs a startupProbe"
    assert "refuses connections" in section, "What to probe does not say the port refuses connections during the load"
    ready = next(line for line in section.splitlines() if line.startswith("| readiness"))
    assert not re.search(r"\|\s*loading,", ready), f"the /ready row promises a 503 while loading: {ready}"


def test_every_engine_failure_stage_is_served_at_0_before_any_failure():
    """Each stage serving.md lists is a series of a fresh server's /metrics, at 0: ``rate()`` over a
    series that does not exist yet is empty, not 0, so an alert on a stage that never failed had
    nothing to read (scheduler and tokenize appeared only at their first failure)."""
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from acarerank.server.metrics import ENGINE_FAILURE_STAGES, ServerMetrics

    m = re.search(r'acarerank_engine_failures_total\{stage=([^}]*)\}', SERVING.read_text())
    documented = set(re.findall(r'"(\w+)"', m.group(1)))
    served = {s.labels["stage"]: s.value for fam in text_string_to_metric_families(ServerMetrics().render().decode())
              for s in fam.samples if s.name == "acarerank_engine_failures_total"}
    assert served == {stage: 0.0 for stage in documented}, served
    assert set(ENGINE_FAILURE_STAGES) == documented


def test_no_merge_conflict_markers_in_tracked_files():
    """A merge committed with its conflict markers (docs/ARCHITECTURE.md, 2026-12-06) read as
    prose and passed every other test; a marker line at the start of a line is never content."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    marker = re.compile(r"^(<{7} |>{7} |={7}$)", re.M)
    found = []
    for name in files:
        path = ROOT / name
        if path.suffix not in (".py", ".md", ".cpp", ".h", ".cu", ".cuh", ".sh", ".toml", ".txt", ".cfg", ".yaml", ".yml",
                               ".json", ".in") or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        found += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}" for m in marker.finditer(text)]
    assert not found, f"merge conflict markers: {found[:10]}"


# --------------------------------------------------------------------------- README's headline table

_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_FIGURE = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?×?")


def summary_rows(text: str) -> list:
    """benchmarks.md's "Summary" rows as [peer, workload, machine, ...] with each ``same`` resolved:
    a cell that is ``same`` is the row above's; a workload holding ``same`` ("M3, same") gets the row
    above's workload appended (its dtype, shape and document count)."""
    rows, prev = [], None
    for row in _table_rows(_section(text, "Summary")):
        if prev is not None:
            row = [p if c == "same" else c for c, p in zip(row, prev)]
            if "same" in row[1].split(", "):
                row[1] = f"{row[1]}, {prev[1]}"
        rows.append(row)
        prev = row
    return rows


def headline_problems(readme: str, benchmarks: str) -> list:
    """Each README results row (a ``**N×**`` ratio) against the Summary rows of the same peer, date
    and machine: its figures are theirs (not only somewhere in the table: a Zen 5 figure beside a
    Zen 4 date passed that), its machine is one of that peer's and date's, each dtype it names is in
    their workloads; a count of the Summary's rows the README states is the count."""
    summary = summary_rows(benchmarks)
    problems = []
    for said in re.findall(r"(\d+) rows in all", readme):
        if int(said) != len(summary):
            problems.append(f"README says the Summary has {said} rows; it has {len(summary)}")
    header = next(line for line in readme.split("\n") if line.startswith("| acarerank beside"))
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in readme.split("\n")
            if line.startswith("|") and re.search(r"\*\*[\d.]+×", line)]
    assert header and rows, "no results table in README.md"
    prev = None
    for row in rows:
        row = [p if c == "same" else c for c, p in zip(row, prev or row)]
        prev = row
        peer, workload, machine_date = row[0], row[1], row[2]
        date = _DATE.search(machine_date)
        if date is None:
            problems.append(f"README row {peer!r} / {workload!r}: no date")
            continue
        same_day = [r for r in summary if r[0] == peer and date.group(0) in r[2]]
        if not same_day:
            problems.append(f"README row {peer!r} dated {date.group(0)}: no Summary row of that peer and date")
            continue
        # one peer may be measured on two machines the same day: the row's machine picks its rows
        machine = machine_date[:date.start()].rstrip(", ")
        matched = [r for r in same_day if machine in r[2]]
        if not matched:
            problems.append(f"README row {peer!r} {date.group(0)}: machine {machine!r} is not the Summary's "
                            f"{sorted({r[2] for r in same_day})}")
            continue
        for dtype in sorted(set(re.findall(r"\b(fp32|bf16)\b", workload.split("(")[0]))):
            if not any(dtype in r[1] for r in matched):
                problems.append(f"README row {peer!r} {date.group(0)}: {dtype} is in none of the Summary's "
                                f"workloads {[r[1] for r in matched]}")
        theirs = " | ".join(" | ".join(r[3:]) for r in matched)
        for cell in row[3:]:
            for figure in _FIGURE.findall(cell):
                if len(figure.strip("×")) > 1 and not re.search(rf"(?<![\d,.]){re.escape(figure)}(?![\d,])", theirs):
                    problems.append(f"README row {peer!r} {date.group(0)}: {figure} is not in the Summary's rows of "
                                    f"that peer and date")
    return problems


def test_readme_headline_rows_are_the_summary_rows_of_their_machine_and_date():
    problems = headline_problems((ROOT / "README.md").read_text(), (ROOT / "docs" / "benchmarks.md").read_text())
    assert not problems, "\n".join(problems)


def test_headline_checker_reports_a_figure_of_another_machine():
    """The checker can fail: a README row that moves a Zen 5 figure to the Zen 4 date, a machine that
    is not the Summary's, a dtype the rows do not have, a wrong row count."""
    readme = (ROOT / "README.md").read_text()
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    zen5 = next(line for line in readme.split("\n") if "2026-12-05" in line and line.startswith("|"))
    zen4 = next(line for line in readme.split("\n") if "Zen 4" in line and line.startswith("|"))
    zen4_date = _DATE.search(zen4).group(0)
    cases = [
        (zen5.replace("2026-12-05", zen4_date).replace("Zen 5", "Zen 4"), "1,145 is not in the Summary"),
        (zen5.replace("Zen 5", "Zen 3"), "machine 'AMD EPYC Zen 3"),
        (zen5.replace("**bf16**", "**fp32**"), "fp32 is in none of the Summary's workloads"),
    ]
    for changed, expected in cases:
        problems = headline_problems(readme.replace(zen5, changed), bench)
        assert any(expected in p for p in problems), (expected, problems)
    problems = headline_problems(readme + "\nThe Summary, 3 rows in all.\n", bench)
    assert any("README says the Summary has 3 rows" in p for p in problems), problems


# --------------------------------------------------------------------------- serving.md's error types

_OUR_TYPE = re.compile(r'"type": "([a-z_]+)"|type `([a-z_]+)`|`([a-z_]+_error)`')
_STATUS = re.compile(r"→ (\d{3})\b|\b(\d{3}) \{\"error\"|`(\d{3})`")


def error_type_problems(text: str) -> list:
    """What serving.md says of error bodies against acarerank/server: each ``type`` word it names
    (``"type": "timeout"``, ``type `context_length```, ``validation_error``) is one the server sends
    (``ERROR_TYPES`` or a ``type="..."`` it passes), each status it answers (``→ 413``, ``504 {"error"``)
    has its type, and the TEI ``error_type`` sentence ("`Overloaded` for 429 and 504, ..., `Validation`
    for every other 4xx") is ``tei_error_type``'s mapping."""
    from acarerank.server.errors import ERROR_TYPES, tei_error_type

    source = "".join(p.read_text() for p in (ROOT / "acarerank" / "server").glob("*.py"))
    sent = set(ERROR_TYPES.values()) | set(re.findall(r'\btype="([a-z_]+)"', source))
    flat = " ".join(text.split())
    problems = [f"serving.md names the error type {t!r}; the server sends {sorted(sent)}"
                for m in _OUR_TYPE.finditer(flat) for t in [next(g for g in m.groups() if g)] if t not in sent]
    problems += [f"serving.md answers {s}, which has no error type in ERROR_TYPES"
                 for m in _STATUS.finditer(flat) for s in [next(g for g in m.groups() if g)]
                 if s[0] in "45" and int(s) not in ERROR_TYPES]
    m = re.search(r"`error_type` (.*?) \|", flat)
    if m is None:
        return problems + ["serving.md: no TEI `error_type` sentence in the Errors table"]
    listed = set()
    for word, statuses in re.findall(r"`(\w+)` for ([^,`]+)", m.group(1)):
        codes = [int(c) for c in re.findall(r"\b\d{3}\b", statuses)]
        if "every other 4xx" in statuses:
            codes = [c for c in ERROR_TYPES if 400 <= c < 500 and c not in listed]
        listed |= set(codes)
        problems += [f"serving.md: TEI error_type {word!r} for {c}; the server sends {tei_error_type(c)!r}"
                     for c in codes if tei_error_type(c) != word]
    problems += [f"serving.md's TEI error_type sentence does not cover {c}" for c in ERROR_TYPES
                 if c not in listed and c >= 400]
    return problems


def test_error_types_in_serving_md_are_the_ones_sent():
    problems = error_type_problems(SERVING.read_text())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("old, new, expected", [
    ('"type": "timeout"', '"type": "deadline_exceeded"', "names the error type 'deadline_exceeded'"),
    ("type `context_length`", "type `context_too_long`", "names the error type 'context_too_long'"),
    ("`Unhealthy` for 503", "`Overloaded` for 503", "TEI error_type 'Overloaded' for 503"),
    ("`Backend` for 500, ", "", "does not cover 500"),
    ("→ 415", "→ 416", "answers 416"),
])
def test_error_type_checker_reports_a_word_the_server_does_not_send(old, new, expected):
    text = SERVING.read_text()
    assert old in text, old
    problems = error_type_problems(text.replace(old, new, 1))
    assert any(expected in p for p in problems), (expected, problems)


# --------------------------------------------------------------------------- the README's set-up facts

def setup_fact_problems(docs: dict) -> list:
    """The versions a newcomer is told before installing (``Python 3.10+``, ``torch==2.13.0``) are
    the ones setup.py's ``python_requires`` and scripts/setup.sh's pin ask for. ``docs``: file name ->
    text."""
    setup = (ROOT / "setup.py").read_text()
    python = re.search(r'python_requires=">=([\d.]+)"', setup).group(1)
    pin = re.search(r'"torch==([\d.]+)"', (ROOT / "scripts" / "setup.sh").read_text()).group(1)
    problems = []
    for name, text in docs.items():
        flat = " ".join(text.split())
        problems += [f"{name}: Python {v}+, but setup.py asks for >={python}"
                     for v in re.findall(r"\bPython (\d+\.\d+)\+", flat) if v != python]
        problems += [f"{name}: torch=={v}, but scripts/setup.sh pins torch=={pin}"
                     for v in re.findall(r"torch==([\d.]+\d)", flat) if v != pin]
    return problems


def test_readme_and_install_md_state_the_python_and_torch_setup_asks_for():
    docs = {name: (ROOT / name).read_text() for name in ("README.md", "docs/install.md")}
    assert "Python 3" in docs["README.md"] and "torch==" in docs["docs/install.md"]
    problems = setup_fact_problems(docs)
    assert not problems, "\n".join(problems)


def test_setup_fact_checker_reports_another_version():
    problems = setup_fact_problems({"x.md": "On Linux with Python 3.9+ and `torch==2.12.0`."})
    assert any("Python 3.9+" in p for p in problems) and any("torch==2.12.0" in p for p in problems), problems


# --------------------------------------------------------------------------- acarerank bench's results folder

_RESULTS = re.compile(r"results/bench-(?:agent-)?<[a-z]+>-<[a-z]+>-<[a-z]+>|results/bench-tiny-cpu-<[a-z]+>-cpu")


def results_folder_problems(texts: dict) -> list:
    """Each ``results/bench-<preset>-<dtypes>-<device>`` pattern the docs and ``--help`` name, filled in
    for a two-dtype run (and the agent workload's), is the folder ``acarerank bench`` writes
    (``default_output``). ``texts``: where -> text."""
    from acarerank.cli.bench import default_output

    fill = {"<preset>": "tiny-cpu", "<device>": "cpu", "<dtypes>": "float32+bfloat16", "<dtype>": "float32"}
    problems = []
    for where, text in texts.items():
        for pattern in _RESULTS.findall(" ".join(text.split())):
            agent = "bench-agent-" in pattern
            filled = re.sub(r"<[a-z]+>", lambda m: fill.get(m.group(0), m.group(0)), pattern)
            want = default_output("tiny-cpu", ["float32"] if agent else ["float32", "bfloat16"], "cpu", agent=agent)
            if filled != want:
                problems.append(f"{where}: {pattern} reads {filled}; bench writes {want}")
    return problems


def test_results_folder_named_in_the_docs_is_the_one_bench_writes():
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in DOC_FILES}
    texts["acarerank bench --help"] = _sub("bench").format_help()
    texts["scripts/main.sh"] = (ROOT / "scripts" / "main.sh").read_text()
    named = [w for w, t in texts.items() if _RESULTS.search(" ".join(t.split()))]
    assert {"README.md", "docs/benchmarks.md", "acarerank bench --help"} <= set(named), named
    problems = results_folder_problems(texts)
    assert not problems, "\n".join(problems)


def test_default_output_is_the_folder_bench_wrote_before_it_was_a_function():
    """``default_output`` is the expression run() and run_agent() had inline (a refactor, no change):
    the folder names of earlier runs (results/bench-tiny-cpu-float32+bfloat16-cpu)."""
    from acarerank.cli.bench import default_output

    assert default_output("tiny-cpu", ["float32", "bfloat16"], "cpu") == "results/bench-tiny-cpu-float32+bfloat16-cpu"
    assert default_output("tiny-cpu", ["bfloat16"], "cuda:0", model=True) == "results/bench-model-bfloat16-cuda0"
    assert default_output("tiny-cpu", ["float32"], "cpu", agent=True) == "results/bench-agent-tiny-cpu-float32-cpu"


# --------------------------------------------------------------------------- gpu.md's plan

def gpu_plan_problems(doc: str, script: str) -> list:
    """gpu.md's step table (name, limit) is bench/gpu_check.sh's ``STEPS``, its "within N s" the
    script's ``DEADLINE``, its "add up to N s" their sum, and ``--also A,B`` its ``OPTIONAL_STEPS``."""
    def table(name):
        body = re.search(rf"^{name}=\(\n(.*?)^\)", script, re.M | re.S).group(1)
        return [(n, int(s)) for n, s in re.findall(r'"(\w+)\s+(\d+)"', body)]

    steps, optional = table("STEPS"), table("OPTIONAL_STEPS")
    deadline = int(re.search(r"^DEADLINE=(\d+)", script, re.M).group(1))
    rows = [(r[0], r[1]) for r in _table_rows(doc) if re.fullmatch(r"\d+ s", r[1])]
    documented = [(name, int(limit.split()[0])) for name, limit in rows]
    flat = " ".join(doc.split())
    problems = []
    if documented != steps:
        problems.append(f"gpu.md's step table {documented}; gpu_check.sh's STEPS {steps}")
    for said in re.findall(r"within (\d+) s", flat):
        if int(said) != deadline:
            problems.append(f"gpu.md: within {said} s; gpu_check.sh's DEADLINE is {deadline}")
    for said in re.findall(r"add up to (\d+) s", flat):
        if int(said) != sum(s for _, s in steps):
            problems.append(f"gpu.md: the limits add up to {said} s; STEPS add up to {sum(s for _, s in steps)}")
    also = re.search(r"`--also ([\w,]+)`", flat)
    if also is None or set(also.group(1).split(",")) != {n for n, _ in optional}:
        problems.append(f"gpu.md's --also {also and also.group(1)}; OPTIONAL_STEPS {[n for n, _ in optional]}")
    return problems


def test_gpu_md_plan_is_gpu_check_sh():
    doc = (ROOT / "docs" / "gpu.md").read_text()
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    problems = gpu_plan_problems(doc, script)
    assert not problems, "\n".join(problems)
    for old, new, expected in [("| build | 120 s |", "| build | 100 s |", "step table"),
                               ("within 540 s", "within 600 s", "within 600 s"),
                               ("add up to 520 s", "add up to 500 s", "add up to 500 s"),
                               ("`--also kernels,agent`", "`--also kernels`", "--also kernels")]:
        assert old in doc, old
        assert any(expected in p for p in gpu_plan_problems(doc.replace(old, new), script)), (old, new)
