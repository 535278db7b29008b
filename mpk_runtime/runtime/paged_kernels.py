"""The paged decode attention's Triton kernels (runtime/paged_attention.py launches them and documents what they do
and what was measured): the split partials over a row's keys read through the block table, with the step's deferred
K / V appends, and the merge of the splits. Constexpr switches (ROW_KEYS, USED, APPEND_CACHE, HEAD_MAJOR, HG) select
the variants; at their defaults the kernels are the ones GPU-measured in session 40."""
from __future__ import annotations

from .triton_support import tl, triton

if triton is not None:
    @triton.jit
    def _split_blocks(length, n_splits, n_blocks, BLOCK: tl.constexpr, ROW_KEYS: tl.constexpr):
        """Key blocks a split spans: the cap's share (n_blocks), or under ROW_KEYS == 2 (split) the row's own keys
        divided evenly among the splits, in whole blocks. The partials and the merge (USED) agree through it."""
        nb = n_blocks
        if ROW_KEYS == 2:
            nb = tl.cdiv(tl.cdiv(tl.maximum(length, 1), n_splits), BLOCK)
        return nb

    @triton.jit
    def _partial_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, o_ptr, ml_ptr, new_ptr, scale,
                        s_qb, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_bt, s_ob, s_oh, s_os, s_nb, n_blocks,
                        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
                        BLOCK: tl.constexpr, MULTI: tl.constexpr, NKV: tl.constexpr, APPEND: tl.constexpr,
                        IDX_AHEAD: tl.constexpr = False, ROW_KEYS: tl.constexpr = 0, USED: tl.constexpr = False,
                        APPEND_CACHE: tl.constexpr = False, HEAD_MAJOR: tl.constexpr = False,
                        HG: tl.constexpr = 1):
        # HG > 1 (MPK_PAGED_HEADS=group): a program takes HG adjacent KV heads, their G * HG q heads as the rows of q
        # and each loop step's keys as BLOCK * HG tile rows (key-major: HG heads' contiguous bytes a slot), the
        # scores of other heads' keys masked: the same dot shapes and work a key, 1 / HG of the programs and page
        # lookups, and a slot's HG heads read as one run of bytes
        if HEAD_MAJOR:   # MPK_PAGED_GRID=head: the KV head (group) is the fastest-varying program index
            kvh = tl.program_id(0) * HG
            b = tl.program_id(1)
        else:
            b = tl.program_id(0)
            kvh = tl.program_id(1) * HG
        s = tl.program_id(2)
        length = tl.load(pos_ptr + b) + 1                    # keys this row has written (0: inactive row)
        nb = _split_blocks(length, tl.num_programs(2), n_blocks, BLOCK, ROW_KEYS)
        span = nb * BLOCK                                    # this split's keys: [k0, k0 + span)
        k0 = s * span
        gi = tl.arange(0, GP)
        hmask = gi < G * HG
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * s_qb + (kvh * G + gi)[:, None] * D + d[None, :], mask=hmask[:, None], other=0.0)
        last = length - 1                                    # the step's own key (its row may not be in the cache yet)
        if APPEND and HG > 1:   # (the cache path only: the wrapper takes HG = 1 for register appends)
            hv = kvh + tl.arange(0, HG)
            nk = tl.load(new_ptr + b * s_nb + hv[:, None] * D + d[None, :])
            nv = tl.load(new_ptr + b * s_nb + (NKV + hv)[:, None] * D + d[None, :])
            owns = (last >= k0) & (last < k0 + span)
            lp = tl.load(bt_ptr + b * s_bt + tl.maximum(last, 0) // PS).to(tl.int64)
            ls = tl.maximum(last, 0) % PS
            own_row = (d < D)[None, :] & owns
            tl.store(k_ptr + lp * s_kp + ls * s_ks + hv[:, None] * s_kh + d[None, :], nk, mask=own_row)
            tl.store(v_ptr + lp * s_vp + ls * s_vs + hv[:, None] * s_vh + d[None, :], nv, mask=own_row)
            tl.debug_barrier()
        elif APPEND:   # deferred append: the new k / v rows come from `new` (B, 2, nkv, D); the program whose keys
            # hold `last` writes them into the cache for later steps, and every program uses them from registers
            nk = tl.load(new_ptr + b * s_nb + kvh * D + d)
            nv = tl.load(new_ptr + b * s_nb + (NKV + kvh) * D + d)
            owns = (last >= k0) & (last < k0 + span)
            lp = tl.load(bt_ptr + b * s_bt + tl.maximum(last, 0) // PS).to(tl.int64)
            ls = tl.maximum(last, 0) % PS
            tl.store(k_ptr + lp * s_kp + ls * s_ks + kvh * s_kh + d, nk, mask=(d < D) & owns)
            tl.store(v_ptr + lp * s_vp + ls * s_vs + kvh * s_vh + d, nv, mask=(d < D) & owns)
            if APPEND_CACHE:   # the owner reads its row back from the cache like any key: the stores above are the
                tl.debug_barrier()   # CTA's, and a barrier makes them visible to its own threads' loads below
        m = tl.full((GP,), float("-inf"), tl.float32)
        lsum = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        if HG > 1:   # tile row j: key j // HG of the step's block, head kvh + j % HG
            jj = tl.arange(0, BLOCK * HG)
            n = jj // HG
            hh = kvh + jj % HG
            k_head, v_head = (hh * s_kh)[:, None], (hh * s_vh)[:, None]
            own_head = (gi[:, None] // G) == (jj % HG)[None, :]
        else:
            n = tl.arange(0, BLOCK)
            k_head, v_head = kvh * s_kh, kvh * s_vh
        if IDX_AHEAD:   # the first block's page indices, before the loop (then each step loads the next block's)
            page_next = tl.load(bt_ptr + b * s_bt + (k0 + n) // PS, mask=(k0 + n) < length, other=0).to(tl.int64)
        if ROW_KEYS != 0:   # up to the row's last block only (none for a split past the row's length)
            nb = tl.minimum(nb, tl.cdiv(tl.maximum(length - k0, 0), BLOCK))
        for i in range(0, nb):   # a runtime count: a constant one was unrolled (registers, spills)
            key = k0 + i * BLOCK + n
            kmask = key < length
            if IDX_AHEAD:
                page = page_next
                page_next = tl.load(bt_ptr + b * s_bt + (key + BLOCK) // PS, mask=(key + BLOCK) < length,
                                    other=0).to(tl.int64)
            else:
                page = tl.load(bt_ptr + b * s_bt + key // PS, mask=kmask, other=0).to(tl.int64)
            slot = key % PS
            kk = tl.load(k_ptr + page[:, None] * s_kp + slot[:, None] * s_ks + k_head + d[None, :],
                         mask=kmask[:, None], other=0.0)
            vv = tl.load(v_ptr + page[:, None] * s_vp + slot[:, None] * s_vs + v_head + d[None, :],
                         mask=kmask[:, None], other=0.0)
            if APPEND and not APPEND_CACHE:
                own = (key == last)[:, None]
                kk = tl.where(own, nk[None, :], kk)
                vv = tl.where(own, nv[None, :], vv)
            sc = tl.dot(q, tl.trans(kk)) * scale                # (GP, BLOCK * HG) fp32
            if HG > 1:
                smask = kmask[None, :] & own_head
            else:
                smask = kmask[None, :]
            sc = tl.where(smask, sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            alive = m_new > float("-inf")
            alpha = tl.where(alive, tl.exp(m - m_new), 1.0)
            p = tl.where(smask & alive[:, None], tl.exp(sc - m_new[:, None]), 0.0)
            lsum = lsum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
            m = m_new
        heads = kvh * G + gi
        if not MULTI:     # one split: the output itself (zeros where no key: inactive rows)
            out = tl.where(lsum[:, None] > 0, acc / tl.maximum(lsum, 1e-30)[:, None], 0.0)
            tl.store(o_ptr + b * s_ob + heads[:, None] * s_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=hmask[:, None])
        else:             # the split's unnormalised o, its max and its sum
            base = b * s_ob + heads * s_oh + s * s_os
            live = hmask
            if USED:      # a split past its row's length: the merge does not read it
                live = hmask & (k0 < length)
            tl.store(o_ptr + base[:, None] + d[None, :], acc, mask=live[:, None])
            tl.store(ml_ptr + 2 * (base // D), m, mask=live)
            tl.store(ml_ptr + 2 * (base // D) + 1, lsum, mask=live)

    @triton.jit
    def _merge_kernel(o_ptr, ml_ptr, out_ptr, pos_ptr, s_ob, s_oh, s_os, s_outb, n_splits, n_blocks,
                      D: tl.constexpr, BLOCK: tl.constexpr, ROW_KEYS: tl.constexpr = 0, USED: tl.constexpr = False):
        b = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, D)
        n = n_splits
        if USED:   # only the splits that hold keys of the row (the partials' spans); the rest add exactly nothing
            length = tl.load(pos_ptr + b) + 1
            span = _split_blocks(length, n_splits, n_blocks, BLOCK, ROW_KEYS) * BLOCK
            n = tl.minimum(n_splits, tl.cdiv(tl.maximum(length, 0), span))
        M = float("-inf")
        for s in range(0, n):
            M = tl.maximum(M, tl.load(ml_ptr + 2 * ((b * s_ob + h * s_oh + s * s_os) // D)))
        num = tl.zeros((D,), tl.float32)
        den = 0.0
        for s in range(0, n):   # split order
            base = b * s_ob + h * s_oh + s * s_os
            ms = tl.load(ml_ptr + 2 * (base // D))
            w = tl.where(ms > float("-inf"), tl.exp(ms - M), 0.0)
            den += w * tl.load(ml_ptr + 2 * (base // D) + 1)
            num += w * tl.load(o_ptr + base + d)
        out = tl.where(den > 0, num / tl.maximum(den, 1e-30), 0.0)
        tl.store(out_ptr + b * s_outb + h * D + d, out.to(out_ptr.dtype.element_ty))
else:   # no Triton (CI's CPU torch): paged_attention raises before it would launch them
    _split_blocks = _partial_kernel = _merge_kernel = None
