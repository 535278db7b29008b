"""Whole-op torch implementations for the conventional path (prefill, conventional plan segments).

Every op of a step runs here as a handful of batched torch kernels: on a GPU each small kernel costs ~2-3 us
even inside a CUDA graph, so the kernel count per layer is what a small-batch conventional step pays for
(tests/runtime/test_conventional_op_count.py pins it). No host round trips (no host-to-device copies either),
so on a GPU the segment can be captured in a CUDA graph.

Numerics: embed, linear and qkv_rope compute bit for bit what their task kinds (tasks/ops/*.py, the pyvm /
megakernel contract) compute with one coarse tile, only with fewer kernels: matmuls write straight into their
destination (`out=`), residuals and SiLU are applied in place, RMSNorm is tasks/ops/common.rms_norm (the task
kinds' own function, written for few kernels), RoPE is rotate-half with the sign folded into a
per-step sin table (exact: negation commutes with rounding). Attention agrees to bf16 tolerance (see
attention()). On a GPU the small ops between the matmuls run as torch.compile'd pieces of the same arithmetic
(conventional_fused.py).

Per-step values every layer needs (row positions, RoPE cos/sin, the KV slots the step writes, the key pages,
causal mask and live-row mask of attention) are computed once per step, by the first op that needs them, into
the `step` dict the executor passes along (fresh every step - ConventionalExecutor.run's own, or the one a
PlanExecutor shares among a step's conventional segments - so a CUDA graph capture records them inside the step
and every replay recomputes them from the current pos / block_tables).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.weights import adjacent_rows
from ..tasks.ops.common import row_positions
from .conventional_fused import fuse_rope, fuse_silu, fused_qk, fused_qk_kv, fused_silu, rms_norm
from . import paged_attention, skinny_gemm


# --- shared pieces -----------------------------------------------------------------------------------------------
def _wt(cache: dict, mem, name: str) -> torch.Tensor:
    """mem.t(name).T, the view made once per executor (cache["const"] outlives the step; checked by identity, so
    a replaced weight tensor gets a fresh view). Views launch nothing; this only trims host dispatch."""
    const = cache.setdefault("const", {})     # the executor passes its persistent dict in every step's
    w = mem.t(name)
    ent = const.get(name)
    if ent is None or ent[0] is not w:
        ent = const[name] = (w, w.T)
    return ent[1]


def _wt_cat(cache: dict, mem, names: list[str]) -> torch.Tensor | None:
    """The (K, sum of N) transposed view of weights stored back to back (models.weights.pack_adjacent: q/k/v,
    gate/up), made once per executor, or None when they are separate tensors: one matmul computes them all."""
    const = cache.setdefault("const", {})
    ws = [mem.t(n) for n in names]
    key = ("cat", *names)
    ent = const.get(key)
    if ent is None or any(a is not b for a, b in zip(ent[0], ws)):
        f = adjacent_rows(ws)
        ent = const[key] = (ws, None if f is None else f.T)
    return ent[1]


def _bias_cat(cache: dict, mem, names: list[str]) -> torch.Tensor:
    """The biases `names` concatenated (one add for a q/k/v matmul's whole output), made once per executor."""
    const = cache.setdefault("const", {})
    bs = [mem.t(n) for n in names]
    key = ("bias", *names)
    ent = const.get(key)
    if ent is None or any(a is not b for a, b in zip(ent[0], bs)):
        ent = const[key] = (bs, torch.cat(bs))
    return ent[1]


def _rows(cache: dict, ctx) -> torch.Tensor:
    """Absolute position of every row of the step (row_positions), once per step."""
    if "pos" not in cache:
        cache["pos"] = ctx.packed[0] if ctx.packed is not None else row_positions(ctx)
    return cache["pos"]


def _rope_tables(cache: dict, ctx, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, 1, D) cos and signed sin in `dtype`, once per step: y * cos + cat(y2, y1) * sin_s is rope()'s
    y * cos + cat(-y2, y1) * sin with the sign moved onto the table (sin_s = cat(-sin, sin); both halves of
    rope()'s sin are the same sin(ang), and (-a) * b == a * (-b) exactly, so the values are rope()'s bit for bit)."""
    key = ("rope", dtype)
    if key not in cache:
        ang = _rows(cache, ctx).float()[:, None] * ctx.inv_freq[None, :]     # (M, D/2), as rope()
        cos = ang.cos().to(dtype)
        sin = ang.sin().to(dtype)
        cache[key] = (torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :])
    return cache[key]


def _kv_slots(cache: dict, mem, ctx) -> torch.Tensor:
    """(M,) flat slot (page * page_size + offset) each row's K/V goes to, once per step; inactive rows (pos < 0)
    write into the scratch page, so the write needs no data-dependent mask."""
    if "slots" not in cache:
        pos = _rows(cache, ctx)
        T, ps = ctx.tokens_per_seq, ctx.page_size
        b = ctx.packed[1].clamp(min=0) if ctx.packed is not None else torch.arange(pos.numel(), device=pos.device) // T
        p = pos.clamp(min=0)
        page = torch.where(pos >= 0, ctx.block_tables[b, p // ps], torch.full_like(p, mem.kvstore.scratch))
        cache["slots"] = page * ps + p % ps
    return cache["slots"]


# --- ops ---------------------------------------------------------------------------------------------------------
def embed(op, mem, ctx, cache) -> None:
    """tasks/ops/embed.py: table rows gathered straight into out (index_select; same values as table[tok])."""
    a = op.attrs
    tok = mem.t(a["tokens"])
    table = mem.t(a["table"])   # (ids outside the table: their nearest row, tasks/ops/embed.py)
    torch.index_select(table, 0, tok.clamp(0, table.shape[0] - 1), out=mem.t(a["out"]))


def linear_whole(op) -> bool:
    """The linears run whole here: all but the TP paths (push of fp32 partials, K segments), which run as their
    coarse task (tasks/ops/linear.py)."""
    a = op.attrs
    return not a["push"] and a.get("k_segments", 1) == 1


def linear(op, mem, ctx, cache) -> None:
    """tasks/ops/linear.py with one tile of all N columns (no push, one K segment), bit for bit: y = x @ W.T in
    x's dtype, silu(g) * u, residual + y, cast to out's dtype; the matmul or the epilogue writes into out."""
    a = op.attrs
    x = mem.t(a["x"])
    out = mem.t(a["out"])
    N = out.shape[-1]
    r0 = a.get("weight_row0", 0)
    if a["row_select"]:   # each sequence's last row (a packed step's are where its chunks end)
        x = x.index_select(0, ctx.packed[2]) if ctx.packed is not None else \
            x[a["row_select"]["offset"]::a["row_select"]["stride"]]
    if a["norm"]:
        x = rms_norm(x, mem.t(a["norm"]), a["eps"])
    ws = [_wt(cache, mem, name) if (r0 == 0 and mem.t(name).shape[0] == N) else mem.t(name)[r0:r0 + N].T
          for name in a["weights"]]
    direct = out.dtype == x.dtype and out.is_contiguous()
    if a["epilogue"] == "silu_mul":
        wgu = _wt_cat(cache, mem, a["weights"]) if r0 == 0 else None
        if wgu is not None and wgu.shape[1] == 2 * N:   # gate/up back to back: one matmul, two column views
            gu = x @ wgu
            g, u = gu[:, :N], gu[:, N:]
        else:
            g = x @ ws[0]
            u = x @ ws[1]
        if x.is_cuda and fuse_silu():   # one kernel instead of silu and mul (the same two roundings)
            fused_silu()(g, u, out)
            return
        F.silu(g, inplace=True)
        if direct:
            torch.mul(g, u, out=out)
        else:
            out.copy_(g * u)
        return
    res = mem.t(a["residual"]) if a["residual"] else None
    cfg = skinny_gemm.lm_head_config(x, N) if res is None and out.is_contiguous() else None
    if cfg is not None:   # the LM head (fp32 logits): the Triton skinny matmul where it wins
        # the product in x's dtype, then out's (as x @ W.T then the cast)
        skinny_gemm.skinny_mm(x, mem.t(a["weights"][0])[r0:r0 + N], out, cfg, round_to_x=True)
        return
    if direct and (res is None or res.dtype == out.dtype):
        torch.mm(x, ws[0], out=out)
        if res is not None:
            out.add_(res)           # residual + y: the same single rounding
        return
    y = x @ ws[0]
    if res is not None:
        y = res + y
    elif a["out"] in cache.get("bf16_names", ()):   # a greedy LM head whose fp32 logits nobody reads (torch_exec):
        cache["bf16_logits"][a["out"]] = y          # its argmax takes the product itself, no fp32 copy
        return
    out.copy_(y)


def _qk_epilogue(qk, nq, qn, kn, cos, sin_s, eps, q):
    """The q/k tail of qkv_rope on the (M, n_q + n_kv, D) stack, eager and in place: (Qwen3) per-head RMSNorm and
    its weights, RoPE; q written into `q`, the roped k returned (a view of the stack)."""
    M, D = qk.shape[0], qk.shape[2]
    nkv = qk.shape[1] - nq
    qh, kh = qk.split((nq, nkv), 1)
    if qn is not None:      # per-head RMSNorm, statistics of all heads at once, then each part's weight
        qk = rms_norm(qk, None, eps)
        qh, kh = qk.split((nq, nkv), 1)
        qh.mul_(qn)
        kh.mul_(kn)
    y1, y2 = qk.chunk(2, -1)
    rot = torch.cat((y2, y1), -1)
    rot.mul_(sin_s)
    qk.mul_(cos)
    rq, rk = rot.split((nq, nkv), 1)
    if q.dtype == qk.dtype and q.is_contiguous():
        torch.add(qh, rq, out=q.view(M, nq, D))
    else:
        q.copy_((qh + rq).reshape(M, -1))
    return kh.add_(rk)


def _append_kv(k, v, kc, vc, slots) -> None:
    """Rows of k and v into their cache slots (flat page * page_size + offset), in place."""
    kc.view(-1, *kc.shape[2:])[slots] = k
    vc.view(-1, *vc.shape[2:])[slots] = v


def qkv_rope(op, mem, ctx, cache) -> None:
    """All heads at once, the task kernels' numerics: RMSNorm, the q/k/v projections (+ Qwen2's biases), (Qwen3)
    per-head q/k RMSNorm, RoPE, q written, k/v appended to the paged cache. q and k heads are stacked as
    (M, n_q + n_kv, D) so the per-head norm statistics and RoPE run once for both (per-row reductions over D and
    elementwise ops: the same values as per tensor); at batch 1 the projections write straight into that stack."""
    a = op.attrs
    D = ctx.config.head_dim
    nq, nkv = a["n_q"], a["n_kv"]
    x = mem.t(a["x"])
    M = x.shape[0]
    xn = rms_norm(x, mem.t(a["norm"]), a["eps"])
    cos, sin_s = _rope_tables(cache, ctx, xn.dtype)
    qn, kn = (mem.t(a["q_norm"]), mem.t(a["k_norm"])) if a["q_norm"] is not None else (None, None)
    q = mem.t(a["q"])
    fused_tail = x.is_cuda and fuse_rope() and q.dtype == xn.dtype and q.is_contiguous()
    wqkv = _wt_cat(cache, mem, [a["wq"], a["wk"], a["wv"]])
    yv = None
    if wqkv is not None:   # q/k/v stored back to back: one matmul, the q/k stack and v are views of its output
        out = xn @ wqkv
        qk, yv = out[:, :(nq + nkv) * D].view(M, nq + nkv, D), out[:, (nq + nkv) * D:].view(M, nkv, D)
        qr, kr = qk[:, :nq], qk[:, nq:]
    else:
        wq, wk, wv = (_wt(cache, mem, a[n]) for n in ("wq", "wk", "wv"))
        if fused_tail:   # the tail stacks q and k itself
            qr, kr = (xn @ wq).view(M, nq, D), (xn @ wk).view(M, nkv, D)
        elif M == 1:   # a (1, n) column slice of the stack is contiguous: the matmuls write into it
            qk = torch.empty(1, nq + nkv, D, dtype=xn.dtype, device=x.device)
            fq, fk = qk.view(1, -1).split((nq * D, nkv * D), 1)
            torch.mm(xn, wq, out=fq)
            torch.mm(xn, wk, out=fk)
        else:
            qk = torch.cat(((xn @ wq).view(M, nq, D), (xn @ wk).view(M, nkv, D)), 1)
    if yv is None:
        yv = (xn @ wv).view(M, nkv, D)
    if a.get("bq") is not None:   # (Qwen2) the biases, added to the rounded products in place (the tasks' numerics)
        if wqkv is not None:
            out.add_(_bias_cat(cache, mem, [a["bq"], a["bk"], a["bv"]]))
        else:
            bq, bk = mem.t(a["bq"]).view(nq, D), mem.t(a["bk"]).view(nkv, D)
            (qr if fused_tail else qk[:, :nq]).add_(bq)
            (kr if fused_tail else qk[:, nq:]).add_(bk)
            yv.add_(mem.t(a["bv"]).view(nkv, D))
    if a.get("kv_defer"):   # the attention megakernel appends them (ir/defer.py): k and v rows into kv_new
        kv = mem.t(a["kv_new"]).view(M, 2, nkv, D)
        if fused_tail:
            fused_qk_kv()(qr, kr, qn, kn, cos, sin_s, a["eps"], q.view(M, nq, D), yv, kv)
        else:
            kv[:, 0].copy_(_qk_epilogue(qk, nq, qn, kn, cos, sin_s, a["eps"], q))
            kv[:, 1].copy_(yv)
        return
    slots = _kv_slots(cache, mem, ctx)
    kc, vc = mem.kv(a["k_cache"]), mem.kv(a["v_cache"])
    if fused_tail:   # the q/k tail as one kernel
        k = fused_qk()(qr, kr, qn, kn, cos, sin_s, a["eps"], q.view(M, nq, D))
    else:
        k = _qk_epilogue(qk, nq, qn, kn, cos, sin_s, a["eps"], q)
    _append_kv(k, yv, kc, vc, slots)


def _key_cap(ctx) -> int:
    """Keys an attention reads at most this step: kv_len_cap (static on a GPU: graph capture), else the rows' own."""
    return ctx.kv_len_cap or int(ctx.pos.max()) + ctx.tokens_per_seq


