"""Exact sampling from the whole vocabulary on the logits' device (DeviceSampling.full): the rows whose top_k is 0
(no limit) or above the graph sampler's C candidates (ir/sampling.py).

The graph's `argmax` op draws every row from its top C = 64 logits. A full row's token is drawn again after the
step ran, from the step's fp32 logits, and written over the op's `next_tokens` entry: no logits copy to the host, no
host round trip, so such rows take part in multi-step bursts (decode_io.burst) like the others.

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
fp32 rounding of each weight (float64 sums); the host sampler draws its top_k 0 / > 64 rows with this module's
torch form, so host and device give one token for one seed. A row whose logits hold NaN / inf draws -1 (the engine fails that request
with a clear error). A row's token does not depend on the other rows of the step: every pass works row by row.

Two implementations of that definition: Triton kernels (full_sampling_triton.py: a vocab row split into chunks over
many programs, a few launches a step, no host synchronisation; on CUDA tensors, and on the CPU under
TRITON_INTERPRET=1 for the tests), and torch ops (CPU runners; a host check a round). Ranked rows take torch.topk first
either way. Their sums run in different orders and their fp32 exp may differ in the last bit, so the two may differ
where a uniform falls that close to a boundary.
"""
from __future__ import annotations

import torch

from ..ir.sampling import FULL_SALT, ROUND_SALT, seed_to_int64
from ..tasks.ops.argmax import hash32, seed_pos_hash
from . import full_sampling_triton as fst
from .triton_support import runs_on

MAX_ROUNDS = fst.MAX_ROUNDS


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
            tok = torch.where(todo, i.squeeze(1), tok)
            if not self.nucleus:   # (every row accepts its first draw: the mass before it is not needed)
                break
            vi = v.gather(1, i)
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
        key = (logits.device, logits.shape[1], fst.CHUNK)
        if getattr(self, "_work_key", None) != key:   # (a burst's steps draw the same rows: one workspace)
            self._work, self._work_key = fst.VocabWork(self.idx.numel(), logits.shape[1], logits.device, fst.CHUNK), key
        fst.draw_vocab(self, logits, pos, out, self._work)


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
        fst.draw_ranked(self, vals.contiguous(), order.contiguous(), pos, out)


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
