"""The paged attention kernel's launch shapes (runtime/paged_attention.py runs them): the shape type, the shapes
measured per point (TUNED) and the lookup a step makes (config_for, lookup_keys, $MPK_PAGED_SHAPE), the page-table
type each shape reads (MPK_PAGED_TABLE), and the record of the shape a planner-profile curve point ran under
(shape_label, curve_shapes, stale_curve_points: profile.conv_attn_shape_by_shape)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ..envflags import env_choice

BLOCK_N = 64       # keys a program reads per step (4 pages of 16)
TARGET_PROGRAMS = 264   # ~2 programs an SM on an H200: key splits are added until the grid reaches this
NUM_WARPS, NUM_STAGES = 4, 3


@dataclass(frozen=True)
class PagedAttnConfig:
    """The kernel's launch shape: keys per loop step, the grid the key splits fill, warps, cp.async stages."""
    block_n: int = BLOCK_N
    target_programs: int = TARGET_PROGRAMS
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES
    # the page indices loaded a block ahead by hand: without it the pipeliner keeps two K / V buffers whatever
    # num_stages says (offline sm_90 build: stages 3-4 take stage 2's shared memory); with it, num_stages buffers
    # (session 27; session 30's sweep ranked it first at three of qwen3-8b's points, but the step got slower with it
    # there; TUNED takes it where the step measured it faster, sessions 41-44)
    idx_ahead: bool = False
    # which keys a program walks (ROW_KEYS): "cap" = its split of the key cap, "stop" = that, up to its row's last
    # block, "split" = its split of the row's own keys; None = row_keys() (MPK_PAGED_ROW_KEYS)
    row_keys: str | None = None
    # the page tables' type this shape's build reads ("i32" / "i64"; None = "i32"): Triton builds the kernel per
    # pointer type and the two binaries hold different registers, so the type is part of the launch shape
    # (MPK_PAGED_TABLE=auto, the default; session 43's curves: int32 -21% at llama B=8 4097 keys and -15% at qwen3-8b
    # B=128 513 keys, +17..+25% at qwen3-8b TP=2 B=32 2049-4097 keys, where int64's build holds 5 CTAs an SM to 4)
    table: str | None = None


TABLES = ("i64", "i32")


def table_choice() -> str:
    """MPK_PAGED_TABLE: "auto" (the default since session 43) = the type the launch shape names
    (PagedAttnConfig.table, int32 where it names none); "i32" / "i64" = that type at every point (A/Bs)."""
    return env_choice("MPK_PAGED_TABLE", ("auto",) + TABLES, "auto")


def table_dtype(config: PagedAttnConfig) -> torch.dtype:
    """The page tables' dtype a launch of `config` reads: MPK_PAGED_TABLE's, else the shape's own (int32 where it
    names none). The conventional step converts its int64 tables once a step (conventional_ops._paged_tables; ~2 us).
    Measured (session 43, 1x H200, bench/results/s43/tab): llama-3.2-1b B=8 ctx 4096's conventional step 1620 -> 1501
    us with int32 (the op 32.8 -> 25.9 us a layer); the same page indices either way, so the same bits."""
    t = table_choice()
    if t == "auto":
        t = config.table or "i32"
    return torch.int32 if t == "i32" else torch.int64


def table_dtype_for(D: int, B: int, nkv: int, L: int) -> torch.dtype:
    """table_dtype of config_for's shape at this point (head dim D, B rows of nkv KV heads, key cap L)."""
    return table_dtype(config_for(D, B, nkv, L))


def shape_label(config: PagedAttnConfig) -> str:
    """A launch shape as $MPK_PAGED_SHAPE writes it, with the page-table type a launch of it reads now
    (table_dtype): "block_n,target_programs,warps,stages[,ahead],i32|i64"."""
    t = "i32" if table_dtype(config) == torch.int32 else "i64"
    return ",".join([str(config.block_n), str(config.target_programs), str(config.num_warps),
                     str(config.num_stages)] + (["ahead"] if config.idx_ahead else []) + [t])


