"""A Plan: how one step of one model is run, as a list of segments over the Graph's ops.

A segment is a run of consecutive ops executed either as one persistent megakernel (with its own task graph,
tiling and SM count) or as conventional kernels (torch ops, captured in a CUDA graph on a GPU). One
megakernel for the whole step is the plan with one megakernel segment.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class Segment:
    kind: str                        # "megakernel" | "conventional"
    ops: list[str]                   # op names, consecutive in the Graph
    tiling: dict = field(default_factory=dict)   # Tiling fields for megakernel segments
    predicted_us: float = 0.0
    features: dict = field(default_factory=dict)   # the price's terms (cost.segment features; fit.py refits)


@dataclass
class Plan:
    model: str
    tp: int
    batch: int
    context_len: int
    name: str                        # candidate family, e.g. "mono", "mega3", "conventional", "attn-conv"
    segments: list[Segment]
    attn_splits: int = 1
    predicted_us: float = 0.0        # whole step, launches included
    band: tuple[float, float] = (0.0, 0.0)   # uncertainty band (us)
    profile: str = "h200"
    notes: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        d = dict(d)
        d["segments"] = [Segment(**s) for s in d["segments"]]
        d["band"] = tuple(d.get("band", (0.0, 0.0)))
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> "Plan":
        return cls.from_dict(json.loads(s))

    def describe(self) -> str:
        kinds = "+".join(("M" if s.kind == "megakernel" else "C") + str(len(s.ops)) for s in self.segments)
        lo, hi = self.band
        return (f"{self.name:14s} {len(self.segments):3d} segments [{kinds[:40]}{'...' if len(kinds) > 40 else ''}] "
                f"predicted {self.predicted_us:8.1f} us  ({lo:.0f}-{hi:.0f})")
