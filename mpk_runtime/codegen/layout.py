"""The host/device contract of the megakernel, defined once here and emitted into `mpk_generated.h`.

Everything the kernel and the packer must agree on lives in this module: opcodes (from `tasks.ops.OPCODES`),
the task record (a fixed row of int64 words: a header, then per-opcode argument slots), the kernel parameter
block, the status block written on a timeout, and compile-time specialisation constants. Pointers travel as
int64 device addresses; floats as their fp32 bit pattern in the low 32 bits of a word.
"""
from __future__ import annotations

import os

from ..ir.sampling import SAMPLE_CANDIDATES
from ..tasks.ops import OPCODES

# --- task record: TASK_WORDS int64 per task ------------------------------------------------------------------
# next_task: the task that follows on the same SM (the list wraps to its first task for the next step): while a
# task's op runs, the kernel copies the next record into shared memory (cp.async), so a task starts with its
# record, waits and signal words at hand and no global round trip but the counter poll.
# stage: weight rows the kernel copies into shared memory (one TMA bulk copy per weight range) before it waits on the
# task's events (pack_stage; 0 = none): a batch-1 tile's SM would otherwise idle through the wait (up to ~15 us before
# o_proj while attention runs on a few SMs) and then stream every byte after it.
TASK_HEADER = ["opcode", "task_id", "wait_begin", "wait_end", "sig_begin", "sig_end", "next_task", "stage"]
ARG_BASE = 8                      # header words reserved (room to grow)
ARG_END = 32                      # up to 24 argument words
# The first INLINE_WAITS waits of a task (packed, pack_wait) and its first INLINE_SIGNALS signal words, copied
# into the record; 0 = none. The kernel reads the rest from the wait / signal tables: [begin + inlined, end).
INLINE_WAITS = 2
INLINE_SIGNALS = 2
T_INLINE_WAIT = ARG_END
T_INLINE_SIG = ARG_END + INLINE_WAITS
TASK_WORDS = ARG_END + INLINE_WAITS + INLINE_SIGNALS   # 36 words = 288 bytes = 18 16-byte cp.async pieces

