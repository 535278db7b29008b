"""Cost of plan segments: megakernel segments by simulating their schedule, conventional ones op by op.

Conventional ops are priced as the kernels a good torch.compile'd decoder launches for them (counts below):
each kernel costs a fixed `conv_kernel_us` (launch gap in a CUDA graph plus a small kernel's ramp), plus the
op's bytes at `conv_bw_fraction` of the full-GPU streaming bandwidth, or its Tensor Core time if larger.
All-reduces outside megakernels are NCCL calls inside the CUDA graph (measured curve).
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


def conventional_op_us(op: Op, graph: Graph, prof: HardwareProfile) -> float:
    k = conv_kernels(op)
    t = prof.conv_fixed_us_by_kind.get(conv_key(op), k * prof.conv_kernel_us)
    if op.kind == "allreduce":
        W, M, N = graph.tensors[op.attrs["part"]].shape
        return t + prof.nccl_allreduce_us(M * N * 2)
    if op.kind == "argmax" and graph.tp > 1:
        t += prof.nccl_allreduce_us(graph.batch * 16)
    stream = op.bytes / (prof.bw(prof.num_sms) * prof.conv_bw_fraction) * 1e6
    rows = graph.rows if op.kind != "argmax" else 1
    tc = prof.tc_time_us(op.flops, rows, prof.num_sms) if op.kind in ("linear", "qkv_rope", "attention") else 0.0
    return t + max(stream, tc)


def conventional_us(graph: Graph, ops: list[str], prof: HardwareProfile) -> float:
    by = {o.name: o for o in graph.ops}
    return sum(conventional_op_us(by[n], graph, prof) for n in ops)


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

    def megakernel_us(self, ops: list[str], tiling: Tiling) -> float:
        key = self._signature(ops, tiling)
        if key not in self._memo:
            sub = [g.subgraph(ops) for g in self.graphs]
            tgs = build_task_graphs(sub, tiling)
            self._memo[key] = simulate(tgs, self.prof).makespan_us + self.prof.megakernel_launch_us
            self.simulations += 1
        return self._memo[key]
