"""Hide installed modules from a Python process, as if they were not installed.

Put this folder first on PYTHONPATH and name the modules in ``ACARERANK_HIDE_MODULES``
(comma-separated top-level or dotted names, e.g. ``fastapi,uvicorn,acarerank._C``). Python
imports ``sitecustomize`` at start-up, so every process started with this environment (pytest,
a console script, ``python -c``, their subprocesses) sees the same absence — what the tests of
"works without the extras" need, without a second environment.

The path-based finder itself is made blind to the hidden names (pytest's assertion rewriter
calls it directly, so wrapping it in ``sys.meta_path`` is not enough): ``import fastapi`` raises
the ordinary ``ModuleNotFoundError``, ``importlib.util.find_spec("fastapi")`` returns None and
``importlib.metadata`` finds no such distribution, as on a machine that lacks the package
(libraries probe optional packages with ``find_spec`` and the metadata: a finder that raised
would break them where absence does not). A hidden ``hypothesis`` also turns its pytest plugin
off (``-p no:hypothesispytest``): on a machine without hypothesis pytest has no such plugin.
"""
import importlib.machinery
import os
import sys

_HIDDEN = tuple(n.strip() for n in os.environ.get("ACARERANK_HIDE_MODULES", "").split(",") if n.strip())


def _hidden(fullname: str) -> bool:
    return any(fullname == n or fullname.startswith(n + ".") for n in _HIDDEN)


def _install() -> None:
    finder = importlib.machinery.PathFinder
    find_spec, find_distributions = finder.find_spec, finder.find_distributions

    def blind_find_spec(cls, fullname, path=None, target=None):
        return None if _hidden(fullname) else find_spec(fullname, path, target)

    def blind_find_distributions(cls, context=None, **kwargs):
        import importlib.metadata as md
        context = context or md.DistributionFinder.Context(**kwargs)
        if context.name is not None and _hidden(context.name.lower().replace("-", "_")):
            return iter(())
        return find_distributions(context)

    finder.find_spec = classmethod(blind_find_spec)
    finder.find_distributions = classmethod(blind_find_distributions)
    for name in [m for m in sys.modules if _hidden(m)]:  # nothing is imported yet at start-up; be safe anyway
        del sys.modules[name]
    if "hypothesis" in _HIDDEN:
        os.environ["PYTEST_ADDOPTS"] = (os.environ.get("PYTEST_ADDOPTS", "") + " -p no:hypothesispytest").strip()


if _HIDDEN:
    _install()
