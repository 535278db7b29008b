"""Discrete-event simulation of the static schedule the kernel really runs.

It replays the TaskGraphs' per-SM lists under the same counter protocol as the GPU kernel and pyvm (waits
`counter >= triggers * (step - lag)`, signals after a task), with costs from a HardwareProfile:
  * a task = fixed cost (dispatch, waits observed, pipeline fill) + streaming its bytes + a Tensor Core floor;
  * streaming SMs of one GPU share its bandwidth as a fluid: each gets min(bw(1), bw(n) / n) for n streaming;
  * a signal becomes visible `sync_us` later on the same GPU, `remote_signal_us(tile bytes)` on a peer.
The result says when every task started and ended, so it can also be shown as a trace.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from math import ulp

from ..tasks.graph import Task, TaskGraph
from .profile import HardwareProfile


@dataclass
class SimResult:
    makespan_us: float                      # slowest rank, one launch of `steps` steps (no launch overhead)
    per_rank_us: list[float]
    start: dict[tuple[int, int, int], float] = field(default_factory=dict)   # (rank, step, task) -> us
    end: dict[tuple[int, int, int], float] = field(default_factory=dict)
    busy_fraction: float = 0.0              # SM-time running tasks / (SMs x makespan)
    stream_bytes: int = 0

    def to_chrome_trace(self, graphs: list[TaskGraph]) -> list[dict]:
        ev = []
        for (r, s, tid), t0 in self.start.items():
            t = graphs[r].tasks[tid]
            ev.append({"name": f"{t.kind} {t.op}", "ph": "X", "ts": t0, "dur": self.end[(r, s, tid)] - t0,
                       "pid": r, "tid": t.sm, "args": {"step": s, "task": tid}})
        return ev


def task_tc_us(t: Task, prof: HardwareProfile) -> float:
    """The compute floor of a task: Tensor Core time, or the measured per-flop cost of this kernel kind."""
    if not t.est_flops:
        return 0.0
    rows = max(1, round(t.est_flops / max(1, t.est_bytes)))  # flops per weight byte ~ rows for a GEMM tile
    return max(prof.tc_time_us(t.est_flops, rows), t.est_flops * prof.flop_us(t.kind))


def task_stream_bytes(t: Task, prof: HardwareProfile) -> float:
    """Bytes a task streams from HBM. A megakernel linear tile loops over row groups of `prof.row_tile` rows
    (device_kernels/ops/linear.cuh) and every group re-reads its weight tile: at batch 32 the 8-row kernel
    streams each weight tile 4 times (the batch >= 8 cost that no Tensor Core path removes yet)."""
    if t.kind != "linear" or prof.row_tile <= 0 or not t.reads:
        return t.est_bytes
    rng = t.reads[0].ranges
    M = rng[0][1] - rng[0][0]
    groups = -(-M // prof.row_tile)
    if groups <= 1:
        return t.est_bytes
    K = rng[1][1] - rng[1][0] if len(rng) > 1 else 0
    p = t.params
    wbytes = len(p.get("weights", ())) * (p.get("n1", 0) - p.get("n0", 0)) * K * 2
    return t.est_bytes + (groups - 1) * wbytes * prof.restream_frac


def simulate(graphs: list[TaskGraph], prof: HardwareProfile, steps: int = 1, record: bool = False) -> SimResult:
    """Makespan (and, with `record`, every task's start and end) of the graphs' static schedule.

    Same model and event order as `simulate_ref.simulate_reference` (the straightforward version, kept for the
    tests), written for speed: per-task costs are computed once up front, SMs / tasks / events are numbered
    globally, each rank's streaming SMs sit in a heap keyed by their virtual end (the next completion is its
    top, not a scan), and a waiter list is only scanned once the counter reaches its smallest need."""
    R = len(graphs)
    cap = prof.per_sm_bw(1)
    rates = [0.0] + [min(cap, prof.bw(n) / n) / 1e6 for n in range(1, max(g.num_sms for g in graphs) + 1)]
    # --- static tables, flat over ranks: global SM g = sm_off[r] + sm, task = task_off[r] + id, event likewise
    sm_off, task_off, ev_off = [], [], []
    nsm = ntask = nev = 0
    for g in graphs:
        sm_off.append(nsm)
        task_off.append(ntask)
        ev_off.append(nev)
        nsm += g.num_sms
        ntask += len(g.tasks)
        nev += len(g.events)
    sm_rank = [r for r, g in enumerate(graphs) for _ in range(g.num_sms)]
    lists = [[task_off[r] + tid for tid in lst] for r, g in enumerate(graphs) for lst in g.sm_lists]
    fixed, vbytes, nbytes_of, tc, waits, signals = [], [], [], [], [], []
    fixed_by_kind: dict[str, float] = {}
    for r, g in enumerate(graphs):
        ev = g.events
        for t in g.tasks:
            f = fixed_by_kind.get(t.kind)
            if f is None:
                f = fixed_by_kind[t.kind] = prof.fixed_us(t.kind)
            fixed.append(f)
            nb = task_stream_bytes(t, prof)
            nbytes_of.append(nb)
            # a kernel that streams below its fair share (latency-bound) moves "more" bytes in the fluid
            vbytes.append(nb / prof.stream_eff(t.kind) if nb else 0.0)
            tc.append(task_tc_us(t, prof))
            waits.append([(ev_off[r] + e, ev[e].triggers, lag) for e, lag in t.waits])
            sig = []
            for rr, e in t.signals:
                lat = prof.sync_us if rr == r else prof.remote_signal_us(max(64, t.est_bytes // 64))
                sig.append((ev_off[rr] + e, lat))
            signals.append(sig)
    # --- dynamic state
    counters = [0] * nev
    waiting: dict[int, list] = {}          # global event -> [smallest need, [(need, global SM), ...]]
    ptr = [0] * nsm
    kstep = [1] * nsm
    t_start = [0.0] * nsm                  # when the SM's current task started (its fixed part)
    s_t0 = [0.0] * nsm                     # when its streaming started
    V = [0.0] * R                          # fluid: virtual bytes streamed by each streaming SM of the rank
    t_v = [0.0] * R
    nstream = [0] * R
    sheap: list[list] = [[] for _ in range(R)]   # (virtual end, start order, global SM)
    version = [0] * R
    last_end = [0.0] * R
    busy = 0.0
    total_bytes = 0
    res = SimResult(0.0, [0.0] * R)
    rstart, rend = res.start, res.end
    heap: list = []   # (time, seq, kind, a, b): 0 signal (event), 1 fixed done (SM, t0), 2 stream check (rank,
    seq = 0           # version), 3 done (SM)
    push, pop = heapq.heappush, heapq.heappop

    def try_start(gs: int, now: float) -> None:
        nonlocal seq
        lst = lists[gs]
        s = kstep[gs]
        if not lst or s > steps:
            return
        tid = lst[ptr[gs]]
        for e, trig, lag in waits[tid]:
            need = trig * (s - lag)
            if counters[e] < need:
                w = waiting.get(e)
                if w is None:
                    waiting[e] = [need, [(need, gs)]]
                else:
                    if not w[1] or need < w[0]:
                        w[0] = need
                    w[1].append((need, gs))
                return
        if record:
            r = sm_rank[gs]
            rstart[(r, s, tid - task_off[r])] = now
        seq += 1
        push(heap, (now + fixed[tid], seq, 1, gs, now))

    for gs in range(nsm):
        try_start(gs, 0.0)
    eps = 1e-6
    while heap:
        now, _, kind, a, b = pop(heap)
        if kind == 0:                                    # a signal arrives: event a
            c = counters[a] + 1
            counters[a] = c
            w = waiting.get(a)
            if w is not None and w[1] and w[0] <= c:
                ready = [gs for need, gs in w[1] if need <= c]
                rest = [(need, gs) for need, gs in w[1] if need > c]
                w[1] = rest
                w[0] = min(need for need, _ in rest) if rest else 0
                for gs in ready:
                    try_start(gs, now)
        elif kind == 1:                                  # fixed part done: stream, or go to the compute floor
            gs = a
            t_start[gs] = b
            tid = lists[gs][ptr[gs]]
            nb = nbytes_of[tid]
            total_bytes += nb
            if nb:
                r = sm_rank[gs]
                n = nstream[r]
                V[r] += (now - t_v[r]) * rates[n]
                t_v[r] = now
                seq += 1
                hp = sheap[r]
                push(hp, (V[r] + vbytes[tid], seq, gs))
                nstream[r] = n + 1
                s_t0[gs] = now
                version[r] += 1
                dt = (hp[0][0] - V[r]) / rates[n + 1]
                seq += 1
                push(heap, (now + (dt if dt > 0.0 else 0.0), seq, 2, r, version[r]))
            else:
                seq += 1
                push(heap, (now + tc[tid], seq, 3, gs, 0))
        elif kind == 2:                                  # a streaming SM of rank a may have finished
            r = a
            if b != version[r]:
                continue
            n = nstream[r]
            V[r] += (now - t_v[r]) * rates[n]
            t_v[r] = now
            hp = sheap[r]
            # done: within 1e-6 virtual bytes, or closer than a few ulps of the clock (a later check could not
            # advance `now`) or of V (it could not advance V). The reference used only 1e-6: once V ~ 1e9 bytes
            # and now ~ 1e5 us (a 36-layer model at batch 128) that spun through millions of checks a few ulps
            # apart; the extra slack is below float resolution, so predictions are unchanged beyond rounding.
            lim = V[r] + max(eps, rates[n] * 4.0 * ulp(now), 4.0 * ulp(V[r]))
            done = []
            while hp and hp[0][0] <= lim:
                _, o, gs = pop(hp)
                done.append((o, gs))
            if len(done) > 1:
                done.sort()
            n -= len(done)
            nstream[r] = n
            for _, gs in done:
                fe = s_t0[gs] + tc[lists[gs][ptr[gs]]]
                seq += 1
                push(heap, (fe if fe > now else now, seq, 3, gs, 0))
            version[r] += 1
            if n:
                dt = (hp[0][0] - V[r]) / rates[n]
                seq += 1
                push(heap, (now + (dt if dt > 0.0 else 0.0), seq, 2, r, version[r]))
        else:                                            # task done on SM a
            gs = a
            r = sm_rank[gs]
            tid = lists[gs][ptr[gs]]
            busy += now - t_start[gs]
            if record:
                rend[(r, kstep[gs], tid - task_off[r])] = now
            if now > last_end[r]:
                last_end[r] = now
            for e, lat in signals[tid]:
                seq += 1
                push(heap, (now + lat, seq, 0, e, 0))
            p = ptr[gs] + 1
            if p == len(lists[gs]):
                p = 0
                kstep[gs] += 1
            ptr[gs] = p
            try_start(gs, now)
    unfinished = [(sm_rank[gs], gs - sm_off[sm_rank[gs]]) for gs in range(nsm) if lists[gs] and kstep[gs] <= steps]
    if unfinished:
        raise RuntimeError(f"simulation stalled (deadlock in the schedule?) on (rank, SM) {unfinished[:5]}")
    res.per_rank_us = last_end
    res.makespan_us = max(last_end)
    res.busy_fraction = busy / max(1e-9, sum(g.num_sms for g in graphs) * res.makespan_us)
    res.stream_bytes = int(total_bytes)
    return res
