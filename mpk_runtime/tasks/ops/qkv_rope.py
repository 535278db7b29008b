"""qkv_rope: a head of this rank (q heads, then k heads, then v heads) is cut into `parts` tasks by RoPE pairs.

A task normalises the input rows (RMSNorm, recomputed per task: cheaper than a sync), projects them onto its
weight rows of the head (adding Qwen2's bias of those rows), applies the Qwen3 per-head q/k RMSNorm and RoPE, and
writes q, or appends k / v into the paged KV cache at each row's position. Part [r0, r1) of a head owns pair indices r0..r1-1 of [0, D/2), i.e.
head rows [r0, r1) and [D/2 + r0, D/2 + r1): RoPE mixes d with d + D/2 only, so it stays local to the task and a
head's weights stream on several SMs without a reduction. A per-head q/k RMSNorm needs every row of the head:
those heads are split like the others when the op has a `qk_raw` activation: their parts write the bf16
projection rows there, and one `qk_norm_rope` task per KV group (its q heads and its k head) normalises whole
heads, applies RoPE and writes q / the k cache, in the same arithmetic order as a whole-head task (so the values
are the same). Without `qk_raw`, or with one part per head, a normed head is one task that does everything.
Tiles per head let attention of KV group g start as soon as group g's heads are done.
"""
from __future__ import annotations

import torch

from ..graph import Region, Task
from . import decomposer, linear, task_kind
from .common import rms_norm, row_positions


@decomposer("qkv_rope")
def decompose(op, graph, tiling, rank):
    a = op.attrs
    M, H = graph.tensors[a["x"]].shape
    B = graph.batch
    D = graph.config.head_dim
    h2 = D // 2
    if a.get("bq") is not None and a.get("qk_raw") is not None:
        raise ValueError(f"{op.name}: q / k / v biases with a per-head q / k norm (qk_raw) are not decomposed: the "
                         "flat projection tiles and qk_norm_rope add no bias (no model family has both)")
    if a.get("kv_defer"):
        raise ValueError(f"{op.name}: a deferred KV append (ir/defer.py) is for a conventional qkv_rope; its tasks "
                         "append themselves")
    raw = qk_raw(op, graph, tiling)   # split the normed heads (finished by qk_norm_rope tasks or by attention)
    flat = None
    if raw is not None and tiling.qkv_flat and M < _tc_min_m():   # (None where the SMs are too few: head parts)
        flat = tiling.qkv_flat_fit((a["n_q"] + a["n_kv"]) * D, a["n_kv"], h2, a["n_q"] * D)
    if flat is not None:
        tasks = _flat_tasks(op, graph, tiling, rank, raw, M, B, H, D, *flat)
    else:
        P = tiling.qkv_p(graph, op, a["n_q"] + 2 * a["n_kv"], h2)
        tasks = [t for which, n in (("q", a["n_q"]), ("k", a["n_kv"]), ("v", a["n_kv"]))
                 for t in _head_parts(op, graph, rank, which, n, P, raw, M, B, H, D)]
    if raw is not None and not norm_in_attention(op, graph, tiling):
        tasks += _norm_tasks(op, graph, rank, raw, M, B, D)
    return tasks


