"""Run one step as a Plan: its segments in order, each a megakernel or a run of conventional ops.

Segments share one RankMemory per rank (the same Graph's tensors and the same KV cache), so activations and
cache hand over through memory; a segment boundary is a launch boundary, which orders everything before it.
Megakernel segments run on `pyvm` (CPU twin) or the GPU `Megakernel`, each with its own counters.
"""
from __future__ import annotations

from typing import Callable

from ..ir.graph import Graph
from ..planner.plan import Plan
from ..tasks.build import build_task_graphs
from ..tasks.check import check_task_graphs
from ..tasks.tiling import Tiling
from .memory import RankMemory, StepCtx
from .pyvm import PyVM
from .torch_exec import ConventionalExecutor


def _tiling(d: dict, num_sms: int | None) -> Tiling:
    d = dict(d)
    if num_sms:
        d["num_sms"] = num_sms
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
        self.plan, self.mems, self.backend = plan, mems, backend
        self.segments: list[tuple[str, object]] = []
        for seg in plan.segments:
            sub = [g.subgraph(seg.ops) for g in graphs]
            if seg.kind == "conventional":
                self.segments.append(("conventional", ConventionalExecutor(sub, mems, comm=comm)))
                continue
            tgs = build_task_graphs(sub, _tiling(seg.tiling, num_sms))
            if check:
                check_task_graphs(tgs, steps=2)
            if backend == "pyvm":
                self.segments.append(("megakernel", PyVM(tgs, mems, mode=mode, seed=seed, poison=False)))
            else:
                if make_megakernel is None:
                    raise ValueError("backend 'megakernel' needs make_megakernel(task_graph, mem)")
                self.segments.append(("megakernel", make_megakernel(tgs[mems[0].rank if len(tgs) > 1 else 0], mems[0])))

    def run(self, ctx_for: Callable[[int], StepCtx]) -> None:
        """One step. ctx_for(rank) gives the step's inputs for each rank held here."""
        if self.backend == "pyvm":  # NaN-poison activations once per step (segments share them)
            for m in self.mems:
                m.poison()
        for kind, ex in self.segments:
            if kind == "conventional":
                ex.run([ctx_for(m.rank) for m in self.mems])
            elif self.backend == "pyvm":
                ex.launch(lambda r, k: ctx_for(r), 1)
            else:
                ex.launch(1)
