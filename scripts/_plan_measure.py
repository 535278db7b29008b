"""Measuring one plan on a GPU (or, as a logic check, on the CPU through pyvm): a (model, batch) point's graphs,
memory, KV cache and step inputs (`Point`), and `measure_plan`: the step as one CUDA graph replayed and timed alone
(synchronised), median, then per-segment graphs with events between them. Used by scripts/validate_planner.py,
bench_decode.py's planned column and profile_conventional.py."""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository root
from mpk_runtime.envflags import env_choice  # noqa: E402
from mpk_runtime.ir import build_graph  # noqa: E402
from mpk_runtime.models.reference import rope_inv_freq  # noqa: E402
from mpk_runtime.runtime.memory import KVStore, RankMemory, StepCtx  # noqa: E402
from mpk_runtime.runtime.plan_exec import PlanExecutor  # noqa: E402


def med(x):
    x = sorted(x)
    return x[len(x) // 2]


def measure_cap() -> str:
    """$MPK_MEASURE_CAP resolved: "serving" (unset) or "tight" (key_cap)."""
    return env_choice("MPK_MEASURE_CAP", ("serving", "tight"), "serving")


def key_cap(context: int, cfg) -> int:
    """The conventional attention's key cap for a step at `context` (it reads context + 1 keys). $MPK_MEASURE_CAP:
    "serving" (default since session 39) = the engine's rule (runtime/megakernel_plans.kv_cap: the power of two
    above, >= 256), what LLM.generate's captured steps run, where the rows are up to half the cap short (the paged
    kernel's MPK_PAGED_ROW_KEYS=split, its default, sizes each row's splits by its own keys); "tight" = context + 1,
    as every measurement before session 39."""
    if measure_cap() == "tight":
        return context + 1
    from mpk_runtime.runtime.megakernel_plans import kv_cap
    return kv_cap(context + 1, max(context + 1, cfg.max_position_embeddings))


class Point:
    """One (model, batch) on this rank: graph, memory, KV cache, step inputs (device tensors, fixed in place)."""

    def __init__(self, cfg, w, B, context, dev, splits, tp=1, rank=0, heap=None, sampled=False):
        cap = key_cap(context, cfg)
        ps, max_seq = 16, context + 64
        pps = -(-max_seq // ps)
        self.graphs = [build_graph(cfg, batch=B, context_len=context, max_seq_len=max_seq, attn_splits=splits, tp=tp,
                                   rank=r) for r in range(tp)]
        g = self.graphs[rank]
        self.kv = KVStore(cfg.num_layers, B * pps + 1, ps, g.tensors["L0.k_cache"].shape[1], cfg.head_dim,
                          w["model.norm.weight"].dtype, device=dev, poison=False)
        for c in self.kv.k + self.kv.v:
            c.normal_(0, 1.0)
        self.mem = RankMemory(g, w, self.kv, device=dev)
        self.syms = None
        if heap is not None:
            from mpk_runtime.runtime.nvshmem import place_symmetric
            self.syms = place_symmetric(self.mem, heap)
        # a serving cap past max_seq: the table's extra columns name scratch page 0 (keys past every row's length:
        # the paged kernel never loads them, the gather path masks them)
        self.tables = torch.zeros(B, max(pps, -(-cap // ps)), dtype=torch.int64)
        self.tables[:, :pps] = (torch.arange(B * pps) + 1).view(B, pps)
        self.tables = self.tables.to(dev)
        self.pos = torch.full((B,), context, dtype=torch.int64, device=dev)
        gen = torch.Generator().manual_seed(1)
        self.mem.t("tokens").copy_(torch.randint(0, cfg.vocab_size, (B,), generator=gen))
        self.inv = rope_inv_freq(cfg).to(dev)
        # greedy steps (the sampling inputs stay zero), as the peers decode: the conventional argmax skips the
        # sampling candidates (StepCtx.greedy); nothing reads the logits afterwards (StepCtx.logits_unread, as the
        # engine's steps when every row samples on the device: the fp32 copy is skipped under MPK_CONV_BF16_ARGMAX=1).
        # sampled: every row samples (temperature 0.8, top-k 50, top-p 0.9)
        if sampled:
            self.mem.t("sample.temperature").fill_(0.8)
            self.mem.t("sample.top_k").fill_(50)
            self.mem.t("sample.top_p").fill_(0.9)
            self.mem.t("sample.seed").copy_(torch.arange(B) + 1)
        self.ctx = StepCtx(cfg, 1, self.pos, self.tables, ps, 1, self.inv, kv_len_cap=cap, greedy=not sampled,
                           logits_unread=not sampled)
        self.cfg, self.ps, self.heap = cfg, ps, heap
        self.trace_steps = 0   # > 0: the megakernels measure_plan makes record per-task globaltimer starts / ends

    def make_mk(self, tg, m):
        from mpk_runtime.runtime.megakernel import Megakernel, PeerTable
        peers = counters = None
        if self.heap is not None:   # TP: counters of this segment on the heap, peers' addresses
            n = 1 << max(6, (len(tg.events) + 1 - 1).bit_length())   # same size on every rank (collective)
            counters = self.heap.tensor((n,), torch.int64)
            peers = PeerTable(self.heap.rank, self.heap.nranks, self.heap.peer_ptrs(counters), self.syms)
        return Megakernel(tg, m, page_size=self.ps, block_tables=self.tables, pos=self.pos,
                          inv_freq=self.inv.cpu(), head_dim=self.cfg.head_dim, peers=peers, counters=counters,
                          trace_steps=self.trace_steps)


def _sync_all(ex, heap):
    torch.cuda.synchronize()
    for mk in ex.megakernels():
        mk.check()
    if heap is not None:
        heap.barrier()


WARM_S = 0.3   # seconds of untimed replays before a plan's timed ones


def segment_spans(ex, trace_dir: str | None = None, tag: str = "") -> list[dict]:
    """Where each megakernel segment's time went in the last replay (Point.trace_steps > 0): its tasks' window on
    the GPU's globaltimer (first start, after the first task's waits, to last end) and the gap from the previous
    megakernel segment's last task (the boundary, the next kernel's launch and prologue, and any conventional
    segment between them). With trace_dir, each segment's per-task Chrome trace too (<tag>_seg<i>.json.gz)."""
    import gzip
    import json
    out, prev_end = [], None
    for i, (kind, e) in enumerate(ex.segments):
        if kind != "megakernel" or not getattr(e, "trace_steps", 0):
            continue
        tr = e.trace_times()[0]
        done = (tr[:, 0] > 0) & (tr[:, 1] > 0)
        if not bool(done.any()):
            continue
        first, last = int(tr[done, 0].min()), int(tr[done, 1].max())
        out.append({"segment": i, "tasks": int(done.sum()), "span_us": (last - first) / 1e3,
                    "gap_before_us": None if prev_end is None else (first - prev_end) / 1e3})
        prev_end = last
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            with gzip.open(os.path.join(trace_dir, f"{tag}_seg{i}.json.gz"), "wt") as f:
                json.dump(e.chrome_trace(), f)
    return out


def measure_plan(plan, pt: Point, steps: int, cpu: bool, comm=None, trace_dir: str | None = None,
                 trace_tag: str = "") -> dict:
    """Step and per-segment times of one plan (ms lists), and how it ran. With pt.trace_steps > 0 (GPU), the
    megakernel segments' task windows in the last whole-step replay (segment_spans, "spans")."""
    heap = pt.heap
    ex = PlanExecutor(plan, pt.graphs, [pt.mem], backend="pyvm" if cpu else "megakernel", check=False,
                      num_sms=4 if cpu else None, make_megakernel=pt.make_mk, mode="ordered", comm=comm)
    ctx_for = lambda r: pt.ctx  # noqa: E731
    info = {}
    segs = ex.segments_for(pt.ctx.greedy)   # sampled steps: the plan's argmax may run as a megakernel
    if cpu:   # logic check: eager pyvm, host timers
        tot, seg = [], [[] for _ in segs]
        for s in range(steps + 1):
            t = [time.perf_counter()]
            for kind, e in segs:
                e.run([pt.ctx]) if kind == "conventional" else e.launch(lambda r, k: pt.ctx, 1)
                t.append(time.perf_counter())
            if s:
                tot.append((t[-1] - t[0]) * 1e3)
                for i in range(len(seg)):
                    seg[i].append((t[i + 1] - t[i]) * 1e3)
        return dict(step_ms=tot, seg_ms=seg if pt.ctx.greedy else [], exec="cpu eager (pyvm)")
    if heap is not None:
        heap.barrier()   # every rank's segment counters exist and are zero before any launch
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    # whole step: one graph (TP=1); TP>1: per-segment graphs with eager megakernel launches between
    try:
        ex.capture(ctx_for, mode="step", warmup=1)
        info["exec"] = f"cuda graph ({ex.graph_mode})"
    except Exception as e:  # noqa: BLE001 - keep measuring, eagerly, and say so
        ex.drop_graphs()
        torch.cuda.synchronize()
        info["exec"] = f"eager (capture failed: {type(e).__name__}: {str(e)[:200]})"
    _sync_all(ex, heap)
    # GPU warm-up before timing: ~WARM_S of replays (the count from the plan's price, so every TP rank runs as many).
    # The timed replays followed seconds of host-side compile / capture with one untimed replay; session 16's
    # validate rows sat 7-16% above bench_decode's planned rows for the same plans at B >= 32 (bench's cells run
    # back to back after long megakernel cells): an idle-clock ramp is one suspect (gpu_pending.sh consistency)
    for s in range(max(2, min(500, int(WARM_S * 1e6 / max(plan.predicted_us, 1.0))))):
        ex.run(ctx_for)
    _sync_all(ex, heap)
    tot = []
    for s in range(steps + 1):
        a, b = ev(), ev()
        a.record()
        ex.run(ctx_for)
        b.record()
        _sync_all(ex, heap)
        if s:
            tot.append(a.elapsed_time(b))
    # the same replays queued back to back (no host sync between them): the step's device time with the host's
    # replay overhead hidden, as the peers' ms_pipelined and the megakernel's 8-steps-a-launch cells
    a, b = ev(), ev()
    a.record()
    for s in range(steps):
        ex.run(ctx_for)
    b.record()
    _sync_all(ex, heap)
    info["step_ms_pipelined"] = a.elapsed_time(b) / steps
    if pt.trace_steps:   # the last whole-step replay's task windows, before the per-segment replays overwrite them
        info["spans"] = segment_spans(ex, trace_dir, trace_tag)
    # per segment: one graph per segment, events between
    seg = [[] for _ in ex.segments]
    if not pt.ctx.greedy:   # the sampled variant's segments are not the plan's: step times only
        del ex
        return dict(step_ms=tot, seg_ms=[], **info)
    if ex.graphs is not None and ex.graph_mode == "step" and len(ex.segments) > 1:
        ex.drop_graphs()
        try:
            ex.capture(ctx_for, mode="segments", warmup=0)
        except Exception as e:  # noqa: BLE001
            ex.drop_graphs()
            info["exec_segments"] = f"eager (capture failed: {type(e).__name__}: {str(e)[:200]})"
    units = ex.replay_units() if ex.graphs is not None else ex.eager_units([pt.ctx])
    if len(ex.segments) == 1:
        seg = [list(tot)]
    else:
        for s in range(steps + 1):
            marks = [ev() for _ in range(len(units) + 1)]
            marks[0].record()
            for i, u in enumerate(units):
                u()
                marks[i + 1].record()
            _sync_all(ex, heap)
            if s:
                for i in range(len(units)):
                    seg[i].append(marks[i].elapsed_time(marks[i + 1]))
    del ex
    return dict(step_ms=tot, seg_ms=seg, **info)