def _attn_step(cache: dict, ctx, g: int, dtype, dev) -> dict:
    """What every layer's attention shares in a step: key count L, pages to gather, the (B, 1, g*T, L) mask
    (causal and written keys; inactive rows see every key) as the additive 0 / -inf mask in the query dtype that
    SDPA would make of the boolean one in every call (the same values), the live-row mask."""
    key = ("attn", g, dtype)
    if key not in cache:
        T, ps = ctx.tokens_per_seq, ctx.page_size
        B = ctx.pos.numel()
        if ctx.pad is None:
            L = _key_cap(ctx)
            qpos = ctx.pos[:, None] + torch.arange(T, device=dev)   # (B, T)
            dead = (ctx.pos < 0)[:, None, None]
        else:   # left-padded prefill: padding rows (position -1) see every key, like inactive sequences
            qpos = _rows(cache, ctx).view(B, T)
            L = ctx.kv_len_cap or max(int(qpos.max()) + 1, 1)
            dead = (qpos < 0)[:, :, None]
        npg = -(-L // ps)
        kpos = torch.arange(L, device=dev)
        mask = (kpos[None, None, :] <= qpos[:, :, None]) | dead    # (B, T, L)
        cache[key] = dict(
            L=L, npg=npg, pages=ctx.block_tables[:, :npg].reshape(-1),
            mask=torch.full((B, 1, g * T, L), float("-inf"), dtype=dtype, device=dev).masked_fill_(
                mask[:, None, None].expand(B, 1, g, T, L).reshape(B, 1, g * T, L), 0.0),
            live=(ctx.pos >= 0).view(B, 1, 1, 1, 1), kpos=kpos)
    return cache[key]


def _paged_tables(cache: dict, ctx, want: torch.dtype) -> torch.Tensor:
    """The step's page tables in the type the paged kernel reads here (paged_attention.table_dtype,
    MPK_PAGED_TABLE): converted once a step, every layer's call reusing the copy (a per-step value, as the RoPE
    tables)."""
    if ctx.block_tables.dtype == want:
        return ctx.block_tables
    key = ("paged_tables", want)
    if key not in cache:
        cache[key] = ctx.block_tables.to(want)
    return cache[key]


def attention(op, mem, ctx, cache) -> None:
    """All sequences and heads at once: the pages of keys [0, L_cap) gathered per sequence (one indexed copy of
    whole pages, in the cache dtype), then one fused scaled-dot-product attention call.

    GQA without expanding K/V: the g = n_q / n_kv query heads of a KV head are stacked as g*T query rows of
    that head (a boolean mask keeps each row causal and inside the keys its sequence has written), so the
    gathered cache is read once. Scores and softmax accumulate in fp32 inside the fused kernel; on bf16 the
    probabilities are rounded to bf16 before the PV product (the task kernels keep them in fp32: agreement to
    bf16 tolerance, not bitwise). Unwritten slots are masked out of the scores and get probability 0, which is
    exact for any finite garbage; a NaN-poisoned cache (KVStore(poison=True), the CPU twin's debug fill) is
    sanitised first because 0 * NaN is NaN. Pages, masks and L are per-step values (_attn_step); inactive rows
    are zeroed by the select that writes the output."""
    a = op.attrs
    D, T, ps = ctx.config.head_dim, ctx.tokens_per_seq, ctx.page_size
    nq, nkv = a["n_q"], a["n_kv"]
    g = nq // nkv
    q = mem.t(a["q"])
    B = q.shape[0] // T
    out = mem.t(a["out"])
    kc, vc = mem.kv(a["k_cache"]), mem.kv(a["v_cache"])         # (pages, ps, nkv, D)
    kvn = mem.t(a["kv_new"]).view(B * T, -1) if a.get("kv_defer") else None   # rows qkv_rope left (ir/defer.py)
    if ctx.packed is not None:
        attention_packed(q, out, kc, vc, _kv_slots(cache, mem, ctx), _packed_step(cache, ctx, g, q.dtype), nkv, g, D,
                         a["scale"])
        return
    if ctx.pad is None and paged_attention.enabled(q, T, D) and q.is_contiguous() and out.is_contiguous():
        # decode straight from the pages (the default where Triton is installed): no gathered copy, no mask, and the
        # deferred k / v rows appended by the kernel
        cap = _key_cap(ctx)
        c = paged_attention.config_for(D, B, nkv, cap)   # the launch shape, and with it the tables' type
        bt = _paged_tables(cache, ctx, paged_attention.table_dtype(c))
        paged_attention.paged_decode_attention(q, kc, vc, bt, ctx.pos, a["scale"], cap, out, kv_new=kvn, config=c)
        return
    if kvn is not None:   # deferred rows, but this step takes the gather + SDPA path: append them first
        rows = kvn.view(B * T, 2, nkv, D)
        _append_kv(rows[:, 0], rows[:, 1], kc, vc, _kv_slots(cache, mem, ctx))
    if ctx.rows is not None:
        attention_rows(q, out, kc, vc, ctx, B, T, nq, nkv, D, a["scale"])
        return
    st = _attn_step(cache, ctx, g, q.dtype, q.device)
    L, npg = st["L"], st["npg"]
    # index_select copies whole contiguous pages (a vectorised gather); advanced indexing kc[pages] ran an
    # element-wise index kernel: 24.6 of 45.6 ms GPU time of a qwen3-8b batch-128 step (H200 profile)
    k = kc.index_select(0, st["pages"]).view(B, npg * ps, nkv, D)
    v = vc.index_select(0, st["pages"]).view(B, npg * ps, nkv, D)
    if L < npg * ps:
        k, v = k[:, :L], v[:, :L]
    k, v = k.transpose(1, 2), v.transpose(1, 2)                 # (B, nkv, L, D)
    if mem.kvstore.poisoned:
        if "written" not in st:                                  # (B, 1, L, 1): written keys
            end = ctx.pos[:, None] + T if ctx.pad is None else _rows(cache, ctx).view(B, T).amax(1, keepdim=True) + 1
            st["written"] = (st["kpos"][None, :] < end)[:, None, :, None]
        zero = torch.zeros((), dtype=k.dtype, device=k.device)
        k, v = torch.where(st["written"], k, zero), torch.where(st["written"], v, zero)
    qg = q.view(B, T, nkv, g, D).permute(0, 2, 3, 1, 4).reshape(B, nkv, g * T, D)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=st["mask"], scale=a["scale"])   # (B, nkv, g*T, D)
    o = o.view(B, nkv, g, T, D).permute(0, 3, 1, 2, 4)         # (B, T, nkv, g, D)
    if "zero" not in st:
        st["zero"] = torch.zeros((), dtype=o.dtype, device=o.device)
    if out.dtype == o.dtype and out.is_contiguous():
        torch.where(st["live"], o, st["zero"], out=out.view(B, T, nkv, g, D))
    else:
        out.copy_(torch.where(st["live"], o, st["zero"]).reshape(B * T, nq * D))