# Argument slots per opcode (index = ARG_BASE + position). Shapes in comments; ptr = device address.
OP_ARGS: dict[str, list[str]] = {
    # out (M, H) = table[clamp(tokens, 0, rows - 1)] (rows: the table's; tasks/ops/embed.py says why)
    "embed": ["tokens", "table", "out", "m", "h", "rows"],
    # part of a head: x (M, K) -> norm -> W rows head*D + [r0, r0+nr) and head*D + D/2 + [r0, r0+nr) (w = row
    # head*D) -> [q/k norm: nr == D/2] -> rope (pairs r0..r0+nr-1) -> q or paged cache
    # which "raw" (a normed head's part): only the bf16 projection rows, to q = qk_raw (row stride ldq) at the
    # head's column block, no norm / rope
    # bias: the head's (D,) bf16 bias (Qwen2), added to the rounded product before norm / rope; 0 = none
    "qkv_rope": ["x", "norm", "w", "head_norm", "q", "ldq", "cache", "which", "head", "m", "k", "d", "eps",
                 "n_kv", "r0", "nr", "kslices", "bias"],
    # whole normed heads of qk_raw: q heads [qh0, qh0+nqh) (raw column block qh)
    # and k heads [kh0, kh0+nkh) (block nq + kh) -> q-/k-norm -> rope -> q or the paged k cache
    "qk_norm_rope": ["raw", "ldraw", "q_norm", "k_norm", "q", "ldq", "cache", "m", "d", "eps", "n_kv", "nq", "qh0",
                     "nqh", "kh0", "nkh"],
    # part (M, nq, S, D) fp32, lse (M, nq, S) fp32 for q heads [g*gs, g*gs+gs) of sequence b, split s
    # folded merge (Tiling.attn_fold_merge): ticket = the group's int64 ticket counter (0 = not folded), out = the
    # group's merged output (as attn_merge's); direct = 1: one split and folded, so the chunk is the group's output:
    # written as the merge of one chunk would write it, without part / lse, the ticket and the merge's reloads;
    # ng: KV groups g .. g + ng - 1 of sequence b in one task (ng > 1 only with direct: Tiling.attn_groups);
    # wide: 16-key tiles per warp and pass (1 or 2; tasks/tiling.py attn_wide); kv_new (0 = off), ldkv: the step's
    # k / v rows (M, 2 n_kv D), row stride ldkv, that the last chunk's partial appends to the cache (ir/defer.py);
    # q_norm != 0 (Tiling.attn_qk_norm; the packer then needs a -DMPK_ATT_QKNORM=1 build): q is qk_raw
    # (M, (nq + n_kv) D), its q heads normed (q_norm) and rotated into shared memory by the partial, and the last
    # chunk's k heads (k_norm) into the cache at the new position
    "attn_partial": ["q", "k_cache", "v_cache", "part", "lse", "b", "g", "split", "splits", "gs", "d", "nq", "n_kv",
                     "scale", "out", "ticket", "direct", "ng", "wide", "kv_new", "ldkv", "q_norm", "k_norm", "eps"],
    "attn_merge": ["part", "lse", "out", "b", "g", "gs", "d", "nq", "splits"],
    # y[:, n0:n1] = epilogue(norm?(x) @ W[r0+n0 : r0+n1].T) (+ residual); out_kind: OUT_BF16 | OUT_F32 | OUT_PUSH;
    # kslices: Tensor Core warp k-slices per n-tile (0 = auto from the tile width; tasks/ops/linear.py k_slices)
    # tc_rows: rows per Tensor Core pass (bits 0-7; 0 = CUDA cores) | x chunks << 8 (pack_tc_rows: tiles whose whole
    # input rows do not fit hold K / chunks columns at a time, layout.linear_tile; 0 or 1 = whole rows)
    "linear": ["x", "w0", "w1", "norm", "residual", "out", "m_in", "k", "n0", "n1", "n", "m", "eps", "epilogue",
               "out_kind", "row_off", "row_stride", "peers", "npeers", "par_stride", "slot", "kseg", "tc_rows", "kslices"],
    # out[:, n0:n1] = residual + sum_r part[parity][r]
    # ll: the partials are (fp32, step flag) words, polled until the flags equal the step (device build MPK_AR_LL=1)
    "allreduce": ["part", "par_stride", "residual", "out", "world", "m", "n", "n0", "n1", "ll"],
    # sampler (ir/sampling.py): part (2, W * S, B, SAMPLE_C, 2) fp32 candidates (S vocabulary slices per rank;
    # a partial covers nslices slices of v logits each, rows [b0, b0 + nb) of b, row stride ld; a reduce rows
    # [b0, b0 + nb)); temp/top_k/top_p/seed: (B,) params
    "argmax_partial": ["logits", "b", "v", "ld", "nslices", "vocab0", "peers", "npeers", "par_stride", "slot", "temp",
                       "b0", "nb"],
    "argmax_reduce": ["part", "par_stride", "out", "tokens", "world", "b", "temp", "top_k", "top_p", "seed", "b0",
                      "nb"],
    # n (address, bytes) weight ranges to prefetch into L2 (tasks/ops/prefetch.py PREFETCH_RANGES)
    "weight_prefetch": ["n"] + [f"{w}{i}" for i in range(11) for w in ("p", "b")],
}
EPILOGUES = ["none", "silu_mul"]
OUT_KINDS = ["bf16", "f32", "push", "push_ll"]   # push_ll: (fp32, step flag) words (build_graph allreduce_ll)
WHICH = ["q", "k", "v", "raw"]

# --- waits: WAIT_WORDS int64 per wait; signals: one int64 counter address each ---------------------------------
WAIT_FIELDS = ["event", "triggers", "lag", "scope"]   # scope: 0 = gpu, 1 = sys (a peer rank signals the event)
# A signal word is a counter address; bit SIGNAL_REMOTE_BIT set = a peer rank's counter (an nvshmem_ptr address
# on the symmetric heap): the kernel then fences at system scope and releases at system scope.
SIGNAL_REMOTE_BIT = 1
# A wait packed in one word for the record (never 0: triggers >= 1): event (bits 0-31), triggers (32-55),
# lag (56-61), scope (62).
PW_TRIGGERS_SHIFT, PW_LAG_SHIFT, PW_SCOPE_SHIFT = 32, 56, 62
# The stage word: rows (bits 0-23) staged from the start of each of the task's weight ranges (linear: w0 / w1 rows
# [n0, n0 + rows); qkv_rope: the part's two row ranges), at byte offset (bits 24-47) of the dynamic shared memory,
# range j at offset + j * rows * K * 2.
STAGE_OFF_SHIFT = 24


