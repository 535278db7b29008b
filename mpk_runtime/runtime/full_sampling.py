"""Exact sampling from the whole vocabulary on the logits' device (DeviceSampling.full): the rows whose top_k is 0
(no limit) or above the graph sampler's C candidates (ir/sampling.py).

The graph's `argmax` op draws every row from its top C = 64 logits. A full row's token is drawn again after the
step ran, by torch ops on the step's fp32 logits, and written over the op's `next_tokens` entry: no logits copy to
the host, no host round trip, so such rows take part in multi-step bursts (megakernel_plans.burst) like the others.

Per row, with x = logits / temperature (fp32) and u = uniform53(seed, pos) (ir/sampling.py, 53 bits; pos = the
position of the row's last token, as the graph sampler's):
  - top_k == 0 and top_p == 1 ("plain"): e_i = exp(x_i - max x) in float64, vocabulary order; the token is the
    first i with cumsum(e)_i > u * sum(e). No sort.
  - otherwise ("ranked"): the candidates sorted by (logit desc, index asc): torch.topk of the largest top_k (a
    full stable sort when top_k is 0); e_j as above, 0 past the row's top_k; the nucleus keeps the prefix of j with
    (mass before j) < top_p * (mass of all candidates), j = 0 always kept (the host sampler's rule); the token is
    the candidate j with cumsum(e)_j > u * (nucleus mass), the first one.
That is the host sampler's distribution (engine/sampling.py: temperature, top-k, top-p, renormalised) to float64
rounding; the stream differs from the host's for the same seed (another random source), as the graph sampler's
does. A row whose logits hold NaN / inf draws -1 (the engine fails that request with a clear error).
A row's token does not depend on the other rows of the step: every op works row by row.

Two implementations of that definition: torch ops (CPU runners; ~80 small kernels a step on a GPU, the hash alone
~56) and one Triton kernel per group (`_draw_kernel`: a program per row, the hash, max, sum, nucleus and search
passes over the row; on CUDA tensors, and on the CPU under TRITON_INTERPRET=1 for the tests); ranked rows sort or
topk with torch first either way. Their sums run in different orders, so the two may differ where u falls within
float64 rounding of a token's boundary (~1e-16 a draw).
"""
from __future__ import annotations

import torch

