"""The partition search: candidate plans for one (model, tp, batch, context), each priced without running it.

Candidates (cut points at op boundaries, in families):
  mono           the whole step as one megakernel (tiling variants: tiles per SM, attention splits)
  megaK          K megakernels of consecutive layers (K = 2, 3, 4)
  per-layer      one megakernel per decoder layer
  attn-conv      attention as conventional kernels, everything between as megakernels
  attn-mk        the reverse: attention as megakernels (paged KV read in place), everything between conventional
  conventional   every op as conventional kernels (torch ops in a CUDA graph)
The best predicted plan is chosen; the others are kept (sorted) for validation. Plans whose argmax is conventional also
carry notes["sampled_us"]: a step with sampled rows (its argmax as a megakernel, PlanExecutor.segments_for).
A plan whose megakernel segments cannot launch (a task over a CTA's shared memory: feasible.py) is not a candidate; the
others carry notes["infeasible"] (family -> why).
"""
from __future__ import annotations

import gc

from ..ir.build import build_graph
from ..ir.defer import defer_kv_appends, kv_defer_layers
from ..ir.graph import Graph
from ..models.config import ModelConfig
from ..tasks.tiling import Tiling, attn_splits_for
from .cost import SegmentCoster, conventional_features, conventional_us, price_from_features
from .feasible import SmemCheck
from .plan import Plan, Segment
from .profile import HardwareProfile

ALL_FAMILIES = ("mono", "mono-w2", "mega2", "mega3", "mega4", "per-layer", "attn-conv", "attn-mk", "conventional")


def _layer_groups(g: Graph) -> list[list[str]]:
    """Ops grouped as: [embed + layer 0], layer 1, ..., [layer L-1 + lm_head + argmax]."""
    groups: list[list[str]] = []
    cur: list[str] = []
    for op in g.ops:
        if op.name.startswith("L") and op.name.endswith(".qkv_rope") and cur and op.name != "L0.qkv_rope":
            groups.append(cur)
            cur = []
        cur.append(op.name)
    groups.append(cur)
    return groups


