"""Classify a model (at a TP degree) by how stable its best composition is across batch sizes.

Features, all computed from the Graph and the profile (no runs):
  launch_share      kernel fixed costs / conventional step time: what fusion can remove
  intensity_ratio   step flops per byte / the ridge point (tc flops / bandwidth): > 1 means matmul-bound
  heterogeneity     spread (coefficient of variation) of per-op-kind intensity: mixing memory- and compute-
                    bound work in one kernel leaves one resource idle
  comm_share        predicted all-reduce time (conventional, NCCL) / conventional step time
Category from the best predicted plan per batch bucket:
  monolith-stable          one megakernel wins everywhere
  multi-megakernel-stable  a multi-segment megakernel plan wins everywhere
  conventional-stable      the conventional graph wins everywhere
  crossover                the winner changes with batch size
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..ir.build import build_graph
from ..models.config import ModelConfig
from .cost import conv_kernels, conventional_op_us
from .profile import HardwareProfile
from .search import candidates


@dataclass
class Features:
    batch: int
    launch_share: float
    intensity_ratio: float
    heterogeneity: float
    comm_share: float


def features(cfg: ModelConfig, tp: int, batch: int, context: int, prof: HardwareProfile) -> Features:
    prof = prof.for_batch(batch)
    g = build_graph(cfg, batch=batch, context_len=context, tp=tp)
    conv = [conventional_op_us(o, g, prof) for o in g.ops]
    total = sum(conv)
    fixed = sum(conv_kernels(o) * prof.conv_kernel_us for o in g.ops)
    comm = sum(c for o, c in zip(g.ops, conv) if o.kind == "allreduce")
    ridge = prof.tc_flops_per_s / prof.bw(prof.num_sms)
    kinds: dict[str, list[int]] = {}
    for o in g.ops:
        k = kinds.setdefault(o.kind, [0, 0])
        k[0] += o.flops
        k[1] += o.bytes
    ints = [f / max(1, b) for f, b in kinds.values()]
    mean = sum(ints) / len(ints)
    sd = (sum((x - mean) ** 2 for x in ints) / len(ints)) ** 0.5
    return Features(batch, fixed / total, g.total_flops() / max(1, g.total_bytes()) / ridge,
                    sd / max(1e-12, mean), comm / total)


def classify(cfg: ModelConfig, tp: int = 1, batches=(1, 8, 32, 128), context: int = 512,
             prof: HardwareProfile | None = None) -> dict:
    prof = prof or HardwareProfile.load()
    best = {}
    for b in batches:
        plans = candidates(cfg, tp=tp, batch=b, context=context, prof=prof)
        best[b] = {"plan": plans[0].name, "predicted_us": plans[0].predicted_us,
                   "runner_up": plans[1].name if len(plans) > 1 else None}
    fam = {b: ("conventional" if v["plan"] == "conventional" else
               "mono" if v["plan"].startswith("mono") else "multi") for b, v in best.items()}
    kinds = set(fam.values())
    if len(kinds) > 1:
        cat = "crossover"
    else:
        cat = {"mono": "monolith-stable", "multi": "multi-megakernel-stable",
               "conventional": "conventional-stable"}[kinds.pop()]
    return {"model": cfg.name, "tp": tp, "context": context, "category": cat, "best": best,
            "features": [asdict(features(cfg, tp, b, context, prof)) for b in batches]}
