"""hypothesis where installed (the ``test`` extra), else its property tests skip with the reason.

Test modules import ``given, settings, st, HealthCheck, event`` from here instead of from
hypothesis, so that a machine without it still runs their other tests (a module-level
``import hypothesis`` would fail the whole module's collection). Without hypothesis, ``st`` is an
inert stand-in (module-level strategy definitions still evaluate) and ``@given`` marks the test
skipped.
"""
import pytest

try:
    from hypothesis import HealthCheck, event, given, settings
    from hypothesis import strategies as st
    HAVE_HYPOTHESIS = True
except ModuleNotFoundError as _e:
    HAVE_HYPOTHESIS = False
    _REASON = f"hypothesis is not installed ({_e}): property test skipped (pip install 'acarerank[test]')"

    class _Inert:
        """Any attribute, call or operator gives itself: stands for strategies and HealthCheck."""
        def __getattr__(self, name):
            return self

        def __call__(self, *args, **kwargs):
            return self

        def __or__(self, other):
            return self

    st = HealthCheck = _Inert()

    def given(*args, **kwargs):
        return pytest.mark.skip(reason=_REASON)

    def settings(*args, **kwargs):
        return lambda fn: fn

    def event(*args, **kwargs):
        return None
