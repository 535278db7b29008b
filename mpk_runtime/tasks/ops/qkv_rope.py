"""qkv_rope: one task per attention head of this rank (q heads, then k heads, then v heads).

A head's task normalises the input rows (RMSNorm, recomputed per task: B x H reads, cheaper than a sync),
projects them onto the head's D rows of W_q / W_k / W_v, applies the Qwen3 per-head q/k RMSNorm and RoPE,
and writes q, or appends k / v into the paged KV cache at each row's position.
Per-head tiles keep norm and RoPE local to the task, and let attention of KV group g start as soon as
group g's heads are done.
"""
from __future__ import annotations

import torch

from ..graph import Region, Task
from . import decomposer, task_kind
from .common import rms_norm, row_positions


@decomposer("qkv_rope")
def decompose(op, graph, tiling, rank):
    a = op.attrs
    M, H = graph.tensors[a["x"]].shape
    B = graph.batch
    D = graph.config.head_dim
    head_bytes = D * H * 2 + M * H * 2
    tasks = []
    for which, n in (("q", a["n_q"]), ("k", a["n_kv"]), ("v", a["n_kv"])):
        for h in range(n):
            if which == "q":
                writes = [Region(a["q"], rank, ((0, M), (h * D, (h + 1) * D)))]
            else:
                writes = [Region(a[f"{which}_cache"], rank, ((0, B), (h, h + 1)))]
            params = {k: a[k] for k in ("x", "norm", "eps", "q", "k_cache", "v_cache", "layer")}
            params.update(which=which, head=h, weight=a["w" + which],
                          head_norm=a["q_norm"] if which == "q" else (a["k_norm"] if which == "k" else None))
            tasks.append(Task(-1, rank, "qkv_rope", op.name, params,
                              reads=[Region(a["x"], rank, ((0, M), (0, H)))], writes=writes,
                              est_bytes=head_bytes, est_flops=2 * M * D * H))
    return tasks


def rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x (M, D) rotated by position pos (M,), rotate_half convention; cos/sin in fp32 cast to x's dtype."""
    ang = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@task_kind("qkv_rope")
def execute(task, mem, ctx):
    p = task.params
    x = mem.t(p["x"])
    D = ctx.config.head_dim
    h = p["head"]
    xn = rms_norm(x, mem.t(p["norm"]), p["eps"])
    y = xn @ mem.t(p["weight"])[h * D:(h + 1) * D].T  # (M, D)
    pos = row_positions(ctx)
    if p["which"] != "v":
        if p["head_norm"] is not None:
            y = rms_norm(y, mem.t(p["head_norm"]), p["eps"])
        y = rope(y, pos, ctx.inv_freq)
    if p["which"] == "q":
        mem.t(p["q"])[:, h * D:(h + 1) * D] = y
        return
    cache = mem.kv(p[f"{p['which']}_cache"])  # (pages, page_size, n_kv, D)
    live = pos >= 0                            # rows of padded (inactive) sequences have pos < 0
    T = ctx.tokens_per_seq
    b = torch.arange(x.shape[0], device=x.device) // T
    page = ctx.block_tables[b[live], pos[live] // ctx.page_size]
    cache[page, pos[live] % ctx.page_size, h] = y[live]
