"""A measured hardware profile: what the cost model prices tasks and kernels with.

Profiles are JSON files in `planner/profiles/` (written by `scripts/profile_hw.py` on the GPU machine), so the
planner runs, and is tested, on a CPU. Curves are piecewise linear in log-space between measured points.
"""
from __future__ import annotations

import bisect
import json
import math
import os
import re
from dataclasses import dataclass, field

_DIR = os.path.join(os.path.dirname(__file__), "profiles")
# The profile the planner prices with unless told otherwise. h200_v27_cal since session 13: fitted on the validation
# rows of commit 1f8638c (v25 attention, the conventional path's shared per-step values and greedy argmax) at contexts
# 512 and 4096, with the conventional attention's per-key floor; out of sample at context 2048 (9641b95, 48 plans):
# segment / step MAPE 7.0% / 6.6%, regret 0 at all 8 points, Spearman >= 0.94 at 7 of 8 (docs/planner.md, session
# 13; h200_v26_cal, the same fit without the floor, 8.7% / 7.4%; h200_v20_cal 25% / 15% with regrets up to 116%:
# it priced the conventional path from before those fixes). h200_v28_cal since session 15: v27_cal with the
# conventional terms refit for the fused RMSNorm (MPK_CONV_FUSE_NORM, default on) on rows of commit 3403612 at
# context 512; out of sample at context 1024: segment / step MAPE 8.7% / 5.8%, max regret 0.09%, Spearman >= 0.94 at
# 5 of 8 points (v27_cal on the same rows: 10.9% / 9.0%). h200_v29_cal since session 16: the conventional terms refit
# again with the fused q/k tail and projections on (default since session 16) on rows at contexts 512 and 4096 (v28
# was fit at 512 only and lost the conventional attention's per-key floor: regret 54% at qwen3-8b B=8 ctx 4096); in
# sample segment / step MAPE 6.3% / 5.2%, regret 0; hold-out by points 13-15% / 9-15%, regret 0. h200_v30_cal since
# session 17: megakernel and conventional terms refit with the session-17 defaults (warp-pipelined and grouped
# attention, fused SiLU) after the validate / bench gap closed (v29_cal over-predicted attn-mk by 25-30%); in sample
# 6.5% / 5.8%, Spearman >= 0.94, regret 0 at 14 points; hold-out 16% / 12-14%, regret 0 (profile's source).
# h200_v31_cal since session 18: the same terms refit on rows of the session-17 defaults only (de4fe7e, ctx 512 and
# 4096); v30_cal out of sample on them 8.0% / 6.7% with regret 12.5% at qwen3-8b B=8; v31_cal in sample 5.7% / 5.5%,
# regret 0 at 14 points; hold-out by context halves 13.7% / 13.2% and 12.8% / 9.1%, regret 0. Out of sample on
# session 19's rows (bca6d81: the split rule, mega3): 6.1% / 5.0% (ctx 512), 7.1% / 6.4% (4096), regret 0 at 14 points.
# h200_v32 since session 19: v31_cal plus the per-flop cost of attention's wide passes (attn_partial@w2 = 0.73 x the
# narrow 1e-05 us/flop, derived from the 1x H200 A/B of 5a47206, not fit): llama-3.2-1b's predicted steps at the
# eight A/B points against the measured wide default: 4.8% mean error (v31_cal's narrow terms on the narrow runs: 5.8%).
# h200_v33_cal since session 19: an attention partial's chain as a per-flop plus a per-key term (key_us_by_kind;
# chosen by a grid refit on session 19's rows, both hold-out halves agreeing): in sample 5.5% / 4.6%, hold-out by
# context 13.0% / 11.6% and 10.9% / 7.6% (megakernel segments 7.0% / 6.3%), regret 0; the eight wide A/B points
# 4.4% mean step error, the narrow ones 3.8% (profile's source).
# h200_v35_cal since session 21: v33_cal plus the conventional attention op's measured curves (conv_attn_us_by_shape,
# scaled per regime), refit on session 20's rows with the wide passes' per-key term on a grid (0.0038 chosen): in
# sample 5.2% / 4.4%; hold-out by context: conventional segments 10.0% / 7.4% (v33: 26.0% / 16.4%), regret 0;
# out of sample on session 21's 16 bench steps 7.9% (v33_cal 7.9%); B=128 ctx 4096 over-predicted 16-17%.
# h200_v36_cal since session 23: v35_cal refit on rows of the lean K/V issue loop and 8-group attention tasks
# (session 23's validate rows; the wide passes' per-key term fell to 0.0005 us on the grid): in sample 5.1% / 5.6%,
# hold-out halves megakernel 6.5% / 6.8%; out of sample on session 23's bench steps 7.0-7.5% (v35_cal 22-28%).
# h200_v38 since session 27: v36_cal (its regime terms unchanged, so the gather path is priced as before) plus the
# paged attention kernel's curves ("<shape>@paged", K / V read from HBM), which price the conventional attention
# whenever it takes that kernel (the default on a GPU). Session 27's rows (B=8,32,128, ctx 512 / 4096): step MAPE
# 7.8%, regret 0 at 10 of 12 points, 6.8% at llama B=8 ctx 4096 (mono, as v36_cal chose; conventional measured
# faster), 0.4% at llama B=128 ctx 512. Refit it chose worse (docs/planner.md session 27).
# h200_v39 since session 28: v38 with the paged curves at scale 1.0 in the B=8 regime (conv_attn_paged_scale; v38
# scaled them by the gather curves' 1.54, fitted on L2-resident curves). On session 27's 70 rows: step MAPE 7.8% ->
# 6.9%, max regret 6.8% -> 0.44% (llama B=8 ctx 4096 conventional); out of sample on session 28's 19 bench steps 5.1%
# -> 4.7%. B >= 32 keep v38's scales (at 1.0 they expose the attention megakernels' over-pricing: regret 18-20%).
# h200_v40 since session 29: v39 plus mk_attn_factor per regime (1.07 / 1.06 / 0.92 / 0.89 at B=1 / 8 / 32 / 128,
# attn-mk's attention-only megakernel segments against their price on session 29's 112 GPU-validated rows) and the
# paged curves at their measured 1.0 at B=1 and 32 too. On those rows (in sample): the same choice at all 16 points
# (max regret 0.85%), step MAPE 6.6% -> 5.4%, segment 9.9% -> 7.4%; on session 27's rows 7.8% -> 7.3%.
# Session 30 validated it on the GPU out of sample (bench/results/s30/run1_val, 112 rows): regret 0 at 15 of 16
# points, 0.26% at qwen3-8b B=8 ctx 4096; step MAPE 5.6% / 5.8% (ctx 512 / 4096).
# h200_v41 since session 30: v40 with llama-3.2-1b's TP=1 paged curve re-measured where paged_shapes.TUNED's
# launch shapes changed (B=32..128 at 2048..8192 keys). On the 112 rows that ran this commit's kernels (s30 run1,
# and run6 for those llama points): same choices, step MAPE 5.79% -> 5.71%, segment 8.23% -> 8.15%.
# h200_v42 since session 33: v41 with the batch-1 / batch-8 regimes refit at an attention partial's fixed cost of
# 7 us there (planner.fit --batches 1,8 --grid fixed.attn_partial=7; the traced tasks take 6-9 us, v41 priced 4): on
# sessions 32-33's 112 rows the same choices, step MAPE 5.4% -> 4.6%, Spearman >= 0.9 at 10 of 16 points (9).
# h200_v43 since session 35: v42 with a Tensor Core linear pass's serial time by its rows (tc_pass_us_by_rows, from
# session 34's traces) at B >= 32, those regimes' whole-layer megakernel scale refit on session 32's rows with the
# attention-only segments' price kept (fit --keep-attn). Out of sample on session 35's 56 rows (B=32 / 128): step
# MAPE 6.4% -> 3.8%, segment 8.1% -> 6.8%, regret 0 at 8 of 8 as v42; choices as v42's wherever compared
# (docs/planner.md).
# h200_v44 since session 38: v43 with a segment boundary priced as measured (-2.9 us: the step's graph overlaps a
# segment's launch with its predecessor's tail; v43 added +1.3) and the whole-layer megakernel scale refit, both in
# the B=1 / 8 regimes. Out of sample on session 38's 28 rows: step MAPE 4.4% -> 2.2%, Spearman >= 0.9 at 4 of 4
# points (v43: 3), regret 0.04%. B >= 32 keeps v43's terms (docs/planner.md session 38).
# h200_v45 since session 39: v44 with the paged attention's curves re-measured as the engine runs it (rows of C + 1
# keys under the power-of-two cap, MPK_PAGED_ROW_KEYS=split, the 1024-key launch shapes) and the boundary in the
# B >= 32 regimes too. Out of sample on session 39's 70 rows (ctx 1024 / 2048): step MAPE 3.2% -> 2.6%, max regret
# 7.0% as v44 (llama-3.2-1b B=8 ctx 2048) (docs/planner.md session 39).
# h200_v46 since session 40: v45 with the paged curves re-measured after MPK_PAGED_APPEND=cache and
# MPK_PAGED_USED_SPLITS=1 became the kernel's defaults, and the B=128 regime's paged curves at their measured scale 1.0
# (v40-v45's 1.377 had priced the register-path appends, gone with cache). Nothing fitted. On session 40's 112 rows
# (ctx 512 / 4096, both models, B=1..128): step MAPE 3.2% -> 2.3%, max regret 5.8% -> 2.6% (docs/planner.md session 40).
# h200_v47 since session 41: v46 with the paged curves re-measured under TUNED's session-41 launch shapes. Nothing
# fitted (docs/planner.md session 41).
# h200_v48 since session 43: v47 with the paged curves re-measured, each point under the page-table type its launch
# shape names (MPK_PAGED_TABLE=auto; scripts/merge_table_curves.py). Nothing fitted (docs/planner.md session 43).
# h200_v49 since session 44: v48 with the paged curves re-measured under session 44's defaults (each launch shape's
# own table type, session 43's new llama shapes). Nothing fitted. On session 44's 65 validation rows (same machine
# start, ctx 512 / 4096): max regret 9.1% (v48, llama B=32 ctx 4096 chose attn-mk) -> 0, step MAPE 2.5% -> 2.2%.
# h200_v50 since session 45: v49 with the paged curves re-measured under session 44's final TUNED (lookup_keys, qwen3-8b's
# 512-key B=8 / 32 shapes; no point stale). Nothing fitted. Out of sample on session 45's 66 rows (ctx 1024 / 2048, same
# machine start): regret 0 at 10 of 10 under both, step MAPE 2.63% either way, segment MAPE 4.40% -> 4.31%.
# h200_v51 since session 47: v50 with regimes 1 / 8's megakernel terms refit on session 47's rows (B=1 / 8, the L2
# prefetch default) and the new mk_mixed_attn_us (a segment holding a layer's attention among other ops). Out of
# sample on sessions 45 / 46's rows (B=8-128): step MAPE 2.63 / 2.33% -> 2.49 / 2.23%, the same choices.
# h200_v52 since session 48: v51 with regimes 32 / 128's megakernel terms refit on session 45's rows with the new
# mk_attn_layer_us (per layer of attention beyond the first in a mixed segment; mk_offset_us and the attention-only
# terms kept). Out of sample on sessions 44 / 46's rows: step MAPE 2.11 / 2.23% -> 1.63 / 1.86%, resolved pairs ordered
# 94.7 / 94.0% -> 98.7 / 98.0%, regret 0, the same choices (docs/planner.md session 48).
# h200_v56 since session 56: v52 with the B=8 regime's megakernel attention partials at 0.9 of their fair streaming
# share. The one megakernel's cost a key at B=8 (H200) is 0.078-0.083 us at every context from 512 to 131072 keys;
# v52 priced 0.064, so mono at 32k / 131k keys came out -11.2% / -15.3% (session 56 run 3) and the planner chose it at
# 131k, where the conventional plan is faster (H100: 12875 against 13205 us measured). Now -5.5% / -7.4% and
# conventional at both; on sessions 44-49's 257 rows the same choices and Spearman, step MAPE 1.79 -> 1.76%, segment
# MAPE 4.53 -> 4.85% (docs/planner.md session 56).
# h200_v57 since session 68: v56 with the paged attention's curves measured past 8193 keys on an H200 and regimes 1 / 8's
# megakernel terms refit with mk_mixed_attn_sim_scale on the H200 rows of sessions 45-57 and 68 (ctx 512-131072). v56
# priced session 68's long-context rows (16k-131k keys, B=1 / 8, every family) with step MAPE 8.1% (the megakernel
# 7-14% low, conventional at B=1 up to +49% high); v57 left one context out: pooled step MAPE 2.2%, max regret 0.3%;
# the same choices as v56 at every book point (both models, ctx 512 / 4096 / 32768, TP 1 and 2; docs/planner.md).
DEFAULT_PROFILE = "h200_v57"
# The profile a planner not handed one (and without MPK_PLANNER_PROFILE) prices with on each card, by the name the
# CUDA device reports; a card not here (and a machine without a GPU: CI, `plan` on a laptop) gets DEFAULT_PROFILE.
# h100_v1 (session 60): this card's stream, latencies, launch, conventional costs and attention curves measured,
# its regimes fitted on its own validation rows (docs/planner.md session 60); h100_v2 (session 61) refitted on its
# rows from 512 to 131072 keys with a mixed segment's attention priced on its own simulated time (leaving one context
# out: max regret 0.9%, where h100_v1 chose plans up to 11.9% slower from 32k keys on); h100_v3 (session 62) is
# h100_v2 with qwen2.5-7b's paged attention curve measured (nothing refitted); h100_v4 (session 62) refitted on
# every H100 row with B=128 to 8192 keys and attention-only segments priced on their own line (fit --terms mkattn).
PROFILE_BY_CARD: dict[str, str] = {"H200": DEFAULT_PROFILE, "H100": "h100_v4"}