def pack_wait(event: int, triggers: int, lag: int, scope: int) -> int:
    if not (0 <= event < 1 << 32 and 1 <= triggers < 1 << 24 and 0 <= lag < 64 and scope in (0, 1)):
        raise ValueError(f"wait (event {event}, triggers {triggers}, lag {lag}, scope {scope}) does not fit the "
                         "packed record word (event < 2^32, 1 <= triggers < 2^24, 0 <= lag < 64)")
    return event | triggers << PW_TRIGGERS_SHIFT | lag << PW_LAG_SHIFT | scope << PW_SCOPE_SHIFT


def pack_stage(rows: int, offset: int) -> int:
    if rows == 0:
        return 0
    if not (0 < rows < 1 << 24 and 0 <= offset < 1 << 24 and offset % 128 == 0):
        raise ValueError(f"stage (rows {rows}, offset {offset}) does not fit the stage word (offset 128-aligned)")
    return rows | offset << STAGE_OFF_SHIFT


def unpack_stage(word: int) -> tuple[int, int]:
    return word & 0xFFFFFF, (word >> STAGE_OFF_SHIFT) & 0xFFFFFF


def unpack_wait(word: int) -> tuple[int, int, int, int]:
    return (word & 0xFFFFFFFF, (word >> PW_TRIGGERS_SHIFT) & 0xFFFFFF, (word >> PW_LAG_SHIFT) & 63,
            (word >> PW_SCOPE_SHIFT) & 1)

STAGE_AUTO = -1


def _env_kb(name: str, default: str, most: int = 227, what: str = "") -> int:
    """$name in KiB (unset or empty: default) as bytes, 0..most. what = "" : shared memory per CTA, where 'auto' is
    STAGE_AUTO; otherwise what the kilobytes are of (no 'auto')."""
    v = (os.environ.get(name) or "").strip() or default
    if v == "auto" and not what:
        return STAGE_AUTO
    try:
        kb = int(v)
    except ValueError:
        took = "kilobytes" if what else "'auto' or kilobytes of shared memory"
        raise ValueError(f"{name}={v!r}: expected {took} as an integer (0 = off)") from None
    if not 0 <= kb <= most:
        raise ValueError(f"{name}={kb}: expected 0-{most} KiB of {what} (0 = off)" if what else
                         f"{name}={kb}: shared memory per CTA is at most {most} KB (0 = off)")
    return kb * 1024


# --- kernel parameter block (int64 words, device resident) -----------------------------------------------------
PARAMS = ["tasks", "sm_offsets", "sm_tasks", "waits", "signals", "counters", "status", "trace", "trace_steps",
          "pos", "block_tables", "max_pages", "page_size", "inv_freq", "timeout_ns", "num_tasks", "batch",
          "num_sms", "prefetch"]

# --- weight prefetch table: PF_WORDS int64 per task: up to two (device address, bytes) weight ranges ---------
# Weights never depend on events, so an SM pulls the next task's weight bytes into L2 (cp.async.bulk.prefetch)
# before it spins on that task's events: HBM keeps streaming across dependency waits.
PF_WORDS = 4

# --- status block written by the first SM whose wait times out (int64 words) ------------------------------------
STATUS = ["flag", "sm", "task", "event", "counter", "needed", "step", "elapsed_ns"]
STATUS_OK, STATUS_TIMEOUT = 0, 1

