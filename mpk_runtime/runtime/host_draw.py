"""The graph sampler's draw for one row on the host (engine/sampling.py `sample`, 1 <= top_k <= SAMPLE_CANDIDATES):
the token tasks/ops/argmax.py `sample_logits` draws for that row, found from a few candidates instead of an order
key over the whole vocabulary, and the top-C arithmetic in numpy with the same single fp32 ops in the same order
(session 73: ~0.15 ms a row at V = 152k on a 2-core host; tests/tasks/test_sampling.py and
tests/engine/test_host_sampler_exact.py hold it to sample_logits token for token). `candidate_pool` also serves the
full-vocabulary draw's ranked rows (runtime/full_sampling.py draw_row)."""
from __future__ import annotations

import numpy as np
import torch

from ..ir.sampling import EXP2_POLY, LOG2E, PAD_INDEX, uniform_bits


def key32(x: np.ndarray) -> np.ndarray:
    """fp32 -> int32 whose signed order is order_key's (the float's total order, -0.0 below +0.0; equal keys = equal
    bit patterns): the sign-magnitude bits with a negative float's magnitude bits flipped."""
    b = x.view(np.int32)
    return ((b >> 31) & 0x7FFFFFFF) ^ b


def _order_key_np(x: np.ndarray) -> np.ndarray:
    """order_key in numpy (int64)."""
    u = x.view(np.uint32).astype(np.int64)
    return np.where(u >= 0x80000000, 0xFFFFFFFF - u, u | 0x80000000)