def profile_for_card(device_name: str) -> str:
    """The default profile for a CUDA device name ("NVIDIA H100 80GB HBM3" -> PROFILE_BY_CARD["H100"]): the card
    whose key appears in the name (the longest such key, so "GH200" is not taken for "H200" once it has its own)."""
    hits = [k for k in PROFILE_BY_CARD if k in device_name.upper()]
    return PROFILE_BY_CARD[max(hits, key=len)] if hits else DEFAULT_PROFILE


def default_profile_name() -> str:
    """$MPK_PLANNER_PROFILE, else this machine's card's profile (profile_for_card of CUDA device 0's current device),
    else DEFAULT_PROFILE (no GPU, or torch without CUDA)."""
    env = os.environ.get("MPK_PLANNER_PROFILE")
    if env:
        return env
    try:
        import torch
        if torch.cuda.is_available():
            return profile_for_card(torch.cuda.get_device_name(torch.cuda.current_device()))
    except (ImportError, RuntimeError, AssertionError):
        pass
    return DEFAULT_PROFILE


def key_fallbacks(key: str) -> list[str]:
    """A cost key and the keys it falls back to, most specific first: "linear@tc2" -> ["linear@tc2",
    "linear@tc", "linear"]; "linear@tc" -> ["linear@tc", "linear"]; "embed" -> ["embed"]."""
    if "@" not in key:
        return [key]
    kind, path = key.split("@", 1)
    bare = path.rstrip("0123456789")
    return [key] + ([f"{kind}@{bare}"] if bare != path else []) + [kind]


