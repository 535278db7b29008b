"""embed: gather token embeddings. One task (the gather moves B x H elements; never worth splitting)."""
from __future__ import annotations

from ..graph import Region, Task
from . import decomposer, task_kind


@decomposer("embed")
def decompose(op, graph, tiling, rank):
    a = op.attrs
    M, H = graph.tensors[a["out"]].shape
    return [Task(-1, rank, "embed", op.name, {"tokens": a["tokens"], "table": a["table"], "out": a["out"]},
                 reads=[Region(a["tokens"], rank, ((0, M),))], writes=[Region(a["out"], rank, ((0, M), (0, H)))],
                 est_bytes=op.bytes, est_flops=0)]


@task_kind("embed")
def execute(task, mem, ctx):
    p = task.params
    tok = mem.t(p["tokens"])
    out = mem.t(p["out"])
    out.copy_(mem.t(p["table"])[tok.clamp(min=0)])