def candidate_pool(x: torch.Tensor, n: int):
    """A few entries of the row x (V,) (a CPU tensor of fp32 values, or of key32 keys) that hold its n largest:
    (pool values, their indices ascending (numpy), t0, the row's max (NaN where the row holds one)); (None, None,
    None, max) where the max is not finite; None where V is too short for blocks of >= 2 entries (V < 8 n).

    The row is cut into blocks of L entries (a tail shorter than L counts as blocks of one entry each); t0 = the
    n-th largest block maximum. The pool is every entry >= t0 of the blocks whose maximum is > t0, and of the first
    n blocks (in vocabulary order) whose maximum is == t0. So: (1) the n-th largest value of the pool is the row's
    (n block maxima are >= t0, so the row's n-th largest t_n is >= t0; every entry > t0 is in the pool, and where
    t_n == t0 the pool holds n block maxima equal to it); (2) every entry > t0 is in the pool; (3) of the entries
    == t0, the pool holds the n of lowest index (each of the first n blocks whose maximum is t0 holds one, and every
    later such entry comes after all of them) - whatever else a ranking of equal entries needs (-0.0 and +0.0 are
    equal values but different keys: rank by key32 there). About n entries for a row without many ties; ~40 us at
    V = 152k, n = 64 against ~250 us for a torch.topk of the row (2-core host)."""
    V = x.numel()
    L = min(64, V // (4 * n))
    if L < 2:
        return None
    L = 1 << (L.bit_length() - 1)   # (torch's amax over rows of a power-of-two length is the fast one)
    B = V // L
    xn = x.numpy()
    bm = x[:B * L].view(B, L).amax(1).numpy()   # (amax propagates NaN)
    if B * L < V:
        bm = np.concatenate([bm, xn[B * L:]])
    top = bm.max()
    if not np.isfinite(top):
        return None, None, None, top
    t0 = np.partition(bm, bm.size - n)[bm.size - n]
    take = bm > t0
    take[np.flatnonzero(bm == t0)[:n]] = True
    blocks = np.flatnonzero(take)
    mb = blocks[blocks < B]
    vals = xn[:B * L].reshape(B, L)[mb].ravel()
    idx = (mb[:, None] * L + np.arange(L)).ravel()
    if mb.size < blocks.size:   # tail blocks: single entries, block b >= B holds entry b - B + B L
        t = blocks[mb.size:] + (B * L - B)
        vals, idx = np.concatenate([vals, xn[t]]), np.concatenate([idx, t])
    keep = vals >= t0
    return vals[keep], idx[keep], t0, top


def row_candidates(x: torch.Tensor, C: int) -> np.ndarray | None:
    """The indices (numpy int64) of the device's top-C candidates of one CPU row x (V,) fp32, best first: the first
    min(C, V) entries by (order key desc, index asc), as partial_candidates ranks them; None where the row holds NaN
    or its largest value is +-inf (the host fails such a row). Only entries whose value is >= the n-th largest can be
    among them (keys order as values; -0.0 and +0.0 are equal values), so the order keys are computed for those
    alone, found in candidate_pool's few blocks (or, for a short row, in all of it)."""
    x = x.contiguous()
    V = x.numel()
    n = min(C, V)
    xn = x.numpy()
    pool = candidate_pool(x, n)
    if pool is None:
        if not np.isfinite(xn.max()):   # (max propagates NaN)
            return None
        pv, pi = xn, np.arange(V)
        thr = np.partition(pv, V - n)[V - n]
    else:
        pv, pi, t0, top = pool
        if pv is None:
            return None
        thr = np.partition(pv, pv.size - n)[pv.size - n]
        if thr == 0 and t0 == 0:
            # zeros tie at the n-th place: +0.0 ranks above -0.0, which the pool's values do not see; its keys do
            pv, pi, _, _ = candidate_pool(torch.from_numpy(key32(xn)), n)
            thr = np.partition(pv, pv.size - n)[pv.size - n]
    sub = pi[pv >= thr]
    order = (_order_key_np(xn[sub]) << 24) | (PAD_INDEX - sub)   # _rank_order: unique, (key desc, index asc)
    return sub[np.argsort(-order)[:n]]


def serial_prefix_f32(e: np.ndarray) -> np.ndarray:
    """c (C + 1,) float32: c[0] = 0, c[q + 1] = c[q] + e[q] in float32, one add after another (sample_rows' loop of
    torch.add steps, the device thread's order): numpy's cumsum of a float32 array accumulates in float32, serially
    (tests/tasks/test_sampling.py checks it bitwise against the torch loop)."""
    c = np.zeros(e.shape[0] + 1, dtype=np.float32)
    np.cumsum(e, dtype=np.float32, out=c[1:])
    return c


def sample_candidates(vals: np.ndarray, idx: np.ndarray, temperature: float, top_k: int, top_p: float,
                      seed: int, pos: int) -> int:
    """sample_rows for one row of merged candidates (vals (C,) fp32 best first, idx (C,) int64), in numpy: the same
    single IEEE fp32 operations in the same order (numpy's float32 add / multiply / divide / floor round as torch's;
    the prefix sums by serial_prefix_f32), ~30 us instead of ~0.3 ms of small torch ops. temperature > 0.
    tests/tasks/test_sampling.py checks it against sample_rows row by row."""
    f32 = np.float32
    C = vals.shape[0]
    if not np.isfinite(vals[0]):
        return PAD_INDEX   # as sample_rows: no distribution to draw from
    T = f32(temperature)
    T = T if T > 0 else f32(1.0)
    d = (vals - vals[0]) / T
    t = d * f32(LOG2E)
    k = top_k if 1 <= top_k <= C else C
    ok = t >= f32(-126.0)                                  # exp2_neg
    ts = np.where(ok, t, f32(0.0))
    nn = np.floor(ts)
    f = ts - nn
    p = np.full(C, EXP2_POLY[6], dtype=f32)
    for c in EXP2_POLY[5::-1]:
        p = p * f
        p = p + f32(c)
    scale = ((nn.astype(np.int32) + 127) << 23).view(f32)
    e = np.where(ok, p * scale, f32(0.0))
    e[0] = f32(1.0)
    e[k:] = f32(0.0)
    c = serial_prefix_f32(e)
    S = c[k]
    thr = f32(top_p) * S
    j = np.arange(C)
    m = int(((j < k) & ((j == 0) | (c[:C] < thr))).sum())
    r = f32(uniform_bits(seed, pos) * 2.0 ** -24) * c[m]   # (24 bits: exact in fp32)
    live = j < m
    chosen = int((live & (c[1:] <= r)).sum())
    if chosen >= m:
        hit = np.nonzero(live & (e > 0))[0]
        chosen = int(hit[-1]) if hit.size else 0
    return int(idx[chosen])


def sample_row(x: torch.Tensor, temperature: float, top_k: int, top_p: float, seed: int, pos: int, C: int) -> int:
    """sample_logits for one row (V,) fp32 of the whole vocabulary with temperature > 0, the same token: the
    candidates by row_candidates (order keys for a few entries, not for every one: ~0.3 ms for sample_logits' 4.5 at
    V = 152k on a 2-core host in session 72, ~0.1 ms since session 73's block search), drawn by sample_candidates
    (numpy, sample_rows' fp32 operations). seed: the int64 two's complement. -1 for a row holding NaN or whose
    largest value is +-inf."""
    x = x.contiguous()
    V = x.numel()
    n = min(C, V)
    top = row_candidates(x, C)
    if top is None:
        return -1
    vals = np.full(C, -np.inf, dtype=np.float32)
    idx = np.full(C, PAD_INDEX, dtype=np.int64)
    vals[:n] = x.numpy()[top]
    idx[:n] = top
    return sample_candidates(vals, idx, temperature, top_k, top_p, seed, pos)
