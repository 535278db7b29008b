"""Whole-op torch implementations for the conventional path (prefill, conventional plan segments).

Ops whose task kernels already work on whole tensors (embed, linear, allreduce, argmax) run their task
semantics with one coarse tile. qkv_rope and attention get batched versions here: every head at once, key
pages gathered through the page tables into a padded (B, L, n_kv, D) block with a causal mask and one fused
attention call, no host round trips (no host-to-device copies either), so on a GPU the segment can be
captured in a CUDA graph. qkv_rope has the task kernels' numerics (RMSNorm statistics in fp32, bf16/fp32
rounding at the same points); attention agrees to bf16 tolerance (see attention()).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..tasks.ops.common import rms_norm, row_positions


def qkv_rope(op, mem, ctx) -> None:
    a = op.attrs
    D = ctx.config.head_dim
    x = mem.t(a["x"])
    M = x.shape[0]
    xn = rms_norm(x, mem.t(a["norm"]), a["eps"])
    pos = row_positions(ctx)                                   # (M,)
    # cos/sin once per row, broadcast over heads and shared by q and k (rope() per head row computed them
    # n_q + n_kv times); the same values and elementwise ops as rope(), so the same numerics
    ang = pos.float()[:, None] * ctx.inv_freq[None, :]
    emb = torch.cat((ang, ang), dim=-1)[:, None, :]             # (M, 1, D)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    out = {}
    for which, n in (("q", a["n_q"]), ("k", a["n_kv"]), ("v", a["n_kv"])):
        y = (xn @ mem.t(a["w" + which]).T).view(M, n, D)      # (M, heads, D)
        if which != "v":
            hn = a["q_norm"] if which == "q" else a["k_norm"]
            if hn is not None:
                y = rms_norm(y, mem.t(hn), a["eps"])
            y1, y2 = y.chunk(2, dim=-1)
            y = y * cos + torch.cat((-y2, y1), dim=-1) * sin
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
    """All sequences and heads at once: the pages of keys [0, L_cap) gathered per sequence (one indexed copy of
    whole pages, in the cache dtype), then one fused scaled-dot-product attention call.

    GQA without expanding K/V: the g = n_q / n_kv query heads of a KV head are stacked as g*T query rows of
    that head (a boolean mask keeps each row causal and inside the keys its sequence has written), so the
    gathered cache is read once. Scores and softmax accumulate in fp32 inside the fused kernel; on bf16 the
    probabilities are rounded to bf16 before the PV product (the task kernels keep them in fp32: agreement to
    bf16 tolerance, not bitwise). Unwritten slots are masked out of the scores and get probability 0, which is
    exact for any finite garbage; a NaN-poisoned cache (KVStore(poison=True), the CPU twin's debug fill) is
    sanitised first because 0 * NaN is NaN."""
    a = op.attrs
    D, T, ps = ctx.config.head_dim, ctx.tokens_per_seq, ctx.page_size
    nq, nkv = a["n_q"], a["n_kv"]
    g = nq // nkv
    q = mem.t(a["q"])
    B = q.shape[0] // T
    L = ctx.kv_len_cap or int(ctx.pos.max()) + T                # static on a GPU (kv_len_cap), dynamic on CPU
    npg = -(-L // ps)
    pages = ctx.block_tables[:, :npg].reshape(-1)               # (B * npg): whole pages
    kc, vc = mem.kv(a["k_cache"]), mem.kv(a["v_cache"])         # (pages, ps, nkv, D)
    # index_select copies whole contiguous pages (a vectorised gather); advanced indexing kc[pages] ran an
    # element-wise index kernel: 24.6 of 45.6 ms GPU time of a qwen3-8b batch-128 step (H200 profile)
    k = kc.index_select(0, pages).view(B, npg * ps, nkv, D)[:, :L].transpose(1, 2)   # (B, nkv, L, D)
    v = vc.index_select(0, pages).view(B, npg * ps, nkv, D)[:, :L].transpose(1, 2)
    kpos = torch.arange(L, device=q.device)
    qpos = ctx.pos[:, None] + torch.arange(T, device=q.device)  # (B, T)
    mask = kpos[None, None, :] <= qpos[:, :, None]             # (B, T, L): causal and written (pos + t >= key)
    mask = mask | (ctx.pos < 0)[:, None, None]                  # inactive rows: any finite result, zeroed below
    if mem.kvstore.poisoned:
        w = (kpos[None, :] < (ctx.pos[:, None] + T))[:, None, :, None]    # (B, 1, L, 1): written keys
        zero = torch.zeros((), dtype=k.dtype, device=k.device)
        k, v = torch.where(w, k, zero), torch.where(w, v, zero)
    qg = q.view(B, T, nkv, g, D).permute(0, 2, 3, 1, 4).reshape(B, nkv, g * T, D)
    m = mask[:, None, None].expand(B, 1, g, T, L).reshape(B, 1, g * T, L)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=a["scale"])   # (B, nkv, g*T, D)
    o = o.view(B, nkv, g, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, nq * D)
    o = torch.where((ctx.pos >= 0)[:, None, None], o, torch.zeros((), dtype=o.dtype, device=o.device))
    out = mem.t(a["out"])
    out.copy_(o.reshape(B * T, nq * D).to(out.dtype))


OPS = {"qkv_rope": qkv_rope, "attention": attention}
