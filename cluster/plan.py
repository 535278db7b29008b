"""The controller plans once, centrally, and ships the plan to every rank.

`make_plan` turns the replica's runner arguments into a PlanBook (planner.book: the planner's chosen plan per
decode batch bucket, plain JSON-able data) when the caller asked for `plan="auto"`; every worker receives the
same book with `init_model(..., plan=book)` and only looks plans up in it (`planner.book.pick_plan`), so workers
never plan. `plan=None` (the default) keeps each runner's single task graph; a book passed in is shipped as is.
The same function serves the in-process executors (mpk_runtime.runtime.executor.plan_once).
"""
from __future__ import annotations

from typing import Any

from mpk_runtime.runtime.executor import plan_once


def make_plan(config, world_size: int, backend: str, runner_kwargs: dict[str, Any]):
    """Return the plan book to ship (or None). Called once per replica build on the controller, never on
    workers, so all ranks run exactly the same plans. (`config` is unused: the model comes from runner_kwargs.)"""
    return plan_once(backend, world_size, runner_kwargs).get("plan")
