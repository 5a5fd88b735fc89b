"""What makes an engine unhealthy: the one rule behind ``GET /health`` and Ray Serve's health check.

docs/serving.md, "What to probe": dead or stopped is unhealthy; a step running longer than the
caller's ``max_pass_s`` is unhealthy only when the caller asks for that bound (a long pass is
legitimate, so there is no default).
"""
from __future__ import annotations

from typing import Optional

from .._validate import check_seconds


def check_max_pass_s(max_pass_s: Optional[float]) -> None:
    """ValueError unless ``max_pass_s`` is None or a finite number >= 0 (seconds): a negative or NaN
    bound would make the probe always fail or never, an infinite one never."""
    check_seconds("max_pass_s", max_pass_s, zero=True, inf=False, none=True)


def health_problem(health: dict, max_pass_s: Optional[float] = None) -> Optional[str]:
    """Why an engine with this ``health()`` (state, busy_s, reason) should be restarted; None when
    it should not."""
    if health["state"] in ("dead", "stopped"):
        why = health.get("reason", "the scheduler loop is not running")
        return f"engine {health['state']}: {why}"
    if max_pass_s is not None and health["busy_s"] > max_pass_s:
        return f"the model thread has been in one step for {health['busy_s']:.1f} s (more than max_pass_s={max_pass_s:g})"
    return None
