"""Helpers shared by the CPU semantics of several task kinds (numerics follow the HF conventions)."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """(.., H) -> (.., H) in x's dtype; the statistics in fp32, as Hugging Face does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def split_range(n: int, tile: int) -> list[tuple[int, int]]:
    """[0, n) cut into tiles of `tile` (the last may be shorter)."""
    tile = max(1, min(tile, n))
    return [(i, min(i + tile, n)) for i in range(0, n, tile)]


def row_positions(ctx, rows: range | None = None) -> torch.Tensor:
    """Absolute position of every row m = b * T + t of the step: pos[b] + t. (M,) int64."""
    T = ctx.tokens_per_seq
    pos = ctx.pos.repeat_interleave(T) + torch.arange(T, device=ctx.pos.device).repeat(ctx.pos.numel())
    return pos if rows is None else pos[rows.start:rows.stop]
