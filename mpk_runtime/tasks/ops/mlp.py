"""mlp: a layer's gate_up tile with its share of the down projection (ir/build.py mlp_fuse, MPK_MLP_FUSE=1).

Task [n0, n1) of a fused MLP computes the intermediate columns act[:, n0:n1] = silu(norm(x) Wg^T) * (norm(x) Wu^T)
as the gate_up linear tile would (kept, not stored), then their part of the down projection over exactly those K
columns, act[:, n0:n1] Wd[:, n0:n1]^T (M, H) in fp32, added into the layer's accumulator `acc` (ir/build.py
`L{i}.mlp_acc`). It then takes the op's ticket; the task that takes the last one of the step writes the down op's
output, out = residual + bf16(acc) (the down linear's rounding points: its sum rounded once, then the residual add),
and zeroes acc for the next step. So the down projection needs no dependent phase of its own: no wait on every
gate_up tile, no intermediate row through memory.

Dependencies: every task declares the whole output row as written, so a reader's event (one per producer set)
counts all of them, and only the last one (the finisher, which signals after writing the row) completes it. The
accumulator and the ticket are ordered by the ticket itself (the folded attention merge's pattern), not by events.
The fp32 partials are added in task order here and in the hardware's order on the GPU: the GPU's output may differ
from this in the last bit of bf16(acc).

Fused when the graph holds both ops (a plan segment can cut between them), the rows are below TC_MIN_M (batch-1
CUDA-core tiles: docs/perf-notes.md session 37's design), and the down projection is the tp == 1 one (residual fused,
one K segment, no push). Otherwise gate_up and down decompose as two linear ops.
"""
from __future__ import annotations

import torch.nn.functional as F

from ..graph import Region, Task
from . import task_kind
from .common import rms_norm


def fused_down(op, graph):
    """The down op a gate_up op runs inside its tiles, or None."""
    a = op.attrs
    name = a.get("fuse_down")
    if op.kind != "linear" or not name or not a.get("acc"):
        return None
    down = next((o for o in graph.ops if o.name == name), None)
    if down is None or down.attrs.get("x") != a["out"] or down.attrs.get("push") or not down.attrs.get("residual") \
            or down.attrs.get("k_segments", 1) != 1 or down.attrs.get("norm"):
        return None
    from ...codegen import layout   # (codegen reads the tasks' opcodes at import)
    if graph.tensors[a["out"]].shape[0] >= layout.CONSTANTS["TC_MIN_M"]:
        return None
    return down


def fused_into(op, graph) -> bool:
    """True for a down op whose gate_up runs it (fused_down): it decomposes into no tasks."""
    return op.kind == "linear" and any(o.attrs.get("fuse_down") == op.name and fused_down(o, graph) is op
                                       for o in graph.ops)


def mlp_tasks(op, down, graph, tiling, rank: int) -> list[Task]:
    a, d = op.attrs, down.attrs
    M_in, K = graph.tensors[a["x"]].shape
    M, I = graph.tensors[a["out"]].shape
    H = graph.tensors[d["out"]].shape[-1]
    tiles = tiling.linear_tiles(graph, op, I)
    tasks = []
    for n0, n1 in tiles:
        params = {k: a[k] for k in ("x", "weights", "norm", "eps", "acc")}
        params.update(act=a["out"], wd=d["weights"][0], residual=d["residual"], out=d["out"], n0=n0, n1=n1,
                      tiles=len(tiles))
        reads = [Region(a["x"], rank, ((0, M_in), (0, K))), Region(d["residual"], rank, ((0, M), (0, H)))]
        writes = [Region(d["out"], rank, ((0, M), (0, H)))]
        w = n1 - n0
        tasks.append(Task(-1, rank, "mlp", op.name, params, reads=reads, writes=writes,
                          est_bytes=2 * w * K * 2 + H * w * 2 + M_in * K * 2 + M * H * 4,
                          est_flops=2 * M * 2 * w * K + 2 * M * w * H))
    return tasks


@task_kind("mlp")
def execute(task, mem, ctx):
    p = task.params
    n0, n1 = p["n0"], p["n1"]
    x = rms_norm(mem.t(p["x"]), mem.t(p["norm"]), p["eps"])
    g, u = (x @ mem.t(w)[n0:n1].T for w in p["weights"])
    act = (F.silu(g) * u).to(mem.t(p["act"]).dtype)   # the gate_up tile's columns, as linear's epilogue rounds them
    acc = mem.t(p["acc"])
    acc += act.float() @ mem.t(p["wd"])[:, n0:n1].float().T
    if ctx.take_ticket((task.op, "mlp")) % p["tiles"] == p["tiles"] - 1:   # the step's last tile: finish the row
        res, out = mem.t(p["residual"]), mem.t(p["out"])
        out.copy_((res + acc.to(act.dtype)).to(out.dtype))
        acc.zero_()
