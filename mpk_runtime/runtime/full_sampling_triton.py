"""The full-vocabulary draw (full_sampling.py's module doc has the definition) in Triton kernels, on CUDA tensors and
on the CPU under TRITON_INTERPRET=1 (the tests).

A vocab row (top_k 0 or >= V) is split into chunks of CHUNK entries, so that a step's draw spreads over the SMs at
any batch (session 50's kernel gave a row one program: a 128k-entry row streamed three times on one SM, +0.17 ms a
step at batch 1). Each launch ends where the next needs every chunk of a row (kernel boundaries are the only barriers;
no atomics):
  1. `_chunk_max`     (rows x chunks): each chunk's largest logit.
  2. `_chunk_sum`     (rows x chunks): each chunk's sum of e = exp(logit / T - mx) in float64, mx = the row's max / T.
  3. `_first_draw`    (rows): total = sum of the chunk sums; the chunk whose running sum first passes r = u_0 * total,
                      then a scan of that chunk alone for the token. Done unless the row has a top_p < 1.
  Nucleus rows, ROUNDS + 1 times (programs of decided rows return at once):
  4. `_chunk_before`  (rows x chunks): each chunk's mass of the tokens ranked before the row's token (logit desc,
                      index asc).
  5. `_next_draw`     (rows): before = their sum; accept the token when before < top_p * total; else the set becomes
                      the tokens ranked before it, whose chunk masses are step 4's sums, and the next round draws from
                      it as step 3 does (uniform u_{r+1}). The last of these launches (LOOP) keeps checking and
                      drawing in one program, streaming the row, for the rows still undecided then (a round accepts
                      with probability >= top_p, so they are rare; the result is the same).
The weights are the definition's (fp32 exp of fp32 x - mx, summed in float64); only the order of the float64 sums
differs from the torch twin's, so the two can differ where a uniform falls within rounding of a boundary.
Ranked rows (0 < top_k < V) have a program a row over their torch.topk candidates (`_ranked_kernel`).
"""
from __future__ import annotations

import torch

from ..ir.sampling import FULL_SALT, HASH_M1, HASH_M2, POS_SALT, ROUND_SALT
from .triton_support import tl, triton

