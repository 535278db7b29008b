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
    """All sequences and heads at once; keys [0, L_cap) gathered per sequence, masked beyond each query."""
    a = op.attrs
    D, T = ctx.config.head_dim, ctx.tokens_per_seq
    nq, nkv = a["n_q"], a["n_kv"]
    q = mem.t(a["q"])
    B = q.shape[0] // T
    L = ctx.kv_len_cap or int(ctx.pos.max()) + T                # static on a GPU (kv_len_cap), dynamic on CPU
    kpos = torch.arange(L, device=q.device)
    pages = ctx.block_tables[:, kpos // ctx.page_size]          # (B, L)
    valid = kpos[None, :] < (ctx.pos[:, None] + T)              # (B, L): keys this sequence has written
    k = mem.kv(a["k_cache"])[pages, kpos % ctx.page_size]       # (B, L, nkv, D)
    v = mem.kv(a["v_cache"])[pages, kpos % ctx.page_size]
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    k = torch.where(valid[..., None, None], k, zero)            # slots past the sequence may hold anything
    v = torch.where(valid[..., None, None], v, zero)
    qpos = ctx.pos[:, None] + torch.arange(T, device=q.device)  # (B, T)
    mask = kpos[None, None, :] <= qpos[:, :, None]              # (B, T, L) causal
    qh = q.view(B, T, nq, D).transpose(1, 2).float()            # (B, nq, T, D)
    kh = k.transpose(1, 2).float().repeat_interleave(nq // nkv, dim=1)  # (B, nq, L, D)
    vh = v.transpose(1, 2).float().repeat_interleave(nq // nkv, dim=1)
    mask = mask | (ctx.pos < 0)[:, None, None]                  # inactive rows: any finite result, zeroed below
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[:, None], scale=a["scale"])
    o = torch.where((ctx.pos >= 0)[:, None, None, None], o, torch.zeros_like(o))
    out = mem.t(a["out"])
    out.copy_(o.transpose(1, 2).reshape(B * T, nq * D).to(out.dtype))


OPS = {"qkv_rope": qkv_rope, "attention": attention}
