"""The package's import graph is a tree of layers: no cycle, and the command line on top.

Every module under ``acarerank/`` (``acarerank/kernels/`` included) is parsed, and
every ``import`` statement it holds — at the top or inside a function, a method or an
``if`` — becomes an edge to the module it names (``from .x import y`` names ``x``, or
``x.y`` when ``y`` is a submodule); so does a module's full name given as a string to
``importlib.import_module`` or to the ops' ``lazy_backend``. A package's implicit import of its ``__init__`` is not an
edge: every submodule has it, so counting it would make every package a cycle. The test lists
every cycle it finds (each once, as ``a -> b -> a``) so a failure says what to cut.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"acarerank": ROOT / "acarerank"}


def _modules() -> dict:
    """{dotted module name: path} for every .py file of the package."""
    mods = {}
    for pkg, base in PACKAGES.items():
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = path
    return mods


IMPORTING_CALLS = ("import_module", "lazy_backend")  # calls that import the module a string names


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def _resolve(name: str, mods: dict) -> str | None:
    """The longest prefix of ``name`` that is one of our modules (``a.b.func`` -> ``a.b``)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in mods:
            return cand
    return None


def _imports(module: str, path: Path, mods: dict) -> set:
    """Our modules that ``module`` imports anywhere in its body."""
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.Call) and _callee(node) in IMPORTING_CALLS:
            # a module named by a string: importlib.import_module("acarerank.x"), or an op's
            # lazy_backend(..., "acarerank.kernels.y", ...) that imports it on first use
            targets = [a.value for a in [*node.args, *(k.value for k in node.keywords)]
                       if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value in mods]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            # "from pkg import sub" imports the submodule pkg.sub when there is one, else pkg itself
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in mods else stem for a in node.names]
        else:
            continue
        for t in targets:
            r = _resolve(t, mods)
            if r is not None and r != module:
                out.add(r)
    return out


def import_graph() -> dict:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def find_cycles(graph: dict) -> list:
    """Every elementary cycle's strongly connected component, reported as one cycle through it
    (Tarjan's algorithm, then a shortest cycle through the component's first node)."""
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    cycles = []
    for comp in comps:
        start, members = comp[0], set(comp)
        prev, frontier = {start: None}, [start]
        found = None
        while frontier and found is None:  # BFS back to start inside the component
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        found = v
                        break
                    if w in members and w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path, v = [start], found
        while v is not None and v != start:
            path.insert(1, v)
            v = prev[v]
        cycles.append(" -> ".join(path + [start]) + f"   (component: {', '.join(comp)})")
    return cycles


def test_the_walk_sees_function_level_and_relative_imports():
    """The graph builder itself: a relative import inside a function is an edge (so the test can fail)."""
    graph = import_graph()
    assert "acarerank.ops._backend" in graph["acarerank.ops.yes_no"], graph["acarerank.ops.yes_no"]
    # attention names its Triton kernel module in its backend declaration; rescore imports the
    # tokenizer inside a function
    assert "acarerank.kernels.prefix_shared_attention" in graph["acarerank.ops.attention"], \
        graph["acarerank.ops.attention"]
    assert "acarerank.tokenizer" in graph["acarerank.ato.rescore"], graph["acarerank.ato.rescore"]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a   (component: a, b, c)"]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles (imports inside functions counted):\n  " + "\n  ".join(cycles)


def test_only_the_cli_imports_the_cli():
    bad = sorted(f"{m} imports {t}" for m, ts in import_graph().items() if not m.startswith("acarerank.cli")
                 for t in ts if t == "acarerank.cli" or t.startswith("acarerank.cli."))
    assert not bad, "modules below the command line that import it:\n  " + "\n  ".join(bad)


def test_only_the_cli_imports_the_server():
    """The library (setwise, benchmark workloads, ops, model) never imports the server: a limit both
    need lives below them (``acarerank.limits``)."""
    def in_server(t):
        return t == "acarerank.server" or t.startswith("acarerank.server.")
    bad = sorted(f"{m} imports {t}" for m, ts in import_graph().items()
                 if not (in_server(m) or m.startswith("acarerank.cli")) for t in ts if in_server(t))
    assert not bad, "library modules that import the server:\n  " + "\n  ".join(bad)


def test_kernels_import_only_leaves():
    """``acarerank/kernels/`` sits below the ops: it may import only leaf modules (ones that import none of
    ours), never ``acarerank.ops`` (whose ``__init__`` loads every op)."""
    graph = import_graph()
    bad = []
    for m, ts in sorted(graph.items()):
        if not m.startswith("acarerank.kernels"):
            continue
        for t in sorted(ts):
            if t.startswith("acarerank.kernels"):
                continue
            if t == "acarerank.ops" or t.startswith("acarerank.ops.") or graph[t]:
                bad.append(f"{m} imports {t} (which imports {sorted(graph[t]) or 'nothing of ours'})")
    assert not bad, "kernels importing more than a leaf:\n  " + "\n  ".join(bad)


def test_the_repository_root_holds_no_package_but_acarerank():
    """``python -m pytest`` (and any ``python`` run from the checkout) puts the repository root first
    on sys.path, so a package folder there shadows an installed one of the same name: the Triton
    kernels once sat in a top-level ``kernels/``, and transformers 5.25, which imports the PyPI
    package ``kernels``, then failed to import Qwen3's modeling code from the checkout."""
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists())
    assert packages == ["acarerank"], f"package folders at the repository root: {packages}"
    done = subprocess.run([sys.executable, "-c", "from transformers import Qwen3ForCausalLM"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
