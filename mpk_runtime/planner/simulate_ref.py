"""The reference (original, straightforward) simulator, kept to test the fast one in simulate.py against.

Same model and same results (up to float rounding) as `simulate.simulate`; about 5x slower. Only tests use it.

Discrete-event simulation of the static schedule the kernel really runs.

It replays the TaskGraphs' per-SM lists under the same counter protocol as the GPU kernel and pyvm (waits
`counter >= triggers * (step - lag)`, signals after a task), with costs from a HardwareProfile:
  * a task = fixed cost (dispatch, waits observed, pipeline fill) + streaming its bytes + a Tensor Core floor;
  * streaming SMs of one GPU share its bandwidth as a fluid: each gets min(bw(1), bw(n) / n) for n streaming;
  * a signal becomes visible `sync_us` later on the same GPU, `remote_signal_us(tile bytes)` on a peer.
The result says when every task started and ended, so it can also be shown as a trace.
"""
from __future__ import annotations

import heapq
import itertools

from ..tasks.graph import Task, TaskGraph
from .profile import HardwareProfile
from .simulate import (SimResult, finish_result, task_serial_us, task_stream_bytes, task_stream_eff,
                       task_tc_us)


def simulate_reference(graphs: list[TaskGraph], prof: HardwareProfile, steps: int = 1,
                       record: bool = False) -> SimResult:
    R = len(graphs)
    cap = prof.per_sm_bw(1)
    seq = itertools.count()
    heap: list = []  # (time, seq, kind, payload)
    counters = [[0] * len(g.events) for g in graphs]
    waiting: list[dict[int, list[int]]] = [dict() for _ in range(R)]  # rank -> event -> [sm]
    ptr = [[0] * g.num_sms for g in graphs]
    kstep = [[1] * g.num_sms for g in graphs]
    # fluid streaming state per rank: virtual bytes V (per streaming task), rate, heap of (V_end, sm)
    V = [0.0] * R
    t_v = [0.0] * R
    streaming: list[dict[int, float]] = [dict() for _ in range(R)]   # sm -> V_end
    stream_t0: list[dict[int, float]] = [dict() for _ in range(R)]
    version = [0] * R
    busy = 0.0
    res = SimResult(0.0, [0.0] * R)
    last_end = [0.0] * R
    total_bytes = 0

    rates = [0.0] + [min(cap, prof.bw(n) / n) / 1e6 for n in range(1, max(g.num_sms for g in graphs) + 1)]

    def rate(r: int) -> float:  # bytes per us per streaming SM
        return rates[len(streaming[r])]

    def advance(r: int, now: float) -> None:
        V[r] += (now - t_v[r]) * rate(r)
        t_v[r] = now

    def reschedule(r: int, now: float) -> None:
        version[r] += 1
        if streaming[r]:
            v_end = min(streaming[r].values())
            dt = max(0.0, (v_end - V[r]) / rate(r))
            heapq.heappush(heap, (now + dt, next(seq), "stream_check", (r, version[r])))

    def current(r: int, sm: int) -> Task | None:
        g = graphs[r]
        lst = g.sm_lists[sm]
        if not lst or kstep[r][sm] > steps:
            return None
        return g.tasks[lst[ptr[r][sm]]]

    def try_start(r: int, sm: int, now: float) -> None:
        t = current(r, sm)
        if t is None:
            return
        s = kstep[r][sm]
        g = graphs[r]
        for e, lag in t.waits:
            need = g.events[e].triggers * (s - lag)
            if counters[r][e] < need:
                waiting[r].setdefault(e, []).append((need, sm))
                return
        if record:
            res.start[(r, s, t.id)] = now
        heapq.heappush(heap, (now + task_serial_us(t, prof), next(seq), "fixed_done", (r, sm, now)))

    def finish(r: int, sm: int, now: float, t0: float) -> None:
        nonlocal busy
        t = current(r, sm)
        s = kstep[r][sm]
        busy += now - t0
        if record:
            res.end[(r, s, t.id)] = now
        last_end[r] = max(last_end[r], now)
        for rr, e in t.signals:
            lat = prof.sync_us if rr == r else prof.remote_signal_us(max(64, t.est_bytes // 64))
            heapq.heappush(heap, (now + lat, next(seq), "signal", (rr, e)))
        ptr[r][sm] += 1
        if ptr[r][sm] == len(graphs[r].sm_lists[sm]):
            ptr[r][sm] = 0
            kstep[r][sm] += 1
        try_start(r, sm, now)

    starts: dict[tuple[int, int], float] = {}
    for r, g in enumerate(graphs):
        for sm in range(g.num_sms):
            try_start(r, sm, 0.0)
    while heap:
        now, _, kind, p = heapq.heappop(heap)
        if kind == "signal":
            r, e = p
            counters[r][e] += 1
            ws = waiting[r].get(e)
            if ws:
                ready = [sm for need, sm in ws if need <= counters[r][e]]
                if ready:
                    waiting[r][e] = [(need, sm) for need, sm in ws if need > counters[r][e]]
                    for sm in ready:
                        try_start(r, sm, now)
        elif kind == "fixed_done":
            r, sm, t0 = p
            t = current(r, sm)
            starts[(r, sm)] = t0
            nbytes = task_stream_bytes(t, prof)
            total_bytes += nbytes
            if nbytes:
                advance(r, now)
                # a kernel that streams below its fair share (latency-bound) moves "more" bytes in the fluid
                streaming[r][sm] = V[r] + nbytes / task_stream_eff(t, prof)
                stream_t0[r][sm] = now
                reschedule(r, now)
            else:
                heapq.heappush(heap, (now + task_tc_us(t, prof), next(seq), "done", (r, sm)))
        elif kind == "stream_check":
            r, ver = p
            if ver != version[r]:
                continue
            advance(r, now)
            done = [sm for sm, ve in streaming[r].items() if ve <= V[r] + 1e-6]
            for sm in done:
                del streaming[r][sm]
                t = current(r, sm)
                floor_end = stream_t0[r].pop(sm) + task_tc_us(t, prof)
                heapq.heappush(heap, (max(now, floor_end), next(seq), "done", (r, sm)))
            reschedule(r, now)
        elif kind == "done":
            r, sm = p
            finish(r, sm, now, starts.pop((r, sm)))
    unfinished = [(r, sm) for r, g in enumerate(graphs) for sm in range(g.num_sms) if current(r, sm) is not None]
    return finish_result(res, graphs, unfinished, last_end, busy, total_bytes)
