"""Decode attention straight from the paged KV cache, in Triton (split-K "flash decoding"), for the conventional
path's attention op: no gather of the pages into a dense copy and no mask tensor.

The conventional attention (conventional_ops.attention) gathers each sequence's pages with index_select (K and V
written once more, then read again) and calls SDPA with an additive mask, which rules out the flash kernels. Here one
program owns (sequence, KV head, key split): it loads the g query heads of its KV head once, walks its keys in blocks
of BLOCK_N through the block table (K and V rows read once, straight from their pages), and keeps an online softmax in
fp32, the probabilities rounded to the cache dtype for the P.V product as SDPA does on bf16. With one split it writes
the output; with more, a second kernel merges the splits' (o, max, sum) in split order. Keys at or past a row's length
(pos + 1) are never loaded, so unwritten (even NaN-poisoned) slots cannot leak in; inactive rows (pos < 0) get zeros.
Which keys a program walks is `MPK_PAGED_ROW_KEYS`. The splits are sized from the key cap, which is the longest
row's, and a serving step's cap is the power of two above it (runtime/megakernel_plans.kv_cap), so rows can be half
the cap short. `split` (the default since session 39) divides each row's own keys evenly among the splits: a short
row's programs get short too. `cap` (the default before) walks each program's split of the cap, masked past its
row's length (no loads there, but the dot products, the exponentials and the loop's latency); `stop` is that up to
the row's last block (the same output as cap bit for bit: a skipped block adds exactly nothing). split's partition
differs from cap's, so its sums round differently, within the kernel's tolerance. Measured on an H200 (session 39,
bench/results/s39/rs_l, llama-3.2-1b ctx 1024, the conventional step under the engine's cap 2048): cap 1899 / 1896
us at B=32, 3847 / 3816 at B=128; stop 1652 / 3027; split 1657, 1632 / 2988, 2961; under the tight cap 1025: 1635 /
2988. So split costs a serving step what the tight cap does.

The splits themselves are sized from the cap too, so at small batch (many splits of one block) a row half the cap
long leaves half of them empty, and the merge still reads every split: session 39's curves under the power-of-two
cap (bench/results/s39/cattn) put llama-3.2-1b B=1 at 8193 keys at 31.7 us (19.1 at a cap of 8192) and B=8 at 2049
keys at 25.3 (17.7). `MPK_PAGED_USED_SPLITS=1` (the default since session 40; 0 = the old merge) merges only
the splits that hold the row's keys (each split's span as the partial computes it) and has the empty ones store
nothing: the same output bit for bit (an empty split's weight is exactly zero and its max -inf). Measured on an H200
(session 40, bench/results/s40/used, A/B twice): llama-3.2-1b B=1 8193 keys 32.0 / 32.1 -> 23.9 / 24.3 us a layer,
B=1 2049 keys 11.4 -> 10.2, B=8 2049 keys 25.4 -> 24.1 / 24.5; qwen3-8b unchanged within 1%; the conventional step
at llama B=8 ctx 2048 1501 / 1512 -> 1478 / 1476 us (-2%).

An offline sm_90 build (triton.compile with the divisibility the JIT gives 16-aligned strides and pointers) has
the K / V loads as cp.async (LDGSTS) pipelined over 3 stages, no spills at 4 warps: 96-128 registers and 21-35 KB
of shared memory at head dim 64, 134-181 and 39-70 KB at 128. A loop count fixed at compile time had been unrolled
(255 registers and spills at head dim 128), so the count of key blocks is a run-time argument.

With deferred appends (ir/defer.py: a conventional qkv_rope leaves the step's k / v rows in kv_new) the program whose
keys hold a row's new position writes them into the cache, and every program takes key pos from the rows in
registers, so no program reads a slot another writes this step: the two indexed-put kernels a layer are gone. That
substitution is a select over every K and V block (and keeps the blocks off the dot operands' shared-memory path:
+60 registers, ~+28% instructions at head dim 128 in the sm_90 build). `MPK_PAGED_APPEND=cache` (the default since
session 40; `regs` = the substitution) has the owning program read the row back from the cache after a CTA barrier
instead, as any key (only the owner's keys hold pos): the same bits, the no-append kernel's loop. Measured on an
H200 (session 40, bench/results/s40/app, A/B twice): the op with appends, us a layer, qwen3-8b B=128 2049 keys
374.7 / 374.1 (regs) -> 274.9 / 275.7 (cache; 270.4 / 271.0 without appends), 4097 keys 706 / 702 -> 519 / 518,
llama-3.2-1b B=128 2049 keys 188.4 / 189.4 -> 163.0 / 163.7; the conventional step at qwen3-8b ctx 2048 B=128
19034 / 19020 -> 15735 / 15696 us (-17.4%), B=32 8711 / 8697 -> 8130 / 8142 (-6.6%).

`MPK_PAGED_GRID=head` (opt-in, session 40, not yet GPU-measured) launches the same programs with the KV head as the
fastest index, so a row's programs of one split read its pages together. `MPK_PAGED_HEADS=group` (opt-in, session
40, not yet GPU-measured) gives a program 4 adjacent KV heads (head_group), their 16 q heads as q's rows and each
step's keys x heads as the tile's rows, other heads' scores masked: the same dots and work a key, one page lookup
and one contiguous run of bytes a slot for the group (docs/perf-notes.md session 40: head dim 64 reaches 58-76% of
HBM, head dim 128 74-92%).

The default on a GPU since session 27 (MPK_CONV_TRITON_ATTN=0 takes the gather + SDPA path): measured on an H200 in
the planner's conventional plans, it makes them the fastest plan at B = 8-32, 512 keys (llama-3.2-1b B=32 1.617 ->
1.458 ms a token, qwen3-8b B=8 6.350 -> 5.530; bench/results/s27). CPU tests run it under the Triton interpreter.
"""
from __future__ import annotations