def parse_curve_key(key: str) -> tuple[int, int, int] | None:
    """(KV heads, head dim, q heads per KV head) of a planner profile's "@paged" curve key
    (planner.profile.conv_attn_shape, e.g. "8x64x4@paged"); None for another implementation's or a variant's."""
    base, _, impl = key.partition("@")
    parts = base.split("x")
    if impl != "paged" or len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1]), int(parts[2])


def curve_shapes(curves: dict[str, list], cap_of) -> dict[str, list]:
    """{curve key: [[batch, keys, shape_label], ...]}: the launch shape config_for picks now at each point of a
    profile's "@paged" curves ({key: [[batch, keys, us], ...]}), under the key cap cap_of(keys) the measurement
    used (scripts/profile_conv_attn.py: the engine's power of two). What the profile records beside the curves
    (HardwareProfile.conv_attn_shape_by_shape), so a curve measured under a shape TUNED has since replaced is found."""
    out = {}
    for key, pts in curves.items():
        shp = parse_curve_key(key)
        if shp is None:
            continue
        nkv, D, _ = shp
        out[key] = [[b, k, shape_label(config_for(D, int(b), nkv, cap_of(int(k))))] for b, k, *_ in pts]
    return out


def stale_curve_points(recorded: dict[str, list], cap_of) -> list[tuple]:
    """The points of `recorded` ({curve key: [[batch, keys, shape_label], ...]}, as curve_shapes writes it) where
    config_for now picks another launch shape: [(key, batch, keys, recorded label, current label), ...]. A curve
    point measured under a replaced shape prices the old kernel (session 44: h200_v48's llama B=32 4097-key point,
    86.1 us a layer priced against 72.8 under its new shape, cost a 9.1% regret); re-measure the curves
    (scripts/gpu_run.sh cattn) after changing TUNED."""
    now = curve_shapes({k: [[b, n, 0.0] for b, n, _ in pts] for k, pts in recorded.items()}, cap_of)
    stale = []
    for key, pts in recorded.items():
        for (b, n, was), (_, _, cur) in zip(pts, now.get(key, [])):
            if was != cur:
                stale.append((key, b, n, was, cur))
    return stale


DEFAULT_CONFIG = PagedAttnConfig()

