#!/usr/bin/env python3
"""Where a megakernel step's time goes, from a per-task Chrome trace (Megakernel.chrome_trace; bench_decode.py
--tp 2 writes one per rank): SM busy share per op kind, and each op's phase (first task start to last task end,
mean over layers) against the time its bytes (Graph op.bytes) take at the streaming floor.

    PYTHONPATH=. python3 scripts/trace_phases.py TRACE.json[.gz] --model qwen3-8b --tp 2 [--step 2] [--bw 4.55e12]
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load(path: str) -> list[dict]:
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        d = json.load(f)
    return [e for e in (d["traceEvents"] if isinstance(d, dict) else d) if e.get("ph") == "X"]


def bytes_per_op(model: str, tp: int, batch: int, context: int) -> dict[str, float]:
    """Mean bytes each op must move (Graph op.bytes: weights once, activations, KV; rank 0's graph), keyed like
    the trace's op kinds."""
    from mpk_runtime.ir.build import build_graph
    from mpk_runtime.models.config import load_config
    g = build_graph(load_config(model), batch=batch, context_len=context, tp=tp, rank=0)
    per: dict[str, list[int]] = collections.defaultdict(list)
    for o in g.ops:
        per[re.sub(r"^L\d+\.", "", o.name)].append(o.bytes)
    return {k: sum(v) / len(v) for k, v in per.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--step", type=int, default=None, help="default: the last traced step")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--bw", type=float, default=4.55e12, help="streaming floor, bytes/s per GPU")
    a = ap.parse_args()
    ev = load(a.trace)
    step = a.step or max(e["args"]["step"] for e in ev)
    ev = [e for e in ev if e["args"]["step"] == step]
    sms = len({e["tid"] for e in ev})
    t0, t1 = min(e["ts"] for e in ev), max(e["ts"] + e["dur"] for e in ev)
    kind = lambda c: re.sub(r"^L\d+\.", "", c)  # noqa: E731
    busy: collections.Counter = collections.Counter()
    ntask: collections.Counter = collections.Counter()
    spans: dict[str, list[float]] = collections.defaultdict(list)
    by_op: dict[str, list] = collections.defaultdict(list)
    for e in ev:
        busy[kind(e["cat"])] += e["dur"]
        ntask[kind(e["cat"])] += 1
        by_op[e["cat"]].append((e["ts"], e["ts"] + e["dur"]))
    for op, iv in by_op.items():
        spans[kind(op)].append(max(b for _, b in iv) - min(x for x, _ in iv))
    wb = bytes_per_op(a.model, a.tp, a.batch, a.context)
    span = t1 - t0
    print(f"{a.model} tp={a.tp} step {step}: {span:.0f} us on {sms} SMs, SMs busy {sum(busy.values()) / (span * sms):.1%}")
    print(f"{'op':20s} {'phase us':>9s} {'x ops':>6s} {'tasks/op':>8s} {'bytes MB':>10s} {'floor us':>9s} {'SM busy':>8s}")
    for k, v in sorted(spans.items(), key=lambda kv: -sum(kv[1])):
        nops = len(v)
        mb = wb.get(k, 0.0) / 1e6
        print(f"{k:20s} {sum(v) / nops:9.1f} {nops:6d} {ntask[k] / nops:8.0f} {mb:10.1f} {mb * 1e12 / a.bw:9.1f} "
              f"{busy[k] / (span * sms):8.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