# --- specialisation constants (part of the cache key) ----------------------------------------------------------
CONSTANTS = {
    "THREADS": 256,        # threads per CTA (8 warps); one CTA per SM (512 spills at 128 regs)
    "ROW_TILE": 8,         # rows (sequences) per pass of a CUDA-core linear tile; batch > 8 loops over row groups
    "TC_MIN_M": 3,         # rows from which linear tiles use Tensor Cores (mma.sync m16n8k16, bf16 -> fp32)
    "MAX_PASS_ROWS": 32,   # rows per Tensor Core pass at most (weights stream once per pass)
    "UNROLL": 8,           # 16-byte weight loads in flight per lane per column (batch <= 2)
    "MAX_GS": 8,           # q heads per KV group handled by one attention task
    "ATT_MAX_QH": 32,      # q heads of one attention task (its ng KV groups x gs; the q area of its shared memory)
    "MAX_HEAD_DIM": 128,
    "ATT_KP": 128,         # attention: keys per pass (K/V rows of a pass in shared memory, double-buffered)
    "ATT_MAX_PAGES": 1024,  # attention: page-table entries fetched with the position (longer tables: per key)
    "SAMPLE_C": SAMPLE_CANDIDATES,   # sampling candidates per rank / after the merge (= the largest device top_k)
    # sampled rows: a vocabulary slice of at most this many logits is copied into shared memory once (as order
    # keys) and its top-C selected there; longer slices are selected from global memory (5 passes over them)
    "SAMPLE_STAGE": 16384,
    # ... among at most this many candidates (the keys >= the C-th largest of the per-thread maxima; more, from
    # heavy ties: the radix select over the staged keys)
    "SAMPLE_CAP": 1024,
    # L2 weight prefetch before a task's waits (thread 0, cp.async.bulk.prefetch.L2, no registers held): 64 KiB by
    # default since session 46 (ABBA at B=1 ctx 512: qwen3-8b 4.89 -> 4.80 ms, -1.8%; llama-3.2-1b within +-0.4%;
    # qwen3-8b's B=8 megakernel -0.5%; session 2's 256 KiB + next-task form was 10-17% slower on an older kernel).
    # $MPK_PF_CUR_KB sets it (0 = off; gpu_pending.sh ab variants pf0 / pf32 / pf128).
    "PF_CUR": _env_kb("MPK_PF_CUR_KB", "64", 4096, "a task's weights"),   # bytes of a task's weights pulled into L2 before waiting on its events
    "PF_NEXT": 0,           # bytes of the following task's weights pulled into L2 at the same time
    "PF_DIST": 0,           # linear: L2-prefetch the weight rows this many warp passes ahead (0 = off)
}


def stage_smem() -> int:
    """Weight staging (TASK_HEADER "stage"), a packer setting, not a build constant (the kernel reads the stage word
    only): chosen CUDA-core linear / qkv_rope tiles get the first weight rows that fit below this many bytes of
    dynamic shared memory copied in while they wait on their events (STAGE_AUTO: the shared memory the graph needs
    anyway; 0 = off; runtime/packer.py TaskPacker; $MPK_STAGE_KB: auto | KB, read when a packer is made). Off by
    default: measured neutral to slower (docs/perf-notes.md v22)."""
    return _env_kb("MPK_STAGE_KB", "0")


def stage_cap() -> int:
    """Bytes of a task's weights staged at most, all its ranges together ($MPK_STAGE_CAP_KB, 0 = no cap): a cap of
    one warp pass (64 KiB at 8 warps x 2 columns x 4 KiB rows) stages the first round of every warp and no more."""
    return _env_kb("MPK_STAGE_CAP_KB", "0", 4096, "a task's staged weights")

KERNEL_NAME = "mpk_megakernel"


def cc_xrows(M: int) -> int:
    """x rows a CUDA-core linear / qkv_rope tile keeps in shared memory (linear.cuh cc_xrows): its M rows below
    the Tensor Core batch (so a batch-1 tile leaves the rest to staged weights), else ROW_TILE per pass."""
    return M if M < CONSTANTS["TC_MIN_M"] else CONSTANTS["ROW_TILE"]


SMEM_PER_CTA = 227 * 1024   # an H100 / H200 CTA's shared memory (sharedMemPerBlockOptin): static + dynamic
# the megakernel's static shared memory (1.9 KB in session 20's builds; runtime/megakernel.py checks the build's
# own number): what the dynamic part may not use. 227 KB of dynamic memory alone fails cuFuncSetAttribute.
STATIC_SMEM_RESERVE = 4 * 1024
ATT_SMEM_MAX = SMEM_PER_CTA - STATIC_SMEM_RESERVE   # an attention task's dynamic shared memory, at most


