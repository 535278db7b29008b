"""Helpers shared by the TP GPU scripts (scripts/gpu_check_tp.py, scripts/bench_decode.py --tp 2).

GPU side (torch.cuda / NVSHMEM touched only when called):
  shard_weights   the same seeded random bf16 weights on every rank (generated on the GPU), and this rank's shard
  rig             one rank's TP megakernel through megakernel_runner.build_rank_kernel (gpu_check_tp's rig)
  bench_rig       the same with the cost estimates of a real context (context_len) and a chosen attn_splits, as
                  bench_decode's single-GPU path builds its kernel, optionally with a trace buffer
  TokenCheck      a TP group's greedy steps against the one-rank kernel's (mismatches, near-tie margin, logit error)
  time_launches   N steps per launch, all ranks released together by a barrier, CUDA events, median over launches
  set_trace       switch the per-task globaltimer trace of a built Megakernel on/off between launches
Pure (CPU-tested in tests/scripts/test_tp_rig.py):
  rank_weight_bytes / floor_ms_per_rank   bytes of weights one rank streams per decode step, and its floor
  comm_meta / analyze_comm / chrome_trace exposed-communication analysis of a traced TP launch
  StoreSync                               rank-0 decisions and per-cell results through a c10d Store (host side,
                                          independent of the NCCL / NVSHMEM streams, so a failed cell cannot
                                          mismatch collectives)
"""
from __future__ import annotations

import datetime
import json
import os

SAFE_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
os.environ.update(SAFE_ENV)   # NVLink multicast stays off in every process that imports this


# ----------------------------------------------------------------------------------------------- GPU helpers
def shard_weights(cfg, seed, rank, world, device="cuda"):
    """(full, part): seeded random bf16 weights generated on `device` (identical on every rank) and rank's shard."""
    from mpk_runtime.models.weights import random_weights
    from mpk_runtime.runtime.pyvm_runner import shard_weights as shard
    full = random_weights(cfg, seed, dtype="bfloat16", device=device)
    return full, (full if world == 1 else shard(cfg, full, world, rank))


