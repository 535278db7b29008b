"""argmax: greedy next token over a vocab-parallel LM head.

argmax_partial: this rank's best (value, global index) per sequence, pushed into slot `rank` of every rank's
symmetric buffer. argmax_reduce: every rank picks the best slot (ties -> lowest index, as torch.argmax), so
all ranks agree on the token without a host round trip; in decode graphs it also writes the `tokens` input
of the next step (a lag-1 dependency), which is what lets several steps run in one launch.
"""
from __future__ import annotations

import torch

from ..graph import Region, Task
from . import decomposer, task_kind


@decomposer("argmax")
def decompose(op, graph, tiling, rank):
    a = op.attrs
    B, V = graph.tensors[a["logits"]].shape
    W = a["world"]
    part = Task(-1, rank, "argmax_partial", op.name,
                {"logits": a["logits"], "part": a["part"], "vocab0": a["vocab0"]},
                reads=[Region(a["logits"], rank, ((0, B), (0, V)))],
                writes=[Region(a["part"], r, ((rank, rank + 1),)) for r in range(W)],
                est_bytes=B * V * 4, est_flops=B * V)
    lag = [Region("tokens", rank, ((0, B),))] if a["feeds_next_step"] else []
    red = Task(-1, rank, "argmax_reduce", op.name,
               {"part": a["part"], "out": a["out"], "world": W, "feeds_next_step": a["feeds_next_step"]},
               reads=[Region(a["part"], rank, ((0, W),))], writes=[Region(a["out"], rank, ((0, B),))],
               lag_writes=lag, est_bytes=W * B * 8 + B * 8, est_flops=W * B)
    return [part, red]


@task_kind("argmax_partial")
def execute_partial(task, mem, ctx):
    p = task.params
    logits = mem.t(p["logits"])  # (B, V_local) fp32
    val, idx = logits.max(-1)    # first occurrence on ties
    pair = torch.stack([val, (idx + p["vocab0"]).float()], -1)
    for peer in mem.peers:
        peer.sym(p["part"], ctx.parity)[mem.rank] = pair


@task_kind("argmax_reduce")
def execute_reduce(task, mem, ctx):
    p = task.params
    part = mem.sym(p["part"], ctx.parity)  # (W, B, 2)
    best_v, best_i = part[0, :, 0].clone(), part[0, :, 1].clone()
    for r in range(1, p["world"]):
        v, i = part[r, :, 0], part[r, :, 1]
        better = (v > best_v) | ((v == best_v) & (i < best_i))
        best_v = torch.where(better, v, best_v)
        best_i = torch.where(better, i, best_i)
    tok = best_i.long()
    mem.t(p["out"]).copy_(tok)
    if p["feeds_next_step"]:
        mem.t("tokens").copy_(tok)