# The launch shape at each measured point (head dim, programs without splits = batch x KV heads, keys), from
# scripts/bench_paged_attention.py on an H200, K / V read from HBM, then checked in the whole decode step.
# The 512- and 4096-key points: session 41's sweep (bench/results/s41/sweep; sessions 27 / 30 had swept them under the
# register appends, whose per-block selects made other shapes win), checked in the whole conventional step at llama
# B=32 / 128 ctx 512 / 4096 and qwen3-8b B=32 / 128 ctx 4096 (s41 pshl, pshq, psh5: one run a shape). The sweep's
# shape won the step at 4 of those 6 points; at the other two the step's winner is taken (commented there). Session 42
# (bench/results/s42/pshape, ABAB where a shape was adopted or a disagreement settled): llama B=32 ctx 4096 keeps
# (128, 264, 4, 1) (2496 / 2521 us against the sweep's 2892 / 2924); llama B=8 ctx 4096 keeps its shape (1618 / 1634
# against the session-40 shape's 1677 / 1677); qwen3-8b B=128 ctx 512 keeps its shape (8939 against 9456 and 8952);
# qwen3-8b B=32 ctx 512 takes (32, 528, 4, 2) (6047 / 6029 against the sweep's 6188 / 6187, -2.4%). The B=8 points at
# ctx 512: session 43 (llama) and 44 (qwen3-8b, int32). Sessions 42-44's ctx-512 B=32 shapes ran in the default step
# only from session 44 on (lookup_keys).
# Kernel-alone sweeps do not always rank shapes within ~10% the way the step does (docs/perf-notes.md sessions 30, 41).
# Head dim 64, 256 programs at 1024 keys (session 39, bench/results/s39/psh_l): the step's key cap at ctx 1024 is 1025,
# which the 512-key shape ran as 5 splits of 2 blocks, the 5th holding one key; the 4096-key shape's 3 splits of 3
# blocks took llama-3.2-1b B=32 ctx 1024's conventional step 1883 / 1886 -> 1668 / 1648 us (ABAB, one process each).
# Head dim 128 at 256 programs, 1024 keys (s39 psh_q): the 4096-key shape, qwen3-8b B=32 ctx 1024 7961 / 7955 ->
# 7019 / 7018 us. At 1024 programs it lost (B=128: 12423 / 12510 -> 14014 / 14041), so no point there.
# table (session 43): int32 page tables where the paged curves measured them no slower than int64 (every head-dim-64
# point; qwen3-8b B=32 / 128 at 512 keys: -2.9% / -15% on the op), int64 at head dim 128's other points (int32 +1..+2%
# at TP=1, and TP=2 qwen3-8b B=32, 128 programs, takes the nearest of these: +6..+25% with int32; cattn / cattn32).
TUNED = {
    # keyed (head dim, B x KV heads, context): a step at context C runs under the engine's cap, the power of two above
    # C + 1, which config_for looks up at its shortest row (lookup_keys: ctx 512's cap 1024 -> 513 keys)
    (64, 256, 1024): PagedAttnConfig(128, 528, 4, 1), (128, 256, 1024): PagedAttnConfig(64, 528, 4, 2, table="i64"),
    # the op alone, us a layer: session 40's shape -> this one
    (64, 64, 512): PagedAttnConfig(128, 528, 4, 1),     # s43: the step 1270 us under (128, 528, 8, 1), this 1254
    (64, 64, 4096): PagedAttnConfig(128, 528, 4, 2),                    # 37.5 -> 27.6
    # s43 (int32 tables, llama-3.2-1b B=32 ctx 512): the step 1477 / 1477 us under (128, 528, 4, 1) (the 1024-key
    # point's, which ctx 512 read until session 44's lookup_keys), this 1440 / 1437
    (64, 256, 512): PagedAttnConfig(64, 528, 4, 2),
    (64, 256, 4096): PagedAttnConfig(128, 264, 4, 3),   # s43 (int32): the op 89.2 -> 79.1 us, the step 2504 -> 2352
    (64, 1024, 512): PagedAttnConfig(32, 264, 4, 3, idx_ahead=True),    # 48.7 -> 42.3
    (64, 1024, 4096): PagedAttnConfig(128, 528, 4, 4),                  # 311.1 -> 273.6
    # s44 (step ABAB, qwen3-8b B=8 ctx 512): 5564 / 5593 us under (128, 528, 8, 1, i64), this 5454 / 5460
    (128, 64, 512): PagedAttnConfig(64, 264, 4, 3, idx_ahead=True),
    (128, 64, 4096): PagedAttnConfig(64, 528, 4, 2, table="i64"),       # 49.9 -> 43.2
    # s44 (step ABAB, qwen3-8b B=32 ctx 512): 6126 / 6121 us under (64, 528, 4, 2, i64) (the 1024-key point's, which
    # ctx 512 read until session 44's lookup_keys), this 5967 / 5932
    (128, 256, 512): PagedAttnConfig(32, 264, 4, 3, idx_ahead=True),
    (128, 256, 4096): PagedAttnConfig(32, 264, 4, 3, idx_ahead=True, table="i64"),  # 157.6 -> 134.7
    (128, 1024, 512): PagedAttnConfig(64, 528, 4, 2),                   # 86.6 -> 74.7
    # kept: the sweep's (64, 264, 4, 3) 505.6 us, step 25923 us, this 23913
    (128, 1024, 4096): PagedAttnConfig(64, 2112, 4, 2, table="i64"),
    # Not measured at their own point: what these points ran before lookup_keys (session 44), kept so that change
    # moves only the ctx-512 points measured above. 128 programs at ctx 512 (qwen3-8b B=16, TP=2 B=32): the 1024-key
    # point's shape (int64: at TP=2 B=32 513 keys 17.25 us a layer against int32's 18.25, s43 cattn / cattn32);
    # 64 and 1024 programs at ctx 1024 (cap 2048): the 4096-key points' shapes.
    (128, 128, 512): PagedAttnConfig(64, 528, 4, 2, table="i64"),
    (64, 64, 1024): PagedAttnConfig(128, 528, 4, 2), (64, 1024, 1024): PagedAttnConfig(128, 528, 4, 4),
    (128, 64, 1024): PagedAttnConfig(64, 528, 4, 2, table="i64"),
    (128, 1024, 1024): PagedAttnConfig(64, 2112, 4, 2, table="i64"),
    # 8192 keys (a cap of 16384, ctx 8192): what these points ran before session 56's long-key points (the 4096-key
    # points' shapes; the profiles' 8193-key curve points were measured under them), kept so the 16384-key entries
    # below start at their own caps
    (64, 64, 8192): PagedAttnConfig(128, 528, 4, 2), (64, 256, 8192): PagedAttnConfig(128, 264, 4, 3),
    (64, 1024, 8192): PagedAttnConfig(128, 528, 4, 4),
    (128, 64, 8192): PagedAttnConfig(64, 528, 4, 2, table="i64"),
    (128, 256, 8192): PagedAttnConfig(32, 264, 4, 3, idx_ahead=True, table="i64"),
    (128, 1024, 8192): PagedAttnConfig(64, 2112, 4, 2, table="i64"),
    # Long contexts (session 56; bench/results/s56). Until then every cap past 8192 keys took the 4096-key shapes.
    # llama B=8 (int32 tables, as the step reads them), the op alone in us a layer on an H200: 32k keys 181.0 under
    # (64, 264, 4, 3, ahead) -> 145.9; 131k 697.1 -> 542.7 (87% of 4.55 TB/s). On an H100 with int64 tables the same
    # shapes were 6% / 3% behind (64, 264, 4, 3, ahead) (208.7 / 776.9 against 196.1 / 754.4 us): the card
    # decides. The 16k point is the 32k point's shape (H100 int64: 111.4 against the best 104.9).
    (64, 64, 16384): PagedAttnConfig(128, 1056, 4, 3),
    (64, 64, 32768): PagedAttnConfig(128, 1056, 4, 3),
    (64, 64, 131072): PagedAttnConfig(128, 2112, 4, 3),
    # measured on the H100 alone (int64 tables), us a layer: llama B=32 the old shape -> this one; qwen3-8b the
    # kernel's DEFAULT_CONFIG -> this one (the 4096-key points' int64 shapes were not in the sweep's set)
    (64, 256, 16384): PagedAttnConfig(32, 264, 4, 3, idx_ahead=True),    # llama B=32: 390.2 -> 379.9
    (64, 256, 32768): PagedAttnConfig(32, 264, 4, 3, idx_ahead=True),    # 768.4 -> 747.4
    (64, 256, 131072): PagedAttnConfig(32, 264, 4, 4, idx_ahead=True),   # 3021.9 -> 2957.2
    # qwen3-8b B=8 (session 57, the H200's best at 16k / 32k / 40k keys, int64 tables): the op 153.9 / 295.4 / 363.8 ->
    # 138.1 / 259.2 / 321.9 us a layer (the H100's shapes above it were 10-12% behind on the H200; on the H100 this
    # one is 3.2% / 2.5% behind them: 196.5 / 377.8 against 190.4 / 368.5); the step (1x H200, ABAB): ctx 16384
    # 10.25 -> 9.68 ms, 32768 15.30 -> 14.07 (gpt-fast 14.26 on the same machine), 40000 17.36 -> 15.96
    (128, 64, 16384): PagedAttnConfig(64, 528, 4, 2, table="i64"),
    (128, 64, 32768): PagedAttnConfig(64, 528, 4, 2, table="i64"),
    (128, 64, 131072): PagedAttnConfig(64, 1056, 4, 4, table="i64"),     # 1465.5 -> 1439.5
    (128, 256, 16384): PagedAttnConfig(32, 1056, 4, 4, table="i64"),     # qwen3-8b B=32: 881.9 -> 721.1
    (128, 256, 32768): PagedAttnConfig(64, 528, 4, 3, table="i64"),      # 1742.3 -> 1425.0
    (128, 256, 131072): PagedAttnConfig(128, 528, 4, 3, table="i64"),    # 6871.3 -> 5648.8
}


