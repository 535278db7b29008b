"""The conventional path: run a Graph op by op with torch (one coarse task per op tile, in program order).

It reuses the task kinds' semantics with a coarse tiling, so every op has exactly one definition of what it
computes; ranks of a TP group are interleaved task by task (their decompositions are identical, and every
cross-rank producer precedes its consumer in that order). Used for prefill chunks and as the CPU "torch"
backend; on a GPU the same ops run as torch kernels.
"""
from __future__ import annotations

from ..ir.graph import Graph
from ..tasks.build import decompose
from ..tasks.ops import get_task_kind
from ..tasks.tiling import Tiling
from .memory import RankMemory, StepCtx

COARSE = Tiling(num_sms=1, linear_cols=1 << 30, allreduce_cols=1 << 30)


class ConventionalExecutor:
    def __init__(self, graphs: list[Graph], mems: list[RankMemory]):
        self.mems = mems
        self.tasks = [decompose(g, COARSE) for g in graphs]
        self.kernels = {t.kind: get_task_kind(t.kind) for ts in self.tasks for t in ts}

    def run(self, ctxs: list[StepCtx]) -> None:
        n = max(len(ts) for ts in self.tasks)
        for i in range(n):
            for r, ts in enumerate(self.tasks):
                if i < len(ts):
                    t = ts[i]
                    self.kernels[t.kind](t, self.mems[r], ctxs[r])