import torch

from ..envflags import env_choice, env_flag
from ..ir.defer import conv_attn_appends, paged_head_dim

from .paged_kernels import _merge_kernel, _partial_kernel, _split_blocks  # noqa: F401  (the tests build them)
# the launch shapes (their table, lookup and page-table types) live in paged_shapes; their names are this module's too
from .paged_shapes import (BLOCK_N, DEFAULT_CONFIG, NUM_STAGES, NUM_WARPS, TABLES, TARGET_PROGRAMS,  # noqa: F401
                           TUNED, PagedAttnConfig, config_for, curve_shapes, forced_config, lookup_keys,
                           parse_curve_key, shape_label, stale_curve_points, table_choice, table_dtype,
                           table_dtype_for)
from .triton_support import runs_on, triton

ROW_KEYS = ("cap", "stop", "split")


def row_keys() -> str:
    """MPK_PAGED_ROW_KEYS: split (default), cap or stop (the module docstring)."""
    return env_choice("MPK_PAGED_ROW_KEYS", ROW_KEYS, "split")


def used_splits() -> bool:
    """MPK_PAGED_USED_SPLITS: 1 (the default since session 40) = the merge reads only the splits that hold keys of its
    row, and a split past its row's length stores nothing; 0 = every split stored and merged (the module docstring)."""
    return env_flag("MPK_PAGED_USED_SPLITS", default=True)


def append_cache() -> bool:
    """MPK_PAGED_APPEND: with deferred appends, "cache" (the default since session 40) = the program owning a row's new
    key writes it into the cache, then a barrier, then reads it back like any key; "regs" = every block substitutes it
    from registers (two selects over each K / V block, which also keep the blocks out of the dot operands'
    shared-memory path: +17-37% on the op at B=128; the module docstring)."""
    return env_choice("MPK_PAGED_APPEND", ("regs", "cache"), "cache") == "cache"


GRIDS = ("row", "head")


