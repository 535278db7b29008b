"""A PlanBook: the planner's choice per decode batch bucket, made once and shipped to every rank as plain data.

The controller (cluster/plan.py, or the in-process runner) calls `plan_book(cfg, tp, buckets)`; workers get the
dict and call `pick_plan(book, batch)`: the plan of the smallest bucket >= batch (the largest bucket if the batch
is larger). A plan's segments name the Graph's ops, which do not depend on the batch, so the plan of a bucket
runs any batch of that bucket.
"""
from __future__ import annotations

from ..models.config import ModelConfig
from .plan import Plan
from .profile import HardwareProfile
from .search import candidates

DEFAULT_BUCKETS = (1, 8, 32, 128)


def plan_book(cfg: ModelConfig, tp: int, buckets=DEFAULT_BUCKETS, context: int = 512,
              prof: HardwareProfile | str | None = None, families: tuple[str, ...] | None = None) -> dict:
    """{"buckets": {batch: plan dict}, "profile", "context", "tp"}: the lowest predicted plan per bucket."""
    if not buckets or any(int(b) < 1 for b in buckets):
        raise ValueError(f"plan buckets must be positive batch sizes, got {buckets!r}")
    p = prof if isinstance(prof, HardwareProfile) else (HardwareProfile.load(prof) if prof else HardwareProfile.load())
    out = {}
    for b in sorted({int(b) for b in buckets}):
        plan = candidates(cfg, tp=tp, batch=b, context=context, prof=p, families=families)[0]
        out[b] = plan.to_dict()
    return {"buckets": out, "profile": p.name, "context": context, "tp": tp}


def pick_plan(book: dict, batch: int) -> Plan:
    """The plan for a decode batch: the smallest bucket >= batch, else the largest bucket."""
    if not book or not book.get("buckets"):
        raise ValueError("empty plan book: make one with planner.book.plan_book(cfg, tp, buckets)")
    keys = sorted(int(k) for k in book["buckets"])
    b = next((k for k in keys if k >= batch), keys[-1])
    d = book["buckets"].get(b, book["buckets"].get(str(b)))   # JSON round trips turn int keys into strings
    return Plan.from_dict(d)