from ..ir.sampling import FULL_SALT, HASH_M1, HASH_M2, POS_SALT
from .triton_support import runs_on, tl, triton

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
        self.nucleus = any(float(s.top_p) < 1.0 for _, s in rows)   # some row has a top-p nucleus

    def _ks(self, V: int) -> tuple[int, torch.Tensor]:
        """(K, per-row k (m, 1)) at vocabulary V: K candidates sorted (V: the whole vocabulary); a plain row's k is
        V (its entries in play)."""
        if V not in self._k:
            ks = [k if 0 < k < V else V for k in self.top_k]
            self._k[V] = (max(ks), torch.tensor(ks, dtype=torch.int64, device=self.idx.device).unsqueeze(1))
        return self._k[V]

    def _candidates(self, logits: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' K largest logits and their indices, ordered by (logit desc, index asc) (temperature > 0 keeps
        the order of logits / temperature)."""
        x = logits.index_select(0, self.idx)
        if K == x.shape[1]:
            return torch.sort(x, dim=1, descending=True, stable=True)
        vals, order = torch.topk(x, K, 1)   # topk's order among equal values is its own: make it index asc
        o = torch.argsort(order, 1)
        vals, order = vals.gather(1, o), order.gather(1, o)
        o = torch.argsort(vals, dim=1, descending=True, stable=True)
        return vals.gather(1, o), order.gather(1, o)

    def draw(self, logits: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, impl: str | None = None) -> None:
        """impl: "triton" | "torch" | None (Triton where it runs on these tensors)."""
        if impl is None:
            impl = "triton" if runs_on(logits) else "torch"
        (self._draw_triton if impl == "triton" else self._draw_torch)(logits, pos, out)

    def _draw_torch(self, logits: torch.Tensor, pos: torch.Tensor, out: torch.Tensor) -> None:
        u = uniform53(self.seed, pos.index_select(0, self.idx)).unsqueeze(1)
        order = None
        if not self.ranked:
            x = logits.index_select(0, self.idx).float() / self.temp
            e = torch.exp((x - x.amax(1, keepdim=True)).double())
            cum = torch.cumsum(e, 1)
            mass = cum[:, -1:]
        else:
            K, k = self._ks(logits.shape[1])
            vals, order = self._candidates(logits, K)
            x = vals.float() / self.temp
            j = torch.arange(K, device=x.device).unsqueeze(0)
            e = torch.exp((x - x[:, :1]).double()) * (j < k)
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

    def _draw_triton(self, logits: torch.Tensor, pos: torch.Tensor, out: torch.Tensor) -> None:
        V = logits.shape[1]
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        if self.ranked:
            K, k = self._ks(V)
            vals, order = self._candidates(logits, K)
            src, lens = vals.contiguous(), k.view(-1)
        else:   # (order_ptr unused: any int64 tensor)
            src, order, lens = logits, out, self._ks(V)[1].view(-1)
        _draw_kernel[(self.idx.numel(),)](
            src, src.stride(0), order, self.idx, self.temp, lens, self.top_p, self.seed, pos, out,
            RANKED=self.ranked, NUCLEUS=self.ranked and self.nucleus, BLOCK=1024, M1=HASH_M1, M2=HASH_M2,
            SALT=POS_SALT, SALT2=FULL_SALT, num_warps=8)


class FullRows:
    """The full-vocabulary rows of a step's sampling rows (DeviceSampling.full), ready to draw."""

    def __init__(self, rows: list, device):
        full = [(i, s) for i, s in enumerate(rows) if s is not None and getattr(s, "full", False)]
        plain = [(i, s) for i, s in full if s.top_k == 0 and s.top_p >= 1.0]
        ranked = [(i, s) for i, s in full if not (s.top_k == 0 and s.top_p >= 1.0)]
        self.groups = [_Group(g, device, r) for g, r in ((plain, False), (ranked, True)) if g]
        self.rows = len(full)

    def draw(self, logits: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, impl: str | None = None) -> None:
        """Overwrite out[i] (int64) of every full row i with its token from logits (n, V) fp32 and pos (n,) int64,
        all on one device; nothing synchronises with the host. impl: see _Group.draw."""
        for g in self.groups:
            g.draw(logits, pos, out, impl)


def full_rows(rows: list, device) -> FullRows | None:
    """FullRows of the sampling rows (one DeviceSampling or None per row), or None when no row is full."""
    if not any(s is not None and getattr(s, "full", False) for s in rows):
        return None
    return FullRows(rows, device)


