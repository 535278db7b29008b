"""Op decompositions: each IR op kind turns into tile tasks (host side) and each task kind has CPU semantics.

One module per op (`tasks/ops/<op>.py`), paired with `device_kernels/ops/<op>.cuh` on the GPU side. A module
registers:
  @decomposer("<op kind>")  fn(op, graph, tiling, rank) -> list[Task]   (ids and events filled in later)
  @task_kind("<task kind>") fn(task, mem, ctx) -> None                    (pyvm / conventional semantics)
  @task_ready("<task kind>") fn(task, mem, ctx) -> bool   (optional: a readiness condition on data, beyond the
                                                          task's events: the LL all-reduce's flags)
"""
from __future__ import annotations

from typing import Callable

DECOMPOSERS: dict[str, Callable] = {}
TASK_KINDS: dict[str, Callable] = {}
TASK_READY: dict[str, Callable] = {}


def decomposer(kind: str):
    def deco(fn):
        DECOMPOSERS[kind] = fn
        return fn
    return deco


def task_kind(kind: str):
    def deco(fn):
        TASK_KINDS[kind] = fn
        return fn
    return deco


def task_ready(kind: str):
    def deco(fn):
        TASK_READY[kind] = fn
        return fn
    return deco


def get_decomposer(kind: str) -> Callable:
    if kind not in DECOMPOSERS:
        raise KeyError(f"no decomposition for op kind {kind!r}; known: {sorted(DECOMPOSERS)}")
    return DECOMPOSERS[kind]


def get_task_kind(kind: str) -> Callable:
    if kind not in TASK_KINDS:
        raise KeyError(f"no CPU semantics for task kind {kind!r}; known: {sorted(TASK_KINDS)}")
    return TASK_KINDS[kind]


# Opcodes: the order here is the device dispatch order; codegen emits them into the generated header.
OPCODES = ["embed", "qkv_rope", "attn_partial", "attn_merge", "linear", "allreduce", "argmax_partial",
           "argmax_reduce", "qk_norm_rope", "weight_prefetch"]

from . import embed, qkv_rope, attention, linear, allreduce, argmax, prefetch  # noqa: E402,F401  (register)
