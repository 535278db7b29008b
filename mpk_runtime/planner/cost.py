"""Cost of plan segments: megakernel segments by simulating their schedule, conventional ones op by op.

Conventional ops are priced as the torch kernels `runtime/conventional_ops.py` / `torch_exec.py` launch for them,
captured in one CUDA graph (PlanExecutor.capture): per op a fixed cost (measured per kernel sequence,
`conv_fixed_us_by_kind`, else kernels x `conv_kernel_us`), plus the larger of its bytes at the full-GPU streaming
bandwidth / `conv_bw_fraction` and its Tensor Core time at its row count (wgmma M=64 granularity) /
`conv_tc_eff` (cuBLAS: at batch 32/128 the conventional path's matmuls are Tensor Core GEMMs, which is why it
overtakes the CUDA-core megakernel there). Conventional attention moves the gathered KV bytes
`conv_attn_kv_passes` times, and takes at least `conv_attn_key_us` per key (the larger: at small batch its few rows
keep it latency-bound, measured ~30-50 ns per key per layer at B=1-8 where the bytes would take ~1). All-reduces
outside megakernels are NCCL calls inside the graph (measured curve).

A megakernel segment = launch + mk_scale x simulated makespan + mk_offset_us (calibration, fit.py); the
simulator streams each linear weight tile once per pass of the kernel (Tensor Core passes of tc_rows rows from
codegen/layout.linear_geometry at batch >= TC_MIN_M, the packer's own function) and prices the mma.sync math.

`segment_features` returns the terms of a segment's price that `fit.py` refits from measurements, such that
`price_from_features(features, profile)` == the price candidates() gives (tested).
"""
from __future__ import annotations

from ..ir.defer import conv_attn_appends, paged_head_dim
from ..ir.graph import Graph, Op
from ..ir.sampling import conv_bf16_argmax
from ..tasks.build import build_task_graphs
from ..tasks.tiling import Tiling
from .profile import HardwareProfile
from .simulate import simulate

# kernels per op in a fused (torch.compile) conventional decoder
CONV_KERNELS = {"embed": 1, "qkv_rope": 4, "attention": 2, "allreduce": 1, "argmax": 1}


def conv_kernels(op: Op) -> int:
    if op.kind == "linear":
        a = op.attrs
        return 1 + (1 if a.get("norm") else 0) + (1 if a.get("epilogue") == "silu_mul" else 0) + \
            (1 if a.get("residual") else 0)
    if op.kind == "qkv_rope" and op.attrs.get("kv_defer"):   # no indexed puts of k and v (ir/defer.py)
        return CONV_KERNELS[op.kind] - 2
    return CONV_KERNELS[op.kind]


def _conv_fixed(op: Op, prof: HardwareProfile) -> float:
    """The op's measured kernel-sequence cost; a deferred qkv_rope not yet measured as such: the appending one's
    less its two indexed puts (conv_kernel_us each)."""
    k = conv_kernels(op)
    got = prof.conv_fixed_us_by_kind.get(conv_key(op))
    if got is not None:
        return got
    full = f"qkv_rope:{CONV_KERNELS['qkv_rope']}"
    if op.kind == "qkv_rope" and op.attrs.get("kv_defer") and full in prof.conv_fixed_us_by_kind:
        return max(0.0, prof.conv_fixed_us_by_kind[full] - 2 * prof.conv_kernel_us)
    return k * prof.conv_kernel_us


def conv_key(op: Op) -> str:
    """Conventional ops with the same kernel sequence share a measured fixed cost."""
    return f"{op.kind}:{conv_kernels(op)}"


