"""Exact sampling from the whole vocabulary on the logits' device (DeviceSampling.full): the rows whose top_k is 0
(no limit) or above the graph sampler's C candidates (ir/sampling.py).

The graph's `argmax` op draws every row from its top C = 64 logits. A full row's token is drawn again after the
step ran, from the step's fp32 logits, and written over the op's `next_tokens` entry: no logits copy to the host, no
host round trip, so such rows take part in multi-step bursts (megakernel_plans.burst) like the others.

Per row, with x = logits / temperature (fp32), e_i = exp(x_i - max x) (fp32, summed in float64), the ranking of the vocabulary by
(logit desc, index asc), and u_r = uniform53(seed, pos, r) (ir/sampling.py, 53 bits; pos = the position of the
row's last token, as the graph sampler's):
  - top_k == 0 or >= V ("vocab" rows): a token is drawn from a set A by inverse CDF in vocabulary order (the first i
    in A with cumsum over A of e > u_r * mass(A)); A starts as the whole vocabulary. With top_p == 1 that token is
    the draw. With top_p < 1 it is accepted when it belongs to the nucleus (the mass of the tokens ranked before it
    < top_p * sum(e)), else A becomes the tokens ranked before it and round r + 1 draws again. Every round draws
    from e restricted to a superset of the nucleus, so an accepted token follows e restricted to the nucleus
    exactly (rejection sampling); a round accepts with probability >= top_p and expected rounds are ~1 + log2(1 /
    top_p)-ish, never a sort. After MAX_ROUNDS rounds the last draw is taken (bias below 2^-50 at any top_p).
  - 0 < top_k < V ("ranked" rows): the top_k largest logits by torch.topk, in the ranking's order; e_j past the
    row's top_k are 0; the nucleus keeps the prefix of j with (mass before j) < top_p * (mass of all candidates),
    j = 0 always kept; the token is the first candidate j with cumsum(e)_j > u_0 * (nucleus mass).
That is the host sampler's distribution (engine/sampling.py: temperature, top-k, then top-p, renormalised) to
fp32 rounding of each weight (float64 sums); the stream differs from the host's for the same seed (another random
source), as the graph sampler's does. A row whose logits hold NaN / inf draws -1 (the engine fails that request
with a clear error). A row's token does not depend on the other rows of the step: every pass works row by row.

Two implementations of that definition: one Triton kernel per group (a program per row: the hash, then max, sum,
search and nucleus-check passes over the row; on CUDA tensors, and on the CPU under TRITON_INTERPRET=1 for the
tests), and torch ops (CPU runners; a host check a round). Ranked rows take torch.topk first either way. Their sums
run in different orders and their fp32 exp may differ in the last bit, so the two may differ where a uniform falls
that close to a boundary. (Weights in float64 exp cost ~0.1 ms a step on one SM at V = 128k: session 50.)
"""
from __future__ import annotations

import torch

from ..ir.sampling import FULL_SALT, HASH_M1, HASH_M2, POS_SALT, ROUND_SALT, seed_to_int64
from ..tasks.ops.argmax import hash32, seed_pos_hash
from .triton_support import runs_on, tl, triton

MAX_ROUNDS = 64
# a Triton program's entries a pass step, and its warps: one program streams a row, so each step must keep many
# bytes in flight (session 50, 1x H200: 1024 entries x 8 warps took ~0.22 ms a step for three passes over a
# 128256-entry row, latency-bound)
BLOCK, WARPS = 4096, 16   # (8192 spilled: 120-184 bytes of stack at 16 and 32 warps)


# --- the (seed, position, round) uniform in torch ops ------------------------------------------------------------
def _u53(a: torch.Tensor) -> torch.Tensor:
    b = hash32(a ^ FULL_SALT)
    return ((a >> 5) * (1 << 26) + (b >> 6)).double() * 2.0 ** -53


