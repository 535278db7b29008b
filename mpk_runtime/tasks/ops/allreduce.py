"""allreduce: the reduce half of an in-kernel all-reduce (the push half is fused into the producing linear).

One task per column tile [n0, n1): waits until every rank's partial for those columns has arrived in this
rank's symmetric buffer (a cross-rank event with triggers = the producing tiles of all ranks), then
out = residual + sum over ranks (in rank order, so every rank computes identical values).
"""
from __future__ import annotations

from ..graph import Region, Task
from . import decomposer, task_kind
from .common import split_range


@decomposer("allreduce")
def decompose(op, graph, tiling, rank):
    a = op.attrs
    W, M, N = graph.tensors[a["part"]].shape
    tasks = []
    for n0, n1 in split_range(N, tiling.allreduce_n(graph, op, N)):
        tasks.append(Task(-1, rank, "allreduce", op.name,
                          {"part": a["part"], "residual": a["residual"], "out": a["out"], "world": W, "n0": n0, "n1": n1},
                          reads=[Region(a["part"], rank, ((0, W), (0, M), (n0, n1))),
                                 Region(a["residual"], rank, ((0, M), (n0, n1)))],
                          writes=[Region(a["out"], rank, ((0, M), (n0, n1)))],
                          est_bytes=M * (n1 - n0) * (4 * W + 4), est_flops=W * M * (n1 - n0)))
    return tasks


@task_kind("allreduce")
def execute(task, mem, ctx):
    p = task.params
    n0, n1 = p["n0"], p["n1"]
    part = mem.sym(p["part"], ctx.parity)[:, :, n0:n1]  # (W, M, n)
    acc = part[0].clone()
    for r in range(1, p["world"]):
        acc += part[r]
    out = mem.t(p["out"])
    out[:, n0:n1] = mem.t(p["residual"])[:, n0:n1] + acc.to(out.dtype)