def _by_key(d: dict[str, float], key: str, default: float) -> float:
    """d at the first of key_fallbacks(key) it has, else default."""
    for k in key_fallbacks(key):
        if k in d:
            return d[k]
    return default


def _curve(points: dict[str, float], x: float) -> float:
    """Interpolate a measured curve {x: y} at x (log-log between points, clamped at the ends)."""
    xs = sorted((float(k), float(v)) for k, v in points.items())
    keys = [k for k, _ in xs]
    if x <= keys[0]:
        return xs[0][1]
    if x >= keys[-1]:
        return xs[-1][1]
    i = bisect.bisect_right(keys, x)
    (x0, y0), (x1, y1) = xs[i - 1], xs[i]
    f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))


@dataclass
class HardwareProfile:
    name: str
    num_sms: int
    hbm_bw_by_sms: dict[str, float]
    tc_flops_per_s: float
    sync_us: float
    barrier_us: float
    task_fixed_us: float
    megakernel_launch_us: float
    graph_kernel_gap_us: float
    conv_kernel_us: float
    conv_bw_fraction: float
    remote_signal_us_by_bytes: dict[str, float]
    nccl_graph_allreduce_us_by_bytes: dict[str, float]
    wgmma_m: int = 64
    fp32_flops_per_s: float = 60e12
    task_fixed_us_by_kind: dict[str, float] = field(default_factory=dict)
    stream_eff_by_kind: dict[str, float] = field(default_factory=dict)   # achieved / fair-share streaming rate
    # the paged KV cache's rate by the contiguous bytes an attention task reads of one head before it jumps to the
    # next row (scripts/bench_stream.py --pieces: rate / the contiguous rate): head_dim x 2 of (page, slot, head, D)
    # pages; empty = 1 (every piece streams)
    kv_piece_eff_by_bytes: dict[str, float] = field(default_factory=dict)
    flop_us_by_kind: dict[str, float] = field(default_factory=dict)      # per-flop time not hidden under loads
    # per-key time of an attention partial not hidden under loads (a pass's wait, softmax update, rescale and copy
    # issue per key, beside the per-flop term: llama's 64-wide heads and qwen3-8b's 128-wide ones stream their keys
    # at 2.1 and 3.1 TB/s, which no single per-flop cost fits; docs/planner.md session 19)
    key_us_by_kind: dict[str, float] = field(default_factory=dict)
    conv_fixed_us_by_kind: dict[str, float] = field(default_factory=dict)  # measured fixed cost per conventional op
    # megakernel linear tiles loop over row groups of `row_tile` rows (device_kernels/ops/linear.cuh ROW_TILE):
    # every group re-streams the weight tile (from HBM: `restream_frac` of it); 0 = one pass whatever the batch
    # Megakernel linear cost model (planner/simulate.py): "tc" (default) = the kernel since commit 7cee539: a
    # linear tile of M >= TC_MIN_M rows runs on Tensor Cores (mma.sync) in passes of tc_rows rows
    # (codegen/layout.linear_geometry, as the packer picks them), streaming its weight tile once per pass; below
    # TC_MIN_M rows the CUDA-core path (one pass, flop_us_by_kind["linear"] per flop). qkv_rope heads make
    # ROW_TILE-row passes. "row_tile" = the legacy CUDA-core model (re-stream per `row_tile` rows, per-flop cost
    # at every batch): only when a profile asks for it.
    mk_linear_model: str = "tc"
    mk_tc_eff: float = 1.0                 # mma.sync rate per SM / (tc_flops_per_s / num_sms)
    mk_tc_stream_eff: float = 1.0          # streaming rate of a Tensor Core tile / the CUDA-core tile's
    linear_pass_us: float = 0.0            # per extra pass of a linear / qkv_rope tile (x reload, norm, epilogue)
    # serial time a Tensor Core pass of a linear tile takes beyond its share of the stream and the mma floor, by the
    # pass's rows (tc_rows, as str keys; a missing size: 0): added to the tile's fixed part once per pass, so it is
    # not hidden behind streaming as linear_pass_us (a Tensor Core term) is. Session 34's traces at B=32 / 128 have
    # each pass short by about the same time at both batches for one tile shape, growing with the rows
    # (scripts/tile_prices.py; docs/planner.md session 34)
    tc_pass_us_by_rows: dict[str, float] = field(default_factory=dict)
    # legacy model: linear tiles loop over row groups of `row_tile` rows (the pre-7cee539 linear.cuh) and every
    # group re-streams the weight tile; both models re-stream `restream_frac` of a weight tile per extra pass
    row_tile: int = 0
    restream_frac: float = 1.0
    # calibration of a simulated megakernel segment: measured ~ mk_scale * simulated + mk_offset_us (+ launch)
    mk_scale: float = 1.0
    mk_offset_us: float = 0.0
    # conventional (graph-captured torch) path: matmul Tensor Core efficiency (cuBLAS at M rows vs the wgmma
    # peak), and how many times conventional attention moves the KV bytes (gather, mask, fp32 cast, matmuls)
    conv_tc_eff: float = 1.0
    conv_fixed_scale: float = 1.0          # multiplies the conventional fixed costs (fit.py's calibration)
    conv_attn_kv_passes: float = 1.0
    # ... and at least this long per key it reads (latency-bound at small batch: few rows, one pass over the keys;
    # measured ~30-50 ns per key per layer at B=1-8, session 13). 0 = the bandwidth term alone (older profiles)
    conv_attn_key_us: float = 0.0
    # conventional attention measured whole (scripts/profile_conv_attn.py: the op alone in a CUDA graph, gather +
    # SDPA + its masks, greedy), per shape "n_kv x head_dim x q heads per KV head": [[batch, keys, us], ...] on a
    # grid of batches and key counts. Where a shape has a curve it prices the op (times conv_attn_curve_scale, a
    # calibration fit.py may refit) instead of the fixed + KV-passes + per-key terms above, which one context's rows
    # do not identify (docs/planner.md session 19: cross-context hold-out 18-26% on conventional segments)
    conv_attn_us_by_shape: dict[str, list] = field(default_factory=dict)
    # ... and what the step's first conventional attention adds once (the step's shared pages / masks / live rows)
    conv_attn_step_us_by_shape: dict[str, list] = field(default_factory=dict)
    # ... and the launch shape each "@paged" point was measured under, [[batch, keys, "block_n,target,warps,stages
    # [,ahead],i32|i64"], ...] (runtime/paged_shapes.curve_shapes; since h200_v49): stale_curve_points finds the
    # points whose shape TUNED has since replaced. Empty: not recorded (profiles before v49)
    conv_attn_shape_by_shape: dict[str, list] = field(default_factory=dict)
    conv_attn_curve_scale: float = 1.0
    # ... for the "@paged" curves (runtime/paged_attention.py, measured from HBM by --cycle-mb) apart; None = the same
    # scale. conv_attn_curve_scale was fitted where the gather curves had been measured from one L2-resident copy
    # (1.07-1.77), which over-prices the HBM-measured paged curves (docs/planner.md session 28)
    conv_attn_paged_scale: float | None = None
    # a megakernel segment of attention tasks alone (the attn-mk plans' segments): its price times this factor. One
    # mk_scale per regime cannot fit both these and whole-layer segments: session 29 measured attn-mk's segments at
    # 1.08 / 1.06 / 0.92 / 0.89 of their price (B=1 / 8 / 32 / 128) while mono's were under-priced at B >= 32
    mk_attn_factor: float = 1.0
    # ... and the scale on its simulated makespan (None = mk_scale): a refit that moves mk_scale for whole-layer
    # segments alone (planner.fit --keep-attn, session 35) leaves attention-only segments at their validated price
    mk_attn_scale: float | None = None
    # a megakernel segment that holds a layer's attention among its other ops (mono, megaN, per-layer; not attn-mk's
    # attention-only segments, not attn-conv's o_proj-to-qkv segments): added to its price once. Session 47's
    # validation at B=1 / 8 priced per-layer's one-layer segments ~8.5 us low while attn-conv's segments of the same
    # simulated size priced within 1 us; one mk_offset_us cannot hold both (planner.fit fits the three together).
    mk_mixed_attn_us: float = 0.0
    # ... and per layer of attention beyond the first in such a segment (feature attn_layers): at B >= 32 whole-layer
    # segments of many layers (mono, megaN) measured 4-6% above their price at llama-3.2-1b while one-layer segments
    # (per-layer) priced within 1%, so mono / megaN / per-layer swapped places (session 48, sessions 44-46's rows)
    mk_attn_layer_us: float = 0.0
    # ... and per MB of K / V such a segment's attention layers beyond its first read (cost.kv_beyond_first): on an
    # H100 (session 60) the one megakernel's step grew with the context ~1.5-2.6x faster than its simulation
    # (llama-3.2-1b B=8: 0.120 us a key measured, 0.083 priced) while attn-mk's attention-only segments and
    # per-layer's one-layer segments at the same keys priced within 2%: attention inside a kernel that streams the
    # next layers' weights reads its K / V slower. planner.fit --terms mkkv fits it per regime.
    mk_mixed_kv_us_per_mb: float = 0.0
    # ... and on the simulated makespan of such a segment's attention ops, each simulated alone (feature attn_sim_us):
    # the simulator's attention tasks run slower inside a mixed segment than priced, by a share of their own time.
    # On an H100 (session 61, 512-131072 keys) one-layer and whole-model segments both fell short of their price by
    # ~0.1-0.2 of their attention's simulated time from 8192 keys on, while attention-only segments priced within
    # 2-6%; the per-MB term above, fitted at <= 2048 keys, priced the one megakernel +10..+27% at 65-131k keys.
    # planner.fit --terms mkas fits it per regime.
    mk_mixed_attn_sim_scale: float = 0.0
    # TP > 1: extra cost of each conventional collective (all-reduce, distributed argmax) beyond the NCCL curve:
    # the conventional executor all-gathers fp32 partials and sums them in rank order (copies + NCCL + sum)
    conv_collective_us: float = 0.0
    # a plan's uncertainty band, relative to its predicted step: [lo, hi] such that measured / predicted - 1 fell in
    # [lo, hi] for 90% of validated plans (5th / 95th percentiles, per batch regime via `regimes`; planner/band.py
    # measures it from validation rows the profile was not fit on). The default is the pre-measurement +-12%.
    step_band: tuple = (-0.12, 0.12)
    # a step's price of one boundary between two of its segments, beyond the segments' prices (which are fit to
    # each segment measured alone, its launch and drain paid in full). None = graph_kernel_gap_us (the gap between
    # two kernels of a graph, profile_hw). Measured steps pay less than their segments alone: inside one CUDA graph
    # a segment's launch overlaps its predecessor's tail, -1.4..-3.3 us a boundary on every many-segment plan of
    # sessions 34-38 at every batch (planner.fit.fit_boundary; docs/planner.md session 38)
    segment_boundary_us: float | None = None
    # batch regimes: {"min batch": {field: value}}; for_batch(B) applies the largest key <= B (fit.py writes
    # them: the B=1 kernels and the B>=8 row-group kernels are different code paths with different constants)
    regimes: dict[str, dict] = field(default_factory=dict)
    source: str = ""

    def bw(self, active_sms: int) -> float:
        """Aggregate streaming bandwidth (bytes/s) when `active_sms` SMs stream at once."""
        return _curve(self.hbm_bw_by_sms, max(1, active_sms))

    def per_sm_bw(self, active_sms: int) -> float:
        return self.bw(active_sms) / max(1, active_sms)

    # kind: a task kind, or a simulate.cost_key ("<kind>@tc"), which falls back to its kind when not fitted
    def fixed_us(self, kind: str) -> float:
        return _by_key(self.task_fixed_us_by_kind, kind, self.task_fixed_us)

    def tc_pass_us(self, rows: int) -> float:
        return float(self.tc_pass_us_by_rows.get(str(rows), 0.0))

    def stream_eff(self, kind: str) -> float:
        return _by_key(self.stream_eff_by_kind, kind, 1.0)

    def kv_piece_eff(self, nbytes: int) -> float:
        return _curve(self.kv_piece_eff_by_bytes, nbytes) if self.kv_piece_eff_by_bytes else 1.0

    def flop_us(self, kind: str) -> float:
        return _by_key(self.flop_us_by_kind, kind, 0.0)

    def key_us(self, kind: str) -> float:
        return _by_key(self.key_us_by_kind, kind, 0.0)

    def paged_scale(self) -> float:
        """The scale of the "@paged" curves (conv_attn_paged_scale, else conv_attn_curve_scale)."""
        return self.conv_attn_curve_scale if self.conv_attn_paged_scale is None else self.conv_attn_paged_scale

    def has_conv_attn_curve(self, n_kv: int, head_dim: int, gs: int, impl: str = "") -> bool:
        if impl == "paged":
            return self.paged_stand_in(n_kv, head_dim, gs) is not None
        return conv_attn_shape(n_kv, head_dim, gs, impl) in self.conv_attn_us_by_shape

    def paged_stand_in(self, n_kv: int, head_dim: int, gs: int, keys: float | None = None
                       ) -> tuple[str, float] | None:
        """The measured "@paged" curve that prices this shape's paged attention: its own (factor 1) where measured,
        else one of the same head dim, with the factor n_kv / its KV heads that turns this shape's keys into that
        curve's keys of equal K / V bytes a row (the paged kernel streams K / V; its programs split rows x KV heads
        x keys). Among those: with `keys`, first the curves measured that far (their last point at or past keys x
        factor: past a curve's end the kernel changes its launch shape, so its line does not extend: qwen2.5-7b at
        16384 keys read off the 8193-key end of 4x128x4 priced 1.42x, s62), then the nearest KV heads, then the
        nearest q heads per KV head. Before session 61 a shape without its own curve was priced by the gather
        path's per-key floor: qwen2.5-7b (4 KV heads x 128 x 7) at 16384 keys 496 us a layer against 39 measured.
        None: no curve of that head dim."""
        best = None
        for k, pts in self.conv_attn_us_by_shape.items():
            m = re.fullmatch(r"(\d+)x(\d+)x(\d+)@paged", k)
            if m and int(m.group(2)) == head_dim:
                nk, g = int(m.group(1)), int(m.group(3))
                own = nk == n_kv and g == gs
                short = keys is not None and max(p[1] for p in pts) < keys * n_kv / nk
                rank = (not own, short, abs(math.log(nk / n_kv)), abs(g - gs), -nk)
                if best is None or rank < best[0]:
                    best = (rank, k, n_kv / nk)
        return None if best is None else (best[1], best[2])

    def conv_attn_curve_us(self, n_kv: int, head_dim: int, gs: int, batch: int, keys: float,
                           first: bool = False, impl: str = "") -> float | None:
        """The measured conventional attention op at (batch, keys) for this shape, interpolated, plus (first: the
        step's first conventional attention) its once-per-step part; None: no curve for the shape. impl: the
        implementation the runtime takes ("paged": runtime/paged_attention.py), whose own curve is used where the
        profile has one, else the gather + SDPA curve (measured before it existed)."""
        key = conv_attn_shape(n_kv, head_dim, gs, impl)
        if impl == "paged" and (stand := self.paged_stand_in(n_kv, head_dim, gs, keys)) is not None:
            key, keys = stand[0], keys * stand[1]   # its own curve, or a measured one at equal K / V bytes a row
        elif impl and key not in self.conv_attn_us_by_shape:
            key = conv_attn_shape(n_kv, head_dim, gs)
        pts = self.conv_attn_us_by_shape.get(key)
        if not pts:
            return None
        once = self.conv_attn_step_us_by_shape.get(key) if first else None
        return _grid2(pts, batch, keys) + (_grid2(once, batch, keys) if once else 0.0)

    def remote_signal_us(self, nbytes: int) -> float:
        return _curve(self.remote_signal_us_by_bytes, max(64, nbytes))

    def nccl_allreduce_us(self, nbytes: int) -> float:
        return _curve(self.nccl_graph_allreduce_us_by_bytes, max(8192, nbytes))

    def tc_time_us(self, flops: float, m_rows: int, sms: int = 1) -> float:
        """Tensor Core time for `flops` on `sms` SMs; wgmma computes M=64 rows, so M < 64 wastes the rest."""
        eff = min(1.0, max(1, m_rows) / self.wgmma_m)
        return flops / (self.tc_flops_per_s * sms / self.num_sms * eff) * 1e6

    @property
    def boundary_us(self) -> float:
        """What one segment boundary adds to a step beyond its segments' prices (segment_boundary_us)."""
        return self.graph_kernel_gap_us if self.segment_boundary_us is None else self.segment_boundary_us

    def for_batch(self, batch: int) -> "HardwareProfile":
        """This profile with the overrides of the batch regime that `batch` falls in (itself if none)."""
        keys = sorted((int(k) for k in self.regimes if int(k) <= batch), reverse=True)
        if not keys:
            return self
        from dataclasses import replace
        over = {k: v for k, v in self.regimes[str(keys[0])].items() if k in self.__dataclass_fields__}
        merged = {}
        for k, v in over.items():   # dict-valued fields: per-key override, the rest inherited
            base = getattr(self, k)
            merged[k] = {**base, **v} if isinstance(base, dict) and isinstance(v, dict) else v
        return replace(self, regimes={}, **merged)

    @classmethod
    def load(cls, name_or_path: str | None = None) -> "HardwareProfile":
        # MPK_PLANNER_PROFILE: a profile (name or JSON path) for every planner that is not handed one (the engine's,
        # the benchmarks'), e.g. one measured on this machine by scripts/profile_hw.py; without it, the card's own
        # (PROFILE_BY_CARD)
        # (a name from the environment says so: `plan --search` without --profile named a profile the user never
        # typed, with nothing pointing at the variable to fix or unset)
        env = "" if name_or_path or not os.environ.get("MPK_PLANNER_PROFILE") else \
            " (set by MPK_PLANNER_PROFILE: fix or unset it)"
        name_or_path = name_or_path or default_profile_name()
        path = name_or_path if os.path.exists(name_or_path) else os.path.join(_DIR, f"{name_or_path}.json")
        if not os.path.exists(path):
            known = sorted(f[:-5] for f in os.listdir(_DIR) if f.endswith(".json"))
            cards = ", ".join(f"{c}: {n}" for c, n in sorted(PROFILE_BY_CARD.items()))
            raise FileNotFoundError(f"no hardware profile {name_or_path!r}{env}; known: {known} (by card: {cards}), "
                                    "or a JSON path written by scripts/profile_hw.py")
        try:   # a file that is not a profile (bad JSON, a list, fields missing, a directory): one clear error
            with open(path) as f:
                d = json.load(f)
            out = cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
            _check_fields(d)
            return out
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"hardware profile {name_or_path!r}{env} could not be read as a profile ({e}); pass a "
                             "profile name (e.g. h100_v4) or a JSON file written by scripts/profile_hw.py") from None

    def to_json(self) -> str:
        from dataclasses import asdict
        return json.dumps(asdict(self), indent=1)


