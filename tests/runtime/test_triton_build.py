"""The Triton kernels (runtime/paged_attention.py, runtime/skinny_gemm.py) built offline for sm_90 with the
divisibility the JIT gives 16-aligned pointers and strides, as on the H200: they compile, the attention spills
nothing and its K / V loads are asynchronous copies (LDGSTS, pipelined). Needs Triton installed (it brings ptxas and
cuobjdump; CI's CPU torch has none, so there this skips); no GPU needed."""
from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton", reason="needs Triton (pip install triton): it builds without a GPU")

from mpk_runtime.runtime import paged_attention as pa, skinny_gemm as sg  # noqa: E402
from mpk_runtime.runtime.triton_offline import PARTIAL_SIG, build_offline, step_partial_constexprs  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    pytestmark = pytest.mark.skip(reason="TRITON_INTERPRET=1 replaces the kernels by the interpreter's")


def build(fn, sig: dict, const: dict, **opts):
    """(registers, stack bytes, SASS) of fn built offline for sm_90 (runtime/triton_offline.py)."""
    b = build_offline(fn, sig, const, **opts)
    return b.regs, b.stack, b.sass


@pytest.mark.parametrize("D,append", [(64, False), (64, True), (128, True)])
def test_paged_attention_builds_pipelined_without_spills(D, append):
    sig = PARTIAL_SIG
    regs, stack, sass = build(pa._partial_kernel, sig, dict(G=4, GP=16, D=D, PS=16, BLOCK=pa.BLOCK_N, MULTI=True,
                                                            NKV=8, APPEND=append), num_warps=4, num_stages=3)
    assert stack == 0 and regs <= 255, (regs, stack)
    assert "LDGSTS" in sass and "HMMA" in sass


