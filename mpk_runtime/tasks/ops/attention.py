"""attention: causal GQA attention over the paged KV cache, split-KV.

attn_partial (b, g, s): the q heads of KV group g for sequence b against the s-th of `splits` equal chunks of
its keys [0, L) (L = pos[b] + T, known only at run time); writes the chunk's normalised output and its
log-sum-exp. attn_merge (b, g): combines the chunks (weights exp(lse_s - max)). Splitting the keys lets
batch-1 decode of long contexts use many SMs; the merge is cheap.
Folded (Tiling.attn_fold_merge): no attn_merge tasks; every partial of a group declares the group's output as
written, counts itself on the group's ticket (monotonic, never reset: step k's partials take tickets
kS .. kS + S - 1) after writing its chunk, and the one that takes the group's last ticket merges the group, in the
same arithmetic order as attn_merge, before it signals. Consumers of the output wait on all the group's partials.
Grouped (Tiling.attn_g > 1: one split, folded): one attn_partial covers KV groups g .. g + ng - 1 of a sequence
(params g, ng); on the device the groups run side by side, 8 / ng warps each (attention.cuh gwm), so a
group's sums depend on ng. tp_invariant graphs therefore keep one group per task (ng = 1, the 8-warp arithmetic
whatever the TP degree), as linear pins k_slices = 1.
Deferred appends (ir/defer.py, op attr kv_defer): the partial whose chunk holds a sequence's new position first
writes that position's k / v rows of its groups from `kv_new` into the paged cache; it alone reads that chunk.
Normed heads (Tiling.attn_qk_norm, qkv_rope.norm_in_attention): where the layer's qkv_rope leaves Qwen3's q / k
heads unnormalised in qk_raw, every partial normalises and rotates its groups' q heads from qk_raw itself (no
qk_norm_rope tasks, and no q tensor read), and the partial whose chunk holds the new position (the last: chunks
split [0, pos + 1)) writes its groups' normed, rotated k row into the cache first, as a deferred append would.
"""
from __future__ import annotations


import torch

from ..graph import Region, Task
from . import decomposer, task_kind
from .common import row_positions
from .qkv_rope import layer_op, norm_in_attention, norm_rope_head