def grid_order() -> str:
    """MPK_PAGED_GRID: which program index runs fastest in the launch order. "row" (the default) = the batch row, so
    the programs the GPU starts together read different rows' pages; "head" (opt-in, session 40, not yet
    GPU-measured) = the KV head, so a row's NKV programs of one split start together and read the same pages at the
    same time (a page holds every head's keys: at head dim 64 a program reads 128 of each slot's 1024 bytes). The
    same programs either way, so the same bits."""
    return env_choice("MPK_PAGED_GRID", GRIDS, "row")


HEADS = ("one", "group", "all")


def heads_mode() -> str:
    """MPK_PAGED_HEADS: KV heads a program takes. "one" (the default); "group" (opt-in, session 40, not yet
    GPU-measured) = as many adjacent KV heads as fill 16 q rows (4 at 4 q heads a KV head), their keys as the tile's
    rows with other heads' scores masked: the same dots and work a key, a slot's bytes for the group read as one
    run, one page lookup for the group, and 1 / HG of the programs; "all" = every KV head of the row (up to 64 q
    rows: a whole slot's bytes contiguous, at twice the dot and exponential work a key where the q rows pass 16;
    head_group; docs/perf-notes.md session 40)."""
    return env_choice("MPK_PAGED_HEADS", HEADS, "one")


def head_group(G: int, nkv: int, register_appends: bool = False, heads: str | None = None) -> int:
    """KV heads a program takes (HG) under `heads` (None: MPK_PAGED_HEADS): 1 under "one", or with appends
    substituted from registers (MPK_PAGED_APPEND=regs: that path takes one head's row); else the largest power of two
    dividing nkv whose q rows (G each) fit 16 ("group") or 64 ("all")."""
    mode = heads or heads_mode()
    if mode == "one" or register_appends:
        return 1
    rows = 16 if mode == "group" else 64
    hg = 1
    while 2 * hg * G <= rows and nkv % (2 * hg) == 0:
        hg *= 2
    return hg


supports_head_dim = paged_head_dim   # head dims the kernel takes (defined beside the switch, for the planner too)


def enabled(q: torch.Tensor, T: int, D: int) -> bool:
    """Whether the conventional attention of this step takes this kernel: the switch (ir/defer.conv_attn_appends: on
    by default where Triton is installed), decode (one token a sequence), a head dim it supports (others, e.g. 80
    or 96, take the gather + SDPA path, which appends the deferred rows itself), a CUDA tensor (or the
    interpreter's CPU one)."""
    return T == 1 and supports_head_dim(D) and conv_attn_appends() and runs_on(q)