def _packed_step(cache: dict, ctx, g: int, dtype) -> dict:
    """A packed step's attention inputs every layer shares: the (1, 1, g*M, M) additive mask (row i sees row j of
    its own chunk at or before it; padding rows see every row, their output zeroed) and the live-row mask."""
    key = ("packed", g, dtype)
    if key not in cache:
        seq = ctx.packed[1]
        M = seq.numel()
        r = torch.arange(M, device=seq.device)
        ok = ((seq[:, None] == seq[None, :]) & (r[None, :] <= r[:, None])) | (seq < 0)[:, None]
        mask = torch.full((M, M), float("-inf"), dtype=dtype, device=seq.device).masked_fill_(ok, 0.0)
        cache[key] = dict(mask=mask.repeat(g, 1)[None, None], live=(seq >= 0).view(M, 1, 1, 1))
    return cache[key]


def attention_packed(q, out, kc, vc, slots, st: dict, nkv: int, g: int, D: int, scale: float) -> None:
    """A packed prefill step (StepCtx.packed): every chunk starts its sequence, so its keys are its own rows, just
    appended: read back from their slots (M rows, not M x L gathered keys) and attended under the block-diagonal
    causal mask in one SDPA call, the g query heads of a KV head stacked as g*M rows (as `attention`)."""
    M = q.shape[0]
    k = kc.view(-1, nkv, D).index_select(0, slots).transpose(0, 1)[None]    # (1, nkv, M, D)
    v = vc.view(-1, nkv, D).index_select(0, slots).transpose(0, 1)[None]
    qg = q.view(M, nkv, g, D).permute(1, 2, 0, 3).reshape(1, nkv, g * M, D)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=st["mask"], scale=scale)   # (1, nkv, g*M, D)
    o = o.view(nkv, g, M, D).permute(2, 0, 1, 3)                                      # (M, nkv, g, D)
    zero = st.setdefault("zero", torch.zeros((), dtype=o.dtype, device=o.device))
    if out.dtype == o.dtype and out.is_contiguous():
        torch.where(st["live"], o, zero, out=out.view(M, nkv, g, D))
    else:
        out.copy_(torch.where(st["live"], o, zero).reshape(M, nkv * g * D))