def attn_splits(cfg: ModelConfig, tp: int, batch: int, context: int, num_sms: int) -> int:
    """Attention key splits of every plan: tasks.tiling.attn_splits_for, the rule the one-megakernel bench has used
    (sequences x KV heads x splits ~ the SMs, >= 64 keys per split). Until session 18 the plans had their own rule
    (legacy_attn_splits: 1 split at batch 8, 2 at batch 1 ctx 512, where this one gives 2 and 8); measured on the same
    commit (s18, validate_planner vs bench_decode, one megakernel, 1x H200): llama-3.2-1b B=8 ctx 4096 2.418 vs
    2.004 ms, qwen3-8b 10.273 vs 8.965, llama B=1 ctx 512 1.104 vs 1.058, ctx 4096 1.212 vs 1.146; the simulator
    ranks them alike (llama B=8 ctx 4096 2195 vs 1824 us predicted)."""
    return attn_splits_for(batch, max(1, cfg.num_kv_heads // tp), context, num_sms)


def legacy_attn_splits(cfg: ModelConfig, tp: int, batch: int, context: int, num_sms: int) -> int:
    """The plans' split rule before session 18 (enough splits to fill about half the SMs, >= 256 keys each): what
    validation rows without an "attn_splits" field were measured with (score.resimulate re-plans them under it)."""
    n_kv = max(1, cfg.num_kv_heads // tp)
    want = max(1, (num_sms // 2) // max(1, batch * n_kv))
    return max(1, min(want, context // 256 or 1, 16))


def candidates(cfg: ModelConfig, *, tp: int = 1, batch: int = 1, context: int = 512,
               prof: HardwareProfile | None = None, families: tuple[str, ...] | None = None,
               extrapolate: bool = True, splits: int | None = None) -> list[Plan]:
    """Every candidate of `families`, priced, best first. `extrapolate=False` simulates every long segment in
    full instead of extrapolating it from short ones (SegmentCoster; same predictions up to rounding). `splits`:
    the attention key splits of every plan (default attn_splits(); re-pricing measured rows passes theirs)."""
    gc_was = gc.isenabled()
    gc.disable()   # millions of short-lived task objects, no cycles: the cyclic GC only costs time here
    try:
        return _candidates(cfg, tp, batch, context, prof, families, extrapolate, splits)
    finally:
        if gc_was:
            gc.enable()


def _candidates(cfg, tp, batch, context, prof, families, extrapolate, splits) -> list[Plan]:
    prof = (prof or HardwareProfile.load()).for_batch(batch)
    if splits is None:
        splits = attn_splits(cfg, tp, batch, context, prof.num_sms)
    elif splits < 1:
        raise ValueError(f"attention splits must be >= 1 (got {splits})")

    def make_graphs(num_layers: int | None = None) -> list[Graph]:
        c = cfg if num_layers is None else cfg.replace(num_layers=num_layers)
        return [build_graph(c, batch=batch, context_len=context, tp=tp, rank=r, attn_splits=splits) for r in range(tp)]

    graphs = make_graphs()
    g = graphs[0]
    groups = _layer_groups(g)
    coster = SegmentCoster(graphs, prof, make_graphs if extrapolate else None, groups)
    all_ops = [o.name for o in g.ops]
    fams = (families,) if isinstance(families, str) else tuple(families or ALL_FAMILIES)   # ("mono" in "mono-w2")
    unknown = [f for f in fams if f not in ALL_FAMILIES]
    if unknown:
        raise ValueError(f"unknown plan families {unknown}; known: {', '.join(ALL_FAMILIES)}")
    plans: list[Plan] = []

    smem = SmemCheck(graphs, Tiling(num_sms=prof.num_sms))
    infeasible: dict[str, str] = {}   # family -> why it cannot launch here (feasible.py)

    def mk(name: str, parts: list[tuple[str, list[str]]], tiling: Tiling) -> Plan | None:
        why = next((w for kind, ops in parts if kind == "megakernel" and (w := smem.problem(ops))), None)
        if why is not None:
            infeasible[name] = why
            return None
        segs = []
        total = 0.0
        gd = defer_kv_appends(g, kv_defer_layers(g, parts))   # the graph the executor will run (MPK_KV_DEFER)
        for kind, ops in parts:
            if kind == "megakernel":
                f = coster.megakernel_features(ops, tiling)
                us = price_from_features(f, prof)
                segs.append(Segment(kind, ops, tiling.to_dict(), us, f))
            else:
                us = conventional_us(gd, ops, prof)
                segs.append(Segment(kind, ops, {}, us, conventional_features(gd, ops, prof)))
            total += us
        total += prof.boundary_us * max(0, len(segs) - 1)
        return Plan(cfg.name, tp, batch, context, name, segs, attn_splits=splits, predicted_us=total,
                    band=(total * (1 + prof.step_band[0]), total * (1 + prof.step_band[1])), profile=prof.name)

    base = Tiling(num_sms=prof.num_sms)
    for waves, name in ((1.0, "mono"), (2.0, "mono-w2")):
        if name in fams:
            t = Tiling(num_sms=prof.num_sms, waves=waves)
            plans.append(mk(name, [("megakernel", all_ops)], t))
    for k in (2, 3, 4):
        if f"mega{k}" in fams and len(groups) >= k:
            cuts = [round(i * len(groups) / k) for i in range(k + 1)]
            parts = [("megakernel", [n for grp in groups[cuts[i]:cuts[i + 1]] for n in grp]) for i in range(k)]
            plans.append(mk(f"mega{k}", parts, base))
    if "per-layer" in fams and len(groups) > 4:
        plans.append(mk("per-layer", [("megakernel", grp) for grp in groups], base))
    for name, attn_kind, other in (("attn-conv", "conventional", "megakernel"),
                                   ("attn-mk", "megakernel", "conventional")):
        if name in fams:
            parts: list[tuple[str, list[str]]] = []
            for n in all_ops:
                kind = attn_kind if n.endswith(".attention") else other
                if parts and parts[-1][0] == kind:
                    parts[-1][1].append(n)
                else:
                    parts.append((kind, [n]))
            plans.append(mk(name, parts, base))
    if "conventional" in fams:
        plans.append(mk("conventional", [("conventional", all_ops)], base))
    plans = [p for p in plans if p is not None]
    if not plans and infeasible:   # (families the model cannot have at all: none built, the caller says so)
        raise ValueError(f"no plan of {', '.join(fams)} can run {cfg.name} at tp={tp} batch={batch}: "
                         + "; ".join(f"{k}: {v}" for k, v in infeasible.items())
                         + ". Plans that keep these ops out of megakernels (attn-mk, conventional) can, or a batch "
                         "below the Tensor Core rows (TC_MIN_M) keeps only its own rows")
    # a step with sampled rows runs a conventional argmax as a megakernel of its own (PlanExecutor.segments_for,
    # world size 1): its price, beside the greedy step's the plans are ranked by
    argmax = [o.name for o in g.ops if o.kind == "argmax"]
    for p in plans:
        if tp == 1 and any(sg.kind == "conventional" and set(argmax) & set(sg.ops) for sg in p.segments):
            p.notes["sampled_us"] = (p.predicted_us - conventional_us(g, argmax, prof) + prof.boundary_us
                                     + coster.megakernel_us(argmax, base))
    plans.sort(key=lambda p: p.predicted_us)
    for p in plans:
        if infeasible:
            p.notes["infeasible"] = dict(infeasible)
        p.notes["simulations"] = coster.simulations
        p.notes["extrapolated_segments"] = coster.extrapolated
    return plans


def choose(cfg: ModelConfig, **kw) -> Plan:
    return candidates(cfg, **kw)[0]