def uniform53(seed: torch.Tensor, pos: torch.Tensor, round: int = 0) -> torch.Tensor:
    """ir.sampling.uniform53 on int64 tensors (seed: the int64 two's complement of the 64-bit seed): float64."""
    a = seed_pos_hash(seed, pos)
    for _ in range(round):
        a = hash32(a ^ ROUND_SALT)
    return _u53(a)


# --- row groups -----------------------------------------------------------------------------------------------
class _Rows:
    """One group's rows as tensors on the device."""

    def __init__(self, rows: list, device):
        self.idx = torch.tensor([i for i, _ in rows], dtype=torch.int64, device=device)
        self.temp = torch.tensor([float(s.temperature) for _, s in rows], dtype=torch.float32, device=device)
        self.seed = torch.tensor([seed_to_int64(int(s.seed)) for _, s in rows], dtype=torch.int64, device=device)
        self.top_p = torch.tensor([float(s.top_p) for _, s in rows], dtype=torch.float64, device=device)
        self.nucleus = any(float(s.top_p) < 1.0 for _, s in rows)

    def draw(self, logits: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, impl: str | None = None) -> None:
        """impl: "triton" | "torch" | None (Triton where it runs on these tensors)."""
        if impl is None:
            impl = "triton" if runs_on(logits) else "torch"
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        (self._triton if impl == "triton" else self._torch)(logits, pos, out)

    @staticmethod
    def _put(out, idx, tok, mass) -> None:
        bad = ~torch.isfinite(mass) | ~(mass > 0)
        out.index_copy_(0, idx, torch.where(bad, torch.full_like(tok, -1), tok))


class _VocabRows(_Rows):
    """top_k 0 (or >= V): inverse CDF in vocabulary order, the nucleus by rejection (module doc)."""

    def _torch(self, logits, pos, out) -> None:
        v = logits.index_select(0, self.idx).float()
        x = v / self.temp[:, None]
        e = torch.exp(x - x.amax(1, keepdim=True)).double()
        total = e.sum(1)
        lim = self.top_p * total
        a = seed_pos_hash(self.seed, pos.index_select(0, self.idx))
        j = torch.arange(v.shape[1], device=v.device)
        in_a = torch.ones_like(e, dtype=torch.bool)
        mass, tok = total.clone(), torch.zeros_like(self.idx)
        todo = torch.isfinite(total) & (total > 0)
        for rnd in range(MAX_ROUNDS):
            ea = torch.where(in_a, e, 0.0)
            cum = torch.cumsum(ea, 1)
            r = torch.minimum(_u53(a) * mass, torch.nextafter(mass, torch.zeros_like(mass)))
            i = torch.searchsorted(cum, r[:, None], right=True).clamp_(max=v.shape[1] - 1)
            vi = v.gather(1, i)
            tok = torch.where(todo, i.squeeze(1), tok)
            before_set = (v > vi) | ((v == vi) & (j[None] < i))
            before = torch.where(before_set, e, 0.0).sum(1)
            accept = (before < lim) | (self.top_p >= 1.0) | (rnd == MAX_ROUNDS - 1)
            todo = todo & ~accept
            if not bool(todo.any()):
                break
            in_a, mass = before_set, torch.where(todo, before, mass)
            a = hash32(a ^ ROUND_SALT)
        self._put(out, self.idx, tok, total)

    def _triton(self, logits, pos, out) -> None:
        _vocab_kernel[(self.idx.numel(),)](
            logits, logits.stride(0), logits.shape[1], self.idx, self.temp, self.top_p, self.seed, pos, out,
            NUCLEUS=self.nucleus, MAX_ROUNDS=MAX_ROUNDS, BLOCK=BLOCK, M1=HASH_M1, M2=HASH_M2, SALT=POS_SALT,
            SALT2=FULL_SALT, RSALT=ROUND_SALT, num_warps=WARPS)