def splits_for(B: int, nkv: int, L: int, block_n: int = BLOCK_N, target: int = TARGET_PROGRAMS) -> int:
    """Key splits: enough programs to fill the GPU (`target` of them), at least one block_n block of keys each."""
    blocks = max(1, -(-L // block_n))
    return max(1, min(blocks, -(-target // max(1, B * nkv))))


def launch_shape(B: int, nq: int, nkv: int, L: int, config: PagedAttnConfig, register_appends: bool = False,
                 heads: str | None = None) -> tuple[int, int, int, int]:
    """(HG, GP, BN, S) of a launch: KV heads a program (head_group, under `heads` or MPK_PAGED_HEADS), q rows padded
    for the dot (>= 16), keys a loop step (the config's tile rows over HG heads) and key splits (splits_for over
    B x nkv / HG programs)."""
    G = nq // nkv
    HG = head_group(G, nkv, register_appends, heads)
    BN = max(1, config.block_n // HG)
    return HG, max(16, 1 << (G * HG - 1).bit_length()), BN, splits_for(B, nkv // HG, L, BN, config.target_programs)


# torch.compile (MPK_CONV_COMPILE=1 compiles whole conventional segments) does not trace into it: a graph break at
# the attention, and the kernel launched as it is eagerly (under TRITON_INTERPRET=1 dynamo would trace the interpreter)
@torch.compiler.disable
def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, pos: torch.Tensor, scale: float, L_cap: int,
                           out: torch.Tensor, splits: int | None = None,
                           kv_new: torch.Tensor | None = None,
                           config: PagedAttnConfig | None = None) -> torch.Tensor:
    """out (B, nq * D) = softmax(q k^T * scale) v over each row's keys [0, pos + 1), read from the pages
    (k_cache / v_cache (pages, page_size, nkv, D), block_tables (B, >= ceil(L_cap / page_size))); q (B, nq * D);
    L_cap >= every row's pos + 1 (a static bound: the grid and loop sizes, so a CUDA graph can hold them).
    block_tables int64 or int32, read as given (each type is its own build; MPK_PAGED_TABLE is applied by the caller,
    conventional_ops._paged_tables, which converts once a step).
    kv_new (B, 2 * nkv * D): the step's k and v rows, not yet in the cache (ir/defer.py): appended at pos here and
    used for key pos (inactive rows, pos < 0, append nothing). config: the launch shape (default config_for's)."""
    if triton is None:
        raise RuntimeError("paged_decode_attention needs Triton (it comes with CUDA builds of torch)")
    P, PS, nkv, D = k_cache.shape
    B = pos.numel()
    nq = q.shape[-1] // D
    if q.shape != (B, nq * D) or nq % nkv or out.shape != (B, nq * D):
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)}, out {tuple(out.shape)} for {B} rows of "
                         f"{nq} heads x {D}")
    if not supports_head_dim(D):
        raise ValueError(f"paged_decode_attention: head dim {D} must be a power of two >= 16")
    if not (q.is_contiguous() and out.is_contiguous() and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1):
        raise ValueError("paged_decode_attention: q, out and the caches' rows must be contiguous")
    if kv_new is not None and (kv_new.shape != (B, 2 * nkv * D) or not kv_new.is_contiguous()):
        raise ValueError(f"paged_decode_attention: kv_new {tuple(kv_new.shape)}, expected ({B}, {2 * nkv * D})")
    G = nq // nkv
    used, acache = used_splits(), append_cache()
    config = config or config_for(D, B, nkv, L_cap)
    HG, GP, BN, S = launch_shape(B, nq, nkv, L_cap, config, register_appends=kv_new is not None and not acache)
    S = splits or S
    per = -(-L_cap // S)
    NB = -(-per // BN)
    if S == 1:
        o, ml, s_ob, s_oh, s_os = out, out, out.stride(0), D, 0
    else:
        o = torch.empty(B, nq, S, D, dtype=torch.float32, device=q.device)
        ml = torch.empty(B, nq, S, 2, dtype=torch.float32, device=q.device)
        s_ob, s_oh, s_os = o.stride(0), o.stride(1), o.stride(2)
    new = q if kv_new is None else kv_new
    rk = ROW_KEYS.index(config.row_keys or row_keys())
    head_major = grid_order() == "head"
    grid = (nkv // HG, B, S) if head_major else (B, nkv // HG, S)
    _partial_kernel[grid](q, k_cache, v_cache, block_tables, pos, o, ml, new, scale,
                          q.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                          v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
                          s_ob, s_oh, s_os, new.stride(0), NB, G=G, GP=GP, D=D, PS=PS, BLOCK=BN,
                          MULTI=S > 1, NKV=nkv, APPEND=kv_new is not None, IDX_AHEAD=config.idx_ahead,
                          ROW_KEYS=rk, USED=used, APPEND_CACHE=acache and kv_new is not None,
                          HEAD_MAJOR=head_major, HG=HG, num_warps=config.num_warps, num_stages=config.num_stages)
    if S > 1:
        _merge_kernel[(B, nq)](o, ml, out, pos, s_ob, s_oh, s_os, out.stride(0), S, NB, D=D, BLOCK=BN, ROW_KEYS=rk,
                               USED=used)
    return out