def forced_config() -> PagedAttnConfig | None:
    """$MPK_PAGED_SHAPE = "block_n,target_programs,warps,stages[,ahead][,i32|i64]": one launch shape for every call,
    in place of TUNED's, so a shape the kernel-alone sweep proposes can be A/B'd in the whole decode step (session 30:
    the sweep and the step ranked qwen3-8b's read-ahead shapes oppositely); the last field its page tables' type
    (int32 where unnamed, as PagedAttnConfig.table). Unset or empty: None (TUNED decides)."""
    v = os.environ.get("MPK_PAGED_SHAPE", "").strip()
    if not v:
        return None
    parts = [p.strip() for p in v.split(",")]
    table = parts.pop() if len(parts) > 4 and parts[-1] in TABLES else None
    ahead = len(parts) == 5 and parts[4] == "ahead"
    ok = (len(parts) == 4 or ahead) and all(p.isdigit() for p in parts[:4])
    if ok:
        bn, tgt, w, st = map(int, parts[:4])
        ok = bn in (16, 32, 64, 128) and 1 <= tgt <= 65536 and w in (1, 2, 4, 8, 16) and 1 <= st <= 6
    if not ok:
        raise ValueError(f"MPK_PAGED_SHAPE={v!r}: expected block_n,target_programs,warps,stages[,ahead][,i32|i64] "
                         "with block_n 16/32/64/128, warps 1-16 (a power of two), stages 1-6, e.g. 32,264,4,3,ahead "
                         "or 64,528,4,2,i64; unset it for the tuned shapes")
    return PagedAttnConfig(bn, tgt, w, st, idx_ahead=ahead, table=table)