class _RankedRows(_Rows):
    """0 < top_k < V: candidates by torch.topk in the ranking's order, inverse CDF over the nucleus prefix."""

    def __init__(self, rows: list, device):
        super().__init__(rows, device)
        ks = [int(s.top_k) for _, s in rows]
        self.K = max(ks)
        self.k = torch.tensor(ks, dtype=torch.int64, device=device)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' K largest logits and their indices, ordered by (logit desc, index asc)."""
        vals, order = torch.topk(logits.index_select(0, self.idx), self.K, 1)
        o = torch.argsort(order, 1)   # topk's order among equal values is its own: make it index asc
        vals, order = vals.gather(1, o), order.gather(1, o)
        o = torch.argsort(vals, dim=1, descending=True, stable=True)
        return vals.gather(1, o), order.gather(1, o)

    def _torch(self, logits, pos, out) -> None:
        vals, order = self.candidates(logits)
        x = vals.float() / self.temp[:, None]
        j = torch.arange(self.K, device=x.device)[None]
        e = torch.exp(x - x[:, :1]).double() * (j < self.k[:, None])
        cum = torch.cumsum(e, 1)
        keep = ((cum - e) < self.top_p[:, None] * cum[:, -1:]) | (j == 0)   # a prefix: the mass before j only grows
        mass = cum.gather(1, keep.sum(1, keepdim=True) - 1)
        u = uniform53(self.seed, pos.index_select(0, self.idx))[:, None]
        r = torch.minimum(u * mass, torch.nextafter(mass, torch.zeros_like(mass)))   # < mass: a kept token
        tok = order.gather(1, torch.searchsorted(cum, r, right=True).clamp_(max=self.K - 1))
        self._put(out, self.idx, tok.squeeze(1), mass.squeeze(1))

    def _triton(self, logits, pos, out) -> None:
        vals, order = self.candidates(logits)
        vals = vals.contiguous()
        _ranked_kernel[(self.idx.numel(),)](
            vals, order.contiguous(), vals.stride(0), self.idx, self.temp, self.k, self.top_p, self.seed, pos, out,
            NUCLEUS=self.nucleus, BLOCK=BLOCK, M1=HASH_M1, M2=HASH_M2, SALT=POS_SALT, SALT2=FULL_SALT, num_warps=WARPS)


class FullRows:
    """The full-vocabulary rows of a step's sampling rows (DeviceSampling.full), ready to draw."""

    def __init__(self, rows: list, device, vocab: int):
        full = [(i, s) for i, s in enumerate(rows) if s is not None and getattr(s, "full", False)]
        vocab_rows = [(i, s) for i, s in full if not 0 < s.top_k < vocab]
        ranked = [(i, s) for i, s in full if 0 < s.top_k < vocab]
        self.vocab = vocab
        self.groups = ([_VocabRows(vocab_rows, device)] if vocab_rows else []) + \
            ([_RankedRows(ranked, device)] if ranked else [])
        self.rows = len(full)

    def draw(self, logits: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, impl: str | None = None) -> None:
        """Overwrite out[i] (int64) of every full row i with its token from logits (n, V) fp32 and pos (n,) int64,
        all on one device; with Triton nothing synchronises with the host. impl: see _Rows.draw."""
        if logits.shape[-1] != self.vocab:
            raise ValueError(f"full-vocabulary sampling needs the logits of the whole vocabulary ({self.vocab}), "
                             f"got {logits.shape[-1]} (a vocabulary shard): this runner cannot draw such rows")
        for g in self.groups:
            g.draw(logits, pos, out, impl)


def full_rows(rows: list, device, vocab: int) -> FullRows | None:
    """FullRows of the sampling rows (one DeviceSampling or None per row), or None when no row is full."""
    if not any(s is not None and getattr(s, "full", False) for s in rows):
        return None
    return FullRows(rows, device, vocab)


