"""Optional packages in the tests: a module whose tests need one skips, saying which and why,
where it is not installed (pytest -rs prints the reason), instead of failing the collection."""
import sys

import pytest

#: what installs each optional package (setup.py extras)
EXTRA = {"fastapi": "serve", "uvicorn": "serve", "pydantic": "serve", "prometheus_client": "serve",
         "httpx": "serve", "cohere": "test", "ray": "ray", "hypothesis": "test"}


def require(*modules: str) -> None:
    """Skip the calling test module unless every one of ``modules`` imports."""
    caller = sys._getframe(1).f_globals.get("__name__", "?")
    for name in modules:
        pytest.importorskip(name, reason=f"{caller}: {name} is not installed "
                                         f"(pip install 'acarerank[{EXTRA.get(name, 'test')}]')")
