"""The controller plans once, centrally, and ships the plan to every rank.

Hook for the planner: `make_plan` will turn (config, TP degree, backend, batch buckets) into a `Plan` (segments,
per-segment config) that every worker receives with `init_model(..., plan=plan)`. Until the planner exists it
returns None and workers plan nothing (each runner uses its defaults).
"""
from __future__ import annotations

from typing import Any


def make_plan(config, world_size: int, backend: str, runner_kwargs: dict[str, Any]):
    """Return a picklable plan object (or None). Called once per replica build on the controller, never on
    workers, so all ranks run exactly the same plan."""
    return None
