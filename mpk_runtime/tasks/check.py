"""Static checks of a TP group's task graphs, before anything runs:

  * every task sits on exactly one SM list, once;
  * every event's `triggers` equals the number of tasks that signal it;
  * every read is covered: each task that writes a region another task reads (same step, any rank) happens
    before the reader, through the reader's waits (directly or transitively) or earlier on the same SM;
    lag-1 reads (the next step's tokens) likewise through a lag-1 wait;
  * no deadlock: an abstract run of the per-SM lists of all ranks for several steps, under the counter
    protocol, completes (this is also what catches cycles).
"""
from __future__ import annotations

from collections import defaultdict, deque

from .graph import TaskGraph


class GraphCheckError(AssertionError):
    pass


def _data_deps(graphs: list[TaskGraph]):
    """Yield (reader, writer, lag) from region overlaps, by brute force per (tensor, rank)."""
    by_key: dict[tuple[str, int, int], list] = defaultdict(list)
    for g in graphs:
        for t in g.tasks:
            for w in t.writes:
                by_key[(w.tensor, w.rank, 0)].append((w, t))
            for w in t.lag_writes:
                by_key[(w.tensor, w.rank, 1)].append((w, t))
    for g in graphs:
        for t in g.tasks:
            for r in t.reads:
                for lag in (0, 1):
                    for w, wt in by_key.get((r.tensor, r.rank, lag), ()):
                        if (wt.rank, wt.id) != (t.rank, t.id) and w.overlaps(r):
                            yield t, wt, lag, r


def check_task_graphs(graphs: list[TaskGraph], steps: int = 3) -> dict:
    world = len(graphs)
    stats = {"tasks": 0, "deps": 0, "events": 0}
    # 1. placement
    for g in graphs:
        seen = [0] * len(g.tasks)
        for sm, lst in enumerate(g.sm_lists):
            for tid in lst:
                seen[tid] += 1
                if g.tasks[tid].sm != sm:
                    raise GraphCheckError(f"{g.tasks[tid].label()} is on SM {sm}'s list but says sm={g.tasks[tid].sm}")
        bad = [i for i, c in enumerate(seen) if c != 1]
        if bad:
            raise GraphCheckError(f"rank {g.rank}: tasks {bad[:5]} appear {[seen[i] for i in bad[:5]]} times in SM lists")
        stats["tasks"] += len(g.tasks)
        stats["events"] += len(g.events)
    # 2. triggers
    count = [[0] * len(g.events) for g in graphs]
    signalers: list[list[list[tuple[int, int]]]] = [[[] for _ in g.events] for g in graphs]
    for g in graphs:
        for t in g.tasks:
            for r, e in t.signals:
                if not (0 <= r < world and 0 <= e < len(graphs[r].events)):
                    raise GraphCheckError(f"{t.label()} signals a missing event {e} on rank {r}")
                count[r][e] += 1
                signalers[r][e].append((t.rank, t.id))
    for g in graphs:
        for e in g.events:
            if count[g.rank][e.id] != e.triggers:
                raise GraphCheckError(f"rank {g.rank} event {e.id}: triggers={e.triggers} but "
                                      f"{count[g.rank][e.id]} tasks signal it; waiters would hang or run early")
    # 3. coverage: writer must reach reader through waits (event producers) or SM program order
    preds_cache: dict[tuple[int, int, int], set] = {}

    def direct_preds(rank: int, tid: int, lag: int) -> list[tuple[int, int]]:
        t = graphs[rank].tasks[tid]
        out = [p for e, l in t.waits if l == lag for p in signalers[rank][e]]
        if lag == 0 and t.order > 0:
            out.append((rank, graphs[rank].sm_lists[t.sm][t.order - 1]))
        return out

    def reaches(writer: tuple[int, int], reader, lag: int) -> bool:
        start = direct_preds(reader.rank, reader.id, lag)
        if writer in start:
            return True
        seen, dq = set(start), deque(start)
        while dq:  # transitively through same-step predecessors
            cur = dq.popleft()
            for p in direct_preds(cur[0], cur[1], 0):
                if p == writer:
                    return True
                if p not in seen:
                    seen.add(p)
                    dq.append(p)
        return False

    for reader, writer, lag, region in _data_deps(graphs):
        stats["deps"] += 1
        if not reaches((writer.rank, writer.id), reader, lag):
            raise GraphCheckError(f"{reader.label()} reads {region.tensor}{list(region.ranges)} on rank {region.rank}, "
                                  f"written by {writer.label()}{' in the previous step' if lag else ''}, "
                                  "but does not wait for it: missing dependency")
    # 4. deadlock: abstract run of all SM lists for `steps` steps
    counters = [[0] * len(g.events) for g in graphs]
    ptr = [[0] * g.num_sms for g in graphs]
    step_of = [[1] * g.num_sms for g in graphs]
    total = sum(len(g.tasks) for g in graphs) * steps
    done = 0
    progress = True
    while progress:
        progress = False
        for g in graphs:
            r = g.rank
            for sm in range(g.num_sms):
                lst = g.sm_lists[sm]
                while step_of[r][sm] <= steps:
                    if ptr[r][sm] == len(lst):
                        ptr[r][sm] = 0
                        step_of[r][sm] += 1
                        continue
                    t = g.tasks[lst[ptr[r][sm]]]
                    s = step_of[r][sm]
                    if any(counters[r][e] < g.events[e].triggers * (s - lag) for e, lag in t.waits):
                        break
                    for rr, e in t.signals:
                        counters[rr][e] += 1
                    ptr[r][sm] += 1
                    done += 1
                    progress = True
    if done != total:
        stuck = []
        for g in graphs:
            for sm in range(g.num_sms):
                if step_of[g.rank][sm] <= steps and ptr[g.rank][sm] < len(g.sm_lists[sm]):
                    t = g.tasks[g.sm_lists[sm][ptr[g.rank][sm]]]
                    s = step_of[g.rank][sm]
                    ev = [(e, counters[g.rank][e], g.events[e].triggers * (s - lag)) for e, lag in t.waits
                          if counters[g.rank][e] < g.events[e].triggers * (s - lag)]
                    stuck.append(f"rank {g.rank} SM {sm} step {s}: {t.label()} waits on (event, count, needed) {ev}")
        raise GraphCheckError("deadlock: the per-SM lists cannot complete under the event protocol:\n  "
                              + "\n  ".join(stuck[:8]))
    return stats