if triton is not None:
    @triton.jit
    def _mulmod32(x, m: tl.constexpr):
        return (x * (m & 0xFFFF) + (((x * (m >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF

    @triton.jit
    def _hash32_k(x, M1: tl.constexpr, M2: tl.constexpr):
        x = x ^ (x >> 16)
        x = _mulmod32(x, M1)
        x = x ^ (x >> 15)
        x = _mulmod32(x, M2)
        return x ^ (x >> 16)

    @triton.jit
    def _exps(base, s, offs, L, T, mx):
        """e_j = exp(x_j - mx) in float64 for j in s + offs (0 past L) and j."""
        j = s + offs
        v = tl.load(base + j, mask=j < L, other=0.0)
        e = tl.exp((tl.math.div_rn(v, T) - mx).to(tl.float64))
        return tl.where(j < L, e, 0.0), j

    @triton.jit
    def _draw_kernel(src_ptr, src_stride, order_ptr, idx_ptr, temp_ptr, len_ptr, top_p_ptr, seed_ptr, pos_ptr,
                     out_ptr, RANKED: tl.constexpr, NUCLEUS: tl.constexpr, BLOCK: tl.constexpr, M1: tl.constexpr,
                     M2: tl.constexpr, SALT: tl.constexpr, SALT2: tl.constexpr):
        """One program per row: src is the step's logits (plain: row idx[r]) or the row's sorted candidates
        (ranked: row r; order_ptr their vocabulary indices); L = len[r] entries in play."""
        r = tl.program_id(0)
        row = tl.load(idx_ptr + r)
        if RANKED:
            base = src_ptr + r.to(tl.int64) * src_stride
        else:
            base = src_ptr + row * src_stride
        T = tl.load(temp_ptr + r)
        L = tl.load(len_ptr + r)
        offs = tl.arange(0, BLOCK)
        if RANKED:
            mx = tl.math.div_rn(tl.load(base), T)
        else:
            m = tl.full([BLOCK], float("-inf"), tl.float32)
            for s in range(0, L, BLOCK):
                m = tl.maximum(m, tl.load(base + s + offs, mask=s + offs < L, other=float("-inf")))
            mx = tl.math.div_rn(tl.max(m, 0), T)   # (division by T > 0 keeps the max)
        total = tl.zeros([1], tl.float64).sum(0)
        for s in range(0, L, BLOCK):
            e, j = _exps(base, s, offs, L, T, mx)
            total += tl.sum(e, 0)
        mass = total
        if NUCLEUS:   # the kept prefix: (mass before j) < top_p * total, j = 0 always
            lim = tl.load(top_p_ptr + r) * total
            carry = tl.zeros([1], tl.float64).sum(0)
            mass = tl.zeros([1], tl.float64).sum(0)
            for s in range(0, L, BLOCK):
                e, j = _exps(base, s, offs, L, T, mx)
                cs = carry + tl.cumsum(e, 0)
                keep = (((cs - e) < lim) | (j == 0)) & (j < L)
                mass = tl.maximum(mass, tl.max(tl.where(keep, cs, 0.0), 0))
                carry += tl.sum(e, 0)
        # u = uniform53(seed, pos): ir/sampling.py
        seed = tl.load(seed_ptr + r)
        p = tl.load(pos_ptr + row)
        a = _hash32_k((p + SALT) & 0xFFFFFFFF, M1, M2)
        a = _hash32_k(a ^ ((seed >> 32) & 0xFFFFFFFF), M1, M2)
        a = _hash32_k(a ^ (seed & 0xFFFFFFFF), M1, M2)
        b = _hash32_k(a ^ SALT2, M1, M2)
        u = ((a >> 5) * 67108864 + (b >> 6)).to(tl.float64) * 1.1102230246251565e-16   # 2^26, 2^-53
        rr = tl.minimum(u * mass, mass * 0.9999999999999998)   # < mass strictly (1 - 2^-52)
        first = tl.full([BLOCK], 2147483647, tl.int64)
        last = tl.full([BLOCK], -1, tl.int64)
        carry = tl.zeros([1], tl.float64).sum(0)
        for s in range(0, L, BLOCK):
            e, j = _exps(base, s, offs, L, T, mx)
            cs = carry + tl.cumsum(e, 0)
            ok = (j < L) & (cs <= mass) & (e > 0)
            first = tl.minimum(first, tl.where((cs > rr) & (j < L), j, 2147483647))
            last = tl.maximum(last, tl.where(ok, j, -1))
            carry += tl.sum(e, 0)
        jj = tl.min(first, 0)
        jj = tl.where(jj == 2147483647, tl.max(last, 0), jj)   # rounding left no cs above rr: the last kept token
        if RANKED:
            tok = tl.load(order_ptr + r.to(tl.int64) * src_stride + jj)
        else:
            tok = jj
        good = (mass == mass) & (mass > 0) & (mass < float("inf"))
        tl.store(out_ptr + row, tl.where(good, tok, -1))
