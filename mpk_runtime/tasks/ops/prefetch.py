"""weight_prefetch: pull weight bytes of a layer's next projections into L2 while attention runs.

Not an IR op: `tasks/build.py` adds these tasks when `Tiling.l2_prefetch_mb > 0`. At batch 1 a layer's attention
leaves most SMs without a task and HBM idle (it reads ~1 MB of KV); the prefetch tasks run on those SMs after the
layer's q is written (they read q only to depend on it) and issue L2 prefetches (`cp.async.bulk.prefetch.L2`,
no shared memory, no registers held) of the first rows of every o_proj tile, then of every gate_up tile, within
a per-layer byte budget (the same share of each tile of an op, since a phase is as slow as its slowest tile; first
rows, since a tile streams its rows in order).
Each task carries up to PREFETCH_RANGES (weight, first row, rows, K) ranges. CPU semantics: nothing (a prefetch
changes no value).
"""
from __future__ import annotations

from ..graph import Region, Task
from . import task_kind

PREFETCH_RANGES = 11   # (address, bytes) pairs in a task record (codegen/layout.py OP_ARGS["weight_prefetch"])


@task_kind("weight_prefetch")
def execute(task, mem, ctx):
    return None


def _tile_bytes(t: Task) -> int:
    p = t.params
    return len(p["weights"]) * (p["n1"] - p["n0"]) * 2 * (t.reads[0].ranges[1][1] - t.reads[0].ranges[1][0])


def _tile_ranges(t: Task, frac: float) -> list[tuple[str, int, int, int]]:
    """(weight, first row, rows, K) of the first `frac` of a linear tile's rows, per weight (rows counted from the
    weight's row 0, i.e. weight_row0 + n0 ...)."""
    p = t.params
    K = t.reads[0].ranges[1][1] - t.reads[0].ranges[1][0]
    w = p["n1"] - p["n0"]
    rows = w if frac >= 1.0 else int(w * frac)
    if rows <= 0:
        return []
    r0 = p.get("weight_row0", 0) + p["n0"]
    return [(name, r0, rows, K) for name in p["weights"]]


def prefetch_tasks(attn: list[Task], o_proj: list[Task], gate_up: list[Task], budget_bytes: float, num_sms: int,
                   rank: int) -> list[Task]:
    """The weight_prefetch tasks of one layer (ids filled in by the caller): the first rows of o_proj's tiles (all
    of them if the budget allows), then of gate_up's with what is left, the same share of every tile of an op,
    over about as many tasks as attention leaves SMs free (at least enough for PREFETCH_RANGES ranges per task)."""
    if not attn or not o_proj or budget_bytes <= 0:
        return []
    q = attn[0].reads[0]    # the layer's q: wait for it (all its producers), i.e. start with attention
    q_all = Region(q.tensor, q.rank, _full_ranges(attn, q.tensor))
    ranges: list[tuple[str, int, int, int]] = []
    left = budget_bytes
    for tiles in (o_proj, gate_up):   # o_proj first (it streams first), then gate_up, each tile the same share
        total = sum(_tile_bytes(t) for t in tiles)
        if not tiles or left <= 0 or total <= 0:
            continue
        part = [r for t in tiles for r in _tile_ranges(t, min(1.0, left / total))]
        ranges += part
        left -= sum(rows * K * 2 for _, _, rows, K in part)
    if not ranges:
        return []
    free = max(1, num_sms - len(attn))
    n = max(-(-len(ranges) // PREFETCH_RANGES), min(free, len(ranges)))
    out = []
    for i in range(n):
        part = ranges[i::n]
        out.append(Task(-1, rank, "weight_prefetch", attn[0].op.rsplit(".", 1)[0] + ".prefetch",
                        {"ranges": part}, reads=[q_all], writes=[],
                        est_bytes=sum(rows * K * 2 for _, _, rows, K in part), est_flops=0))
    return out


def _full_ranges(attn: list[Task], tensor: str) -> tuple[tuple[int, int], ...]:
    """The union extent of `tensor` over the attention tasks' reads (every row, every head of q)."""
    rs = [r.ranges for t in attn for r in t.reads if r.tensor == tensor]
    return tuple((min(x[d][0] for x in rs), max(x[d][1] for x in rs)) for d in range(len(rs[0])))
