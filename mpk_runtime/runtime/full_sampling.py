"""Exact sampling from the whole vocabulary on the logits' device (DeviceSampling.full): the rows whose top_k is 0
(no limit) or above the graph sampler's C candidates (ir/sampling.py).

The graph's `argmax` op draws every row from its top C = 64 logits. A full row's token is drawn again after the
step ran, by torch ops on the step's fp32 logits, and written over the op's `next_tokens` entry: no logits copy to
the host, no host round trip, so such rows take part in multi-step bursts (megakernel_plans.burst) like the others.

Per row, with x = logits / temperature (fp32) and u = uniform53(seed, pos) (ir/sampling.py, 53 bits; pos = the
position of the row's last token, as the graph sampler's):
  - top_k == 0 and top_p == 1 ("plain"): e_i = exp(x_i - max x) in float64, vocabulary order; the token is the
    first i with cumsum(e)_i > u * sum(e). No sort.
  - otherwise ("ranked"): the candidates sorted by (value desc, index asc): torch.topk of the largest top_k (a full
    stable sort when top_k is 0); e_j as above, 0 past the row's top_k; the nucleus keeps the prefix of j with
    (mass before j) < top_p * (mass of all candidates), j = 0 always kept (the host sampler's rule); the token is
    the candidate j with cumsum(e)_j > u * (nucleus mass), the first one.
That is the host sampler's distribution (engine/sampling.py: temperature, top-k, top-p, renormalised) to float64
rounding; the stream differs from the host's for the same seed (another random source), as the graph sampler's
does. A row whose logits hold NaN / inf draws -1 (the engine fails that request with a clear error).
A row's token does not depend on the other rows of the step: every op works row by row.
Cost per step (reads of the rows' logits, float64 temporaries): ~8 passes over rows x vocab (plain); a sort of
the vocabulary per row (ranked with top_k 0).
"""
from __future__ import annotations

import torch

from ..ir.sampling import FULL_SALT, HASH_M1, HASH_M2, POS_SALT

_M32 = 0xFFFFFFFF


def _mulmod32(x: torch.Tensor, m: int) -> torch.Tensor:
    """(x * m) mod 2^32 for int64 x in [0, 2^32), without int64 overflow (products < 2^48)."""
    lo, hi = m & 0xFFFF, m >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mulmod32(x, HASH_M1)
    x = x ^ (x >> 15)
    x = _mulmod32(x, HASH_M2)
    return x ^ (x >> 16)


def uniform53(seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """ir.sampling.uniform53 on int64 tensors (seed: the int64 two's complement of the 64-bit seed): float64."""
    a = _hash32((pos + POS_SALT) & _M32)
    a = _hash32(a ^ ((seed >> 32) & _M32))
    a = _hash32(a ^ (seed & _M32))
    b = _hash32(a ^ FULL_SALT)
    return ((a >> 5) * (1 << 26) + (b >> 6)).double() * 2.0 ** -53


class _Group:
    """Rows of one kind (plain or ranked) as tensors on the device."""

    def __init__(self, rows: list, device, ranked: bool):
        from ..ir.sampling import seed_to_int64
        self.ranked = ranked
        self.idx = torch.tensor([i for i, _ in rows], dtype=torch.int64, device=device)
        self.temp = torch.tensor([[float(s.temperature)] for _, s in rows], dtype=torch.float32, device=device)
        self.seed = torch.tensor([seed_to_int64(int(s.seed)) for _, s in rows], dtype=torch.int64, device=device)
        self.top_p = torch.tensor([[float(s.top_p)] for _, s in rows], dtype=torch.float64, device=device)
        self.top_k = [int(s.top_k) for _, s in rows]   # 0 = the whole vocabulary
        self._k: dict[int, tuple[int, torch.Tensor]] = {}

    def _ks(self, V: int) -> tuple[int, torch.Tensor]:
        """(K, per-row k (m, 1)) at vocabulary V: K candidates sorted (V: the whole vocabulary)."""
        if V not in self._k:
            ks = [k if 0 < k < V else V for k in self.top_k]
            self._k[V] = (max(ks), torch.tensor(ks, dtype=torch.int64, device=self.idx.device).unsqueeze(1))
        return self._k[V]

    def draw(self, logits: torch.Tensor, pos: torch.Tensor, out: torch.Tensor) -> None:
        x = logits.index_select(0, self.idx).float() / self.temp
        u = uniform53(self.seed, pos.index_select(0, self.idx)).unsqueeze(1)
        V = x.shape[1]
        order = None
        if not self.ranked:
            e = torch.exp((x - x.amax(1, keepdim=True)).double())
            cum = torch.cumsum(e, 1)
            mass = cum[:, -1:]
        else:
            K, k = self._ks(V)
            if K == V:
                vals, order = torch.sort(x, dim=1, descending=True, stable=True)
            else:   # topk's order among equal values is its own: make it (value desc, index asc)
                vals, order = torch.topk(x, K, 1)
                o = torch.argsort(order, 1)
                vals, order = vals.gather(1, o), order.gather(1, o)
                o = torch.argsort(vals, dim=1, descending=True, stable=True)
                vals, order = vals.gather(1, o), order.gather(1, o)
            j = torch.arange(K, device=x.device).unsqueeze(0)
            e = torch.exp((vals - vals[:, :1]).double()) * (j < k)
            cum = torch.cumsum(e, 1)
            keep = ((cum - e) < self.top_p * cum[:, -1:]) | (j == 0)   # a prefix: the mass before j only grows
            mass = cum.gather(1, keep.sum(1, keepdim=True) - 1)
        # r < mass strictly: the first cum > r then has e > 0 (a kept token with some probability)
        r = torch.minimum(u * mass, torch.nextafter(mass, torch.zeros_like(mass)))
        tok = torch.searchsorted(cum, r, right=True).clamp_(max=cum.shape[1] - 1)
        if order is not None:
            tok = order.gather(1, tok)
        bad = ~torch.isfinite(mass) | ~(mass > 0)
        out.index_copy_(0, self.idx, torch.where(bad, torch.full_like(tok, -1), tok).squeeze(1))


class FullRows:
    """The full-vocabulary rows of a step's sampling rows (DeviceSampling.full), ready to draw."""

    def __init__(self, rows: list, device):
        full = [(i, s) for i, s in enumerate(rows) if s is not None and getattr(s, "full", False)]
        plain = [(i, s) for i, s in full if s.top_k == 0 and s.top_p >= 1.0]
        ranked = [(i, s) for i, s in full if not (s.top_k == 0 and s.top_p >= 1.0)]
        self.groups = [_Group(g, device, r) for g, r in ((plain, False), (ranked, True)) if g]
        self.rows = len(full)

    def draw(self, logits: torch.Tensor, pos: torch.Tensor, out: torch.Tensor) -> None:
        """Overwrite out[i] (int64) of every full row i with its token from logits (n, V) fp32 and pos (n,) int64,
        all on one device; nothing synchronises with the host."""
        for g in self.groups:
            g.draw(logits, pos, out)


def full_rows(rows: list, device) -> FullRows | None:
    """FullRows of the sampling rows (one DeviceSampling or None per row), or None when no row is full."""
    if not any(s is not None and getattr(s, "full", False) for s in rows):
        return None
    return FullRows(rows, device)