def att_smem_bytes(D: int, C: dict | None = None, ng: int = 1, stages: int = 2, wide: int = 1) -> int:
    """Shared memory of an attn_partial task with head dim D (device_kernels/ops/attention.cuh layout): q (bf16,
    ATT_MAX_QH x MAX_HEAD_DIM), the page table (s64, ATT_MAX_PAGES), then `stages` (MPK_ATT_STAGES, 2 by default)
    buffers of wide x ATT_KP K rows and as many of V rows (bf16, both padded to D + 8); a task of ng > 1 groups
    merges all but its last group in a region after them (fp32 outputs, maxima and sums of every warp:
    NW x MAX_GS x (D + 2))."""
    C = C or CONSTANTS
    head = C["ATT_MAX_QH"] * C["MAX_HEAD_DIM"] * 2 + C["ATT_MAX_PAGES"] * 8
    merge = (C["THREADS"] // 32) * C["MAX_GS"] * (D + 2) * 4 if ng > 1 else 0
    return head + stages * 2 * wide * C["ATT_KP"] * (D + 8) * 2 + merge

# --- linear tile geometry (device_kernels/ops/linear.cuh): the packer (runtime/packer.py) and the planner's
# simulator (planner/simulate.py) both call linear_geometry, so the rows per pass are defined once ------------
SMEM_BUDGET = 200 * 1024   # a linear tile's shared memory when choosing its Tensor Core rows per pass


def tc_kslices(ntn: int, nw: int, R: int, kslices: int = 0, cap: int = 0) -> int:
    """Warp k-slices wk of each unit of a Tensor Core linear tile (device_kernels/ops/linear.cuh tc_kslices: the
    same rule, keep them equal). A tile of ntn 16-column n-tiles has ntn units (one weight) or 2 ntn (two: gate's
    n-tiles, then up's), one (weight, n-tile) each, run by the nwarps warps as wk k-slices per unit.
    kslices 1 (tp_invariant graphs): 1. Auto (0): one weight: the largest power of two with wk * ntn <= nwarps;
    two weights: the smallest power of two wk <= min(nwarps, R) (R: 32-wide k rounds per K segment, so no slice
    is empty) minimising the makespan ceil(2 ntn wk / nwarps) / wk (in units), among those whose 2 ntn wk
    partial blocks fit `cap` blocks (0 = no limit; qkv_rope's linear_tc_rows8 passes 16)."""
    nwarps = CONSTANTS["THREADS"] // 32
    wk = 1
    if kslices != 0:
        return wk
    if nw == 1:
        while wk * 2 * ntn <= nwarps:
            wk *= 2
        return wk
    units = 2 * ntn
    best = -(-units // nwarps) * nwarps   # makespan x nwarps (an integer: wk divides nwarps)
    c = 2
    while c <= nwarps and c <= R and (cap == 0 or units * c <= cap):
        span = -(-(units * c) // nwarps) * (nwarps // c)
        if span < best:
            best, wk = span, c
        c *= 2
    return wk


def pack_tc_rows(rows: int, chunks: int) -> int:
    """The linear record's tc_rows word: rows per pass (bits 0-7), x chunks (bits 8-15; linear_tile)."""
    assert 0 <= rows < 256 and 1 <= chunks < 256, (rows, chunks)
    return rows | (chunks << 8 if chunks > 1 else 0)


def linear_geometry(M: int, K: int, w: int, nw: int, kseg: int, norm: bool = False) -> tuple[int, int]:
    """(tc_rows, shared bytes) of a linear tile: linear_tile without its x chunks."""
    return linear_tile(M, K, w, nw, kseg, norm)[:2]


def linear_tile(M: int, K: int, w: int, nw: int, kseg: int, norm: bool = False) -> tuple[int, int, int]:
    """(tc_rows, shared bytes, x chunks) of a linear tile. x chunks > 1 where the whole input rows fit no layout (the
    CUDA-core fallback over a CTA's shared memory: K past ~14k at 8 rows, an MLP down projection of llama-3.1-8b,
    qwen3-14b, qwen2.5-7b): the Tensor Core tile then holds K / chunks columns of its rows at a time (op_linear_tc
    loads chunk c, reduces it into the fp32 result, loads the next), streaming each weight row once as before.
    Only without K segments (kseg 1) and without a norm of the input (`norm`: RMSNorm needs whole rows); chunks
    divide K into 32-wide rounds; the fewest that fit."""
    rows, need = _tile_geometry(M, K, w, nw, kseg)
    if rows or M < CONSTANTS["TC_MIN_M"] or kseg != 1 or norm or need <= ATT_SMEM_MAX:
        return rows, need, 1
    for chunks in range(2, K // 32 + 1):
        if K % (32 * chunks) == 0:
            r, n = _tile_geometry(M, K // chunks, w, nw, 1)
            if r:
                return r, n, chunks
    return rows, need, 1


def _tile_geometry(M: int, K: int, w: int, nw: int, kseg: int) -> tuple[int, int]:
    """(tc_rows, shared bytes) of a linear tile holding its whole input rows: M rows, K inputs, w output columns, nw
    weights, kseg K segments, as linear.cuh lays it out: xs (xrows, ldx) bf16, the fp32 result tile(s) (rows, w), then (Tensor
    Cores) the k-slice partials `red` in blocks of (16, mt8 * 8) fp32, one per (unit, k-slice) pair: one weight
    8 (ntn * wk <= 8); two weights 2 ntn wk with wk = tc_kslices(ntn, 2, R) (auto: the kslices = 1 of tp_invariant
    graphs uses none), at least 16 (v18's two-weight loop, replaced in v20: kept so tile geometries stay). Tensor
    Cores from TC_MIN_M rows when K splits into 32-wide rounds per segment; rows per pass 32, 16 or 8, the largest
    that fits SMEM_BUDGET (weights stream once per pass). tc_rows 0 = the CUDA-core path (ROW_TILE rows per
    pass). Pure: no CUDA, no torch."""
    C = CONSTANTS
    cuda_core = ((cc_xrows(M) * K * 2 + 15) & ~15) + C["ROW_TILE"] * w * 4 * nw
    if M < C["TC_MIN_M"] or K % (32 * kseg):
        return 0, cuda_core
    if nw == 1:
        blocks = 8
    else:
        ntn = -(-w // 16)
        wk = tc_kslices(ntn, 2, K // kseg // 32)
        blocks = max(16, 2 * ntn * wk if wk > 1 else 0)
    for rows in (32, 16, 8):
        if rows > C["MAX_PASS_ROWS"] or (rows > 8 and rows // 2 >= M):
            continue
        need = ((rows * (K + 8) * 2 + 15) & ~15) + 2 * rows * w * 4 + blocks * 16 * rows * 4
        if need <= SMEM_BUDGET:
            return rows, need
    return 0, cuda_core


def qkv_rope_smem(M: int, K: int) -> int:
    """Shared bytes of a qkv_rope task of M rows and K inputs (qkv_rope.cuh): xs (cc_xrows rows of K bf16), the two
    fp32 result tiles (ROW_TILE x MAX_HEAD_DIM together at most), the Tensor Core k-slice partials of two weights."""
    C = CONSTANTS
    return ((cc_xrows(M) * K * 2 + 15) & ~15) + C["ROW_TILE"] * C["MAX_HEAD_DIM"] * 4 + 2 * 8 * 16 * 8 * 4


def linear_passes(M: int, K: int, w: int, nw: int, kseg: int) -> tuple[int, int]:
    """(rows per pass, passes) of a linear tile: the kernel streams its weight tile once per pass
    (op_linear_tc: passes of tc_rows rows; op_linear: passes of ROW_TILE rows)."""
    rows = linear_geometry(M, K, w, nw, kseg)[0] or CONSTANTS["ROW_TILE"]
    return rows, max(1, -(-M // rows))


def arg_index(op: str, name: str) -> int:
    return ARG_BASE + OP_ARGS[op].index(name)


def check_layout() -> None:
    assert len(TASK_HEADER) <= ARG_BASE
    for op, args in OP_ARGS.items():
        assert op in OPCODES, op
        assert ARG_BASE + len(args) <= ARG_END, (op, len(args))
    assert TASK_WORDS * 8 % 16 == 0   # the kernel copies records in 16-byte pieces
    assert set(OP_ARGS) == set(OPCODES), set(OPCODES) ^ set(OP_ARGS)


check_layout()
