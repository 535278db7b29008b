"""GPU decode for the "megakernel" ModelRunner beyond one task graph: PlannedDecoder.

PlannedDecoder: decode under a plan book (planner/book.py). Each batch bucket of the book gets its own decode graph
at that batch, a RankMemory over the shared weights and KV cache, and a PlanExecutor running the bucket's plan
(megakernel segments as GPU Megakernels, conventional segments as torch ops). A step is replayed as one CUDA graph
per bucket (PlanExecutor.capture, mode "step"). The conventional attention gathers a static number of keys inside a
graph (StepCtx.kv_len_cap): the cap is the smallest power of two (>= 256, <= max_seq_len) covering the batch's
longest sequence, and a bucket re-captures when a step needs a larger cap (at most log2(max_seq_len / 256) + 1
caps per bucket; the cap never shrinks, so a graph is never captured twice for the same cap). Per cap there are up
to two graphs: all-greedy steps (StepCtx.greedy: the conventional argmax skips the sampling candidates and draw,
~250 small kernels, ~0.6 ms on an H200) and steps with sampled rows; each is captured when first needed and kept.
A larger cap can also want more attention key splits than the plan's (PlannedDecoder.splits_at: batch 1 from 1024
keys): the bucket is then built again with them, once per split count, and the builds are kept: steps switch
between them as their caps want (a short request after a long one runs the plan's own splits again).

backend="pyvm" runs the same buckets eagerly on the CPU twin (no capture, no cap): what the CPU tests check.

Capture runs one eager warm-up step first (cuBLAS handles, lazy allocations). It runs with every row inactive
(pos = -1: KV writes go to the scratch page, nothing of the live sequences changes), then the step's real inputs are
written back and the graph replays them.

At tp > 1 (runtime/tp_buckets.py) a PlannedDecoder holds one rank of the group and runs conventional plans only, its
collectives over the group's communicator. The prompts' prefill: runtime/conventional_prefill.py.
"""
from __future__ import annotations

import logging
import time

import torch

from ..ir.build import build_graph
from ..ir.shard import shard_for
from ..models.reference import rope_inv_freq
from ..planner.book import bucket_key, pick_plan
from ..planner.plan import Plan
from ..tasks.tiling import attn_splits_for
from .base import KernelTimeout, Pending
from .decode_io import burst, device_pending, fill_step
from .conventional_prefill import gather_vocab
from .device_sampling import any_full, draw_full, graph_greedy
from .memory import KVStore, RankMemory, StepCtx
from .plan_exec import PlanExecutor
from .torch_exec import pow2

MIN_CAP = 256
log = logging.getLogger(__name__)


def kv_cap(need: int, max_seq_len: int) -> int:
    """The key-length cap of a captured step: the smallest power of two >= need (and >= MIN_CAP), at most
    max_seq_len."""
    return min(pow2(need, MIN_CAP), max_seq_len)


class _Bucket:
    def __init__(self, batch: int, plan: Plan, ex: PlanExecutor, mem: RankMemory, pos, tables, splits: int,
                 captures: int = 0):
        self.batch, self.plan, self.ex, self.mem, self.pos, self.tables = batch, plan, ex, mem, pos, tables
        self.splits = splits   # attention key splits of its graph (PlannedDecoder.splits_at)
        self.cap = 0                      # kv_len_cap of the captured graph (0 = none captured yet)
        self.ctx: StepCtx | None = None
        self.captures = captures          # graphs captured for batch bucket b (across rebuilds for more splits)


