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

from ..codegen import layout as L
from ..tasks.graph import Task, TaskGraph
from ..tasks.tiling import attn_wide
from .profile import HardwareProfile, key_fallbacks


@dataclass
class SimResult:
    makespan_us: float                      # slowest rank, one launch of `steps` steps (no launch overhead)
    per_rank_us: list[float]
    start: dict[tuple[int, int, int], float] = field(default_factory=dict)   # (rank, step, task) -> us
    end: dict[tuple[int, int, int], float] = field(default_factory=dict)
    busy_fraction: float = 0.0              # SM-time running tasks / (SMs x makespan)
    stream_bytes: int = 0

    def to_chrome_trace(self, graphs: list[TaskGraph]) -> list[dict]:
        """The recorded schedule in Megakernel.chrome_trace's format (name = task kind, cat = op, args label and
        step), so scripts/trace_phases.py reads a simulated step as it reads a measured one."""
        ev = []
        for (r, s, tid), t0 in self.start.items():
            t = graphs[r].tasks[tid]
            ev.append({"name": t.kind, "cat": t.op, "ph": "X", "ts": t0, "dur": self.end[(r, s, tid)] - t0,
                       "pid": r, "tid": t.sm, "args": {"label": t.label(), "step": s, "task": tid}})
        return ev


def linear_shape(t: Task) -> tuple[int, int, int, int, int]:
    """(M, K, w, nw, kseg) of a linear task as the packer passes them to the kernel: M output rows (the kernel's
    loop bound; row_select reads fewer rows than x has), K inputs, w = n1 - n0 columns, nw weights, K segments."""
    p = t.params
    M = t.writes[0].ranges[-2][1] - t.writes[0].ranges[-2][0]
    rng = t.reads[0].ranges
    K = rng[1][1] - rng[1][0]
    return M, K, p["n1"] - p["n0"], len(p["weights"]), p.get("k_segments", 1)


def linear_passes(t: Task) -> tuple[int, int]:
    """(tc_rows, passes) of a linear task: codegen/layout.linear_geometry, the function the packer calls
    (layout.linear_tile in the packer), so the simulator's rows per pass are the kernel's. tc_rows 0 = CUDA cores
    (op_linear, ROW_TILE rows per pass). The weight tile is streamed once per pass."""
    M, K, w, nw, kseg = linear_shape(t)
    tc_rows = L.linear_geometry(M, K, w, nw, kseg)[0]
    return tc_rows, L.linear_passes(M, K, w, nw, kseg)[1]


def qkv_shape(t: Task) -> tuple[int, int, int]:
    """(M rows, K = hidden, D = head dim) of a qkv_rope head task (est_flops = 2 M D K)."""
    rng = t.reads[0].ranges
    M, K = rng[0][1] - rng[0][0], rng[1][1] - rng[1][0]
    return M, K, t.est_flops // max(1, 2 * M * K)


def cost_key(t: Task) -> str:
    """The profile key a task's fitted terms are looked up under: its kind, or "<kind>@tc" for a linear tile or
    qkv_rope part that runs on Tensor Cores (a different code path from the batch-1 CUDA-core loop, with its own
    fixed cost and streaming rate), "linear@tc2" for a Tensor Core tile of two weights (gate_up: the k loop is
    not software-pipelined there, device_kernels/ops/linear.cuh, so it streams at its own rate). A profile
    without the key falls back to "<kind>@tc", then to the kind (profile._by_key)."""
    if t.kind == "linear" and t.reads and linear_passes(t)[0]:
        return "linear@tc2" if len(t.params.get("weights", ())) == 2 else "linear@tc"
    if t.kind == "qkv_rope" and t.reads and qkv_shape(t)[0] >= L.CONSTANTS["TC_MIN_M"]:
        return "qkv_rope@tc"
    if t.kind == "attn_partial" and "head_dim" in t.params and \
            attn_wide(t.params["head_dim"], t.params.get("ng", 1)) == 2:
        return "attn_partial@w2"   # wide passes (attention.cuh): their own per-key chain cost
    return t.kind