def rig(cfg, w, B, rank, world, heap, timeout_s=5.0, max_seq=512, ps=16, num_sms=None, tp_invariant=1):
    """One rank's decode megakernel at batch B via build_rank_kernel (context_len 0, its default attn_splits);
    block tables 1..B*pages. gpu_check_tp's rig."""
    import torch

    from mpk_runtime.runtime.megakernel_runner import build_rank_kernel
    pps = -(-max_seq // ps)
    num_sms = num_sms or torch.cuda.get_device_properties(0).multi_processor_count
    r = build_rank_kernel(cfg, w, rank=rank, world=world, heap=heap, batch=B, max_seq_len=max_seq, page_size=ps,
                          num_pages=B * pps + 1, num_sms=num_sms, timeout_s=timeout_s, tp_invariant=tp_invariant)
    r.tables.copy_((torch.arange(B * pps) + 1).view(B, pps))
    return r



class TokenCheck:
    """A TP group's greedy steps against the one-rank kernel's, one step at a time (gpu_check_tp.py and
    gpu_check_tp_loopback.py): token mismatches, the first divergence and TP=1's top-two margin there (in bf16 ulps of
    the top logit: the LM head's outputs are bf16-rounded), the gathered logits' relative error. `result(tpi)`'s ok:
    with tp_invariant 1 TP=2 rounds its bf16 partials differently from TP=1, so a divergence passes only at a near-tie
    (<= 2 ulps) with bf16-level error before it; with tp_invariant == world nothing but identical tokens passes.
    Pure torch (CPU-tested in tests/scripts/test_tp_rig.py)."""

    def __init__(self):
        self.mism, self.first, self.worst, self.worst_before = 0, -1, 0.0, 0.0
        self.margin = self.ulp = None
        self.toks_ref, self.toks_tp = [], []

    def step(self, s, lr, lg, nr, nm) -> None:
        """Step s: TP=1's logits lr (B, V) and tokens nr (B,), the group's gathered logits lg and tokens nm."""
        import torch
        if not torch.isfinite(lg).all():
            raise AssertionError(f"non-finite TP logits at step {s}")
        self.toks_ref.append(nr.tolist())
        self.toks_tp.append(nm.tolist())
        rel = ((lg - lr).norm() / lr.norm()).item()
        self.worst = max(self.worst, rel)
        d = int((nr != nm).sum())
        if d and self.first < 0:
            self.first = s
            top2 = lr[(nr != nm).nonzero().flatten()].topk(2, dim=-1).values   # the diverging rows only
            self.margin = (top2[:, 0] - top2[:, 1]).max().item()
            self.ulp = 2.0 ** (torch.floor(torch.log2(top2[:, 0].abs().max())).item() - 7)
        if self.first < 0:
            self.worst_before = max(self.worst_before, rel)
        self.mism += d

    def result(self, tp_invariant: int) -> dict:
        m, ulp = self.margin, self.ulp
        return dict(token_mismatches=self.mism, first_mismatch_step=self.first, top2_margin_at_first_mismatch=m,
                    worst_rel_logit_err_before_divergence=self.worst_before, worst_rel_logit_err=self.worst,
                    tokens_identical=self.mism == 0, top2_margin_in_bf16_ulps=(m / ulp if m is not None else None),
                    ok=(self.worst_before < 3e-2 and (self.mism == 0 or (tp_invariant == 1 and m <= 2 * ulp))),
                    first_tokens_ref=[t[0] for t in self.toks_ref[:16]],
                    first_tokens_tp=[t[0] for t in self.toks_tp[:16]])


def graph_kwargs(world: int, tp_invariant: int = 1) -> dict:
    """Extra build_graph arguments for a TP group: tp_invariant (1 = off, what the engine runs; world = reductions
    ordered as a TP=world group, bit-identical to TP=1 but with every Tensor Core tile's K unsliced, which is
    slower at batch >= 3: session 8's 'TP=2 slower than one GPU at B=8' was this setting) where this checkout's
    build_graph has that argument."""
    import inspect

    from mpk_runtime.ir.build import build_graph
    if tp_invariant != 1 and "tp_invariant" in inspect.signature(build_graph).parameters:
        return {"tp_invariant": tp_invariant}
    return {}


def bench_rig(cfg, w, B, rank, world, heap, *, context_len, max_seq, attn_splits, ps=16, num_sms=None,
              timeout_s=5.0, trace_steps=0, tp_invariant=1):
    """As megakernel_runner.build_rank_kernel, but the graphs carry `context_len` (the attention tasks' cost
    estimates, which the list scheduler uses: bench_decode's single-GPU kernel is built the same way) and the
    attention split count is the caller's. KV pages are random N(0, 1) (decode over `context_len` cached keys),
    block tables 1..B*pages. Collective for world > 1 (symmetric allocations on the heap)."""
    from types import SimpleNamespace

    import torch

    from mpk_runtime.ir.build import build_graph
    from mpk_runtime.ir.shard import shard_for
    from mpk_runtime.models.reference import rope_inv_freq
    from mpk_runtime.runtime.megakernel import Megakernel
    from mpk_runtime.runtime.memory import KVStore, RankMemory
    from mpk_runtime.tasks.build import build_task_graphs
    from mpk_runtime.tasks.tiling import Tiling
    dev = torch.device("cuda", torch.cuda.current_device())
    num_sms = num_sms or torch.cuda.get_device_properties(dev).multi_processor_count
    pps = -(-max_seq // ps)
    n_kv = shard_for(cfg, world, rank).n_kv
    kv = KVStore(cfg.num_layers, B * pps + 1, ps, n_kv, cfg.head_dim, torch.bfloat16, device=dev, poison=False)
    for c in kv.k + kv.v:
        c.normal_(0, 1.0)
    gkw = graph_kwargs(world, tp_invariant) if world > 1 else {}
    gs = [build_graph(cfg, mode="decode", batch=B, context_len=context_len, max_seq_len=max_seq, tp=world, rank=r,
                      attn_splits=attn_splits, dtype="bfloat16", **gkw) for r in range(world)]
    tgs = build_task_graphs(gs, Tiling(num_sms=num_sms))   # events of a rank come from every rank
    tg = tgs[rank]
    mem = RankMemory(gs[rank], w, kv, device=dev)
    tables = (torch.arange(B * pps) + 1).view(B, pps).to(dev)
    pos = torch.full((B,), -1, dtype=torch.int64, device=dev)
    peers = counters = None
    if world > 1:
        from mpk_runtime.runtime.nvshmem import rank_setup
        peers, counters = rank_setup(heap, mem, max(len(t.events) for t in tgs) + 1)
        heap.barrier()   # every rank's counters are zero before any rank's kernel can signal them
    mk = Megakernel(tg, mem, page_size=ps, block_tables=tables, pos=pos, inv_freq=rope_inv_freq(cfg),
                    head_dim=cfg.head_dim, timeout_s=timeout_s, trace_steps=trace_steps, peers=peers,
                    counters=counters)
    return SimpleNamespace(mk=mk, mem=mem, tg=tg, pos=pos, tables=tables, kv=kv)


def time_launches(mk, pos_t, pos, n, reps, barrier=None, warm=2):
    """(median, min) ms per step: `reps` launches of n steps each, every launch preceded by `barrier` (all ranks
    released together) and synchronised, timed with CUDA events; `warm` untimed launches first."""
    import torch
    for _ in range(warm):
        if barrier:
            barrier()
        pos_t.copy_(pos); mk.launch(n)
        torch.cuda.synchronize()
    mk.check()
    ts = []
    for _ in range(reps):
        if barrier:
            barrier()
        pos_t.copy_(pos)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); mk.launch(n); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) / n)
    mk.check()
    ts.sort()
    return ts[len(ts) // 2], ts[0]


def set_trace(mk, steps: int) -> None:
    """Trace the first `steps` steps of the following launches (0: off, no trace stores). The Megakernel must have
    been built with trace_steps >= steps (its trace buffer is sized then)."""
    if steps > 0 and mk.trace.numel() < steps * len(mk.tg.tasks) * 2:
        raise ValueError(f"trace buffer holds {mk.trace.numel() // (2 * len(mk.tg.tasks))} steps, asked {steps}")
    mk.trace_steps = steps
    mk._write_params()


# ------------------------------------------------------------------------------------------- pure helpers
def rank_weight_bytes(cfg, tp: int, rank: int, elem_bytes: int = 2) -> int:
    """Bytes of weights rank `rank` of a TP group streams per decode step: its q/k/v/o, gate/up/down slices, the
    (replicated) norms, and its vocabulary rows of the LM head (a tied head reads those rows of the embedding
    table). An untied embedding table is gathered (B rows), not streamed: left out, as bench_decode.floor_ms."""
    from mpk_runtime.ir.shard import shard_for, weight_slice
    from mpk_runtime.models.weights import weight_shapes
    sh = shard_for(cfg, tp, rank)
    n = 0
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("embed_tokens.weight"):
            if cfg.tie_word_embeddings:
                n += sh.n_vocab * shape[1]
            continue
        idx = weight_slice(cfg, sh, name, tuple(shape))
        k = 1
        for d, s in enumerate(shape):
            if idx is not None and idx[d] != slice(None):
                a, b, _ = idx[d].indices(s)
                s = b - a
            k *= s
        n += k
    return n * elem_bytes


def floor_ms_per_rank(cfg, tp: int, hbm_bytes_per_s: float) -> tuple[float, int]:
    """(floor ms, bytes) of the rank that streams the most: that rank's weight bytes / HBM bandwidth."""
    nb = max(rank_weight_bytes(cfg, tp, r) for r in range(tp))
    return nb / hbm_bytes_per_s * 1e3, nb


def comm_meta(tg) -> dict:
    """What analyze_comm needs from one rank's TaskGraph: SM lists, kinds, ops, labels; `remote[t]`: task t waits
    on an event with a producer on another rank (packed with scope = sys: the all-reduce tiles and the
    distributed argmax's reduce); `local_preds[t]`: (task id, lag) of this rank's producers of t's events."""
    n = len(tg.tasks)
    remote = [False] * n
    local_preds: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for t in tg.tasks:
        for e, lag in t.waits:
            prods = tg.events[e].producers
            if any(r != tg.rank for r, _ in prods):
                remote[t.id] = True
        if remote[t.id]:
            local_preds[t.id] = sorted({(pid, lag) for e, lag in t.waits for r, pid in tg.events[e].producers
                                        if r == tg.rank})
    return {"rank": tg.rank, "sm_lists": [list(l) for l in tg.sm_lists], "kind": [t.kind for t in tg.tasks],
            "op": [t.op for t in tg.tasks], "label": [t.label() for t in tg.tasks], "remote": remote,
            "local_preds": local_preds}


def _median(xs):
    xs = sorted(xs)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else 0.5 * (xs[m - 1] + xs[m])


def analyze_comm(trace, meta: dict, first_step: int = 1) -> dict:
    """Exposed communication of one rank from a traced launch.

    trace[k][t] = (start, end) globaltimer ns of task t in the launch's k-th step; `start` is taken after the
    task's waits succeeded (megakernel.cu), `end` after its signals. Steps before `first_step` (>= 1) only serve
    as predecessors. For every task t with a cross-rank wait ("comm" tile; grouped by kind: allreduce,
    argmax_reduce) in step k:
      dur          end - start: the tile's own work (reading the ranks' partial slots, summing, writing);
      wait         start - end of the task before it on its SM (the previous step's last one for an SM's first
                   task): the time the SM sat in t's waits (local and remote events) plus thread 0 issuing the
                   next task's weight prefetch;
      remote_wait  start - max(that predecessor's end, end of t's local producers): the part of the wait left
                   after everything this rank itself had to provide was done, i.e. waiting for the other rank's
                   partials to arrive (NVLink latency + the peer's skew);
    per op (e.g. L3.down.allreduce) in step k: exposed = last tile end - last local producer end: from this
    rank's partials being pushed to the reduced activation being complete, which the next layer waits for. The
    all-reduce ops of a step sit one after another on the dependency chain, so sum(exposed) over a step's ops
    approximates the communication on the critical path (an approximation: other SMs may still run
    independent tiles meanwhile, and it includes the reduce itself).
    step_us = last end of step k - last end of step k-1.
    Returns medians over steps of the per-step sums, and means over all tiles."""
    S = len(trace)
    first_step = max(1, first_step)
    prev = {}
    for lst in meta["sm_lists"]:
        for i, t in enumerate(lst):
            prev[t] = (lst[i - 1], 0) if i > 0 else (lst[-1], 1)
    kinds = meta["kind"]
    comm = [t for t, r in enumerate(meta["remote"]) if r]
    other = [t for t, r in enumerate(meta["remote"]) if not r]
    ends = [max((e for s, e in trace[k] if s and e), default=0) for k in range(S)]
    steps = []
    per_kind: dict[str, dict] = {}
    other_gaps: list[float] = []
    for k in range(first_step, S):
        tr, tb = trace[k], trace[k - 1]
        if not ends[k] or not ends[k - 1]:
            continue
        steps.append((ends[k] - ends[k - 1]) / 1e3)
        ops: dict[str, list] = {}
        acc_step: dict[str, dict] = {}
        for t in comm:
            s, e = tr[t]
            p, back = prev[t]
            pe = (tb if back else tr)[p][1]
            if not (s and e and pe):
                continue
            lr = max((trace[k - lag][pid][1] for pid, lag in meta["local_preds"][t] if k - lag >= 0), default=0)
            kd = kinds[t]
            a = acc_step.setdefault(kd, {"dur": 0.0, "n": 0})
            a["dur"] += (e - s) / 1e3
            a["n"] += 1
            g = per_kind.setdefault(kd, {"wait": [], "remote_wait": [], "dur": [], "tile_sum": [], "op_span": [],
                                         "exposed": [], "tiles": [], "ops": []})
            g["wait"].append(max(0, s - pe) / 1e3)
            g["remote_wait"].append(max(0, s - max(pe, lr)) / 1e3)
            g["dur"].append((e - s) / 1e3)
            o = ops.setdefault(meta["op"][t], [kd, s, e, lr])
            o[1], o[2], o[3] = min(o[1], s), max(o[2], e), max(o[3], lr)
        for kd, a in acc_step.items():
            g = per_kind[kd]
            g["tile_sum"].append(a["dur"])
            g["tiles"].append(a["n"])
            mine = [o for o in ops.values() if o[0] == kd]
            g["ops"].append(len(mine))
            g["op_span"].append(sum((o[2] - o[1]) / 1e3 for o in mine))
            g["exposed"].append(sum(max(0, o[2] - o[3]) / 1e3 for o in mine if o[3]))
        for t in other:
            s, e = tr[t]
            p, back = prev[t]
            pe = (tb if back else tr)[p][1]
            if s and e and pe:
                other_gaps.append(max(0, s - pe) / 1e3)
    step_us = _median(steps)
    out = {"rank": meta.get("rank"), "steps_analyzed": len(steps), "step_us": step_us,
           "step_us_all": [round(x, 3) for x in steps], "kinds": {},
           "other_tasks_wait_us_mean": sum(other_gaps) / len(other_gaps) if other_gaps else None}
    for kd, g in per_kind.items():
        ex = _median(g["exposed"])
        out["kinds"][kd] = {
            "tiles_per_step": _median(g["tiles"]), "ops_per_step": _median(g["ops"]),
            "tile_us_sum": _median(g["tile_sum"]),          # (a) total task time of these tiles per step (SM-us)
            "op_span_us_sum": _median(g["op_span"]),        # sum over ops of (last tile end - first tile start)
            "tile_us_mean": sum(g["dur"]) / len(g["dur"]),
            "wait_us_mean": sum(g["wait"]) / len(g["wait"]),                  # (b)
            "wait_us_max": max(g["wait"]),
            "remote_wait_us_mean": sum(g["remote_wait"]) / len(g["remote_wait"]),
            "exposed_us": ex,                                                 # critical-path approximation
            "exposed_frac_of_step": (ex / step_us) if (ex is not None and step_us) else None}
    return out


def chrome_trace(trace, meta: dict, steps=(1, 2)) -> dict:
    """Chrome/Perfetto JSON of the given steps of a traced launch (pid = rank, tid = SM); comm tiles carry
    args.remote = true and their wait (us) before them."""
    prev = {}
    for lst in meta["sm_lists"]:
        for i, t in enumerate(lst):
            prev[t] = (lst[i - 1], 0) if i > 0 else (lst[-1], 1)
    sm_of = {t: sm for sm, lst in enumerate(meta["sm_lists"]) for t in lst}
    steps = [k for k in steps if 0 <= k < len(trace)]
    t0 = min((s for k in steps for s, e in trace[k] if s), default=0)
    ev = []
    for k in steps:
        for t, (s, e) in enumerate(trace[k]):
            if not (s and e):
                continue
            args = {"label": meta["label"][t], "step": k}
            if meta["remote"][t]:
                p, back = prev[t]
                pe = trace[k - back][p][1] if k - back >= 0 else 0
                args.update(remote=True, wait_us=max(0, s - pe) / 1e3 if pe else None)
            ev.append({"name": meta["kind"][t], "cat": meta["op"][t], "ph": "X", "ts": (s - t0) / 1e3,
                       "dur": (e - s) / 1e3, "pid": meta.get("rank", 0), "tid": sm_of.get(t, -1), "args": args})
    return {"traceEvents": ev, "displayTimeUnit": "ns"}


class StoreSync:
    """Agreement between the ranks of a benchmark through a c10d Store (torch.distributed's TCPStore): rank 0's
    decision (`bcast`) and everybody's per-cell result (`gather`). Host-side only, so it works whatever state
    the GPU collectives of a failed cell were left in; values are JSON."""

    def __init__(self, store, rank: int, world: int, timeout_s: float = 600.0):
        self.store, self.rank, self.world = store, rank, world
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def bcast(self, key: str, value=None):
        if self.rank == 0:
            self.store.set(f"bc/{key}", json.dumps(value, default=str))
        self.store.wait([f"bc/{key}"], self.timeout)
        return json.loads(self.store.get(f"bc/{key}"))

    def gather(self, key: str, value):
        self.store.set(f"ga/{key}/{self.rank}", json.dumps(value, default=str))
        keys = [f"ga/{key}/{r}" for r in range(self.world)]
        self.store.wait(keys, self.timeout)
        return [json.loads(self.store.get(k)) for k in keys]