def conv_op_terms(op: Op, graph: Graph, prof: HardwareProfile) -> dict:
    """fixed_us (kernel sequence + NCCL), stream_us (bytes at full bandwidth), tc_us (Tensor Core at M rows,
    efficiency 1), attn_kv_us (attention: KV bytes at full bandwidth, one pass)."""
    fixed = _conv_fixed(op, prof)
    bw = prof.bw(prof.num_sms)
    if op.kind == "allreduce":
        W, M, N = graph.tensors[op.attrs["part"]].shape
        return {"fixed_us": fixed + prof.nccl_allreduce_us(M * N * 2), "stream_us": 0.0, "tc_us": 0.0,
                "attn_kv_us": 0.0, "coll": 1}
    coll = 0
    if op.kind == "argmax" and graph.tp > 1:
        fixed += prof.nccl_allreduce_us(graph.batch * 16)
        coll = 1
    if op.kind == "attention":
        a = op.attrs   # keys read per row: the op's flops are 4 x rows x q heads x head_dim x keys
        keys = op.flops / max(1, 4 * graph.rows * a["n_q"] * graph.config.head_dim)
        # (layer 0's: the step's first conventional attention, which computes the step's shared pages and masks;
        # every plan family converts all attention ops or none)
        D, gs = graph.config.head_dim, a["n_q"] // a["n_kv"]
        # runtime/paged_attention.py's own curve where the runtime takes it (decode, a head dim it supports) and the
        # profile measured it; else the gather + SDPA curve
        paged = (conv_attn_appends() and graph.mode == "decode" and paged_head_dim(D)
                 and prof.has_conv_attn_curve(a["n_kv"], D, gs, "paged"))
        curve = prof.conv_attn_curve_us(a["n_kv"], D, gs, graph.batch, keys, first=a.get("layer") == 0,
                                        impl="paged" if paged else "")
        if curve is not None:   # measured whole (profile.conv_attn_us_by_shape): that, and none of the terms below
            return {"fixed_us": 0.0, "stream_us": 0.0, "tc_us": 0.0, "attn_kv_us": 0.0, "coll": 0,
                    ("attn_curve_paged_us" if paged else "attn_curve_us"): curve}
        return {"fixed_us": fixed, "stream_us": 0.0, "tc_us": 0.0, "attn_kv_us": op.bytes / bw * 1e6, "coll": 0,
                "attn_keys": keys}
    rows = graph.rows if op.kind != "argmax" else 1
    tc = prof.tc_time_us(op.flops, rows, prof.num_sms) if op.kind in ("linear", "qkv_rope") else 0.0
    out = {"fixed_us": fixed, "stream_us": op.bytes / bw * 1e6, "tc_us": tc, "attn_kv_us": 0.0, "coll": coll}
    copy = logits_copy_saved_us(op, graph, prof)
    if copy:
        out["logits_copy_us"] = copy
    return out


def logits_copy_saved_us(op: Op, graph: Graph, prof: HardwareProfile) -> float:
    """What a greedy step's conventional argmax saves under MPK_CONV_BF16_ARGMAX (ir/sampling.conv_bf16_argmax), as a
    negative price on the argmax op: the LM head's fp32 logits copy (a kernel reading the bf16 product, 2 bytes a
    logit, and writing 4) and half of the argmax's reads (2 of 4 bytes a logit), 8 bytes a logit at the conventional
    streaming rate, plus the copy's kernel. The fitted conventional terms priced the copy implicitly (the IR counts the
    logits once as fp32 out and once in), so the whole copy comes off. TP=1 decode only (what was measured: session
    43, llama-3.2-1b ctx 512, B=128 -54 us, B=32 -14.5; h200_v48 prices -42 / -12). A sampled step keeps the copy: its
    price (search.py notes["sampled_us"]) drops the conventional argmax's price, this term with it."""
    if op.kind != "argmax" or graph.tp != 1 or graph.mode != "decode" or not conv_bf16_argmax():
        return 0.0
    B, V = graph.tensors[op.attrs["logits"]].shape
    return -(prof.conv_kernel_us + 8 * B * V / (prof.bw(prof.num_sms) * prof.conv_bw_fraction) * 1e6)


def _attn_us(kv: float, keys: float, passes: float, key_us: float) -> float:
    """Conventional attention beyond its fixed cost: the KV passes at bandwidth, or the per-key floor."""
    return max(kv * passes, keys * key_us)


