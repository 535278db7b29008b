"""The list scheduler: assigns every task to an SM and orders each SM's list.

Tasks are taken in a topological order (op order, then tile order; ranks interleaved so cross-rank producers
come first). Each goes to the SM that can start it earliest: max(SM free, producers done + sync latency).
Because every SM list follows one topological order, no SM can wait on a task queued behind it: the
schedule cannot deadlock (the checker verifies this independently). The same lists are executed by the GPU
kernel and pyvm, and replayed by the planner's simulator.
"""
from __future__ import annotations

import heapq
from typing import Callable

from .graph import Task, TaskGraph

# Defaults measured on one H200 (../shared notes): 4.55 TB/s read-only streaming over 132 SMs, ~0.41 us for a
# flag from one SM to another. Per-task fixed cost is a placeholder until the hardware profile is fitted.
H200 = {"hbm_bytes_per_us": 4.55e6, "num_sms": 132, "sync_us": 0.41, "task_fixed_us": 0.5,
        "tc_flops_per_us_per_sm": 790e6 / 132}


def default_cost(task: Task, hw: dict = H200) -> float:
    """Microseconds for one task on one SM when all SMs stream together (fair share of HBM bandwidth)."""
    if task.kind == "weight_prefetch":   # issues asynchronous L2 prefetches and ends: the SM is free at once
        return hw["task_fixed_us"]
    bw_sm = hw["hbm_bytes_per_us"] / hw["num_sms"]
    return hw["task_fixed_us"] + max(task.est_bytes / bw_sm, task.est_flops / hw["tc_flops_per_us_per_sm"])


def list_schedule(ranks: list[list[Task]], num_sms: int, producers: dict[tuple[int, int], set[tuple[int, int]]],
                  cost: Callable[[Task], float] = default_cost, sync_us: float = H200["sync_us"]) -> list[float]:
    """Assign `task.sm` / `task.order` in place for every rank; returns each rank's makespan (us).

    producers[(rank, id)] = {(rank, id), ...} tasks whose outputs the task reads (same step)."""
    finish: dict[tuple[int, int], float] = {}
    where: dict[tuple[int, int], int] = {}
    heaps = [[(0.0, k) for k in range(num_sms)] for _ in ranks]
    counts = [[0] * num_sms for _ in ranks]
    n = max(len(ts) for ts in ranks)
    # tiles of one op often share one producer-set object (build_task_graphs memoises them): its ready time is
    # computed once (the producers are all placed before the first consumer, so it cannot change afterwards)
    ready_of: dict[int, tuple[set, float]] = {}
    for i in range(n):
        for r, ts in enumerate(ranks):
            if i >= len(ts):
                continue
            t = ts[i]
            ps = producers.get((r, t.id), ())
            hit = ready_of.get(id(ps)) if ps else None
            if hit is not None and hit[0] is ps:
                ready = hit[1]
            else:
                # == the running max of finish + sync_us from 0.0 (rounding is monotonic; all terms > 0)
                ready = max(0.0, max(map(finish.__getitem__, ps)) + sync_us) if ps else 0.0
                if ps:
                    ready_of[id(ps)] = (ps, ready)
            free, sm = heapq.heappop(heaps[r])
            start = max(free, ready)
            end = start + cost(t)
            t.sm, t.order = sm, counts[r][sm]
            counts[r][sm] += 1
            finish[(r, t.id)] = end
            where[(r, t.id)] = sm
            heapq.heappush(heaps[r], (end, sm))
    return [max((f for (rr, _), f in finish.items() if rr == r), default=0.0) for r in range(len(ranks))]


def sm_lists(tasks: list[Task], num_sms: int) -> list[list[int]]:
    lists: list[list[int]] = [[] for _ in range(num_sms)]
    for t in sorted(tasks, key=lambda t: (t.sm, t.order)):
        lists[t.sm].append(t.id)
    return lists