def qk_raw(op, graph, tiling) -> str | None:
    """The op's qk_raw activation where its normed heads are split (more than one part a head), else None (a
    normed head is then one whole task)."""
    a = op.attrs
    if a.get("qk_raw") is None:
        return None
    return a["qk_raw"] if tiling.qkv_p(graph, op, a["n_q"] + 2 * a["n_kv"], graph.config.head_dim // 2) > 1 else None


def norm_in_attention(op, graph, tiling) -> bool:
    """Tiling.attn_qk_norm applies to this qkv_rope op: it writes qk_raw, it is a decode step, and its layer's
    attention is decomposed into tasks of the same graph (the attn_partials then finish the heads from qk_raw)."""
    return (tiling.attn_qk_norm and graph.tokens_per_seq == 1 and qk_raw(op, graph, tiling) is not None
            and layer_op(graph, "attention", op.attrs["layer"]) is not None)


def layer_op(graph, kind: str, layer: int):
    """The graph's op of this kind in this layer, or None (a plan's segment graph holds a subset of the ops)."""
    return next((o for o in graph.ops if o.kind == kind and o.attrs.get("layer") == layer), None)


def _head_parts(op, graph, rank, which, n, P, raw, M, B, H, D):
    """The qkv_rope tasks of the op's n `which` heads, P RoPE-pair parts each (a normed head: one whole task, or P
    parts into `raw` when given, finished by qk_norm_rope)."""
    a = op.attrs
    h2 = D // 2
    head_norm = a["q_norm"] if which == "q" else (a["k_norm"] if which == "k" else None)
    to_raw = head_norm is not None and raw is not None
    parts = 1 if head_norm is not None and not to_raw else P
    tasks = []
    for h in range(n):
        slot = h if which == "q" else a["n_q"] + h   # the head's column block in qk_raw
        for p in range(parts):
            r0, r1 = h2 * p // parts, h2 * (p + 1) // parts
            rows = 2 * (r1 - r0)
            if to_raw:
                writes = [Region(raw, rank, ((0, M), (slot * D + r0, slot * D + r1))),
                          Region(raw, rank, ((0, M), (slot * D + h2 + r0, slot * D + h2 + r1)))]
            elif which == "q":
                writes = [Region(a["q"], rank, ((0, M), (h * D + r0, h * D + r1))),
                          Region(a["q"], rank, ((0, M), (h * D + h2 + r0, h * D + h2 + r1)))]
            else:
                writes = [Region(a[f"{which}_cache"], rank, ((0, B), (h, h + 1)))]
            params = {k: a[k] for k in ("x", "norm", "eps", "q", "k_cache", "v_cache", "layer")}
            params.update(which=which, head=h, weight=a["w" + which], bias=a.get("b" + which),
                          head_norm=None if to_raw else head_norm,
                          r0=r0, r1=r1, raw=raw if to_raw else None, raw_slot=slot,
                          k_slices=1 if graph.tp_invariant > 1 else 0)   # see linear.py k_slices
            tasks.append(Task(-1, rank, "qkv_rope", op.name, params,
                              reads=[Region(a["x"], rank, ((0, M), (0, H)))], writes=writes,
                              est_bytes=rows * H * 2 + M * H * 2, est_flops=2 * M * rows * H))
    return tasks


def _tc_min_m() -> int:
    from ...codegen import layout   # (codegen reads the tasks' opcodes at import)
    return layout.CONSTANTS["TC_MIN_M"]


def _flat_tasks(op, graph, tiling, rank, raw, M, B, H, D, R, pv):
    """Tiling.qkv_flat: the q and k rows as `linear` tiles into qk_raw (raw column = q / k row: the q heads' slots,
    then the k heads'), cut without regard to heads so about one task per SM streams, none crossing from wq into
    wk; the v heads as pair parts (qkv_rope tasks writing the cache, as before). The heads are finished by the
    qk_norm_rope tasks (or by attention: norm_in_attention)."""
    a = op.attrs
    nq, nkv, h2 = a["n_q"], a["n_kv"], D // 2
    qrows = nq * D
    tasks = []
    for w, lo, hi in ((a["wq"], 0, qrows), (a["wk"], qrows, qrows + nkv * D)):
        lin = {"x": a["x"], "weights": [w], "norm": a["norm"], "eps": a["eps"], "epilogue": "none", "residual": None,
               "out": raw, "push": False, "row_select": None, "weight_row0": -lo}
        tasks += [linear.tile_task(op.name, graph, rank, lin, n0, min(n0 + R, hi), M, M, H,
                                   [Region(raw, rank, ((0, M), (n0, min(n0 + R, hi))))]) for n0 in range(lo, hi, R)]
    return tasks + _head_parts(op, graph, rank, "v", nkv, pv, None, M, B, H, D)


def _norm_tasks(op, graph, rank, raw, M, B, D):
    """One qk_norm_rope task per KV group g: q heads [g gs, (g+1) gs) and k head g, read whole from qk_raw."""
    a = op.attrs
    nq, nkv = a["n_q"], a["n_kv"]
    gs = nq // nkv
    out = []
    for g in range(nkv):
        reads = [Region(raw, rank, ((0, M), (g * gs * D, (g + 1) * gs * D))),
                 Region(raw, rank, ((0, M), ((nq + g) * D, (nq + g + 1) * D)))]
        writes = [Region(a["q"], rank, ((0, M), (g * gs * D, (g + 1) * gs * D))),
                  Region(a["k_cache"], rank, ((0, B), (g, g + 1)))]
        params = {k: a[k] for k in ("q", "k_cache", "q_norm", "k_norm", "eps", "layer")}
        params.update(raw=raw, q_head0=g * gs, n_qh=gs, k_head0=g, n_kh=1)
        heads = gs + 1
        out.append(Task(-1, rank, "qk_norm_rope", op.name, params, reads=reads, writes=writes,
                        est_bytes=2 * M * heads * D * 2 + heads * D * 2, est_flops=6 * M * heads * D))
    return out


def part_rows(D: int, r0: int, r1: int) -> list[int]:
    """Head rows of the part owning RoPE pairs [r0, r1): [r0, r1) then [D/2 + r0, D/2 + r1)."""
    return list(range(r0, r1)) + list(range(D // 2 + r0, D // 2 + r1))


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
    r0, r1 = p.get("r0", 0), p.get("r1", D // 2)
    rows = part_rows(D, r0, r1)
    xn = rms_norm(x, mem.t(p["norm"]), p["eps"])
    y = xn @ mem.t(p["weight"])[[h * D + r for r in rows]].T  # (M, 2 (r1 - r0)): pairs' first, then second rows
    if p.get("bias") is not None:              # (Qwen2) added to the rounded product, before norm / RoPE
        y = y + mem.t(p["bias"])[[h * D + r for r in rows]]
    cols = torch.tensor(rows, device=y.device)
    if p.get("raw") is not None:               # a normed head's part: projection only (qk_norm_rope finishes it)
        mem.t(p["raw"])[:, p["raw_slot"] * D + cols] = y
        return
    pos = row_positions(ctx)
    if p["which"] != "v":
        if p["head_norm"] is not None:
            assert (r0, r1) == (0, D // 2), "a per-head q/k norm needs the whole head in one task"
            y = rms_norm(y, mem.t(p["head_norm"]), p["eps"])
        y = rope(y, pos, ctx.inv_freq[r0:r1])
    _store(mem, ctx, p, p["which"], h, cols, y, pos)


def _store(mem, ctx, p, which, h, cols, y, pos):
    """y (M, len(cols)): columns `cols` of head h -> q, or the k / v cache at each live row's position."""
    D = ctx.config.head_dim
    if which == "q":
        mem.t(p["q"])[:, h * D + cols] = y
        return
    cache = mem.kv(p[f"{which}_cache"])       # (pages, page_size, n_kv, D)
    live = pos >= 0                            # rows of padded (inactive) sequences have pos < 0
    T = ctx.tokens_per_seq
    b = torch.arange(y.shape[0], device=y.device) // T
    page = ctx.block_tables[b[live], pos[live] // ctx.page_size]
    cache[page[:, None], (pos[live] % ctx.page_size)[:, None], h, cols[None, :]] = y[live]


def norm_rope_head(mem, ctx, p, which: str, h: int, nq: int, pos: torch.Tensor) -> torch.Tensor:
    """Head h (`which` q or k) of qk_raw, all rows: per-head RMSNorm, then RoPE at the rows' positions (M, D)."""
    D = ctx.config.head_dim
    slot = h if which == "q" else nq + h
    y = mem.t(p["raw"])[:, slot * D:(slot + 1) * D]
    return rope(rms_norm(y, mem.t(p[f"{which}_norm"]), p["eps"]), pos, ctx.inv_freq)


@task_kind("qk_norm_rope")
def execute_norm(task, mem, ctx):
    """Whole normed heads from qk_raw: q heads [q_head0, +n_qh), k heads [k_head0, +n_kh) (raw slot n_q + h)."""
    p = task.params
    D = ctx.config.head_dim
    nq = mem.t(p["q"]).shape[1] // D
    pos = row_positions(ctx)
    cols = torch.arange(D, device=pos.device)
    for which, h0, n in (("q", p["q_head0"], p["n_qh"]), ("k", p["k_head0"], p["n_kh"])):
        for h in range(h0, h0 + n):
            _store(mem, ctx, p, which, h, cols, norm_rope_head(mem, ctx, p, which, h, nq, pos), pos)