def _mma_us(rows_list, w: int, K: int, nw: int, prof: HardwareProfile) -> float:
    """mma.sync m16n8k16 time of passes of `rows_list` rows: batch rows padded to 8 (the mma's n), columns to
    16 (its m), at the Tensor Core rate of one SM x mk_tc_eff."""
    w16 = -(-w // 16) * 16
    fl = sum(2 * nw * w16 * K * (-(-r // 8) * 8) for r in rows_list)
    return fl / (prof.tc_flops_per_s / prof.num_sms * prof.mk_tc_eff) * 1e6


def task_tc_us(t: Task, prof: HardwareProfile) -> float:
    """The compute floor of a task. Linear tiles (mk_linear_model "tc", the kernel since 7cee539): passes of
    tc_rows rows on Tensor Cores (mma.sync, `_mma_us`) plus `linear_pass_us` per pass after the first (x rows
    reloaded and normed, epilogue, barriers), or below TC_MIN_M rows the fitted CUDA-core per-flop cost;
    qkv_rope likewise in ROW_TILE-row passes. Other kinds (and the "row_tile" legacy model): Tensor Core time at
    the wgmma granularity or the kind's measured per-flop cost, the larger."""
    if not t.est_flops:
        return 0.0
    if prof.mk_linear_model == "tc" and t.kind == "linear" and t.reads:
        tc_rows, passes = linear_passes(t)
        extra = (passes - 1) * prof.linear_pass_us
        if not tc_rows:
            return t.est_flops * prof.flop_us(t.kind) + extra
        M, K, w, nw, _ = linear_shape(t)
        rows = [min(tc_rows, M - g) for g in range(0, M, tc_rows)]
        return _mma_us(rows, w, K, nw, prof) + extra
    if prof.mk_linear_model == "tc" and t.kind == "qkv_rope" and t.reads:
        M, K, D = qkv_shape(t)
        RT, tmin = L.CONSTANTS["ROW_TILE"], L.CONSTANTS["TC_MIN_M"]
        rows = [min(RT, M - g) for g in range(0, M, RT)]   # qkv_rope.cuh: ROW_TILE rows per pass
        us = _mma_us([r for r in rows if r >= tmin and K % 32 == 0], D, K, 1, prof)
        cc = sum(r for r in rows if r < tmin or K % 32)
        return us + 2 * cc * D * K * prof.flop_us(t.kind) + (len(rows) - 1) * prof.linear_pass_us
    rows = max(1, round(t.est_flops / max(1, t.est_bytes)))  # flops per weight byte ~ rows for a GEMM tile
    key = cost_key(t)
    chain = t.est_flops * prof.flop_us(key)
    if "keys" in t.params:   # attention partials: the per-key part of their pass chain
        chain += t.params["keys"] * t.params.get("ng", 1) * prof.key_us(key)
    return max(prof.tc_time_us(t.est_flops, rows), chain)


def task_serial_us(t: Task, prof: HardwareProfile) -> float:
    """A task's fixed part: the kind's fixed cost, plus for a Tensor Core linear tile `tc_pass_us(tc_rows)` per
    pass (profile.tc_pass_us_by_rows: serial per-pass time that neither the stream nor the mma floor covers)."""
    f = prof.fixed_us(cost_key(t))
    if prof.tc_pass_us_by_rows and prof.mk_linear_model == "tc" and t.kind == "linear" and t.reads:
        tc_rows, passes = linear_passes(t)
        if tc_rows:
            f += passes * prof.tc_pass_us(tc_rows)
    return f


def task_stream_bytes(t: Task, prof: HardwareProfile) -> float:
    """Bytes a task streams from HBM: its own bytes, plus its weight tile again for every pass after the first
    (`restream_frac` of it from HBM). mk_linear_model "tc" (default, the kernel since 7cee539): a linear tile
    makes `linear_passes` passes (tc_rows rows each on Tensor Cores, ROW_TILE on CUDA cores), a qkv_rope head
    one pass per ROW_TILE rows. "row_tile" (legacy, the CUDA-core kernel before it): a linear tile re-streams
    per group of `prof.row_tile` rows (0 = never). A weight_prefetch task streams nothing itself (its L2
    prefetches run in the background; neither their HBM traffic nor the later L2 hits are modelled yet)."""
    if t.kind == "weight_prefetch":
        return 0
    if prof.mk_linear_model == "tc":
        if t.kind == "qkv_rope" and t.reads:
            M, K, D = qkv_shape(t)
            passes = -(-M // L.CONSTANTS["ROW_TILE"])
            return t.est_bytes + (passes - 1) * D * K * 2 * prof.restream_frac
        if t.kind != "linear" or not t.reads:
            return t.est_bytes
        _, passes = linear_passes(t)
        if passes <= 1:
            return t.est_bytes
        M, K, w, nw, _ = linear_shape(t)
        return t.est_bytes + (passes - 1) * nw * w * K * 2 * prof.restream_frac
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


def kv_piece_bytes(head_dim: int) -> int:
    """Contiguous bytes of one KV head an attention task reads before it jumps a row (bf16): one row of head_dim
    values of a (page, slot, head, D) page (runtime/memory.py KVStore)."""
    return head_dim * 2


def task_stream_eff(t: Task, prof: HardwareProfile) -> float:
    """Achieved / fair-share streaming rate of a task: the kind's, times `mk_tc_stream_eff` for a Tensor Core
    tile (linear with tc_rows > 0, qkv_rope from TC_MIN_M rows): it keeps fewer weight bytes in flight per warp
    (UN 16-byte rounds of two rows) than the CUDA-core batch-1 loop (UNROLL vectors x 2 columns); an attention
    partial's times the KV cache's rate for its pieces (prof.kv_piece_eff, kv_piece_bytes)."""
    key = cost_key(t)
    if t.kind == "attn_partial" and prof.kv_piece_eff_by_bytes and "head_dim" in t.params:   # (no table: 1)
        return prof.stream_eff(key) * prof.kv_piece_eff(kv_piece_bytes(t.params["head_dim"]))
    if "@tc" not in key:   # the kind's (an attention "@w" key falls back to it): not a Tensor Core tile
        return prof.stream_eff(key)
    for k in key_fallbacks(key)[:-1]:        # fitted for the Tensor Core path itself
        if k in prof.stream_eff_by_kind:
            return prof.stream_eff_by_kind[k]
    e = prof.stream_eff(t.kind)
    return e * prof.mk_tc_stream_eff if prof.mk_linear_model == "tc" else e


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
    fixed_by_key: dict[str, float] = {}
    per_pass = bool(prof.tc_pass_us_by_rows)
    for r, g in enumerate(graphs):
        ev = g.events
        for t in g.tasks:
            if per_pass and t.kind == "linear":
                f = task_serial_us(t, prof)
            else:
                key = cost_key(t)
                f = fixed_by_key.get(key)
                if f is None:
                    f = fixed_by_key[key] = prof.fixed_us(key)
            fixed.append(f)
            nb = task_stream_bytes(t, prof)
            nbytes_of.append(nb)
            # a kernel that streams below its fair share (latency-bound) moves "more" bytes in the fluid
            vbytes.append(nb / task_stream_eff(t, prof) if nb else 0.0)
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
    return finish_result(res, graphs, unfinished, last_end, busy, total_bytes)


def finish_result(res: SimResult, graphs: list[TaskGraph], unfinished: list, last_end: list[float], busy: float,
                  total_bytes: float) -> SimResult:
    """The end of a simulation (this one and simulate_ref's): refuse a stalled schedule, fill the totals."""
    if unfinished:
        raise RuntimeError(f"simulation stalled (deadlock in the schedule?) on (rank, SM) {unfinished[:5]}")
    res.per_rank_us = last_end
    res.makespan_us = max(last_end)
    res.busy_fraction = busy / max(1e-9, sum(g.num_sms for g in graphs) * res.makespan_us)
    res.stream_bytes = int(total_bytes)
    return res
