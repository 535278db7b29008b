"""allreduce: the reduce half of an in-kernel all-reduce (the push half is fused into the producing linear).

One task per column tile [n0, n1): waits until every rank's partial for those columns has arrived in this
rank's symmetric buffer (a cross-rank event with triggers = the producing tiles of all ranks), then
out = residual + sum over ranks (in rank order, so every rank computes identical values).
LL (op attr "ll"): the partials are (fp32, step flag) pairs in int64 words; the tile does not read the buffer as
a region (no events on the producers, so no cross-rank signals) and is ready when every pair of its columns
carries this step's flag (task_ready below; the kernel polls the flags). Slots stay parity-doubled: a rank is
at most one step ahead of its peers' reads, because its next push of a slot needs their results of this step.
"""
from __future__ import annotations

import torch

from ..graph import Region, Task
from . import decomposer, task_kind, task_ready
from .common import split_range
from .linear import ll_flag


@decomposer("allreduce")
def decompose(op, graph, tiling, rank):
    a = op.attrs
    W, M, N = graph.tensors[a["part"]].shape
    tasks = []
    ll = bool(a.get("ll", False))
    for n0, n1 in split_range(N, tiling.allreduce_n(graph, op, N)):
        reads = [Region(a["residual"], rank, ((0, M), (n0, n1)))]
        if not ll:   # LL: ordered by the flags in the data, not by events
            reads.insert(0, Region(a["part"], rank, ((0, W), (0, M), (n0, n1))))
        tasks.append(Task(-1, rank, "allreduce", op.name,
                          {"part": a["part"], "residual": a["residual"], "out": a["out"], "world": W, "n0": n0, "n1": n1,
                           "ll": ll},
                          reads=reads,
                          writes=[Region(a["out"], rank, ((0, M), (n0, n1)))],
                          est_bytes=M * (n1 - n0) * (4 * W + 4), est_flops=W * M * (n1 - n0)))
    return tasks


@task_kind("allreduce")
def execute(task, mem, ctx):
    p = task.params
    n0, n1 = p["n0"], p["n1"]
    part = mem.sym(p["part"], ctx.parity)[:, :, n0:n1]  # (W, M, n)
    if p.get("ll"):
        pairs = part.contiguous().view(torch.int32).view(*part.shape, 2)
        # (checked on the CPU twin only: on a GPU, under CUDA-graph capture, the check would synchronise)
        if pairs.device.type == "cpu" and not bool((pairs[..., 1] == ll_flag(ctx.step)).all()):
            raise RuntimeError(f"{task.op} [{n0}, {n1}): LL partials of step {ctx.step} have not all arrived "
                               "(the executor must check task_ready first)")
        part = pairs[..., 0].contiguous().view(torch.float32)
    acc = part[0].clone()
    for r in range(1, p["world"]):
        acc += part[r]
    out = mem.t(p["out"])
    out[:, n0:n1] = mem.t(p["residual"])[:, n0:n1] + acc.to(out.dtype)


@task_ready("allreduce")
def ready(task, mem, ctx) -> bool:
    """LL: every rank's pair for these columns carries this step's flag."""
    p = task.params
    if not p.get("ll"):
        return True
    part = mem.sym(p["part"], ctx.parity)[:, :, p["n0"]:p["n1"]]
    flags = part.contiguous().view(torch.int32).view(*part.shape, 2)[..., 1]
    return bool((flags == ll_flag(ctx.step)).all())
