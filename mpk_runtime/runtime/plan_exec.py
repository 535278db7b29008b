"""Run one step as a Plan: its segments in order, each a megakernel or a run of conventional ops.

Segments share one RankMemory per rank (the same Graph's tensors and the same KV cache), so activations and
cache hand over through memory; a segment boundary is a launch boundary, which orders everything before it.
Megakernel segments run on `pyvm` (CPU twin) or the GPU `Megakernel`, each with its own counters.

CUDA graphs (GPU): `capture(ctx_for)` records the step once per (plan, batch) and `run` replays it. Graph
replays read the StepCtx tensors captured (pos, block_tables, tokens in the RankMemory), so the caller updates
them in place between steps (`run` refuses a ctx whose tensors are not the captured ones). Two granularities:
  "step"      one graph for the whole step: conventional ops and megakernel launches (cuLaunchKernel on torch's
              current stream is captured like any kernel). A replayed launch cannot advance its step argument,
              so inside the graph each megakernel's counters are zeroed and it runs as step 1 (`_graph_launch`):
              the same protocol state as a fresh kernel, valid because the previous replay finished (stream
              order). World size 1 only: a peer could signal our counters before we zero them. With
              MPK_MK_PDL=1 (programmatic dependent launches, runtime/megakernel.py) the counters of every megakernel
              are zeroed at the graph's start instead, so the node before each launch is the previous kernel.
  "segments"  one graph per segment (megakernel segments too at world size 1, else launched eagerly between
              the replays): what per-segment timing uses.
The eager path (`run` before any capture, and always on a CPU) is unchanged and is what the CPU tests check.

The conventional segments of one step share its per-step values (row positions, RoPE tables, KV slots, attention
masks: conventional_ops): the first segment that needs one computes it, the later ones read it, so a plan with
many conventional segments (attn-mk: one per layer) pays for them once per step, as the all-conventional plan
does. In "segments" graphs the values a segment graph computed are read by later segment graphs: the executor
keeps the captured dicts (their tensors live in the shared pool) for as long as the graphs.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from ..ir.defer import defer_kv_appends, kv_defer_layers
from ..ir.graph import Graph
from ..planner.plan import Plan
from ..tasks.build import build_task_graphs
from ..tasks.check import check_task_graphs
from ..tasks.tiling import ENV_FIELDS, Tiling
from .memory import RankMemory, StepCtx
from .pyvm import PyVM
from .torch_exec import ConventionalExecutor, compile_segments


def _tiling(d: dict, num_sms: int | None) -> Tiling:
    """A plan segment's Tiling; a field's environment switch (tasks/tiling.py ENV_FIELDS), when set, overrides
    the value the plan was made with (plan books are cached on disk)."""
    d = dict(d)
    if num_sms:
        d["num_sms"] = num_sms
    for name, var in ENV_FIELDS.items():
        if os.environ.get(var, "").strip():
            d.pop(name, None)
    return Tiling(**d)


class PlanExecutor:
    """`graphs`/`mems`: every rank of the group (pyvm) or this process's rank (GPU, one per process)."""

    def __init__(self, plan: Plan, graphs: list[Graph], mems: list[RankMemory], *, backend: str = "pyvm",
                 num_sms: int | None = None, mode: str = "random", seed: int = 0, check: bool = True,
                 make_megakernel: Callable | None = None, comm=None):
        names = [o.name for o in graphs[0].ops]
        covered = [n for s in plan.segments for n in s.ops]
        if covered != names:
            raise ValueError(f"plan {plan.name!r} does not cover the graph's ops exactly once, in order "
                             f"({len(covered)} ops in segments, {len(names)} in the graph)")
        if len(plan.segments) > 1 and any(o.attrs.get("ll") for o in graphs[0].ops):
            raise ValueError(f"plan {plan.name!r} has {len(plan.segments)} segments, but the graph's all-reduce uses "
                             "LL words (allreduce_ll / MPK_AR_LL=1), whose flags only a megakernel running the push "
                             "and the reduce together keeps: use a one-megakernel plan, or unset MPK_AR_LL")
        self.plan, self.mems, self.backend = plan, mems, backend
        # (default; MPK_KV_DEFER=0 off) attention megakernels append the k / v rows their conventional qkv_rope left (ir/defer.py)
        self.kv_defer_layers = kv_defer_layers(graphs[0], plan.segments)
        graphs = [defer_kv_appends(g, self.kv_defer_layers) for g in graphs]
        self._consts = [{} for _ in mems]   # per rank held, across steps: weight views (conventional_ops._wt)
        def make(kind: str, ops: list[str], tiling: dict) -> tuple[str, object]:
            sub = [g.subgraph(ops) for g in graphs]
            if kind == "conventional":
                # graphs of every rank but only this process's rank held (GPU TP): its own graph
                held = sub if len(sub) == len(mems) else [sub[m.rank] for m in mems]
                return ("conventional", ConventionalExecutor(
                    held, mems, comm=comm, compile=backend != "pyvm" and compile_segments()))
            tgs = build_task_graphs(sub, _tiling(tiling, num_sms))
            if check:
                check_task_graphs(tgs, steps=2)
            if backend == "pyvm":
                return ("megakernel", PyVM(tgs, mems, mode=mode, seed=seed, poison=False))
            if make_megakernel is None:
                raise ValueError("backend 'megakernel' needs make_megakernel(task_graph, mem)")
            return ("megakernel", make_megakernel(tgs[mems[0].rank if len(tgs) > 1 else 0], mems[0]))

        self.segments: list[tuple[str, object]] = [make(seg.kind, seg.ops, seg.tiling) for seg in plan.segments]
        # StepCtx.greedy changes what runs only in a conventional argmax (a megakernel samples on device either way)
        argmax = [o.name for o in graphs[0].ops if o.kind == "argmax"]
        self._greedy_read = any(seg.kind == "conventional" and set(argmax) & set(seg.ops) for seg in plan.segments)
        # Steps with sampled rows: the conventional argmax would run the whole sampler as ~340 small kernels
        # (candidates, 64 serial prefix sums, the draw: ~0.5 ms on an H200), so they run the argmax op as a
        # megakernel of its own instead (the sampling contract, ir/sampling.py, draws the same token on every
        # executor and tiling). World size 1 only (a TP megakernel segment needs the peers' heap).
        self._sampled: list[tuple[str, object]] | None = None
        if self._greedy_read and len(graphs) == 1 and mems[0].world == 1:
            tiling = next((seg.tiling for seg in plan.segments if seg.kind == "megakernel"), {})
            self._sampled = []
            for (kind, ex), seg in zip(self.segments, plan.segments):
                if kind == "conventional" and set(argmax) & set(seg.ops):
                    rest = [n for n in seg.ops if n not in argmax]
                    if rest:
                        self._sampled.append(make("conventional", rest, {}))
                    self._sampled.append(make("megakernel", [n for n in seg.ops if n in argmax], tiling))
                else:
                    self._sampled.append((kind, ex))

    def segments_for(self, greedy: bool) -> list[tuple[str, object]]:
        """The segments a step runs: the plan's, or for a step with sampled rows the variant whose argmax is a
        megakernel (when the plan's argmax is conventional)."""
        return self.segments if greedy or self._sampled is None else self._sampled

    def megakernels(self) -> list:
        """Every megakernel executor of both variants (status checks after a launch)."""
        seen, out = set(), []
        for kind, ex in self.segments + (self._sampled or []):
            if kind == "megakernel" and id(ex) not in seen:
                seen.add(id(ex))
                out.append(ex)
        return out

    # ------------------------------------------------------------------------------------------- CUDA graphs
    graphs: list | None = None          # captured units: (kind, CUDAGraph | eager segment) in step order
    graph_mode: str | None = None
    # every capture kept, by what it baked in (_ctx_key): a step whose static fields differ from the current
    # capture's (e.g. StepCtx.greedy) switches to its own capture if there is one
    _captures: dict | None = None

    def _key(self, c: StepCtx) -> tuple:
        """_ctx_key, less the greedy and logits_unread flags when no conventional segment holds the argmax (a
        megakernel samples on device and writes its logits either way: one capture serves every such step)."""
        k = _ctx_key(c)
        return k if self._greedy_read else k[:-2]

    def drop_graphs(self) -> None:
        """Forget every capture (the next run() is eager until capture() is called again)."""
        self.graphs = self.graph_mode = None
        self._captures = {}

    def _new_step(self) -> list[dict]:
        """The step's per-step value dicts (one per rank held), shared by its conventional segments."""
        return [{"const": c} for c in self._consts]

    @staticmethod
    def _seg_graphed(seg: tuple[str, object], ctxs: list[StepCtx], steps: list[dict], zeroed: set = frozenset()) \
            -> None:
        """What a graph records for a segment: the eager op sequence; a megakernel as a fresh step-1 launch
        (`zeroed`: ids of megakernels whose counters the graph already zeroed at its start)."""
        kind, ex = seg
        if kind == "conventional":
            ex.run(ctxs, steps)
        else:
            _graph_launch(ex, zero=id(ex) not in zeroed)

    def can_capture_megakernels(self) -> bool:
        return self.backend != "pyvm" and self.mems[0].world == 1

    def capture(self, ctx_for: Callable[[int], StepCtx], mode: str = "step", warmup: int = 1) -> None:
        """Capture the step as CUDA graph(s) (see the module doc). Runs `warmup` eager steps first (cuBLAS
        handles, lazy allocations); those steps execute for real (they write the KV slot at pos)."""
        if self.backend == "pyvm" or self.mems[0].t("tokens").device.type != "cuda":
            raise RuntimeError("CUDA graph capture needs the GPU backend and CUDA memory (CPU: eager run())")
        if mode == "step" and not self.can_capture_megakernels() and \
                any(k == "megakernel" for k, _ in self.segments):
            mode = "segments"   # world > 1: megakernel launches stay eager between per-segment graphs
        ctxs = [ctx_for(m.rank) for m in self.mems]
        segs = self.segments_for(ctxs[0].greedy)
        if any(kind == "conventional" and ex.compile for kind, ex in segs):
            warmup = max(warmup, 2)   # torch.compile: the first run fills the weight views' cache, the second
            #                           compiles against the filled one (or a new variant's fields); the capture
            #                           then compiles nothing
        for _ in range(warmup):   # eager even when another variant is captured (its graphs bake other fields)
            self._run_eager(ctx_for)
        torch.cuda.synchronize()
        # from here until a replay, a captured megakernel's host step (set to 1 by its captured launch) and its
        # counters (the warm-up's values) disagree: an eager step in between (a failed capture's fallback) resets
        # both first (_run_eager). World size 1 only (larger worlds launch their megakernels eagerly).
        self._counters_stale = self.can_capture_megakernels()
        units: list = []
        steps = self._new_step()
        if mode == "step":
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                # programmatic dependent launches (MPK_MK_PDL=1) overlap the kernel before them only if that is a
                # kernel: their counters are zeroed at the graph's start instead of by a memset just before them
                pdl = [ex for kind, ex in segs if kind == "megakernel" and getattr(ex, "pdl", False)]
                if len({id(mk) for mk in pdl}) != len(pdl):   # (zeroed once per replay: one launch each)
                    raise RuntimeError("a megakernel appears twice in the step's segments; MPK_MK_PDL=1 zeroes its "
                                       "counters once per replay: unset MPK_MK_PDL")
                if pdl:   # (one multi-tensor kernel for all of them)
                    torch._foreach_zero_([mk.counters for mk in pdl])
                for seg in segs:
                    self._seg_graphed(seg, ctxs, steps, zeroed={id(mk) for mk in pdl})
            units.append(("graph", g))
        elif mode == "segments":
            pool = None   # the segment graphs replay one after another: one memory pool for all of them
            for kind, ex in segs:
                if kind == "megakernel" and not self.can_capture_megakernels():
                    units.append(("eager", ex))
                    continue
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self._seg_graphed((kind, ex), ctxs, steps)
                pool = pool or g.pool()
                units.append(("graph", g))
        else:
            raise ValueError(f"capture mode {mode!r}: 'step' or 'segments'")
        torch.cuda.synchronize()
        self.graphs, self.graph_mode = units, mode
        self._graph_steps = steps   # values computed inside one segment graph, read by later ones: kept alive
        self._captured = [self._key(c) for c in ctxs]
        if self._captures is None:
            self._captures = {}
        self._captures[tuple(self._captured)] = (units, mode, steps)

    def has_capture(self, ctx_for: Callable[[int], StepCtx]) -> bool:
        """Whether a step with these StepCtx fields would replay a capture (current or kept)."""
        key = tuple(self._key(ctx_for(m.rank)) for m in self.mems)
        return self.graphs is not None and (key == tuple(self._captured) or key in (self._captures or {}))

    def eager_units(self, ctxs: list[StepCtx]) -> list[Callable[[], None]]:
        """The segments as zero-argument callables run eagerly in order (per-segment timing without graphs): the
        first starts a step (fresh per-step values), the later ones share them, as run() does."""
        cur: list = []
        segs = self.segments_for(ctxs[0].greedy)

        def unit(i: int) -> None:
            if i == 0:
                cur[:] = [self._new_step()]
            kind, ex = segs[i]
            if kind == "conventional":
                ex.run(ctxs, cur[0])
            elif self.backend == "pyvm":
                ex.launch(lambda r, k: ctxs[r], 1)
            else:
                ex.launch(1)
        return [lambda i=i: unit(i) for i in range(len(segs))]

    def replay_units(self):
        """The captured units in order, each a zero-argument callable (per-segment timing puts events between)."""
        out = []
        for kind, u in self.graphs or []:
            out.append(u.replay if kind == "graph" else (lambda mk=u: mk.launch(1)))
        return out

    def run(self, ctx_for: Callable[[int], StepCtx]) -> None:
        """One step. ctx_for(rank) gives the step's inputs for each rank held here."""
        if self.graphs is not None:
            got = [self._key(ctx_for(m.rank)) for m in self.mems]
            if got != self._captured and tuple(got) in (self._captures or {}):
                self.graphs, self.graph_mode, self._graph_steps = self._captures[tuple(got)]
                self._captured = got
            if got != self._captured:
                raise ValueError("CUDA graph replay needs the captured StepCtx tensors (pos, block_tables, inv_freq) "
                                 "updated in place and the same static fields; got different ones")
            for f in self.replay_units():
                f()
            self._counters_stale = False   # a replay leaves every captured megakernel at step 1, as steps_done says
            return
        self._run_eager(ctx_for)

    _counters_stale = False

    def _run_eager(self, ctx_for: Callable[[int], StepCtx]) -> None:
        if self.backend == "pyvm":  # NaN-poison activations once per step (segments share them)
            for m in self.mems:
                m.poison()
        elif self._counters_stale:   # captured but never replayed (capture's comment): start the eager steps afresh
            for mk in self.megakernels():
                mk.counters.zero_()
                mk.steps_done = 0
            self._counters_stale = False
        steps = self._new_step()
        for kind, ex in self.segments_for(ctx_for(self.mems[0].rank).greedy):
            if kind == "conventional":
                ex.run([ctx_for(m.rank) for m in self.mems], steps)
            elif self.backend == "pyvm":
                ex.launch(lambda r, k: ctx_for(r), 1)
            else:
                ex.launch(1)


def _ctx_key(c: StepCtx) -> tuple:
    """What a captured graph baked in: tensor addresses and the static fields (the step number is not)."""
    return (c.pos.data_ptr(), c.block_tables.data_ptr(), c.inv_freq.data_ptr(), c.page_size, c.tokens_per_seq,
            c.kv_len_cap, c.greedy, c.logits_unread)


def _graph_launch(mk, zero: bool = True) -> None:
    """A megakernel launch as a graph records it: counters zeroed, step 1 (see the module doc). After a replay
    the counters hold exactly step 1's values, so eager launches may continue from steps_done = 1. zero=False: the
    graph zeroed them earlier in the same replay (nothing else touches them in between)."""
    if zero:
        mk.counters.zero_()
    mk.steps_done = 0
    mk.launch(1)
