"""Cost of plan segments: megakernel segments by simulating their schedule, conventional ones op by op.

Conventional ops are priced as the torch kernels `runtime/conventional_ops.py` / `torch_exec.py` launch for them,
captured in one CUDA graph (PlanExecutor.capture): per op a fixed cost (measured per kernel sequence,
`conv_fixed_us_by_kind`, else kernels x `conv_kernel_us`), plus the larger of its bytes at the full-GPU streaming
bandwidth / `conv_bw_fraction` and its Tensor Core time at its row count (wgmma M=64 granularity) /
`conv_tc_eff` (cuBLAS: at batch 32/128 the conventional path's matmuls are Tensor Core GEMMs, which is why it
overtakes the CUDA-core megakernel there). Conventional attention moves the gathered KV bytes
`conv_attn_kv_passes` times. All-reduces outside megakernels are NCCL calls inside the graph (measured curve).

A megakernel segment = launch + mk_scale x simulated makespan + mk_offset_us (calibration, fit.py); the
simulator already re-streams weight tiles once per row group at batch > row_tile.

`segment_features` returns the terms of a segment's price that `fit.py` refits from measurements, such that
`price_from_features(features, profile)` == the price candidates() gives (tested).
"""
from __future__ import annotations

from ..ir.graph import Graph, Op
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
    return CONV_KERNELS[op.kind]


def conv_key(op: Op) -> str:
    """Conventional ops with the same kernel sequence share a measured fixed cost."""
    return f"{op.kind}:{conv_kernels(op)}"


def conv_op_terms(op: Op, graph: Graph, prof: HardwareProfile) -> dict:
    """fixed_us (kernel sequence + NCCL), stream_us (bytes at full bandwidth), tc_us (Tensor Core at M rows,
    efficiency 1), attn_kv_us (attention: KV bytes at full bandwidth, one pass)."""
    k = conv_kernels(op)
    fixed = prof.conv_fixed_us_by_kind.get(conv_key(op), k * prof.conv_kernel_us)
    bw = prof.bw(prof.num_sms)
    if op.kind == "allreduce":
        W, M, N = graph.tensors[op.attrs["part"]].shape
        return {"fixed_us": fixed + prof.nccl_allreduce_us(M * N * 2), "stream_us": 0.0, "tc_us": 0.0,
                "attn_kv_us": 0.0}
    if op.kind == "argmax" and graph.tp > 1:
        fixed += prof.nccl_allreduce_us(graph.batch * 16)
    if op.kind == "attention":
        return {"fixed_us": fixed, "stream_us": 0.0, "tc_us": 0.0, "attn_kv_us": op.bytes / bw * 1e6}
    rows = graph.rows if op.kind != "argmax" else 1
    tc = prof.tc_time_us(op.flops, rows, prof.num_sms) if op.kind in ("linear", "qkv_rope") else 0.0
    return {"fixed_us": fixed, "stream_us": op.bytes / bw * 1e6, "tc_us": tc, "attn_kv_us": 0.0}


def _conv_price(fixed: float, stream: float, tc: float, kv: float, prof: HardwareProfile) -> float:
    return prof.conv_fixed_scale * fixed + max(stream / prof.conv_bw_fraction, tc / prof.conv_tc_eff) + \
        kv * prof.conv_attn_kv_passes


def conventional_op_us(op: Op, graph: Graph, prof: HardwareProfile) -> float:
    t = conv_op_terms(op, graph, prof)
    return _conv_price(t["fixed_us"], t["stream_us"], t["tc_us"], t["attn_kv_us"], prof)


def conventional_us(graph: Graph, ops: list[str], prof: HardwareProfile) -> float:
    by = {o.name: o for o in graph.ops}
    return sum(conventional_op_us(by[n], graph, prof) for n in ops)


def conventional_features(graph: Graph, ops: list[str], prof: HardwareProfile) -> dict:
    """Per-segment terms for fit.py: summed fixed and KV terms, and the (stream, tc) pairs with counts."""
    by = {o.name: o for o in graph.ops}
    fixed = kv = 0.0
    pairs: dict[tuple, int] = {}
    for n in ops:
        t = conv_op_terms(by[n], graph, prof)
        fixed += t["fixed_us"]
        kv += t["attn_kv_us"]
        if t["stream_us"] or t["tc_us"]:
            key = (round(t["stream_us"], 4), round(t["tc_us"], 4))
            pairs[key] = pairs.get(key, 0) + 1
    return {"kind": "conventional", "fixed_us": fixed, "attn_kv_us": kv,
            "st": [[s, t, c] for (s, t), c in sorted(pairs.items())]}


def price_from_features(f: dict, prof: HardwareProfile) -> float:
    """A segment's price from its features under `prof` (fit.py): the same arithmetic as the cost functions."""
    if f["kind"] == "megakernel":
        return prof.megakernel_launch_us + prof.mk_scale * f["sim_us"] + prof.mk_offset_us
    st = sum(c * max(s / prof.conv_bw_fraction, t / prof.conv_tc_eff) for s, t, c in f["st"])
    return prof.conv_fixed_scale * f["fixed_us"] + st + f["attn_kv_us"] * prof.conv_attn_kv_passes


class SegmentCoster:
    """Prices megakernel segments by simulation, memoised on the segment's structure: identical layers give
    identical task graphs, so a per-layer plan simulates one layer, not all of them."""

    def __init__(self, graphs: list[Graph], prof: HardwareProfile):
        self.graphs, self.prof = graphs, prof
        self._memo: dict = {}
        self.simulations = 0

    def _signature(self, ops: list[str], tiling: Tiling) -> tuple:
        by = {o.name: o for o in self.graphs[0].ops}
        sig = []
        for n in ops:
            o = by[n]
            shapes = tuple(self.graphs[0].tensors[t].shape for t in o.inputs + o.outputs)
            sig.append((o.kind, shapes, o.attrs.get("epilogue"), bool(o.attrs.get("norm")),
                        bool(o.attrs.get("residual")), o.name in ("embed", "lm_head", "argmax")))
        return tuple(sig), tuple(sorted(tiling.to_dict().items()))

    def sim_us(self, ops: list[str], tiling: Tiling) -> float:
        """Simulated makespan of the segment (no launch, no calibration)."""
        key = self._signature(ops, tiling)
        if key not in self._memo:
            sub = [g.subgraph(ops) for g in self.graphs]
            tgs = build_task_graphs(sub, tiling)
            self._memo[key] = simulate(tgs, self.prof).makespan_us
            self.simulations += 1
        return self._memo[key]

    def megakernel_us(self, ops: list[str], tiling: Tiling) -> float:
        return price_from_features({"kind": "megakernel", "sim_us": self.sim_us(ops, tiling)}, self.prof)