class PlannedDecoder:
    def __init__(self, cfg, weights: dict, kv: KVStore, book: dict, *, max_seq_len: int, page_size: int,
                 num_sms: int, dtype: str, device: torch.device, timeout_s: float | None = None, attn_splits: int = 2,
                 backend: str = "megakernel", tp: int = 1, rank: int = 0, comm=None):
        """tp > 1: this process's rank (`weights` its shard, `kv` its KV heads) and the group's communicator; the
        book's plans must be all conventional there (tp_buckets.py runs the one-megakernel buckets): the
        all-reduces, the distributed argmax and the vocab gathers of full-vocabulary rows go through `comm` (NCCL
        inside the captured graphs on GPUs, as ConventionalPrefill's)."""
        if backend not in ("megakernel", "pyvm"):
            raise ValueError(f"backend {backend!r}: 'megakernel' (GPU) or 'pyvm' (CPU twin)")
        if tp > 1 and (comm is None or getattr(comm, "world_size", 1) != tp):
            raise ValueError(f"tp={tp} decode through conventional plans needs the group's communicator")
        self.tp, self.rank, self.comm = tp, rank, comm
        self._vocab: torch.Tensor | None = None   # tp > 1: the gathered logits (_logits), one buffer that stays put
        self.backend = backend
        self.cfg, self.weights, self.kv, self.book = cfg, weights, kv, book
        self.max_seq_len, self.page_size, self.num_sms, self.dtype = max_seq_len, page_size, num_sms, dtype
        self.device, self.timeout_s, self.attn_splits = device, timeout_s, attn_splits
        self.width = -(-max_seq_len // page_size)
        self.inv_cpu = rope_inv_freq(cfg)
        self.inv = self.inv_cpu.to(device)
        self._buckets: dict[int, _Bucket] = {}
        self._shelf: dict[tuple[int, int], _Bucket] = {}   # (batch, splits) -> a build not in use (_bucket)
        self.used: dict[int, str] = {}    # bucket -> plan name, for health()/tests
        self.capture_s = 0.0              # seconds spent capturing decode graphs (warm-up step + capture)
        self.build_s = 0.0                # seconds spent building buckets (task graph, memory, executor)

    def bucket_of(self, n: int) -> int:
        b = bucket_key(self.book, n)
        if b < n:
            raise ValueError(f"{n} decode rows but the plan book's largest bucket is {b}")
        return b

    def splits_at(self, plan: Plan, b: int, cap: int) -> int:
        """Attention key splits of bucket b at key cap `cap`. A plan's splits follow the context it was made for
        (planner.search.attn_splits: rows x KV heads x splits ~ the SMs, >= 64 keys a split; the engine's book is
        made at 512 keys); past it the same rule at the step's cap, never fewer than the plan's. At batch 1 that is
        8 splits of 8 KV heads at 512 keys and 16 from 1024: llama-3.2-1b at a 131k-token context 3.79 -> 2.98 ms a
        token through LLM.generate (1x H100, session 55; 16 splits was what the bench's plans, made at the bench's
        context, had run)."""
        n_kv = shard_for(self.cfg, self.tp, self.rank).n_kv
        return max(plan.attn_splits or self.attn_splits, attn_splits_for(b, n_kv, cap, self.num_sms))

    def _bucket(self, b: int, cap: int) -> _Bucket:
        """Bucket b built with the attention splits of key cap `cap` (splits_at). A build for another split count
        is kept aside with its graphs (self._shelf) and taken back when a step's cap wants its count again: a
        batch-1 bucket goes to 16 splits for a request past 1024 keys and back to 8 for the short ones after it
        (16 at 512 keys was +1.8-2.5% a token at llama-3.2-1b, 1x H100, session 56)."""
        bk = self._buckets.get(b)
        plan = bk.plan if bk is not None else pick_plan(self.book, b)   # (parsed once a bucket, not every step)
        splits = self.splits_at(plan, b, cap)
        if bk is not None and bk.splits == splits:
            return bk
        if bk is not None:
            self._shelf[(b, bk.splits)] = bk
        captures = bk.captures if bk is not None else 0   # (the batch's running count goes with the build in use)
        kept = self._shelf.pop((b, splits), None)
        if kept is not None:
            kept.captures = max(kept.captures, captures)
            self._buckets[b] = kept
            return kept
        if plan.tp != self.tp:
            raise ValueError(f"the plan book was made for tp={plan.tp}; this decoder's group has tp={self.tp}")
        if self.tp > 1 and any(seg.kind != "conventional" for seg in plan.segments):
            raise ValueError(f"bucket {b}'s plan {plan.name!r} has megakernel segments: at tp > 1 PlannedDecoder runs "
                             "conventional plans (one-megakernel plans: runtime/tp_buckets.TPBuckets)")
        t0 = time.perf_counter()
        self._buckets.pop(b, None)
        gs = [build_graph(self.cfg, mode="decode", batch=b, context_len=0, max_seq_len=self.max_seq_len,
                          attn_splits=splits, dtype=self.dtype, tp=self.tp, rank=r) for r in range(self.tp)]
        g = gs[self.rank]
        mem = RankMemory(g, self.weights, self.kv, device=self.device)
        pos = torch.full((b,), -1, dtype=torch.int64, device=self.device)
        tables = torch.zeros((b, self.width), dtype=torch.int64, device=self.device)

        def make_mk(tg, m):
            from .megakernel import Megakernel
            return Megakernel(tg, m, page_size=self.page_size, block_tables=tables, pos=pos,
                              inv_freq=self.inv_cpu, head_dim=self.cfg.head_dim, timeout_s=self.timeout_s)
        ex = PlanExecutor(plan, gs, [mem], backend=self.backend, num_sms=self.num_sms, mode="ordered",
                          check=self.backend == "pyvm", make_megakernel=make_mk,
                          comm=self.comm if self.tp > 1 else None)
        self._buckets[b] = _Bucket(b, plan, ex, mem, pos, tables, splits, captures)
        self.build_s += time.perf_counter() - t0
        return self._buckets[b]

    def _check(self, bk: _Bucket) -> None:
        if self.backend == "pyvm":
            return
        torch.cuda.synchronize(self.device)
        for mk in bk.ex.megakernels():
            mk.check()

    def _ready(self, n: int, need: int, greedy: bool, want_logits: bool) -> _Bucket:
        """The bucket of n rows with its step context set (and, on the GPU, a graph captured) for a key cap >=
        need."""
        bk = self._bucket(self.bucket_of(n), need)
        if self.backend == "pyvm":   # eager, keys as needed
            bk.ctx = StepCtx(self.cfg, 1, bk.pos, bk.tables, self.page_size, 1, self.inv, greedy=greedy,
                             logits_unread=not want_logits)
            return bk
        if need > bk.cap:   # a larger key cap: every capture is stale
            bk.ex.drop_graphs()
            bk.cap = need
        bk.ctx = StepCtx(self.cfg, 1, bk.pos, bk.tables, self.page_size, 1, self.inv, kv_len_cap=bk.cap,
                         greedy=greedy, logits_unread=not want_logits)
        ctx = bk.ctx
        if not bk.ex.has_capture(lambda r: ctx):   # capture this variant, warm-up on inactive rows
            t0 = time.perf_counter()
            fill_step(bk.mem, bk.pos, bk.tables, [], [], [], self.width, None)
            bk.ex.capture(lambda r: ctx, mode="step", warmup=1)
            self._check(bk)
            bk.captures += 1
            self.capture_s += time.perf_counter() - t0
            log.debug("decode bucket %d: graph captured at key cap %d (greedy=%s, logits unread=%s) in %.3f s",
                      bk.batch, bk.cap, greedy, not want_logits, time.perf_counter() - t0)
        return bk

    def warm(self, max_batch: int, sampled: bool = True) -> int:
        """Capture every bucket's step graph now, at the smallest key cap, greedy (and with sampled rows when
        `sampled`), logits unread: what a device-sampled step needs first. Lazily, the first step of a batch size
        paid its bucket's capture, which holds the plan's first kernel compilations (Triton, cuBLAS): 0.6-3.7 s a
        bucket at llama-3.2-1b on an H100 (session 56), inside that step, so the time to first token of a request
        that arrived beside it (a prefill step carrying 5 decode rows captured bucket 8: TTFT 1.46 s against 0.17 s
        without plans). Buckets above max_batch's are never used and not built. Returns the number of graphs
        captured. Larger key caps still capture when first reached, and steps that read their logits (logprobs,
        host sampling) capture their own variant."""
        if self.backend == "pyvm":
            return 0
        before = sum(bk.captures for bk in self._buckets.values())
        cap = kv_cap(1, self.max_seq_len)
        top = bucket_key(self.book, max_batch)
        for b in sorted(int(k) for k in self.book["buckets"] if int(k) <= top):
            for greedy in (True, False) if sampled else (True,):
                self._ready(b, cap, greedy, want_logits=False)
        return sum(bk.captures for bk in self._buckets.values()) - before

    def _run(self, bk: _Bucket) -> None:
        ctx = bk.ctx
        bk.ex.run(lambda r: ctx)

    def _finish(self, bk: _Bucket) -> None:
        try:
            self._check(bk)
        except KernelTimeout:
            self._buckets.pop(bk.batch, None)   # counters are inconsistent: rebuilt on next use
            raise
        self.used[bk.batch] = bk.plan.name

    def decode(self, toks: list[int], pos: list[int], tables: list[list[int]], sampling=None,
               want_logits: bool = True):
        """One step for len(toks) rows; returns (logits (n, V) fp32 on the CPU or None when not wanted, drawn
        tokens (n,) int64)."""
        n = len(toks)
        # all rows greedy: the conventional argmax skips the sampling work (its own captured graph, StepCtx.greedy)
        bk = self._ready(n, kv_cap(max(pos) + 1, self.max_seq_len), graph_greedy(sampling),
                         want_logits or any_full(sampling))
        fill_step(bk.mem, bk.pos, bk.tables, toks, pos, tables, self.width, sampling)
        self._run(bk)
        full = self._logits(bk.mem, n, want_logits)
        draw_full(bk.mem, full, bk.pos[:n], graph=True)
        self._finish(bk)
        nxt = bk.mem.t("next_tokens")[:n].cpu()
        return (full.float().to("cpu", copy=True) if want_logits else None), nxt   # (a copy: full may be a buffer)

    def _logits(self, mem: RankMemory, n: int, needed: bool = False) -> torch.Tensor:
        """The step's logits of n rows over the whole vocabulary: the step's own at tp=1; at tp > 1 gathered from
        every rank's shard where a row draws from the full vocabulary or `needed` (a collective: every rank has the
        same rows), else this rank's shard (unread)."""
        lg = mem.t("logits")[:n]
        if self.tp > 1 and (needed or getattr(mem, "_full_rows", None) is not None):
            if self._vocab is None:   # rows of the largest bucket: allocated once
                rows = max(int(k) for k in self.book["buckets"])
                self._vocab = torch.empty((rows, self.cfg.vocab_size), dtype=torch.float32, device=lg.device)
            return gather_vocab(self.cfg, self.tp, self.comm, lg, out=self._vocab[:n])
        return lg

    def decode_steps(self, toks: list[int], pos: list[int], tables: list[list[int]], sampling, num_steps: int,
                     resume: bool = False) -> torch.Tensor:
        """num_steps steps of the same rows, each step's drawn tokens fed to the next one on the device (no host
        round trip between the steps: the graph replays back to back); returns the drawn tokens (n, num_steps).
        The tables must cover positions up to max(pos) + num_steps - 1. resume: the rows are the last call's and
        each takes the token drawn last for it there, from the device (toks are ignored)."""
        return self.launch_steps(toks, pos, tables, sampling, num_steps, resume).wait()

    def launch_steps(self, toks: list[int], pos: list[int], tables: list[list[int]], sampling, num_steps: int,
                     resume: bool = False) -> Pending:
        """decode_steps queued on the device, returned unread (ModelRunner.launch_steps): a burst resumed from
        this one may be queued behind it before it is read."""
        n = len(toks)
        last = None
        if resume:   # (before _ready: a capture at a larger key cap runs the graph on inactive rows)
            prev = self._buckets.get(self.bucket_of(n))
            if prev is None:
                raise ValueError("decode_steps(resume=True) needs a previous burst of these rows")
            last = prev.mem.t("next_tokens")[:n].clone()
        bk = self._ready(n, kv_cap(max(pos) + num_steps, self.max_seq_len), graph_greedy(sampling),
                         any_full(sampling))
        fill_step(bk.mem, bk.pos, bk.tables, toks, pos, tables, self.width, sampling, tokens_from=last)
        drawn = burst(bk.mem, bk.pos, n, num_steps, lambda: self._run(bk),   # (the context reads pos in place)
                      logits=lambda: self._logits(bk.mem, n))
        self.used[bk.batch] = bk.plan.name
        return device_pending(drawn, bk.ex.megakernels(), lambda: self._buckets.pop(bk.batch, None))
