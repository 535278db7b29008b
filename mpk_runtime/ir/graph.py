"""The graph IR: one decode step (or one prefill chunk) of one TP rank as typed ops.

Each op is a fused unit that later stages decompose into tile tasks (`tasks/ops/<kind>.py`); every op states
its tensors by role in `attrs`, and the bytes it must move and the flops it must do for the given batch,
tokens per sequence and context length. Tensors are SSA within a step: each is written by exactly one op, so
the only write-after-read hazards are across steps, where the token dependency orders them.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ..models.config import ModelConfig

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int64": 8, "int32": 4}

# Tensor kinds: weight (read-only), act (activation, one per step), kv (persistent paged cache),
# sym (symmetric buffer written by peers; double-buffered by step parity), io (host-visible input/output).
TENSOR_KINDS = ("weight", "act", "kv", "sym", "io")


@dataclass
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for s in self.shape:
            n *= s
        return n


@dataclass
class Op:
    name: str
    kind: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any]
    bytes: int = 0      # bytes that must move through device memory (each input read once, outputs written once)
    flops: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Graph:
    config: ModelConfig
    mode: str                  # "decode" | "prefill"
    batch: int                 # sequences in the step
    tokens_per_seq: int        # 1 for decode, the chunk length for prefill
    context_len: int           # context length used for cost estimates (KV bytes); the step itself is dynamic
    max_seq_len: int           # KV capacity per sequence
    tp: int
    rank: int
    tensors: dict[str, TensorSpec]
    ops: list[Op]
    tp_invariant: int = 1      # build_graph's tp_invariant: reductions ordered as a TP=R group's (1 = off)

    @property
    def rows(self) -> int:
        return self.batch * self.tokens_per_seq

    def op(self, name: str) -> Op:
        for o in self.ops:
            if o.name == name:
                return o
        raise KeyError(f"no op {name!r} in graph; ops: {[o.name for o in self.ops][:8]}...")

    def subgraph(self, op_names: list[str] | set[str]) -> "Graph":
        """The same step restricted to some ops (a plan segment). Tensors are shared, so segments hand
        activations and the KV cache to each other through memory; inputs produced by an earlier segment
        are complete when the segment starts (the launch boundary orders them)."""
        keep = set(op_names)
        unknown = keep - {o.name for o in self.ops}
        if unknown:
            raise KeyError(f"ops not in graph: {sorted(unknown)[:5]}")
        return Graph(self.config, self.mode, self.batch, self.tokens_per_seq, self.context_len, self.max_seq_len,
                     self.tp, self.rank, self.tensors, [o for o in self.ops if o.name in keep], self.tp_invariant)

    def total_bytes(self) -> int:
        return sum(o.bytes for o in self.ops)

    def total_flops(self) -> int:
        return sum(o.flops for o in self.ops)

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values() if t.kind == "weight")

    # --- serialisation ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "config": self.config.to_dict(), "mode": self.mode, "batch": self.batch,
            "tokens_per_seq": self.tokens_per_seq, "context_len": self.context_len, "max_seq_len": self.max_seq_len,
            "tp": self.tp, "rank": self.rank, "tp_invariant": self.tp_invariant,
            "tensors": [asdict(t) for t in self.tensors.values()],
            "ops": [o.to_dict() for o in self.ops],
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "Graph":
        tensors = {t["name"]: TensorSpec(t["name"], tuple(t["shape"]), t["dtype"], t["kind"], t.get("attrs", {}))
                   for t in d["tensors"]}
        ops = [Op(**o) for o in d["ops"]]
        return cls(ModelConfig.from_dict(d["config"]), d["mode"], d["batch"], d["tokens_per_seq"], d["context_len"],
                   d["max_seq_len"], d["tp"], d["rank"], tensors, ops, d.get("tp_invariant", 1))

    @classmethod
    def from_json(cls, s: str) -> "Graph":
        return cls.from_dict(json.loads(s))

    def summary(self) -> str:
        lines = [f"Graph {self.config.name} {self.mode} batch={self.batch} tokens/seq={self.tokens_per_seq} "
                 f"ctx={self.context_len} tp={self.tp} rank={self.rank}: {len(self.ops)} ops, "
                 f"{self.total_bytes() / 1e6:.2f} MB, {self.total_flops() / 1e9:.3f} GFLOP"]
        by_kind: dict[str, list[int]] = {}
        for o in self.ops:
            k = by_kind.setdefault(o.kind, [0, 0, 0])
            k[0] += 1
            k[1] += o.bytes
            k[2] += o.flops
        for kind, (n, b, f) in by_kind.items():
            lines.append(f"  {kind:12s} x{n:4d}  {b / 1e6:10.2f} MB  {f / 1e9:9.3f} GFLOP")
        return "\n".join(lines)