MAX_ROUNDS = 64      # (full_sampling.MAX_ROUNDS: the definition's cap on rejection rounds)
CHUNK = 4096         # entries a chunk program reads (128256 / 4096 = 32 programs a row at llama's vocabulary)
ROUNDS = 1           # nucleus rounds run split (4. + 5.) before the last one carries on in one program (at top_p
#                      0.95 a row reaches that program with probability <= 0.05^2; each split round costs two launches)
WARPS, ROW_WARPS = 8, 16   # chunk programs; row programs (a float64 running sum over a chunk: 16 warps spill nothing
#                            at 4096 entries, session 50)
BLOCK = CHUNK        # the ranked kernel's entries a step


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class VocabWork:
    """A row group's workspace on the device (reused by each draw of the same rows: a burst's steps): chunk maxima,
    chunk masses, and each row's state between launches."""

    def __init__(self, n: int, V: int, device, chunk: int):
        self.C = -(-V // chunk)
        self.CP = _pow2(self.C)
        self.chunk = chunk
        self.cmax = torch.empty((n, self.C), dtype=torch.float32, device=device)
        self.w = torch.empty((n, self.C), dtype=torch.float64, device=device)
        self.total = torch.empty(n, dtype=torch.float64, device=device)
        self.vi = torch.empty(n, dtype=torch.float32, device=device)
        self.st = torch.empty((n, 4), dtype=torch.int64, device=device)   # token, hash word, rounds drawn, done


def draw_vocab(rows, logits: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, work: VocabWork) -> None:
    """Vocab rows (full_sampling._VocabRows: idx, temp, top_p, seed, nucleus) drawn from logits (n, V) fp32, row-major."""
    n, V = rows.idx.numel(), logits.shape[1]
    C, CP, CH = work.C, work.CP, work.chunk
    common = (logits, logits.stride(0), V, rows.idx, rows.temp)
    _chunk_max[(n, C)](logits, logits.stride(0), V, rows.idx, work.cmax, C, CH=CH, num_warps=WARPS)
    _chunk_sum[(n, C)](*common, work.cmax, work.w, C, CP=CP, CH=CH, num_warps=WARPS)
    _first_draw[(n,)](*common, rows.top_p, rows.seed, pos, out, work.cmax, work.w, C, work.total, work.vi, work.st,
                      NUCLEUS=rows.nucleus, CP=CP, CH=CH, M1=HASH_M1, M2=HASH_M2, SALT=POS_SALT, SALT2=FULL_SALT,
                      num_warps=ROW_WARPS)
    if not rows.nucleus:
        return
    for i in range(ROUNDS + 1):
        _chunk_before[(n, C)](*common, work.cmax, work.w, C, work.vi, work.st, CP=CP, CH=CH, num_warps=WARPS)
        _next_draw[(n,)](*common, rows.top_p, out, work.cmax, work.w, C, work.total, work.vi, work.st,
                         MAX_ROUNDS=MAX_ROUNDS, LOOP=i == ROUNDS, CP=CP, CH=CH, M1=HASH_M1, M2=HASH_M2,
                         SALT2=FULL_SALT, RSALT=ROUND_SALT, num_warps=ROW_WARPS)


def draw_ranked(rows, vals: torch.Tensor, order: torch.Tensor, pos: torch.Tensor, out: torch.Tensor) -> None:
    """Ranked rows (full_sampling._RankedRows) from their candidates vals / order (n, K), ranked."""
    _ranked_kernel[(rows.idx.numel(),)](
        vals, order, vals.stride(0), rows.idx, rows.temp, rows.k, rows.top_p, rows.seed, pos, out,
        NUCLEUS=rows.nucleus, BLOCK=BLOCK, M1=HASH_M1, M2=HASH_M2, SALT=POS_SALT, SALT2=FULL_SALT,
        num_warps=ROW_WARPS)


if triton is not None:
    # --- the (seed, position, round) uniform: ir/sampling.py's hash in 32-bit words held in int64 -------------------
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
    def _below(mass):
        """u * mass capped below mass (1 - 2^-52): the draw lands on a token of the set."""
        return mass * 0.9999999999999998

    @triton.jit
    def _zero64():
        return tl.zeros([1], tl.float64).sum(0)

    # --- weights, scans ------------------------------------------------------------------------------------------
    @triton.jit
    def _e(v, T, mx):
        """The definition's weight: fp32 exp(v / T - mx), in float64 for the sums."""
        return tl.exp(tl.math.div_rn(v, T) - mx).to(tl.float64)

    @triton.jit
    def _weights(base, j, L, T, mx):
        """e_j for entries j < L of the row at base, 0 past L."""
        v = tl.load(base + j, mask=j < L, other=0.0)
        return tl.where(j < L, _e(v, T, mx), 0.0)

    @triton.jit
    def _scan(base, j, V, T, mx, bv, bj, rr, carry):
        """Over the entries j of the row at base that are in A (ranked before (bv, bj)): the first whose running sum
        from carry passes rr (2^31 - 1 if none), the last with a positive weight (-1 if none), and their mass."""
        ok = (j >= 0) & (j < V)
        v = tl.load(base + j, mask=ok, other=float("-inf"))
        in_a = ok & ((v > bv) | ((v == bv) & (j < bj)))
        e = tl.where(in_a, _e(v, T, mx), 0.0)
        cs = carry + tl.cumsum(e, 0)
        first = tl.min(tl.where((cs > rr) & in_a & (e > 0), j, 2147483647), 0)   # (a chunk's carry can round
        #                                                                            above rr: skip weight-0 entries)
        last = tl.max(tl.where(in_a & (e > 0), j, -1), 0)
        return first, last, tl.sum(e, 0)

    @triton.jit
    def _ahead(base, j, V, T, mx, vi, i):
        """The mass of the entries j ranked before the token (vi, i): logit > vi, or == vi at a lower index."""
        ok = j < V
        v = tl.load(base + j, mask=ok, other=float("-inf"))
        ahead = ok & ((v > vi) | ((v == vi) & (j < i)))
        return tl.sum(tl.where(ahead, _e(v, T, mx), 0.0), 0)

    @triton.jit
    def _row_mx(cmax_ptr, r, C, T, CP: tl.constexpr):
        c = tl.arange(0, CP)
        return tl.math.div_rn(tl.max(tl.load(cmax_ptr + r * C + c, mask=c < C, other=float("-inf")), 0), T)

    @triton.jit
    def _draw_in_chunks(base, V, T, mx, bv, bj, w_ptr, C, rr, CP: tl.constexpr, CH: tl.constexpr):
        """The token of A (ranked before (bv, bj)) at rr, given A's mass in each chunk (w_ptr[0:C]): the first chunk
        whose running mass passes rr (rounding left none: the last chunk with mass), then a scan of that chunk."""
        c = tl.arange(0, CP)
        w = tl.load(w_ptr + c, mask=c < C, other=0.0)
        pre = tl.cumsum(w, 0)
        k = tl.min(tl.where(pre > rr, c, CP), 0)
        k = tl.where(k == CP, tl.max(tl.where(w > 0, c, -1), 0), k)
        carry = tl.sum(tl.where(c == k, pre - w, 0.0), 0)
        first, last, _ = _scan(base, k * CH + tl.arange(0, CH), V, T, mx, bv, bj, rr, carry)
        return tl.where(first == 2147483647, last, first)

    # --- the vocab rows' launches (module doc, 1-5) ------------------------------------------------------------
    @triton.jit
    def _chunk_max(lg_ptr, stride, V, idx_ptr, cmax_ptr, C, CH: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1)
        j = c * CH + tl.arange(0, CH)
        v = tl.load(lg_ptr + tl.load(idx_ptr + r) * stride + j, mask=j < V, other=float("-inf"))
        tl.store(cmax_ptr + r * C + c, tl.max(v, 0))

    @triton.jit
    def _chunk_sum(lg_ptr, stride, V, idx_ptr, temp_ptr, cmax_ptr, w_ptr, C, CP: tl.constexpr, CH: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1)
        T = tl.load(temp_ptr + r)
        mx = _row_mx(cmax_ptr, r, C, T, CP)
        e = _weights(lg_ptr + tl.load(idx_ptr + r) * stride, c * CH + tl.arange(0, CH), V, T, mx)
        tl.store(w_ptr + r * C + c, tl.sum(e, 0))

    @triton.jit
    def _first_draw(lg_ptr, stride, V, idx_ptr, temp_ptr, top_p_ptr, seed_ptr, pos_ptr, out_ptr, cmax_ptr, w_ptr, C,
                    tot_ptr, vi_ptr, st_ptr, NUCLEUS: tl.constexpr, CP: tl.constexpr, CH: tl.constexpr,
                    M1: tl.constexpr, M2: tl.constexpr, SALT: tl.constexpr, SALT2: tl.constexpr):
        r = tl.program_id(0)
        row = tl.load(idx_ptr + r)
        base = lg_ptr + row * stride
        T = tl.load(temp_ptr + r)
        mx = _row_mx(cmax_ptr, r, C, T, CP)
        c = tl.arange(0, CP)
        total = tl.sum(tl.load(w_ptr + r * C + c, mask=c < C, other=0.0), 0)
        good = (total == total) & (total > 0) & (total < float("inf"))
        a = _first_word_k(tl.load(seed_ptr + r), tl.load(pos_ptr + row), M1, M2, SALT)
        rr = tl.minimum(_u53_k(a, M1, M2, SALT2) * total, _below(total))
        bv = tl.full([1], float("-inf"), tl.float32).max(0)   # A = the whole vocabulary
        tok = _draw_in_chunks(base, V, T, mx, bv, V + 1, w_ptr + r * C, C, rr, CP, CH)
        done = ~good
        if NUCLEUS:
            done = done | (tl.load(top_p_ptr + r) >= 1.0)
        else:
            done = done | good
        tl.store(out_ptr + row, tl.where(good, tok, -1).to(tl.int64))
        tl.store(tot_ptr + r, total)
        tl.store(vi_ptr + r, tl.load(base + tl.maximum(tok, 0)))
        tl.store(st_ptr + r * 4, tok.to(tl.int64))
        tl.store(st_ptr + r * 4 + 1, a)
        tl.store(st_ptr + r * 4 + 2, tl.full([1], 1, tl.int64).sum(0))
        tl.store(st_ptr + r * 4 + 3, done.to(tl.int64))

    @triton.jit
    def _chunk_before(lg_ptr, stride, V, idx_ptr, temp_ptr, cmax_ptr, w_ptr, C, vi_ptr, st_ptr, CP: tl.constexpr,
                      CH: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1)
        if tl.load(st_ptr + r * 4 + 3) == 0:
            T = tl.load(temp_ptr + r)
            mx = _row_mx(cmax_ptr, r, C, T, CP)
            tok = tl.load(st_ptr + r * 4).to(tl.int32)
            b = _ahead(lg_ptr + tl.load(idx_ptr + r) * stride, c * CH + tl.arange(0, CH), V, T, mx,
                       tl.load(vi_ptr + r), tok)
            tl.store(w_ptr + r * C + c, b)

    @triton.jit
    def _next_draw(lg_ptr, stride, V, idx_ptr, temp_ptr, top_p_ptr, out_ptr, cmax_ptr, w_ptr, C, tot_ptr, vi_ptr,
                   st_ptr, MAX_ROUNDS: tl.constexpr, LOOP: tl.constexpr, CP: tl.constexpr, CH: tl.constexpr,
                   M1: tl.constexpr, M2: tl.constexpr, SALT2: tl.constexpr, RSALT: tl.constexpr):
        r = tl.program_id(0)
        if tl.load(st_ptr + r * 4 + 3) == 0:
            row = tl.load(idx_ptr + r)
            base = lg_ptr + row * stride
            T = tl.load(temp_ptr + r)
            mx = _row_mx(cmax_ptr, r, C, T, CP)
            lim = tl.load(top_p_ptr + r) * tl.load(tot_ptr + r)
            tok = tl.load(st_ptr + r * 4).to(tl.int32)
            a = tl.load(st_ptr + r * 4 + 1)
            rnd = tl.load(st_ptr + r * 4 + 2)
            vi = tl.load(vi_ptr + r)
            c = tl.arange(0, CP)
            before = tl.sum(tl.load(w_ptr + r * C + c, mask=c < C, other=0.0), 0)
            go = (before >= lim) & (rnd < MAX_ROUNDS)
            if go:   # rejected: draw from the tokens ranked before (vi, tok), whose chunk masses step 4 wrote
                a = _hash32_k(a ^ RSALT, M1, M2)
                rr = tl.minimum(_u53_k(a, M1, M2, SALT2) * before, _below(before))
                tok = _draw_in_chunks(base, V, T, mx, vi, tok, w_ptr + r * C, C, rr, CP, CH)
                vi = tl.load(base + tok)
                rnd += 1
                if LOOP:   # the rare rows still undecided: check and draw in this program, streaming the row
                    go = rnd < MAX_ROUNDS
                    while go:
                        before = _zero64()
                        for s in range(0, V, CH):
                            before += _ahead(base, s + tl.arange(0, CH), V, T, mx, vi, tok)
                        go = (before >= lim) & (rnd < MAX_ROUNDS)
                        if go:
                            a = _hash32_k(a ^ RSALT, M1, M2)
                            rr = tl.minimum(_u53_k(a, M1, M2, SALT2) * before, _below(before))
                            first = tok * 0 + 2147483647
                            last = tok * 0 - 1
                            carry = _zero64()
                            for s in range(0, V, CH):
                                f, l, m = _scan(base, s + tl.arange(0, CH), V, T, mx, vi, tok, rr, carry)
                                first = tl.minimum(first, f)
                                last = tl.maximum(last, l)
                                carry += m
                            tok = tl.where(first == 2147483647, last, first)
                            vi = tl.load(base + tok)
                            rnd += 1
                    go = rnd < 0   # decided
                tl.store(out_ptr + row, tok.to(tl.int64))
                tl.store(vi_ptr + r, vi)
                tl.store(st_ptr + r * 4, tok.to(tl.int64))
                tl.store(st_ptr + r * 4 + 1, a)
                tl.store(st_ptr + r * 4 + 2, rnd)
            tl.store(st_ptr + r * 4 + 3, (~go).to(tl.int64))

    # --- ranked rows: a program a row over its candidates --------------------------------------------------------
    @triton.jit
    def _ranked_kernel(val_ptr, order_ptr, stride, idx_ptr, temp_ptr, k_ptr, top_p_ptr, seed_ptr, pos_ptr, out_ptr,
                       NUCLEUS: tl.constexpr, BLOCK: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr,
                       SALT: tl.constexpr, SALT2: tl.constexpr):
        """A ranked row (full_sampling's module doc): program r draws row idx[r] from its sorted candidates (row r of
        val / order)."""
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
        rr = tl.minimum(_u53_k(a, M1, M2, SALT2) * mass, _below(mass))
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
