"""Helpers shared by the CPU semantics of several task kinds (numerics follow the HF conventions)."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """(.., H) -> (.., H) in x's dtype; the statistics in fp32, as Hugging Face does:
    w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype). Written for few kernels (the conventional path runs it on the
    GPU: eps and rsqrt in place, the fp32 product rounded straight into x's dtype by `out=`, as .to() rounds).
    w None: the normalised rows only (the caller applies its weights)."""
    xf = x.float()
    r = xf.pow(2).mean(-1, keepdim=True)
    r.add_(eps).rsqrt_()
    xn = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(xf, r, out=xn)
    if w is None:
        return xn
    if w.dtype == xn.dtype and torch.broadcast_shapes(w.shape, xn.shape) == xn.shape:
        return xn.mul_(w)           # w * xn: one rounding of the same product either way
    return w * xn


def split_range(n: int, tile: int) -> list[tuple[int, int]]:
    """[0, n) cut into tiles of `tile` (the last may be shorter)."""
    tile = max(1, min(tile, n))
    return [(i, min(i + tile, n)) for i in range(0, n, tile)]


def row_positions(ctx, rows: range | None = None) -> torch.Tensor:
    """Absolute position of every row m = b * T + t of the step: pos[b] + t. (M,) int64. With ctx.pad (batched
    prefill, left-padded chunks): pos[b] + t - pad[b], and -1 for padding rows and inactive sequences."""
    T = ctx.tokens_per_seq
    pos = ctx.pos.repeat_interleave(T) + torch.arange(T, device=ctx.pos.device).repeat(ctx.pos.numel())
    pad = getattr(ctx, "pad", None)
    if pad is not None:
        p = pad.to(pos.device).repeat_interleave(T)
        t = torch.arange(T, device=ctx.pos.device).repeat(ctx.pos.numel())
        pos = torch.where((t >= p) & (ctx.pos.repeat_interleave(T) >= 0), pos - p, torch.full_like(pos, -1))
    return pos if rows is None else pos[rows.start:rows.stop]
