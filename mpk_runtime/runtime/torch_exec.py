"""The conventional path: run a Graph op by op with torch, in program order.

Ops with a whole-op version (conventional_ops: embed, linear without TP push, qkv_rope, attention) run as
batched torch kernels with the task kinds' numerics; the rest run their task kinds' semantics with one coarse
tile, so every op has exactly one definition of what it computes. Ranks of a TP group are interleaved task by
task (their decompositions are identical, and every cross-rank producer precedes its consumer in that order).
Values every layer needs (positions, RoPE tables, KV slots, attention masks) are built once per step, inside
run() (a CUDA graph capture records them; see conventional_ops). Used for prefill chunks and as the CPU
"torch" backend; on a GPU the same ops run as torch kernels.
"""
from __future__ import annotations

from ..ir.graph import Graph
from ..tasks.build import decompose
from ..tasks.ops import get_task_kind
from ..tasks.tiling import Tiling
from .conventional_ops import OPS as WHOLE_OPS, runs_whole
from .memory import RankMemory, StepCtx

COARSE = Tiling(num_sms=1, linear_cols=1 << 30, allreduce_cols=1 << 30)


class ConventionalExecutor:
    """`graphs`/`mems`: the ranks held by this process. With a `comm` (ranks in separate processes), this
    process holds one rank and the symmetric slots of the other ranks are filled by an all-gather right before
    each task that reads them (allreduce, argmax_reduce), so the reductions are the same rank-ordered sums."""

    def __init__(self, graphs: list[Graph], mems: list[RankMemory], comm=None):
        self.mems, self.comm = mems, comm
        # ops with a batched whole-op version run as one pseudo-task; the rest as their coarse tiles
        self.tasks = []
        for g in graphs:
            ts = []
            for op in g.ops:
                if runs_whole(op):
                    ts.append(_WholeOp(op))
                else:
                    ts.extend(decompose(g.subgraph([op.name]), COARSE))
            self.tasks.append(ts)
        self.consts = [{} for _ in self.tasks]   # per rank, kept across steps: views of weights (conventional_ops._wt)
        self.kernels = {t.kind: (WHOLE_OPS[t.op.kind][0] if isinstance(t, _WholeOp) else get_task_kind(t.kind))
                        for ts in self.tasks for t in ts}
        if comm is not None and comm.world_size > 1:
            if len(mems) != 1:
                raise ValueError("with a communicator each process holds exactly one rank")
            for kind, sym_param in (("allreduce", "part"), ("argmax_reduce", "part")):
                if kind in self.kernels:   # a segment without that op (e.g. attention only) has nothing to wrap
                    self.kernels[kind] = self._gathering(self.kernels[kind], sym_param)

    def _gathering(self, kernel, sym_param):
        def run(task, mem, ctx):
            buf = mem.sym(task.params[sym_param], ctx.parity)  # (W, ...)
            buf.copy_(self.comm.all_gather(buf[mem.rank][None].contiguous(), dim=0))
            kernel(task, mem, ctx)
        return run

    def run(self, ctxs: list[StepCtx]) -> None:
        # per-step values shared by the layers, one dict per rank; fresh every run (never reused across steps:
        # a captured graph must recompute them from the pos / block_tables of the step it replays)
        steps = [{"const": c} for c in self.consts]
        n = max(len(ts) for ts in self.tasks)
        for i in range(n):
            for r, ts in enumerate(self.tasks):
                if i < len(ts):
                    t = ts[i]
                    if isinstance(t, _WholeOp):
                        self.kernels[t.kind](t.op, self.mems[r], ctxs[r], steps[r])
                    else:
                        self.kernels[t.kind](t, self.mems[r], ctxs[r])


class _WholeOp:
    """An op run whole (conventional_ops) in the executor's program order."""

    def __init__(self, op):
        self.op, self.kind = op, "whole:" + op.kind    # apart from the task kind (a TP linear runs as tasks)