def _conv_price(fixed: float, stream: float, tc: float, kv: float, coll: int, prof: HardwareProfile,
                keys: float = 0.0, curve: float = 0.0, paged: float = 0.0, copy: float = 0.0) -> float:
    return prof.conv_fixed_scale * fixed + max(stream / prof.conv_bw_fraction, tc / prof.conv_tc_eff) + \
        _attn_us(kv, keys, prof.conv_attn_kv_passes, prof.conv_attn_key_us) + coll * prof.conv_collective_us + \
        prof.conv_attn_curve_scale * curve + prof.paged_scale() * paged + copy


def conventional_op_us(op: Op, graph: Graph, prof: HardwareProfile) -> float:
    t = conv_op_terms(op, graph, prof)
    return _conv_price(t["fixed_us"], t["stream_us"], t["tc_us"], t["attn_kv_us"], t["coll"], prof,
                       t.get("attn_keys", 0.0), t.get("attn_curve_us", 0.0), t.get("attn_curve_paged_us", 0.0),
                       t.get("logits_copy_us", 0.0))


def conventional_us(graph: Graph, ops: list[str], prof: HardwareProfile) -> float:
    by = {o.name: o for o in graph.ops}
    return sum(conventional_op_us(by[n], graph, prof) for n in ops)


def conventional_features(graph: Graph, ops: list[str], prof: HardwareProfile) -> dict:
    """Per-segment terms for fit.py: summed fixed and KV terms, and the (stream, tc) pairs with counts."""
    by = {o.name: o for o in graph.ops}
    fixed = kv = curve = paged = copy = 0.0
    coll = 0
    pairs: dict[tuple, int] = {}
    attn: dict[tuple, int] = {}
    for n in ops:
        t = conv_op_terms(by[n], graph, prof)
        fixed += t["fixed_us"]
        copy += t.get("logits_copy_us", 0.0)
        kv += t["attn_kv_us"]
        curve += t.get("attn_curve_us", 0.0)
        paged += t.get("attn_curve_paged_us", 0.0)
        coll += t["coll"]
        if t["stream_us"] or t["tc_us"]:
            key = (round(t["stream_us"], 7), round(t["tc_us"], 7))
            pairs[key] = pairs.get(key, 0) + 1
        if "attn_keys" in t:
            key = (round(t["attn_kv_us"], 7), round(t["attn_keys"], 3))
            attn[key] = attn.get(key, 0) + 1
    return {"kind": "conventional", "fixed_us": fixed, "attn_kv_us": kv, "n_coll": coll,
            "st": [[s, t, c] for (s, t), c in sorted(pairs.items())],
            "attn": [[k, n, c] for (k, n), c in sorted(attn.items())], "attn_curve_us": curve,
            "attn_curve_paged_us": paged, **({"logits_copy_us": copy} if copy else {})}


def conv_attn_us(f: dict, passes: float, key_us: float) -> float:
    """The attention part of a conventional segment's price from its features (rows recorded before the per-key
    term carry only the summed KV time: bandwidth term alone)."""
    if "attn" not in f:
        return f["attn_kv_us"] * passes
    return sum(c * _attn_us(kv, n, passes, key_us) for kv, n, c in f["attn"])


def kv_beyond_first(f: dict) -> float:
    """The MB of K / V a megakernel segment's attention layers beyond its first read (mk_mixed_kv_us_per_mb's
    feature): attn_kv_mb x (layers - 1) / layers."""
    n = f.get("attn_layers", 1) or 1
    return f.get("attn_kv_mb", 0.0) * max(0, n - 1) / n


def mixed_attn_terms_us(f: dict, prof: HardwareProfile) -> float:
    """What a megakernel segment holding attention among other ops (attn_mixed) adds to its scaled simulation: once
    (mk_mixed_attn_us), per attention layer beyond the first (mk_attn_layer_us), per MB of K / V those layers read
    (mk_mixed_kv_us_per_mb) and on its attention ops' own simulated time (mk_mixed_attn_sim_scale x attn_sim_us)."""
    if not f.get("attn_mixed"):
        return 0.0
    return prof.mk_mixed_attn_us + prof.mk_attn_layer_us * max(0, f.get("attn_layers", 1) - 1) + \
        prof.mk_mixed_kv_us_per_mb * kv_beyond_first(f) + prof.mk_mixed_attn_sim_scale * f.get("attn_sim_us", 0.0)


