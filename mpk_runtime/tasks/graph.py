"""Task graphs: tile tasks, monotonic event counters and static per-SM task lists for one rank.

Protocol (shared by the GPU kernel, the CPU executor pyvm and the cost simulator):
  * Steps are numbered 1, 2, 3, ... and counters are never reset between steps.
  * Before task t of step s runs, for each (event e, lag) in t.waits: counter[e] >= e.triggers * (s - lag).
  * After t finishes (its writes visible), for each (rank r, event e) in t.signals: counter_r[e] += 1
    (release semantics; remote ranks' counters live on the symmetric heap).
  * SM k runs sm_lists[k] in order, once per step.
Events are made per distinct producer set: a consumer waits only for the producer tiles whose output regions
it reads, so an event's `triggers` is the number of tasks that signal it in one step.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Region:
    """A box in a tensor of one rank: half-open ranges over its leading dims (missing dims: all)."""

    tensor: str
    rank: int
    ranges: tuple[tuple[int, int], ...]

    def overlaps(self, other: "Region") -> bool:
        if self.tensor != other.tensor or self.rank != other.rank:
            return False
        for (a0, a1), (b0, b1) in zip(self.ranges, other.ranges):
            if a1 <= b0 or b1 <= a0:
                return False
        return True

    def to_list(self) -> list:
        return [self.tensor, self.rank, [list(r) for r in self.ranges]]

    @classmethod
    def from_list(cls, x: list) -> "Region":
        return cls(x[0], x[1], tuple(tuple(r) for r in x[2]))


@dataclass
class Task:
    id: int                      # index in its rank's TaskGraph.tasks
    rank: int
    kind: str                    # task kind (opcode name), e.g. "linear", "attn_partial"
    op: str                      # the IR op it belongs to
    params: dict[str, Any]       # tile coordinates and op attributes the kernel needs
    reads: list[Region]
    writes: list[Region]
    lag_writes: list[Region] = field(default_factory=list)   # outputs consumed by the *next* step
    waits: list[tuple[int, int]] = field(default_factory=list)     # (event id on this rank, step lag)
    signals: list[tuple[int, int]] = field(default_factory=list)   # (rank, event id on that rank)
    est_bytes: int = 0
    est_flops: int = 0
    sm: int = -1                 # assigned by the scheduler
    order: int = -1              # position in its SM's list

    def label(self) -> str:
        return f"rank{self.rank}/task{self.id}[{self.kind} {self.op} {_short(self.params)}]"

    def to_dict(self) -> dict:
        return {"id": self.id, "rank": self.rank, "kind": self.kind, "op": self.op, "params": self.params,
                "reads": [r.to_list() for r in self.reads], "writes": [r.to_list() for r in self.writes],
                "lag_writes": [r.to_list() for r in self.lag_writes],
                "waits": [list(w) for w in self.waits], "signals": [list(s) for s in self.signals],
                "est_bytes": self.est_bytes, "est_flops": self.est_flops, "sm": self.sm, "order": self.order}

    @classmethod
    def from_dict(cls, d: dict) -> "Task":
        return cls(d["id"], d["rank"], d["kind"], d["op"], d["params"],
                   [Region.from_list(r) for r in d["reads"]], [Region.from_list(r) for r in d["writes"]],
                   [Region.from_list(r) for r in d.get("lag_writes", [])],
                   [tuple(w) for w in d["waits"]], [tuple(s) for s in d["signals"]],
                   d.get("est_bytes", 0), d.get("est_flops", 0), d.get("sm", -1), d.get("order", -1))


def _short(params: dict) -> str:
    keys = [k for k in ("b", "g", "head", "split", "n0", "n1", "m0", "m1") if k in params]
    return " ".join(f"{k}={params[k]}" for k in keys)


@dataclass
class Event:
    id: int
    rank: int
    triggers: int                        # signals per step
    producers: list[tuple[int, int]]     # (rank, task id) of each signalling task, for diagnostics


@dataclass
class TaskGraph:
    rank: int
    world_size: int
    num_sms: int
    tasks: list[Task]
    events: list[Event]
    sm_lists: list[list[int]]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "num_sms": self.num_sms, "meta": self.meta,
                "tasks": [t.to_dict() for t in self.tasks],
                "events": [{"id": e.id, "rank": e.rank, "triggers": e.triggers, "producers": [list(p) for p in e.producers]}
                           for e in self.events],
                "sm_lists": self.sm_lists}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "TaskGraph":
        return cls(d["rank"], d["world_size"], d["num_sms"], [Task.from_dict(t) for t in d["tasks"]],
                   [Event(e["id"], e["rank"], e["triggers"], [tuple(p) for p in e["producers"]]) for e in d["events"]],
                   d["sm_lists"], d.get("meta", {}))

    @classmethod
    def from_json(cls, s: str) -> "TaskGraph":
        return cls.from_dict(json.loads(s))

    def summary(self) -> str:
        kinds = Counter(t.kind for t in self.tasks)
        per_sm = [len(l) for l in self.sm_lists]
        waits = sum(len(t.waits) for t in self.tasks)
        remote = sum(1 for t in self.tasks for r, _ in t.signals if r != self.rank)
        lines = [f"TaskGraph rank {self.rank}/{self.world_size}: {len(self.tasks)} tasks on {self.num_sms} SMs, "
                 f"{len(self.events)} events, {waits} waits, {remote} cross-rank signals",
                 f"  tasks per SM: min {min(per_sm)} max {max(per_sm)} mean {sum(per_sm) / len(per_sm):.1f}",
                 "  tasks by kind: " + ", ".join(f"{k}={n}" for k, n in kinds.items())]
        if "makespan_us" in self.meta:
            lines.append(f"  scheduled makespan (cost model): {self.meta['makespan_us']:.1f} us")
        return "\n".join(lines)