def attention_rows(q, out, kc, vc, ctx, B: int, T: int, nq: int, nkv: int, D: int, scale: float) -> None:
    """A prefill step's attention, one sequence at a time over exactly its own keys (ctx.rows: host-known pad,
    start, n of each; eager steps only, the shapes follow the data): the n live rows of sequence b attend to keys
    [0, start + n), causal to the last key (torch's lower-right causal bias: no mask in memory, so SDPA can take its
    flash kernel), K / V expanded to the query heads (GQA) for that call only. Padding rows and sequences get zeros.
    What it replaces at long contexts: the (B, 1, g * T, L_cap) additive mask over the power-of-two key cap, which at a
    4096-token chunk and a 131072-key cap is 4 GiB and makes every chunk pay for the whole cap (ConventionalPrefill
    picks this path from MPK_PREFILL_EXACT_KEYS keys)."""
    from torch.nn.attention.bias import causal_lower_right
    ps, g = ctx.page_size, nq // nkv
    qv = q.view(B, T, nq, D)
    ov = out.view(B, T, nq, D)
    for b, (pad, start, n) in enumerate(ctx.rows):
        if pad:
            ov[b, :pad].zero_()
        if n <= 0:
            continue
        L = start + n
        npg = -(-L // ps)
        pages = ctx.block_tables[b, :npg]
        k = kc.index_select(0, pages).view(npg * ps, nkv, D)[:L].transpose(0, 1).repeat_interleave(g, dim=0)
        v = vc.index_select(0, pages).view(npg * ps, nkv, D)[:L].transpose(0, 1).repeat_interleave(g, dim=0)
        qb = qv[b, pad:].transpose(0, 1)                      # (nq, n, D)
        o = F.scaled_dot_product_attention(qb[None], k[None].to(qb.dtype), v[None].to(qb.dtype),
                                           attn_mask=causal_lower_right(n, L), scale=scale)   # (1, nq, n, D)
        ov[b, pad:] = o[0].transpose(0, 1).to(ov.dtype)


# kind -> (whole-op implementation, which ops of that kind run whole; the rest run as their coarse task)
OPS = {"embed": (embed, None), "linear": (linear, linear_whole), "qkv_rope": (qkv_rope, None),
       "attention": (attention, None)}


def runs_whole(op) -> bool:
    impl = OPS.get(op.kind)
    return impl is not None and (impl[1] is None or impl[1](op))
