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
where a uniform falls that close to a boundary. The host sampler's one row goes through draw_row: the torch form's
operations on the same values, its token exactly (per-thread buffers, fewer passes over the vocabulary, a ranked
row's candidates from a few blocks; session 73).
"""
from __future__ import annotations

import math
import threading

import numpy as np
import torch
import torch.nn.functional as F

from ..ir.sampling import FULL_SALT, ROUND_SALT, seed_to_int64
from ..ir.sampling import uniform53 as uniform53_ref
from ..tasks.ops.argmax import hash32, seed_pos_hash
from .host_draw import candidate_pool
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
        return _topk_candidates(logits.index_select(0, self.idx), self.K)

    def _torch(self, logits, pos, out) -> None:
        vals, order = self.candidates(logits)
        u = uniform53(self.seed, pos.index_select(0, self.idx))[:, None]
        tok, mass = _ranked_draw(vals, order, self.temp, self.k, self.top_p, u)
        self._put(out, self.idx, tok, mass)

    def _triton(self, logits, pos, out) -> None:
        vals, order = self.candidates(logits)
        fst.draw_ranked(self, vals.contiguous(), order.contiguous(), pos, out)


def _topk_candidates(rows: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K largest logits of rows (n, V) and their indices by torch.topk, ordered by (logit desc, index asc)."""
    vals, order = torch.topk(rows, K, 1)
    o = torch.argsort(order, 1)   # topk's order among equal values is its own: make it index asc
    vals, order = vals.gather(1, o), order.gather(1, o)
    o = torch.argsort(vals, dim=1, descending=True, stable=True)
    return vals.gather(1, o), order.gather(1, o)


def _ranked_draw(vals, order, temp, k, top_p, u) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranked rows' draw from their candidates vals / order (n, K) (ranked), temp (n,) fp32, k (n,) int64, top_p (n,)
    float64, u (n, 1) float64: (token (n,), nucleus mass (n,))."""
    K = vals.shape[1]
    x = vals.float() / temp[:, None]
    j = torch.arange(K, device=x.device)[None]
    e = torch.exp(x - x[:, :1]).double() * (j < k[:, None])
    cum = torch.cumsum(e, 1)
    keep = ((cum - e) < top_p[:, None] * cum[:, -1:]) | (j == 0)   # a prefix: the mass before j only grows
    mass = cum.gather(1, keep.sum(1, keepdim=True) - 1)
    r = torch.minimum(u * mass, torch.nextafter(mass, torch.zeros_like(mass)))   # < mass: a kept token
    tok = order.gather(1, torch.searchsorted(cum, r, right=True).clamp_(max=K - 1))
    return tok.squeeze(1), mass.squeeze(1)


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


# --- one row on the host (engine/sampling.py sample()) -----------------------------------------------------------
# FullRows' torch form draws a batch of rows with a new tensor for every step and the uniforms from int64 tensor
# ops (~2.8 ms a plain row at V = 152k on a 2-core host, session 72; most of it allocating and first-touching
# ~1 MB temporaries, and ~50 tiny hash ops). draw_row draws one row with the same operations on the same values,
# into buffers kept per thread, fewer full-vocabulary passes, and the uniforms in Python integers
# (ir.sampling.uniform53, bitwise the torch uniform53): the same token (tests/runtime/test_full_sampling_host.py).
_host = threading.local()


def _host_work(V: int) -> dict:
    w = getattr(_host, "work", None)
    if w is None or w["V"] != V:
        f64 = torch.float64
        w = {"V": V, "f": torch.empty(1, V), "e": torch.empty(1, V, dtype=f64), "cum": torch.empty(1, V, dtype=f64),
             "masked": torch.empty(1, V, dtype=f64), "before": torch.empty(V, dtype=torch.bool)}
        _host.work = w
    return w


def _first_above(src: torch.Tensor, cum: torch.Tensor, r: float) -> int:
    """searchsorted(cumsum(src), r, right=True) clamped to V - 1 for src (1, V) float64, the cumsum into cum: the
    first i whose prefix sum exceeds r. (A cumsum stopped at the block that passes r, found from block sums, saved
    ~25 us of this ~300 us draw: not kept.)"""
    torch.cumsum(src, 1, out=cum)
    i = int(torch.searchsorted(cum[0], torch.tensor(r, dtype=torch.float64), right=True))
    return min(i, src.shape[1] - 1)


EXP_ZERO_BELOW = -110.0   # torch's fp32 exp is exactly 0 below this (Sleef's: below -104; e^-110 ~ 2^-158.7)
_zero_cut: list[float] = []


def _exp_zero_cut() -> float:
    """The fp32 just below the cut under which _exp_ takes exp to be 0: -104 (Sleef's own cut) where every fp32 in
    [-110, -104) exps to 0 with this torch (checked once, all ~786k of them, ~10 ms), else EXP_ZERO_BELOW."""
    if not _zero_cut:
        lo, hi = np.float32(104.0).view(np.int32), np.float32(-EXP_ZERO_BELOW).view(np.int32)
        y = -torch.from_numpy(np.arange(lo + 1, hi + 1, dtype=np.int32).view(np.float32))   # (-110, -104) .. -110
        cut = -104.0 if bool((torch.exp(y) == 0).all()) else EXP_ZERO_BELOW
        _zero_cut.append(float(np.nextafter(np.float32(cut), np.float32(-np.inf))))
    return _zero_cut[0]


def _exp_(f: torch.Tensor) -> None:
    """torch.exp(f, out=f) for f <= 0 (or NaN), the same bits, faster where f holds entries below the zero cut (a
    low temperature, min_p's -inf). torch's vectorised fp32 exp (Sleef) takes ~0.6 ns an entry, but ~10x that for
    one below -104 (0, by way of denormals) and ~3x for -inf: they are set to +1 first (a fast exp, e = 2.72 where
    every other e <= 1), then e > 1 back to +0.0, three cheap passes, only where the row's least entry asks for it.
    Entries from -104 to -87.3 have denormal results, ~30x: left as they are (gathering them to exp them together
    was slower still: the cost is an entry's, not a vector's)."""
    if not float(f.amin()) < -104.0:   # (NaN: no)
        torch.exp(f, out=f)
        return
    F.threshold_(f, _exp_zero_cut(), 1.0)   # f <= the fp32 below the cut -> 1 (NaN stays)
    torch.exp(f, out=f)
    F.threshold_(f.neg_(), -2.0, -0.0).neg_()   # e = 2.72 -> -2.72 -> -0.0 -> +0.0; e in [0, 1] and NaN stay


def draw_row(x: torch.Tensor, temperature: float, top_k: int, top_p: float, seed: int, pos: int) -> int:
    """The token FullRows([DeviceSampling(temperature, top_k, top_p, seed, full=True)], "cpu", V).draw(x[None],
    tensor([pos]), out, impl="torch") writes, for one CPU row x (V,) fp32 contiguous: -1 for a row it cannot draw
    (NaN / inf after the temperature)."""
    V = x.numel()
    if 0 < top_k < V:
        return _draw_ranked_row(x, temperature, top_k, top_p, seed, pos)
    w = _host_work(V)
    f = torch.div(x.view(1, V), torch.tensor([[temperature]], dtype=torch.float32), out=w["f"])
    torch.sub(f, f.amax(1, keepdim=True), out=f)
    _exp_(f)
    e = w["e"].copy_(f)
    total = float(e.sum(1))
    if not (math.isfinite(total) and total > 0):
        return -1
    lim = float(top_p) * total
    src, mass = e, total
    for rnd in range(MAX_ROUNDS):
        r = min(uniform53_ref(seed, pos, rnd) * mass, math.nextafter(mass, 0.0))
        i = _first_above(src, w["cum"], r)
        if top_p >= 1.0:   # (every row accepts its first draw: the mass before it is not needed)
            return i
        # the tokens ranked before i (logit desc, index asc): logit >= x_i before i, > x_i from i on
        xi, before = x[i], w["before"]
        torch.ge(x[:i], xi, out=before[:i])
        torch.gt(x[i:], xi, out=before[i:])
        # where(before, e, 0.0) as torch.where makes it (e >= 0 finite: e * 1 = e, e * 0 = +0.0), ~60 us (torch.where
        # of a float64 row ~500 us here)
        masked = torch.mul(e, before.view(torch.uint8).view(1, V), out=w["masked"])
        bmass = float(masked.sum(1))
        if bmass < lim or rnd == MAX_ROUNDS - 1:
            return i
        src, mass = masked, bmass   # (the next round's cumsum reads it before this buffer is written again)
    raise AssertionError("unreachable")


def _draw_ranked_row(x, temperature, top_k, top_p, seed, pos) -> int:
    cand = _ranked_candidates(x, top_k)
    if cand is None:
        return -1
    vals, order = cand
    u = torch.tensor([[uniform53_ref(seed, pos)]], dtype=torch.float64)
    tok, mass = _ranked_draw(vals, order, torch.tensor([temperature], dtype=torch.float32),
                             torch.tensor([top_k], dtype=torch.int64), torch.tensor([top_p], dtype=torch.float64), u)
    m = float(mass[0])
    return int(tok[0]) if math.isfinite(m) and m > 0 else -1


def _ranked_candidates(x: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """_RankedRows.candidates(x[None]) for one row: the K largest logits (1, K) and their indices, by (logit desc,
    index asc); None where the row holds NaN or its largest logit is +-inf (a row the host fails). Where the K-th
    largest value is not tied with an entry outside the K, the K are the same whoever picks them: the entries >= it,
    found in candidate_pool's few blocks. Else (a tie at the edge, which torch.topk breaks its own way) or for a
    short row: torch.topk of the row, as candidates() does."""
    pool = candidate_pool(x, K)
    if pool is not None:
        pv, pi, t0, top = pool
        if pv is None:
            return None
        thr = np.partition(pv, pv.size - K)[pv.size - K]
        sel = pv >= thr
        if thr > t0 and int(sel.sum()) == K:   # thr > t0: every entry >= thr is in the pool (its doc)
            vals, idx = pv[sel], pi[sel]         # index asc
            o = np.argsort(-vals, kind="stable")   # (logit desc, index asc), as candidates()' stable sorts
            return torch.from_numpy(vals[o])[None], torch.from_numpy(idx[o])[None]
    elif not math.isfinite(float(x.max())):
        return None
    return _topk_candidates(x[None], K)
