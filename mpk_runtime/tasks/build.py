"""Graph (one per rank) -> TaskGraph (one per rank): decompose, derive tile-level events, schedule.

Dependencies come from regions, never from op boundaries: a task depends on exactly the tasks (of any rank)
whose write regions overlap its read regions. Consumers with the same producer set share one event, whose
`triggers` is the size of that set; every producer signals every event it belongs to.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from itertools import compress
from typing import Callable

from ..ir.graph import Graph
from .graph import Event, Region, Task, TaskGraph
from .ops import get_decomposer
from .ops.prefetch import prefetch_tasks
from .schedule import default_cost, list_schedule, sm_lists
from .tiling import Tiling


class _WriterIndex:
    """(tensor, rank) -> writer regions, searchable by overlap along the most selective dimension."""

    def __init__(self) -> None:
        self._raw: dict[tuple[str, int], list[tuple[Region, tuple[int, int]]]] = defaultdict(list)
        self._idx: dict[tuple[str, int], tuple[int, list[int], list, int]] = {}
        self._memo: dict[tuple, list[tuple[int, int]]] = {}

    def add(self, region: Region, who: tuple[int, int]) -> None:
        self._raw[(region.tensor, region.rank)].append((region, who))

    def freeze(self) -> None:
        for key, items in self._raw.items():
            ndim = max(len(r.ranges) for r, _ in items)
            best = max(range(ndim), key=lambda d: len({r.ranges[d][0] for r, _ in items if len(r.ranges) > d}))
            items.sort(key=lambda it: it[0].ranges[best][0] if len(it[0].ranges) > best else 0)
            los = [it[0].ranges[best][0] if len(it[0].ranges) > best else 0 for it in items]
            width = max((it[0].ranges[best][1] - it[0].ranges[best][0]) if len(it[0].ranges) > best else 1 << 60
                        for it in items)
            self._idx[key] = (best, los, items, width)

    def writers(self, region: Region) -> list[tuple[int, int]]:
        """Writers whose regions overlap `region`, in index order (memoised: many tiles read the same region)."""
        mkey = (region.tensor, region.rank, region.ranges)
        hit = self._memo.get(mkey)
        if hit is None:
            hit = self._memo[mkey] = self._writers(region)
        return hit

    def _writers(self, region: Region) -> list[tuple[int, int]]:
        key = (region.tensor, region.rank)
        if key not in self._idx:
            return []
        d, los, items, width = self._idx[key]
        if len(region.ranges) > d and width < (1 << 60):
            q0, q1 = region.ranges[d]
            lo = bisect.bisect_left(los, q0 - width + 1)
            hi = bisect.bisect_left(los, q1)
            cand = items[lo:hi]
        else:
            cand = items
        out = []
        q = region.ranges
        for r, who in cand:   # Region.overlaps, inlined (same tensor and rank by construction)
            for (a0, a1), (b0, b1) in zip(r.ranges, q):
                if a1 <= b0 or b1 <= a0:
                    break
            else:
                out.append(who)
        return out


def _wait_groups(ps: set, ranks: list[list[Task]], producers: dict, op_of: dict | None = None) -> list[set]:
    """Split a task's producers into one group per producing op, and drop groups already implied by another
    group (every member is a direct producer of one task of that group, which the consumer waits for anyway).

    Why: a consumer's producer set often mixes a big shared group (all gate_up tiles) with one private task
    (the residual's tile). One event per distinct mixed set would make every tile of the big group signal
    one event per consumer (128 atomics per task); per-op groups keep each producer's signals to a few."""
    if op_of is None:
        op_of = {(t.rank, t.id): t.op for ts in ranks for t in ts}
    ops = list(map(op_of.__getitem__, ps))          # in ps's iteration order
    first = dict.fromkeys(ops)                        # distinct ops, in order of first appearance
    if len(first) == 1:
        return [ps]   # one group: its element order is never consulted (only frozenset / sorted / len)
    # each group built by adding its members in ps's order, as a per-element loop would (next(iter(h)) below
    # depends on the set's layout)
    out = [set(compress(ps, map(op.__eq__, ops))) for op in first]
    keep = []
    for i, g in enumerate(out):
        implied = any(g <= producers.get(next(iter(h)), set()) for j, h in enumerate(out) if j != i)
        if not implied:
            keep.append(g)
    return keep or out


def decompose(graph: Graph, tiling: Tiling) -> list[Task]:
    per_op = {op.name: get_decomposer(op.kind)(op, graph, tiling, graph.rank) for op in graph.ops}
    tasks: list[Task] = []
    for op in graph.ops:
        extra = []
        if op.kind == "attention" and tiling.l2_prefetch_mb > 0:   # tasks/ops/prefetch.py
            layer = op.name.rsplit(".", 1)[0]
            extra = prefetch_tasks(per_op[op.name], per_op.get(f"{layer}.o_proj", []),
                                   per_op.get(f"{layer}.gate_up", []), tiling.l2_prefetch_mb * 1e6,
                                   tiling.num_sms, graph.rank)
        for t in per_op[op.name] + extra:
            t.id = len(tasks)
            tasks.append(t)
    return tasks


def build_task_graphs(graphs: list[Graph], tiling: Tiling | None = None,
                      cost: Callable[[Task], float] = default_cost) -> list[TaskGraph]:
    """One TaskGraph per rank of a TP group (`graphs[r]` is rank r's Graph)."""
    world = len(graphs)
    for r, g in enumerate(graphs):
        if g.rank != r or g.tp != world:
            raise ValueError(f"graphs[{r}] is rank {g.rank} of tp={g.tp}; pass one graph per rank, in rank order")
    tiling = tiling or Tiling()
    ranks = [decompose(g, tiling) for g in graphs]

    writers, lag_writers = _WriterIndex(), _WriterIndex()
    for ts in ranks:
        for t in ts:
            for w in t.writes:
                writers.add(w, (t.rank, t.id))
            for w in t.lag_writes:
                lag_writers.add(w, (t.rank, t.id))
    writers.freeze()
    lag_writers.freeze()

    producers: dict[tuple[int, int], set[tuple[int, int]]] = {}
    events: list[list[Event]] = [[] for _ in range(world)]
    event_of: list[dict[tuple[frozenset, int], int]] = [dict() for _ in range(world)]
    # Tiles of one op mostly read the same regions, so they get the same producer set and wait groups: both are
    # memoised on the read regions (pure speed-up: the same sets, built in the same insertion order, as before).
    # A memoised entry is reused only for a task that is not itself in the set and once every member has been
    # visited (their own producer sets, which _wait_groups consults, are final by then).
    memo: list[dict] = [dict(), dict()]
    op_of = {(t.rank, t.id): t.op for ts in ranks for t in ts}
    lag_tensors = {w.tensor for ts in ranks for t in ts for w in t.lag_writes}
    for ts in ranks:
        for t in ts:
            me = (t.rank, t.id)
            for lag, index in ((0, writers), (1, lag_writers)):
                if lag and not any(reg.tensor in lag_tensors for reg in t.reads):
                    continue   # no lag-1 writer of anything it reads: ps would be empty
                mkey = tuple(t.reads)
                hit = memo[lag].get(mkey)
                if hit is not None and hit[3] is None:   # first reuse: were all members visited when it was made?
                    hit[3] = max(hit[0]) < hit[2]
                if hit is not None and hit[3] and me not in hit[0]:
                    ps, groups = hit[0], hit[1]
                else:
                    union = {who for reg in t.reads for who in index.writers(reg)}
                    ps = union - ({me} if lag == 0 else set())
                    groups = None
                if not ps:
                    continue
                if lag == 0:
                    producers[me] = ps
                if groups is None:
                    groups = [(g, frozenset(g))
                              for g in (_wait_groups(ps, ranks, producers, op_of) if lag == 0 else [ps])]
                    if hit is None and me not in union:
                        memo[lag][mkey] = [ps, groups, me, None]   # usable once max(ps) < me is confirmed
                for group, fgroup in groups:
                    key = (fgroup, lag)
                    eid = event_of[t.rank].get(key)
                    if eid is None:
                        eid = len(events[t.rank])
                        event_of[t.rank][key] = eid
                        events[t.rank].append(Event(eid, t.rank, len(group), sorted(group)))
                        for (pr, pid) in sorted(group):
                            ranks[pr][pid].signals.append((t.rank, eid))
                    t.waits.append((eid, lag))

    makespans = list_schedule(ranks, tiling.num_sms, producers, cost)
    out = []
    for r, ts in enumerate(ranks):
        out.append(TaskGraph(r, world, tiling.num_sms, ts, events[r], sm_lists(ts, tiling.num_sms),
                             meta={"mode": graphs[r].mode, "batch": graphs[r].batch,
                                   "tokens_per_seq": graphs[r].tokens_per_seq, "makespan_us": makespans[r],
                                   "tiling": tiling.to_dict(), "model": graphs[r].config.name}))
    return out