def _field_problem(name: str, kind: str, v) -> str | None:
    """What is wrong with a profile's field `name` of annotation `kind` holding JSON value v, or None."""
    def num(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    def keyed(x) -> bool:   # a curve's keys are its x values (_curve: float(k))
        try:
            return math.isfinite(float(x))
        except ValueError:
            return False
    if kind == "str":
        ok = isinstance(v, str)
    elif kind == "int":
        ok = num(v) and v == int(v)
    elif kind in ("float", "float | None"):
        ok = num(v) or (v is None and kind != "float")
    elif kind == "tuple":   # step_band: [lo, hi]
        ok = isinstance(v, (list, tuple)) and len(v) == 2 and all(num(x) for x in v) and v[0] <= v[1]
    elif kind.startswith("dict"):
        ok = isinstance(v, dict)
        if ok and kind == "dict[str, float]":
            ok = all(num(x) for x in v.values()) and (not name.endswith(("_by_sms", "_by_bytes"))
                                                      or all(keyed(k) for k in v))
        elif ok and kind == "dict[str, list]":   # [[batch, keys, us or a launch shape], ...]
            ok = all(isinstance(pts, list) and pts and all(isinstance(q, list) and len(q) == 3 and num(q[0])
                                                           and num(q[1]) for q in pts) for pts in v.values())
        elif ok and kind == "dict[str, dict]":
            ok = all(isinstance(x, dict) for x in v.values())
    else:
        return None
    return None if ok else f"{name} is {json.dumps(v)[:60]}, expected {kind}"


# Rates and efficiencies the cost model divides by (a bandwidth, a flop rate, a share of either): 0 stopped the search
# with a ZeroDivisionError traceback, a negative bandwidth curve with "math domain error" or a simulation that never
# ended (session 76's review)
_POSITIVE = ("tc_flops_per_s", "fp32_flops_per_s", "mk_tc_eff", "mk_tc_stream_eff", "conv_bw_fraction", "conv_tc_eff",
             "wgmma_m")
_POSITIVE_CURVES = ("hbm_bw_by_sms", "stream_eff_by_kind", "kv_piece_eff_by_bytes")


def _rate_problems(d: dict) -> list[str]:
    """The rates in d (a profile's fields or one regime's overrides) that are numbers but not > 0."""
    def bad(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and not x > 0
    out = [f"{k} is {d[k]}, not > 0 (a rate the cost model divides by)" for k in _POSITIVE if bad(d.get(k))]
    for k in _POSITIVE_CURVES:
        if isinstance(d.get(k), dict) and (zero := [x for x, v in d[k].items() if bad(v)]):
            out.append(f"{k}[{zero[0]!r}] is {d[k][zero[0]]}, not > 0 (a rate the cost model divides by)")
    return out


def _check_fields(d: dict) -> None:
    """A profile file's fields are of their types, its curves not empty, its regimes keyed by batch: a hand-edited or
    foreign JSON that constructs a HardwareProfile but holds e.g. a number where a curve belongs, null for a cost or
    0 SMs otherwise loaded and failed deep in the search with a bare TypeError / IndexError traceback."""
    fields = HardwareProfile.__dataclass_fields__
    problems = [w for k, v in d.items() if k in fields and (w := _field_problem(k, fields[k].type, v))]
    if isinstance(d.get("num_sms"), int) and d["num_sms"] < 1:
        problems.append(f"num_sms is {d['num_sms']}, not >= 1")
    problems += _rate_problems(d)
    for k in ("hbm_bw_by_sms", "remote_signal_us_by_bytes", "nccl_graph_allreduce_us_by_bytes"):
        if d.get(k) == {}:
            problems.append(f"{k} is empty (a measured curve, at least one point)")
    for b, over in (d.get("regimes") or {}).items() if isinstance(d.get("regimes"), dict) else ():
        if not (isinstance(b, str) and b.isdigit()):
            problems.append(f"regimes key {b!r} is not a batch size")
        if isinstance(over, dict):
            problems += [f"regimes[{b!r}]: {w}" for k, v in over.items()
                         if k in fields and (w := _field_problem(k, fields[k].type, v))]
            problems += [f"regimes[{b!r}]: {w}" for w in _rate_problems(over)]
    if problems:
        raise ValueError("; ".join(problems[:4]) + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""))


def card_mismatch(profile_name: str, device_name: str) -> str | None:
    """A warning when the GPU is not the card a profile was measured on (the profile's name starts with it: "h200_v56"
    is an H200's), else None. The planner's prices are that card's. h200_v56's choices held on an H100 at the two
    models it was fitted on (sessions 54-60), its times not (step MAPE 12-16%: the H100 streams 3.20 TB/s against the
    H200's 4.55), and at qwen2.5-7b B=8 its choice cost 8.4% there (session 60): hence the H100's own (h100_v1, v2)."""
    m = re.match(r"([a-z]\d{2,4})(_|\.json$|$)", os.path.basename(profile_name).lower())
    card = m.group(1).upper() if m else ""   # a name that does not start with a card says nothing about it
    if not card or card in device_name.upper():
        return None
    return (f"planning with profile {profile_name} (measured on an {card}) on {device_name}: the plans' predicted times "
            f"are the {card}'s; measure this card's profile (scripts/gpu_pending.sh mode card, docs/planner.md "
            "session 60) and set MPK_PLANNER_PROFILE, or add it to PROFILE_BY_CARD, to plan with its own prices")


def conv_attn_shape(n_kv: int, head_dim: int, gs: int, impl: str = "") -> str:
    """conv_attn_us_by_shape's key: KV heads of a rank, head dim, q heads per KV head (and "@<impl>" for another
    implementation than the gather + SDPA one: "paged", runtime/paged_attention.py)."""
    return f"{n_kv}x{head_dim}x{gs}" + (f"@{impl}" if impl else "")


def _interp1(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys) (xs ascending), extended linearly past both ends (one point: constant)."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1 = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


def _grid2(pts: list, batch: float, keys: float) -> float:
    """[[batch, keys, us], ...] on a (batch x keys) grid: linear in keys within each measured batch, then linear in
    batch between them (both extended linearly past the grid: the op's time is close to affine in each); >= 0."""
    rows: dict[float, dict[float, list[float]]] = {}
    for b, k, us in pts:   # (a point measured twice: the mean)
        rows.setdefault(float(b), {}).setdefault(float(k), []).append(float(us))
    bs = sorted(rows)
    at_b = []
    for b in bs:
        ks = sorted(rows[b])
        at_b.append(_interp1(ks, [sum(rows[b][k]) / len(rows[b][k]) for k in ks], keys))
    return max(0.0, _interp1(bs, at_b, batch))