def price_from_features(f: dict, prof: HardwareProfile) -> float:
    """A segment's price from its features under `prof` (fit.py): the same arithmetic as the cost functions."""
    if f["kind"] == "megakernel":
        if not f.get("attn_only"):
            return prof.megakernel_launch_us + prof.mk_scale * f["sim_us"] + prof.mk_offset_us + \
                mixed_attn_terms_us(f, prof)
        scale = prof.mk_scale if prof.mk_attn_scale is None else prof.mk_attn_scale
        return (prof.megakernel_launch_us + scale * f["sim_us"] + prof.mk_offset_us) * prof.mk_attn_factor
    st = sum(c * max(s / prof.conv_bw_fraction, t / prof.conv_tc_eff) for s, t, c in f["st"])
    return prof.conv_fixed_scale * f["fixed_us"] + st + conv_attn_us(f, prof.conv_attn_kv_passes, prof.conv_attn_key_us) + \
        f.get("n_coll", 0) * prof.conv_collective_us + prof.conv_attn_curve_scale * f.get("attn_curve_us", 0.0) + \
        prof.paged_scale() * f.get("attn_curve_paged_us", 0.0) + f.get("logits_copy_us", 0.0)


class SegmentCoster:
    """Prices megakernel segments by simulation, memoised on the segment's structure: identical layers give
    identical task graphs, so a per-layer plan simulates one layer, not all of them.

    Segments of many whole layers (`make_graphs` given): every decoder layer is the same, and the simulated
    makespan of n consecutive layer groups of one position type (with / without the embedding group, with /
    without the LM-head group) is T(n) = T(k) + (n - k) * d from a small k on (the static schedule and the
    simulation reach a periodic steady state after a layer or two). The coster simulates the same segment type
    with k, k+1, k+2 layer groups (from `make_graphs(num_layers)`, a smaller model of the same shape) and, if
    the two increments agree to `EXTRAP_RTOL`, extrapolates; otherwise it tries a larger k, and in the end
    simulates the real segment. Checked against the full simulation on every point of the validation sweep
    (tests/planner/test_planner.py on small models; docs/planner.md, "prediction speed")."""

    EXTRAP_MIN = 6         # segments of fewer layer groups are simulated as they are
    EXTRAP_K = (1, 2, 3, 4)
    EXTRAP_RTOL = 1e-9

    def __init__(self, graphs: list[Graph], prof: HardwareProfile, make_graphs=None, groups=None):
        self.graphs, self.prof = graphs, prof
        self._op = {o.name: o for o in graphs[0].ops}   # rank 0's ops by name
        self.make_graphs = make_graphs          # num_layers -> [Graph per rank] of the same model, fewer layers
        self.groups = groups                    # layer groups of graphs[0] (search._layer_groups)
        self._group_of = {n: i for i, grp in enumerate(groups or []) for n in grp}
        self._memo: dict = {}
        self._small: dict = {}
        self._steady: dict = {}                 # tiling -> (k, per-layer increment from k groups on)
        self.simulations = 0
        self.extrapolated = 0

    def _signature(self, ops: list[str], tiling: Tiling) -> tuple:
        sig = []
        for n in ops:
            o = self._op[n]
            shapes = tuple(self.graphs[0].tensors[t].shape for t in o.inputs + o.outputs)
            sig.append((o.kind, shapes, o.attrs.get("epilogue"), bool(o.attrs.get("norm")),
                        bool(o.attrs.get("residual")), o.name in ("embed", "lm_head", "argmax")))
        return tuple(sig), tuple(sorted(tiling.to_dict().items()))

    def _simulate(self, graphs: list[Graph], ops: list[str], tiling: Tiling) -> float:
        sub = [g.subgraph(ops) for g in graphs]
        tgs = build_task_graphs(sub, tiling)
        self.simulations += 1
        return simulate(tgs, self.prof).makespan_us

    def _span(self, ops: list[str]):
        """(first group, number of groups) if `ops` are whole consecutive layer groups, else None."""
        if not self.groups or ops[0] not in self._group_of:
            return None
        i0 = self._group_of[ops[0]]
        i1 = self._group_of.get(ops[-1], -1)
        if i1 < i0 or ops != [n for grp in self.groups[i0:i1 + 1] for n in grp]:
            return None
        return i0, i1 - i0 + 1

    def _small_sim(self, first: bool, last: bool, k: int, tiling: Tiling) -> float:
        """Makespan of k layer groups of this position type, in a model of just enough layers."""
        key = (first, last, k, tuple(sorted(tiling.to_dict().items())))
        if key not in self._small:
            start = 0 if first else 1
            graphs = self.make_graphs(start + k + (0 if last else 1))
            from .search import _layer_groups
            groups = _layer_groups(graphs[0])
            self._small[key] = self._simulate(graphs, [n for grp in groups[start:start + k] for n in grp], tiling)
        return self._small[key]

    def _extrapolate(self, first: bool, last: bool, n: int, tiling: Tiling) -> float | None:
        tkey = tuple(sorted(tiling.to_dict().items()))
        steady = self._steady.get(tkey)
        if steady is not None and steady[0] + 1 < n:
            # another position type already showed the per-layer increment d from k groups on: two sims of this
            # type (k, k+1 groups) whose difference is d (the layers are the same; only the ends differ)
            k, d = steady
            t0, t1 = self._small_sim(first, last, k, tiling), self._small_sim(first, last, k + 1, tiling)
            if abs((t1 - t0) - d) <= self.EXTRAP_RTOL * t1:
                self.extrapolated += 1
                return t1 + (n - k - 1) * (t1 - t0)
        for k in self.EXTRAP_K:   # this type's own increments: T(k+1) - T(k) == T(k+2) - T(k+1)
            if k + 2 >= n:
                break
            t0, t1, t2 = (self._small_sim(first, last, k + i, tiling) for i in range(3))
            d1, d2 = t1 - t0, t2 - t1
            if abs(d2 - d1) <= self.EXTRAP_RTOL * t2:
                self.extrapolated += 1
                self._steady.setdefault(tkey, (k, d2))
                return t2 + (n - k - 2) * d2
        return None

    def sim_us(self, ops: list[str], tiling: Tiling) -> float:
        """Simulated makespan of the segment (no launch, no calibration)."""
        key = self._signature(ops, tiling)
        if key not in self._memo:
            us = None
            span = self._span(ops) if self.make_graphs is not None else None
            if span is not None and span[1] >= self.EXTRAP_MIN:
                i0, n = span
                us = self._extrapolate(i0 == 0, i0 + n == len(self.groups), n, tiling)
            self._memo[key] = us if us is not None else self._simulate(self.graphs, ops, tiling)
        return self._memo[key]

    def megakernel_features(self, ops: list[str], tiling: Tiling) -> dict:
        """The segment's price terms (price_from_features; fit.py refits from them): its simulated makespan, and
        whether it holds attention alone (attn_only) or among other ops (attn_mixed), how many attention ops
        (attn_layers) and the MB they read (attn_kv_mb: the K / V at the graph's context, the ops' bytes); in a
        mixed segment also attn_sim_us, its attention ops' simulated makespans each alone (an attention-only
        segment's simulation, memoised per shape: one simulation for identical layers)."""
        kinds = {self._op[n].kind for n in ops}
        attn = [self._op[n] for n in ops if self._op[n].kind == "attention"]
        mixed = "attention" in kinds and kinds != {"attention"}
        return {"kind": "megakernel", "sim_us": self.sim_us(ops, tiling), "attn_only": kinds == {"attention"},
                "attn_mixed": mixed, "attn_layers": len(attn), "attn_kv_mb": sum(o.bytes for o in attn) / 1e6,
                **({"attn_sim_us": sum(self.sim_us([o.name], tiling) for o in attn)} if mixed else {})}

    def megakernel_us(self, ops: list[str], tiling: Tiling) -> float:
        return price_from_features(self.megakernel_features(ops, tiling), self.prof)
