"""Whole-op torch implementations for the conventional path (prefill, conventional plan segments).

Ops whose task kernels already work on whole tensors (embed, linear, allreduce, argmax) run their task
semantics with one coarse tile. qkv_rope and attention get batched versions here: every head at once, keys
gathered through the page tables into a padded (B, L, n_kv, D) block with a causal mask, no host round trips,
so on a GPU the segment can be captured in a CUDA graph. Same numerics as the task kernels (fp32 softmax,
RMSNorm statistics in fp32, bf16/fp32 rounding at the same points).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..tasks.ops.common import rms_norm, row_positions
from ..tasks.ops.qkv_rope import rope


def qkv_rope(op, mem, ctx) -> None:
    a = op.attrs
    D = ctx.config.head_dim
    x = mem.t(a["x"])
    M = x.shape[0]
    xn = rms_norm(x, mem.t(a["norm"]), a["eps"])
    pos = row_positions(ctx)                                   # (M,)
    out = {}
    for which, n in (("q", a["n_q"]), ("k", a["n_kv"]), ("v", a["n_kv"])):
        y = (xn @ mem.t(a["w" + which]).T).view(M, n, D)      # (M, heads, D)
        if which != "v":
            hn = a["q_norm"] if which == "q" else a["k_norm"]
            if hn is not None:
                y = rms_norm(y, mem.t(hn), a["eps"])
            y = rope(y.reshape(M * n, D), pos.repeat_interleave(n), ctx.inv_freq).view(M, n, D)
        out[which] = y
    mem.t(a["q"]).copy_(out["q"].reshape(M, -1))
    T = ctx.tokens_per_seq
    b = torch.arange(M, device=x.device) // T
    live = pos >= 0
    p = pos.clamp(min=0)
    page = torch.where(live, ctx.block_tables[b, p // ctx.page_size], torch.full_like(p, mem.kvstore.scratch))
    for which in ("k", "v"):
        mem.kv(a[f"{which}_cache"])[page, p % ctx.page_size] = out[which]


def attention(op, mem, ctx) -> None:
    """All sequences and heads at once; keys [0, L_cap) gathered per sequence, masked beyond each query.

    GQA without expanding K/V: the g = n_q / n_kv query heads of a KV head are stacked as rows of one matmul
    against that head's keys (fp32 scores and softmax, as the task kernels), so the gathered cache is read
    once instead of being copied g times."""
    a = op.attrs
    D, T = ctx.config.head_dim, ctx.tokens_per_seq
    nq, nkv = a["n_q"], a["n_kv"]
    g = nq // nkv
    q = mem.t(a["q"])
    B = q.shape[0] // T
    L = ctx.kv_len_cap or int(ctx.pos.max()) + T                # static on a GPU (kv_len_cap), dynamic on CPU
    kpos = torch.arange(L, device=q.device)
    pages = ctx.block_tables[:, kpos // ctx.page_size]          # (B, L)
    valid = kpos[None, :] < (ctx.pos[:, None] + T)              # (B, L): keys this sequence has written
    slot = kpos % ctx.page_size
    k = mem.kv(a["k_cache"])[pages, slot].transpose(1, 2)       # (B, nkv, L, D)
    v = mem.kv(a["v_cache"])[pages, slot].transpose(1, 2)
    v = torch.where(valid[:, None, :, None], v, torch.zeros((), dtype=v.dtype, device=v.device))  # garbage/NaN
    qpos = ctx.pos[:, None] + torch.arange(T, device=q.device)  # (B, T)
    mask = (kpos[None, None, :] <= qpos[:, :, None]) & valid[:, None, :]   # (B, T, L) causal, written keys
    mask = mask | (ctx.pos < 0)[:, None, None]                  # inactive rows: any finite result, zeroed below
    qg = q.view(B, T, nkv, g, D).permute(0, 2, 3, 1, 4).reshape(B, nkv, g * T, D).float()
    s = torch.matmul(qg, k.float().transpose(-1, -2)) * a["scale"]          # (B, nkv, g*T, L)
    m = mask[:, None, None].expand(B, 1, g, T, L).reshape(B, 1, g * T, L)
    s = s.masked_fill(~m, float("-inf"))                        # also drops scores of garbage (NaN) keys
    o = torch.matmul(torch.softmax(s, -1), v.float())           # (B, nkv, g*T, D)
    o = o.view(B, nkv, g, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, nq * D)
    o = torch.where((ctx.pos >= 0)[:, None, None], o, torch.zeros_like(o))
    out = mem.t(a["out"])
    out.copy_(o.reshape(B * T, nq * D).to(out.dtype))


OPS = {"qkv_rope": qkv_rope, "attention": attention}
