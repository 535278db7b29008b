"""A Plan: how one step of one model is run, as a list of segments over the Graph's ops.

A segment is a run of consecutive ops executed either as one persistent megakernel (with its own task graph,
tiling and SM count) or as conventional kernels (torch ops, captured in a CUDA graph on a GPU). One
megakernel for the whole step is the plan with one megakernel segment.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields


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
        """The plan of Plan.to_dict. Anything else (a plan book, a list, fields missing or of another version, a
        segment without its kind or ops) is a ValueError saying what it is: plans travel as JSON (controller ->
        workers, files), and a corrupt one gave a bare KeyError / TypeError traceback, or a Plan whose segments were
        dicts, failing only when a step ran it."""
        if isinstance(d, dict) and "buckets" in d:
            raise ValueError("this is a plan book ({\"buckets\": ...}), not a plan: take a bucket's plan with "
                             "planner.book.pick_plan(book, batch)")
        if not isinstance(d, dict):
            raise ValueError(f"a plan is a JSON object (Plan.to_dict), got {type(d).__name__}")
        _check_keys("plan", d, cls)
        if not isinstance(d["segments"], list) or not d["segments"]:
            raise ValueError(f"plan {d.get('name')!r}: segments must be a non-empty list, got {d['segments']!r:.60}")
        for i, s in enumerate(d["segments"]):
            if not isinstance(s, dict):
                raise ValueError(f"plan {d.get('name')!r}: segment {i} is not an object: {s!r:.60}")
            _check_keys(f"plan {d.get('name')!r} segment {i}", s, Segment)
            if s["kind"] not in ("megakernel", "conventional") or not isinstance(s["ops"], list) or not s["ops"]:
                raise ValueError(f"plan {d.get('name')!r} segment {i}: kind must be 'megakernel' or 'conventional' "
                                 f"and ops a non-empty list of op names, got {s['kind']!r} / {s['ops']!r:.60}")
        d = dict(d)
        d["segments"] = [Segment(**s) for s in d["segments"]]
        d["band"] = tuple(d.get("band", (0.0, 0.0)))
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> "Plan":
        try:
            d = json.loads(s)
        except ValueError as e:
            raise ValueError(f"not a plan's JSON ({e}): write it with Plan.to_json") from None
        return cls.from_dict(d)

    def check_for(self, model: str | None = None, tp: int | None = None) -> "Plan":
        """This plan, if it was made for `model` and `tp` (None: not checked); else a ValueError saying whose plan it
        is. A plan of another model whose op names happen to match (the same layer count) ran without a word, priced
        for the other model's shapes; one of another tp failed only when its step ran."""
        for what, want, have in (("model", model, self.model), ("tp", tp, self.tp)):
            if want is not None and want != have:
                raise ValueError(f"plan {self.name!r} was made for {what} {have!r}, not {want!r}: make plans for this "
                                 f"{what} (planner.book.plan_book / planner.search.candidates)")
        return self

    def describe(self) -> str:
        kinds = "+".join(("M" if s.kind == "megakernel" else "C") + str(len(s.ops)) for s in self.segments)
        lo, hi = self.band
        return (f"{self.name:14s} {len(self.segments):3d} segments [{kinds[:40]}{'...' if len(kinds) > 40 else ''}] "
                f"predicted {self.predicted_us:8.1f} us  ({lo:.0f}-{hi:.0f})")


def _check_keys(what: str, d: dict, cls) -> None:
    """d holds every field of dataclass cls that has no default, and no other keys (ValueError naming them)."""
    names = {f.name for f in fields(cls)}
    missing = [f.name for f in fields(cls)
               if f.default is MISSING and f.default_factory is MISSING and f.name not in d]
    unknown = sorted(set(d) - names)
    if missing or unknown:
        raise ValueError(f"{what} is not a Plan.to_dict: " + "; ".join(
            x for x in (f"missing {missing}" if missing else "", f"unknown fields {unknown} (written by another "
                        "version of mpk-runtime? plan again)" if unknown else "") if x))