@decomposer("attention")
def decompose(op, graph, tiling, rank):
    a = op.attrs
    B, T, D = graph.batch, graph.tokens_per_seq, graph.config.head_dim
    gs = a["n_q"] // a["n_kv"]
    S = a["splits"]
    eb = 2
    kv_bytes = int((graph.context_len + T) * D * eb * 2 / S)
    base = {k: a[k] for k in ("q", "k_cache", "v_cache", "part", "lse", "out", "scale", "splits", "layer")}
    defer = bool(a.get("kv_defer"))
    if defer:
        if T != 1:
            raise ValueError(f"{op.name}: deferred KV appends are for decode steps (one new row per sequence)")
        base.update(kv_new=a["kv_new"], kv_defer=True)
    fold = tiling.attn_fold_merge
    ng = 1 if graph.tp_invariant > 1 else tiling.attn_g(S, gs, a["n_kv"], D, B, keys=graph.context_len + T)
    qop = layer_op(graph, "qkv_rope", a["layer"])
    raw = qop.attrs["qk_raw"] if qop is not None and norm_in_attention(qop, graph, tiling) else None
    if raw is not None:   # (the decode step's q / k heads from qk_raw: q_norm / k_norm / eps of the qkv op)
        base.update(raw=raw, **{k: qop.attrs[k] for k in ("q_norm", "k_norm", "eps")})
    nq = a["n_q"]
    tasks, merges = [], []
    for b in range(B):
        m0, m1 = b * T, (b + 1) * T
        for g in range(0, a["n_kv"], ng):
            h0, h1 = g * gs, (g + ng) * gs
            for s in range(S):
                writes = [Region(a["part"], rank, ((m0, m1), (h0, h1), (s, s + 1))),
                          Region(a["lse"], rank, ((m0, m1), (h0, h1), (s, s + 1)))]
                if fold:   # (the group's other chunks, read by the merging partial, are ordered by the ticket)
                    writes.append(Region(a["out"], rank, ((m0, m1), (h0 * D, h1 * D))))
                tasks.append(Task(-1, rank, "attn_partial", op.name,
                                  {**base, "b": b, "g": g, "split": s, "gs": gs, "fold": fold, "head_dim": D,
                                   "keys": -(-(graph.context_len + T) // S),   # per group (the planner's key term)
                                   **({"ng": ng} if ng > 1 else {})},
                                  # (deferred: the chunk with the new row also writes that row of the cache,
                                  # which no other task of the step reads: not a declared region)
                                  reads=([Region(a["q"], rank, ((m0, m1), (h0 * D, h1 * D)))] if raw is None else
                                         [Region(raw, rank, ((m0, m1), (h0 * D, h1 * D))),
                                          Region(raw, rank, ((m0, m1), ((nq + g) * D, (nq + g + ng) * D)))])
                                  + [Region(a["k_cache"], rank, ((b, b + 1), (g, g + ng))),
                                         Region(a["v_cache"], rank, ((b, b + 1), (g, g + ng)))]
                                  + ([Region(a["kv_new"], rank, ((m0, m1), (g * D, (g + ng) * D))),
                                      Region(a["kv_new"], rank, ((m0, m1), ((a["n_kv"] + g) * D,
                                                                            (a["n_kv"] + g + ng) * D)))]
                                     if defer else []),
                                  writes=writes,
                                  # folded: every partial is priced with the whole merge (the one that merges
                                  # is the group's last, the one on the critical path)
                                  est_bytes=ng * (kv_bytes + T * gs * D * eb + (T * gs * D * (4 * S + eb) if fold else 0)),
                                  est_flops=ng * (4 * T * gs * D * (graph.context_len + T) // S
                                                  + (3 * T * gs * D * S if fold else 0))))
        if fold:
            continue
        for g in range(a["n_kv"]):
            h0, h1 = g * gs, (g + 1) * gs
            merges.append(Task(-1, rank, "attn_merge", op.name, {**base, "b": b, "g": g, "gs": gs},
                               reads=[Region(a["part"], rank, ((m0, m1), (h0, h1))),
                                      Region(a["lse"], rank, ((m0, m1), (h0, h1)))],
                               writes=[Region(a["out"], rank, ((m0, m1), (h0 * D, h1 * D)))],
                               est_bytes=T * gs * D * (4 * S + eb), est_flops=3 * T * gs * D * S))
    return tasks + merges


def _keys(cache: torch.Tensor, table: torch.Tensor, lo: int, hi: int, page_size: int, g: int) -> torch.Tensor:
    """Positions [lo, hi) of KV head g of one sequence, gathered through its page table: (n, D)."""
    pos = torch.arange(lo, hi, device=cache.device)
    return cache[table[pos // page_size], pos % page_size, g]


@task_kind("attn_partial")
def execute_partial(task, mem, ctx):
    p = task.params
    b, s, gs, S = p["b"], p["split"], p["gs"], p["splits"]
    T, D = ctx.tokens_per_seq, ctx.config.head_dim
    m0 = b * T
    part, lse = mem.t(p["part"]), mem.t(p["lse"])
    pos0 = int(ctx.pos[b])
    L = pos0 + T
    lo, hi = (L * s) // S, (L * (s + 1)) // S
    if p.get("kv_defer") and pos0 >= 0 and lo <= pos0 < hi:   # the new row is in this chunk: append it first
        _append_new_row(p, mem, ctx, b, pos0)
    qn = _normed_heads(p, mem, ctx, b, m0, lo <= pos0 < hi) if p.get("raw") and pos0 >= 0 else None
    for g in range(p["g"], p["g"] + p.get("ng", 1)):   # each of the task's KV groups as its own task would
        if pos0 < 0 or hi <= lo:  # inactive sequence or empty chunk: contributes nothing to the merge
            part[m0:m0 + T, g * gs:(g + 1) * gs, s] = 0
            lse[m0:m0 + T, g * gs:(g + 1) * gs, s] = float("-inf")
        else:
            q = (mem.t(p["q"])[m0:m0 + T, g * gs * D:(g + 1) * gs * D] if qn is None
                 else qn[:, (g - p["g"]) * gs * D:(g - p["g"] + 1) * gs * D])
            _partial_chunk(p, mem, ctx, b, g, s, gs, S, T, D, m0, pos0, lo, hi, part, lse, q)
        if p.get("fold") and ctx.take_ticket((task.op, b, g)) % S == S - 1:   # the group's last chunk: merge it
            _merge(p, mem, ctx, b, g, gs)


def _append_new_row(p, mem, ctx, b, pos):
    """Row b of kv_new (k heads, then v heads) into the caches at position pos, for the task's KV groups."""
    D = ctx.config.head_dim
    g0, ng = p["g"], p.get("ng", 1)
    kc, vc = mem.kv(p["k_cache"]), mem.kv(p["v_cache"])     # (pages, page_size, n_kv, D)
    nkv = kc.shape[2]
    row = mem.t(p["kv_new"])[b].view(2, nkv, D)
    page, off = ctx.block_tables[b, pos // ctx.page_size], pos % ctx.page_size
    kc[page, off, g0:g0 + ng] = row[0, g0:g0 + ng]
    vc[page, off, g0:g0 + ng] = row[1, g0:g0 + ng]


def _normed_heads(p, mem, ctx, b, m0, holds_pos: bool) -> torch.Tensor:
    """Tiling.attn_qk_norm: the task's q heads of sequence b normed and rotated from qk_raw (1, ng gs D), as the
    qk_norm_rope tasks would write them to q; the chunk holding the new position first writes the groups' normed,
    rotated k row into the cache (where qk_norm_rope would have)."""
    D, gs, g0, ng = ctx.config.head_dim, p["gs"], p["g"], p.get("ng", 1)
    nq = mem.t(p["part"]).shape[1]
    pos = row_positions(ctx)
    if holds_pos:
        kc = mem.kv(p["k_cache"])
        page, off = ctx.block_tables[b, int(pos[m0]) // ctx.page_size], int(pos[m0]) % ctx.page_size
        for h in range(g0, g0 + ng):
            kc[page, off, h] = norm_rope_head(mem, ctx, p, "k", h, nq, pos)[m0]
    return torch.cat([norm_rope_head(mem, ctx, p, "q", h, nq, pos)[m0:m0 + 1]
                      for h in range(g0 * gs, (g0 + ng) * gs)], dim=1)


def _partial_chunk(p, mem, ctx, b, g, s, gs, S, T, D, m0, pos0, lo, hi, part, lse, q):
    q = q.reshape(T, gs, D).float()
    table = ctx.block_tables[b]
    k = _keys(mem.kv(p["k_cache"]), table, lo, hi, ctx.page_size, g).float()  # (n, D)
    v = _keys(mem.kv(p["v_cache"]), table, lo, hi, ctx.page_size, g).float()
    scores = torch.einsum("tgd,nd->tgn", q, k) * p["scale"]
    kpos = torch.arange(lo, hi, device=q.device)
    qpos = pos0 + torch.arange(T, device=q.device)
    scores = scores.masked_fill(kpos[None, None, :] > qpos[:, None, None], float("-inf"))
    mx = scores.amax(-1, keepdim=True)
    mx_safe = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    e = torch.exp(scores - mx_safe)
    den = e.sum(-1, keepdim=True)
    o = torch.einsum("tgn,nd->tgd", e, v) / den.clamp(min=1e-30)
    part[m0:m0 + T, g * gs:(g + 1) * gs, s] = o
    lse[m0:m0 + T, g * gs:(g + 1) * gs, s] = (mx_safe + torch.log(den)).squeeze(-1)


@task_kind("attn_merge")
def execute_merge(task, mem, ctx):
    p = task.params
    _merge(p, mem, ctx, p["b"], p["g"], p["gs"])


def _merge(p, mem, ctx, b, g, gs):
    T, D = ctx.tokens_per_seq, ctx.config.head_dim
    m0 = b * T
    out = mem.t(p["out"])
    o = mem.t(p["part"])[m0:m0 + T, g * gs:(g + 1) * gs]   # (T, gs, S, D)
    l = mem.t(p["lse"])[m0:m0 + T, g * gs:(g + 1) * gs]    # (T, gs, S)
    mx = l.amax(-1, keepdim=True)
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    wgt = torch.exp(l - mx)                                 # empty chunks weigh 0
    res = (o * wgt[..., None]).sum(-2) / wgt.sum(-1, keepdim=True).clamp(min=1e-30)
    out[m0:m0 + T, g * gs * D:(g + 1) * gs * D] = res.reshape(T, gs * D).to(out.dtype)