# --- Triton ---------------------------------------------------------------------------------------------------
if triton is not None:
    @triton.jit
    def _mulmod32_k(x, m: tl.constexpr):
        return (x * (m & 0xFFFF) + (((x * (m >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF

    @triton.jit
    def _hash32_k(x, M1: tl.constexpr, M2: tl.constexpr):
        x = x ^ (x >> 16)
        x = _mulmod32_k(x, M1)
        x = x ^ (x >> 15)
        x = _mulmod32_k(x, M2)
        return x ^ (x >> 16)

    @triton.jit
    def _first_word_k(seed, p, M1: tl.constexpr, M2: tl.constexpr, SALT: tl.constexpr):
        a = _hash32_k((p + SALT) & 0xFFFFFFFF, M1, M2)
        a = _hash32_k(a ^ ((seed >> 32) & 0xFFFFFFFF), M1, M2)
        return _hash32_k(a ^ (seed & 0xFFFFFFFF), M1, M2)

    @triton.jit
    def _u53_k(a, M1: tl.constexpr, M2: tl.constexpr, SALT2: tl.constexpr):
        b = _hash32_k(a ^ SALT2, M1, M2)
        return ((a >> 5) * 67108864 + (b >> 6)).to(tl.float64) * 1.1102230246251565e-16   # 2^26, 2^-53

    @triton.jit
    def _zero64():
        return tl.zeros([1], tl.float64).sum(0)

    @triton.jit
    def _weights(base, j, L, T, mx):
        """e_j = exp(logit_j / T - mx) in float64 for entries j < L of the row at base, 0 past L."""
        v = tl.load(base + j, mask=j < L, other=0.0)
        return tl.where(j < L, tl.exp(tl.math.div_rn(v, T) - mx).to(tl.float64), 0.0)

    @triton.jit
    def _vocab_kernel(lg_ptr, stride, V, idx_ptr, temp_ptr, top_p_ptr, seed_ptr, pos_ptr, out_ptr,
                      NUCLEUS: tl.constexpr, MAX_ROUNDS: tl.constexpr, BLOCK: tl.constexpr, M1: tl.constexpr,
                      M2: tl.constexpr, SALT: tl.constexpr, SALT2: tl.constexpr, RSALT: tl.constexpr):
        """A vocab row (module doc): program r draws row idx[r] of the step's logits."""
        r = tl.program_id(0)
        row = tl.load(idx_ptr + r)
        base = lg_ptr + row * stride
        T = tl.load(temp_ptr + r)
        tp = tl.load(top_p_ptr + r)
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        for s in range(0, V, BLOCK):
            m = tl.maximum(m, tl.load(base + s + offs, mask=s + offs < V, other=float("-inf")))
        mx = tl.math.div_rn(tl.max(m, 0), T)    # (division by T > 0 keeps the max)
        total = _zero64()
        for s in range(0, V, BLOCK):
            total += tl.sum(_weights(base, s + offs, V, T, mx), 0)
        lim = tp * total
        good = (total == total) & (total > 0) & (total < float("inf"))
        a = _first_word_k(tl.load(seed_ptr + r), tl.load(pos_ptr + row), M1, M2, SALT)
        mass = total
        bv = tl.full([1], float("-inf"), tl.float32).max(0)   # A = the tokens ranked before (bv, bj): v > bv,
        bj = tl.zeros([1], tl.int64).sum(0) + V + 1            # or v == bv and index < bj
        tok = tl.zeros([1], tl.int64).sum(0)
        rnd = 0
        go = good
        while go:
            rr = tl.minimum(_u53_k(a, M1, M2, SALT2) * mass, mass * 0.9999999999999998)   # < mass (1 - 2^-52)
            first = tl.full([BLOCK], 2147483647, tl.int64)
            last = tl.full([BLOCK], -1, tl.int64)
            carry = _zero64()
            for s in range(0, V, BLOCK):
                j = s + offs
                v = tl.load(base + j, mask=j < V, other=float("-inf"))
                in_a = (j < V) & ((v > bv) | ((v == bv) & (j < bj)))
                e = tl.where(in_a, tl.exp(tl.math.div_rn(v, T) - mx).to(tl.float64), 0.0)
                cs = carry + tl.cumsum(e, 0)
                first = tl.minimum(first, tl.where((cs > rr) & in_a, j, 2147483647))
                last = tl.maximum(last, tl.where(in_a & (e > 0), j, -1))
                carry += tl.sum(e, 0)
            i = tl.min(first, 0)
            i = tl.where(i == 2147483647, tl.max(last, 0), i)   # rounding left no cs above rr: the last in A
            tok = i
            rnd += 1
            go = good & (rnd < 0)   # (false: a tensor, as the loop carries it)
            if NUCLEUS:
                if tp < 1.0:
                    vi = tl.load(base + i)
                    before = _zero64()
                    for s in range(0, V, BLOCK):
                        j = s + offs
                        v = tl.load(base + j, mask=j < V, other=float("-inf"))
                        ahead = (j < V) & ((v > vi) | ((v == vi) & (j < i)))
                        before += tl.sum(tl.where(ahead, tl.exp(tl.math.div_rn(v, T) - mx).to(tl.float64),
                                                  0.0), 0)
                    go = (before >= lim) & (rnd < MAX_ROUNDS)
                    bv = tl.where(go, vi, bv)
                    bj = tl.where(go, i, bj)
                    mass = tl.where(go, before, mass)
                    a = _hash32_k(a ^ RSALT, M1, M2)
        tl.store(out_ptr + row, tl.where(good, tok, -1))

    @triton.jit
    def _ranked_kernel(val_ptr, order_ptr, stride, idx_ptr, temp_ptr, k_ptr, top_p_ptr, seed_ptr, pos_ptr, out_ptr,
                       NUCLEUS: tl.constexpr, BLOCK: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr,
                       SALT: tl.constexpr, SALT2: tl.constexpr):
        """A ranked row (module doc): program r draws row idx[r] from its sorted candidates (row r of val / order)."""
        r = tl.program_id(0)
        row = tl.load(idx_ptr + r)
        base = val_ptr + r.to(tl.int64) * stride
        T = tl.load(temp_ptr + r)
        L = tl.load(k_ptr + r)
        offs = tl.arange(0, BLOCK)
        mx = tl.math.div_rn(tl.load(base), T)
        total = _zero64()
        for s in range(0, L, BLOCK):
            total += tl.sum(_weights(base, s + offs, L, T, mx), 0)
        mass = total
        if NUCLEUS:   # the kept prefix: (mass before j) < top_p * total, j = 0 always
            lim = tl.load(top_p_ptr + r) * total
            carry = _zero64()
            mass = _zero64()
            for s in range(0, L, BLOCK):
                j = s + offs
                e = _weights(base, j, L, T, mx)
                cs = carry + tl.cumsum(e, 0)
                keep = (((cs - e) < lim) | (j == 0)) & (j < L)
                mass = tl.maximum(mass, tl.max(tl.where(keep, cs, 0.0), 0))
                carry += tl.sum(e, 0)
        a = _first_word_k(tl.load(seed_ptr + r), tl.load(pos_ptr + row), M1, M2, SALT)
        rr = tl.minimum(_u53_k(a, M1, M2, SALT2) * mass, mass * 0.9999999999999998)
        first = tl.full([BLOCK], 2147483647, tl.int64)
        last = tl.full([BLOCK], -1, tl.int64)
        carry = _zero64()
        for s in range(0, L, BLOCK):
            j = s + offs
            e = _weights(base, j, L, T, mx)
            cs = carry + tl.cumsum(e, 0)
            first = tl.minimum(first, tl.where((cs > rr) & (j < L), j, 2147483647))
            last = tl.maximum(last, tl.where((j < L) & (cs <= mass) & (e > 0), j, -1))
            carry += tl.sum(e, 0)
        jj = tl.min(first, 0)
        jj = tl.where(jj == 2147483647, tl.max(last, 0), jj)
        tok = tl.load(order_ptr + r.to(tl.int64) * stride + jj)
        good = (mass == mass) & (mass > 0) & (mass < float("inf"))
        tl.store(out_ptr + row, tl.where(good, tok, -1))
