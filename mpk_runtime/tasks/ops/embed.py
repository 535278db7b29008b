"""embed: gather token embeddings. One task (the gather moves B x H elements; never worth splitting).

A token id outside the table reads its nearest row: -1 (the full-vocabulary draw's mark for a row it could not
draw) row 0, PAD_INDEX (the graph sampler's, ir/sampling.py step 6) the last. The engine fails such a request when
it reads the token, but within a launch of several steps, or a burst of decode steps, the device feeds it back as
the next step's input first: unclamped, that read far past the table (a fault that ends the CUDA context and every
request with it; torch's gather asserts on the device). tests/runtime/test_embed_guard.py."""
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
    table = mem.t(p["table"])
    out.copy_(table[tok.clamp(0, table.shape[0] - 1)])