@pytest.mark.parametrize("key", sorted(pa.TUNED))
def test_every_tuned_shape_builds_without_spills(key):
    """Each launch shape TUNED ships, as a decode step launches it (the cache appends, split rows, the used-splits
    merge, its read-ahead flag), builds for sm_90 with no stack, at least 2 CTAs an SM, and its K / V loads as
    asynchronous copies where it has more than one stage (a 1-stage shape loads straight into registers)."""
    D, programs, keys = key
    c = pa.TUNED[key]
    b = build_offline(pa._partial_kernel, PARTIAL_SIG, step_partial_constexprs(D, max(1, programs // 8), 32, 8, keys, c),
                      c.num_warps, c.num_stages)
    assert b.stack == 0, (key, c, b.regs, b.stack)
    assert "HMMA" in b.sass and ("LDGSTS" in b.sass) == (c.num_stages > 1), (key, c)
    assert b.ctas_per_sm() >= 2, (key, c, b.regs, b.smem)


@pytest.mark.parametrize("D,block,stages", [(128, 64, 2), (64, 128, 1)])
def test_append_through_the_cache_builds_like_no_append(D, block, stages):
    """MPK_PAGED_APPEND=cache (APPEND_CACHE): the owner's stores, then a CTA barrier, then every K / V load (the
    pipeline's first copies included, else a program could read its new row's slot before writing it); and the loop
    has none of the register path's per-block byte permutes and selects: its instruction mix is the no-append
    kernel's, and it needs no more registers."""
    sig = PARTIAL_SIG

    def sass_of(append, cache):
        return build(pa._partial_kernel, sig, dict(G=4, GP=16, D=D, PS=16, BLOCK=block, MULTI=True, NKV=8,
                                                   APPEND=append, ROW_KEYS=2, APPEND_CACHE=cache),
                     num_warps=4, num_stages=stages)
    (r0, _, none), (r1, _, regs), (r2, _, cache) = sass_of(False, False), sass_of(True, False), sass_of(True, True)
    count = lambda sass, op: len(re.findall(rf"\b{op}\b", sass))   # noqa: E731
    assert count(regs, "PRMT") > 64 and count(cache, "PRMT") == count(none, "PRMT")
    # selects: the cache path adds a few (its owner's masks), the register path ~130 (two a K / V element a block)
    assert count(cache, "SEL") - count(none, "SEL") < (count(regs, "SEL") - count(none, "SEL")) / 4
    assert r2 <= max(r0, r1) and r2 < r1
    lines = cache.splitlines()
    store = max(i for i, l in enumerate(lines) if re.search(r"\bSTG\.E\.U16\b", l) and i < len(lines) // 2)
    bar = next(i for i, l in enumerate(lines) if i > store and "BAR.SYNC" in l)
    before = "\n".join(lines[:bar])
    # before the barrier: q's rows only (one or two 16-byte loads a thread); a block of K / V is 8+ a thread
    assert count(before, "LDGSTS") == 0 and count(before, r"LDG\.E\.128") <= 2, before[-2000:]


@pytest.mark.parametrize("D,block,stages", [(64, 128, 1), (128, 64, 2)])
def test_head_major_grid_builds_the_same_loop(D, block, stages):
    """MPK_PAGED_GRID=head (HEAD_MAJOR) swaps which program index names the row and which the KV head, nothing
    else: the same Tensor Core, barrier and asynchronous-copy instructions, and instruction counts within 4% (the
    index math differs with the 32-bit strides the JIT passes: 16-40 of 1200-1450 instructions), no stack. The
    registers are the allocator's choice: with the int32 page tables the kernel reads by default (PARTIAL_SIG, session
    43) 124 / 123 at head dim 64 and 126 / 126 at head dim 128's 64-key 2-stage tile (4 CTAs an SM each); with int64
    tables session 42 found 122 / 126 and 96 / 160 (5 / 3 CTAs an SM), which the switch's A/B would pay."""
    sig = PARTIAL_SIG
    (r0, st0, row), (r1, st1, head) = (build(pa._partial_kernel, sig, dict(
        G=4, GP=16, D=D, PS=16, BLOCK=block, MULTI=True, NKV=8, APPEND=True, ROW_KEYS=2, USED=True, APPEND_CACHE=True,
        HEAD_MAJOR=hm), num_warps=4, num_stages=stages) for hm in (False, True))
    ops = lambda sass: sorted(re.findall(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))   # noqa: E731
    assert st0 == st1 == 0 and max(r0, r1) <= 255, (r0, r1, st0, st1)
    a, b = ops(row), ops(head)
    assert abs(len(a) - len(b)) <= 0.04 * len(a) and sum(x in ("HMMA.16816.F32.BF16",) for x in a) == \
        sum(x in ("HMMA.16816.F32.BF16",) for x in b)
    assert a.count("BAR.SYNC.DEFER_BLOCKING") == b.count("BAR.SYNC.DEFER_BLOCKING")
    assert a.count("LDGSTS.E.BYPASS.LTC128B.128") == b.count("LDGSTS.E.BYPASS.LTC128B.128")


@pytest.mark.parametrize("D,tile,stages", [(64, 128, 1), (128, 64, 2)])
def test_grouped_heads_build_the_same_work(D, tile, stages):
    """MPK_PAGED_HEADS=group (HG = 4 KV heads a program, the tile's rows their keys): the build spills nothing, its
    K / V copies and the Tensor Core, exponential and barrier instructions are the one-head kernel's at the same
    tile, and registers stay <= 128 at these shapes (4 CTAs an SM at 4 warps, as the tuned one-head shapes)."""
    sig = PARTIAL_SIG
    (r1, st1, one), (r4, st4, group) = (build(pa._partial_kernel, sig, dict(
        G=4, GP=16, D=D, PS=16, BLOCK=tile // hg, MULTI=True, NKV=8, APPEND=True, ROW_KEYS=2, USED=True,
        APPEND_CACHE=True, HG=hg), num_warps=4, num_stages=stages) for hg in (1, 4))
    assert st1 == st4 == 0 and r4 <= 128, (r1, r4)
    count = lambda sass, op: len(re.findall(rf"\b{op}\b", sass))   # noqa: E731
    for op in ("HMMA.16816.F32.BF16", "MUFU.EX2", "BAR.SYNC.DEFER_BLOCKING", r"LDGSTS\.E\.BYPASS\.LTC128B\.128"):
        assert count(one, op) == count(group, op), op
    # the K / V loads of a 1-stage build (and the group's new rows: one more vector load at most)
    assert count(one, r"LDG\.E\.128") <= count(group, r"LDG\.E\.128") <= count(one, r"LDG\.E\.128") + 2


def test_index_prefetch_deepens_the_pipeline():
    """With the page indices a block ahead (PagedAttnConfig.idx_ahead) num_stages buys K / V buffers: stages 3 and
    4 each add a K / V block of shared memory. Without it they add less than one (the pipeliner keeps one block
    ahead)."""
    def smem(ahead: bool, stages: int) -> int:
        return build_offline(pa._partial_kernel, PARTIAL_SIG, dict(G=4, GP=16, D=64, PS=16, BLOCK=64, MULTI=True,
                                                                   NKV=8, APPEND=True, IDX_AHEAD=ahead),
                             num_warps=4, num_stages=stages).smem

    block = 64 * 64 * 2 * 2   # one block's K and V (64 keys x head dim 64, bf16)
    assert smem(True, 3) - smem(True, 2) >= block and smem(True, 4) - smem(True, 3) >= block
    assert smem(False, 3) - smem(False, 2) < block


def test_skinny_lm_head_builds():
    """The LM head's config at 32 rows (BM 32, K 2048: 16 steps, unrolled) sits at 255 registers with a 40-byte
    stack in this build, the build session 26 measured at 88-93% of the stream rate (bench/results/s26 run 5); the
    bound catches a larger spill, not this one."""
    sig = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*fp32", M="i32", N="i32", ks_len="i32", stride_xm="i32",
               stride_wn="i32", stride_ym="i32", stride_ys="i32")
    BN, BK, SK, stages, warps = sg.LM_HEAD_CFG
    regs, stack, sass = build(sg._skinny_kernel, sig, dict(BM=32, BN=BN, BK=BK, NK=2048 // BK, ROUND=True),
                              num_warps=warps, num_stages=stages)
    assert stack <= 64 and "HMMA" in sass, (regs, stack)


@pytest.mark.parametrize("kernel", ["chunk_max", "chunk_sum", "first_draw", "first_draw_nucleus", "chunk_before",
                                    "next_draw", "next_draw_loop", "ranked", "ranked_nucleus"])
def test_full_sampling_kernels_build(kernel):
    """The full-vocabulary draw's kernels (runtime/full_sampling_triton.py) build for sm_90 at their launch shapes
    (the loop-carried types of the rejection rounds included) without spilling more than a few words."""
    from mpk_runtime.ir import sampling as smp
    from mpk_runtime.runtime import full_sampling_triton as fs
    h = dict(M1=smp.HASH_M1, M2=smp.HASH_M2)
    lg = dict(lg_ptr="*fp32", stride="i32", V="i32", idx_ptr="*i64", temp_ptr="*fp32")
    ws = dict(cmax_ptr="*fp32", w_ptr="*fp64", C="i32")
    st = dict(tot_ptr="*fp64", vi_ptr="*fp32", st_ptr="*i64")
    shape = dict(CP=64, CH=fs.CHUNK)
    name = kernel.replace("_nucleus", "").replace("_loop", "")
    fn = getattr(fs, "_" + name if name != "ranked" else "_ranked_kernel")
    warps = fs.ROW_WARPS
    if kernel == "chunk_max":
        sig, c, warps = dict(**lg, cmax_ptr="*fp32", C="i32"), dict(CH=fs.CHUNK), fs.WARPS
        sig.pop("temp_ptr")
    elif kernel == "chunk_sum":
        sig, c, warps = dict(**lg, **ws), shape, fs.WARPS
    elif kernel == "chunk_before":
        sig, c, warps = dict(**lg, **ws, vi_ptr="*fp32", st_ptr="*i64"), shape, fs.WARPS
    elif name == "first_draw":
        sig = dict(**lg, top_p_ptr="*fp64", seed_ptr="*i64", pos_ptr="*i64", out_ptr="*i64", **ws, **st)
        c = dict(NUCLEUS=kernel.endswith("nucleus"), **shape, **h, SALT=smp.POS_SALT, SALT2=smp.FULL_SALT)
    elif name == "next_draw":
        sig = dict(**lg, top_p_ptr="*fp64", out_ptr="*i64", **ws, **st)
        c = dict(MAX_ROUNDS=fs.MAX_ROUNDS, LOOP=kernel.endswith("loop"), **shape, **h, SALT2=smp.FULL_SALT,
                 RSALT=smp.ROUND_SALT)
    else:
        sig = dict(val_ptr="*fp32", order_ptr="*i64", stride="i32", idx_ptr="*i64", temp_ptr="*fp32", k_ptr="*i64",
                   top_p_ptr="*fp64", seed_ptr="*i64", pos_ptr="*i64", out_ptr="*i64")
        c = dict(NUCLEUS=kernel.endswith("nucleus"), BLOCK=fs.BLOCK, **h, SALT=smp.POS_SALT, SALT2=smp.FULL_SALT)
    b = build_offline(fn, sig, c, num_warps=warps, num_stages=1)
    assert b.stack <= 16 and b.regs <= 128, (b.regs, b.stack)