def lookup_keys(L: int) -> int:
    """The keys at which TUNED is looked up for a key cap L. TUNED's points are keyed by the context each was
    measured at (a step at context C reads C + 1 keys), and since session 39 a step runs under the engine's cap, the
    power of two above (runtime/megakernel_plans.kv_cap): a cap of 2^n holds rows of 2^(n-1) + 1 .. 2^n keys. Such a
    cap is looked up at its shortest row, 2^(n-1) + 1 (ctx 512 -> cap 1024 -> 513: the 512-key point, where sessions
    42-44 measured the ctx-512 shapes; looked up at the cap itself, the 1024-key point answered there, and three of
    those shapes were never run by default: docs/perf-notes.md session 44). Any other L (a tight cap) as is."""
    return L // 2 + 1 if L >= 2 and L & (L - 1) == 0 else L


def config_for(D: int, B: int, nkv: int, L: int) -> PagedAttnConfig:
    """The launch shape for head dim D, B rows of nkv KV heads, key cap L: $MPK_PAGED_SHAPE's if set, else TUNED's
    nearest measured point of this head dim (distance in log2 of programs and of lookup_keys(L)), DEFAULT_CONFIG for
    a head dim never measured."""
    forced = forced_config()
    if forced is not None:
        return forced
    pts = [k for k in TUNED if k[0] == D]
    if not pts:
        return DEFAULT_CONFIG
    lp, lk = math.log2(max(1, B * nkv)), math.log2(max(1, lookup_keys(L)))
    return TUNED[min(pts, key=lambda k: (math.log2(k[1]) - lp) ** 2 + (math.log2(k[2]) - lk) ** 2)]
