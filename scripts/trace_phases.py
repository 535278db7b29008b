#!/usr/bin/env python3
"""Where a megakernel step's time goes, from a per-task Chrome trace (Megakernel.chrome_trace; bench_decode.py
--tp 2 writes one per rank): SM busy share per op kind, and each op's phase (first task start to last task end,
mean over layers) against the time its bytes (Graph op.bytes) take at the streaming floor.

    PYTHONPATH=. python3 scripts/trace_phases.py TRACE.json[.gz] --model qwen3-8b --tp 2 [--step 2] [--bw 4.55e12]
    PYTHONPATH=. python3 scripts/trace_phases.py TRACE.json[.gz] --gaps     # per op kind: task durations and the gap
        before each task on its SM (its waits: how long the SM idled), with the op that ran before it there
    PYTHONPATH=. python3 scripts/trace_phases.py TRACE.json[.gz] --attn     # the attention phase's critical path:
        per key split, its tasks' durations and ends (from the layer's last qkv task); per (layer, sequence, KV
        group), when its last and second-to-last partials end (the last one merges the group: the fold) and
        which split was last
    PYTHONPATH=. python3 scripts/trace_phases.py STAGES.json.gz --merge   # a stage-stamp file (bench_decode --trace
        with -DMPK_STAGE_WORDS=12, gpu_pending.sh stamps): the folded merge's chain in the partial that merges each
        (layer, sequence, KV group): its chunk's rows written -> the ticket taken -> merged -> signals issued, and
        how long after the group's other partials' signals it signals
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
    ap.add_argument("--model", default=None, help="required unless --gaps")
    ap.add_argument("--gaps", action="store_true", help="task durations and the idle gap before each task, per op kind")
    ap.add_argument("--attn", action="store_true", help="the attention phase by key split, and the merging partial")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--step", type=int, default=None, help="default: the last traced step")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--bw", type=float, default=4.55e12, help="streaming floor, bytes/s per GPU")
    ap.add_argument("--merge", action="store_true", help="TRACE is a stage-stamp file: the folded merge's chain")
    a = ap.parse_args()
    if a.merge:
        return merge_chain(a.trace)
    ev = load(a.trace)
    step = a.step or max(e["args"]["step"] for e in ev)
    ev = [e for e in ev if e["args"]["step"] == step]
    if a.gaps:
        return gaps(ev)
    if a.attn:
        return attn(ev)
    if a.model is None:
        ap.error("--model is required (the bytes of each op come from its graph)")
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


def gaps(ev: list[dict]) -> int:
    """Per op kind: median / p90 task duration, and the gap between the SM's previous task's end and this task's
    start (the waits on its events plus the control path), median / p10 / p90, and the kinds that ran before."""
    import statistics
    kind = lambda c: re.sub(r"^L\d+\.", "", c)  # noqa: E731
    by_sm: dict[int, list] = collections.defaultdict(list)
    for e in ev:
        by_sm[e["tid"]].append(e)
    dur: dict[str, list[float]] = collections.defaultdict(list)
    gap: dict[str, list[float]] = collections.defaultdict(list)
    prev: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for lst in by_sm.values():
        lst.sort(key=lambda e: e["ts"])
        for x, y in zip(lst, lst[1:]):
            gap[kind(y["cat"])].append(y["ts"] - x["ts"] - x["dur"])
            prev[kind(y["cat"])][kind(x["cat"])] += 1
    for e in ev:
        dur[kind(e["cat"])].append(e["dur"])
    q = lambda v, p: sorted(v)[min(len(v) - 1, int(p * len(v)))]  # noqa: E731
    print(f"{'op':18s} {'tasks':>6s} {'dur med':>8s} {'dur p90':>8s} {'gap med':>8s} {'gap p10':>8s} {'gap p90':>8s}  before")
    for k in sorted(dur, key=lambda k: -sum(dur[k])):
        g = gap[k] or [0.0]
        print(f"{k:18s} {len(dur[k]):6d} {statistics.median(dur[k]):8.2f} {q(dur[k], .9):8.2f} "
              f"{statistics.median(g):8.2f} {q(g, .1):8.2f} {q(g, .9):8.2f}  {dict(prev[k].most_common(2))}")
    return 0


def attn(ev: list[dict]) -> int:
    """The attention phase, in us after the layer's last qkv_rope task ended: per key split, the median duration
    and end of its partials; per (layer, sequence b, KV group g), the last partial's end (it takes the group's last
    ticket and merges, when the merge is folded), the second-to-last's end (the others' work done), the last one's
    duration, and how often each split was the last. Labels: "... b=B g=G split=S]" (Megakernel.chrome_trace)."""
    import statistics
    med = statistics.median
    qkv_end: dict[str, float] = {}
    for e in ev:
        if e["cat"].endswith(".qkv_rope"):
            lay = e["cat"].split(".")[0]
            qkv_end[lay] = max(qkv_end.get(lay, 0.0), e["ts"] + e["dur"])
    by_split: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    groups: dict[tuple, list[tuple[float, int, float]]] = collections.defaultdict(list)
    for e in ev:
        m = re.search(r"\bb=(\d+) g=(\d+) split=(\d+)", e["args"].get("label", ""))
        lay = e["cat"].split(".")[0]
        if e["name"] != "attn_partial" or m is None or lay not in qkv_end:
            continue
        end = e["ts"] + e["dur"] - qkv_end[lay]
        by_split[int(m.group(3))].append((e["dur"], end))
        groups[(lay, int(m.group(1)), int(m.group(2)))].append((end, int(m.group(3)), e["dur"]))
    if not groups:
        print("no attn_partial tasks with a layer's qkv_rope tasks in this step")
        return 1
    print(f"{'split':>5s} {'tasks':>6s} {'dur med':>8s} {'end med':>8s}  (us; ends from the layer's last qkv task)")
    for sp in sorted(by_split):
        v = by_split[sp]
        print(f"{sp:5d} {len(v):6d} {med(d for d, _ in v):8.2f} {med(x for _, x in v):8.2f}")
    last = [max(v) for v in groups.values()]
    second = [sorted(v)[-2] for v in groups.values() if len(v) > 1]
    who = collections.Counter(x[1] for x in last)
    print(f"groups {len(groups)}: last partial ends {med(x[0] for x in last):.2f} (its duration {med(x[2] for x in last):.2f}), "
          f"second-to-last {med(x[0] for x in second):.2f}" if second else "one partial a group")
    print("last split:", ", ".join(f"{sp} {n / len(last):.0%}" for sp, n in who.most_common(4)))
    return 0


def merge_chain(path: str) -> int:
    """The folded merge's chain from a stage-stamp file (scripts/_bench_common.stage_summary rows: id, kind, op, SM,
    start, end, stamps, label). An attn_partial's stamps: 4 its chunk's part / lse rows written, 6 its group ticket
    taken (attention.cuh), K-2 the op done (the merge, for the partial that took the group's last ticket), K-1 its
    signals issued (megakernel.cu). Per (layer, b, g) the merger is the partial that wrote the merge's stamps 10-12
    after its ticket (K >= 16 builds; with K = 12 the latest ticket stamp, which session 36 found wrong for about half
    of llama's groups); medians over groups, in us, of the merger's steps and of its signal's lag behind the group's
    other partials' last signal."""
    import statistics
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        d = json.load(f)
    k = d["stage_words"]
    groups: dict[tuple, list] = collections.defaultdict(list)
    for r in d["rows"]:
        if r[1] != "attn_partial" or len(r) < 8:
            continue
        m = re.search(r"\bb=(\d+) g=(\d+) split=(\d+)", r[7])
        st = r[6]
        if m is None or not (st[4] and st[6] and st[k - 2] and st[k - 1]):
            continue   # not folded (no ticket), or a file from before the ticket stamp (session 35)
        groups[(r[2].split(".")[0], int(m.group(1)), int(m.group(2)))].append((st[6], int(m.group(3)), r[4], st))
    if not groups:
        print("no folded attn_partial rows with the ticket stamp (a -DMPK_STAGE_WORDS build from session 35 on)")
        return 1
    steps = collections.defaultdict(list)
    for v in groups.values():
        v.sort()
        if k >= 16:   # the partial that wrote the merge's stamps after its ticket merged (the ticket stamps, taken
            # after the atomic's return, can come out of the atomic's order: session 36, llama-3.2-1b B=1, 65 of 128)
            v.sort(key=lambda x: (bool(x[3][12] > x[3][6]), x[0]))
        _, _, start, st = v[-1]
        steps["chunk (start -> rows written)"].append((st[4] - start) / 1e3)
        steps["ticket (rows written -> ticket)"].append((st[6] - st[4]) / 1e3)
        steps["merge (ticket -> merged)"].append((st[k - 2] - st[6]) / 1e3)
        if k >= 16 and st[10] and st[11] and st[12]:   # attention_merge.cuh's stamps, thread 0's outputs
            steps["  ticket -> 1st output's lse max"].append((st[10] - st[6]) / 1e3)
            steps["  -> 1st output written"].append((st[11] - st[10]) / 1e3)
            steps["  -> every output of thread 0"].append((st[12] - st[11]) / 1e3)
            steps["  -> op done"].append((st[k - 2] - st[12]) / 1e3)
        steps["signal (merged -> signals issued)"].append((st[k - 1] - st[k - 2]) / 1e3)
        if len(v) > 1:
            steps["lag behind the others' last signal"].append((st[k - 1] - max(x[3][k - 1] for x in v[:-1])) / 1e3)
            steps["others: ticket (rows written -> ticket)"] += [(x[3][6] - x[3][4]) / 1e3 for x in v[:-1]]
    print(f"folded groups: {len(groups)}, partials a group: {statistics.median(len(v) for v in groups.values()):.0f}")
    for name, xs in steps.items():
        print(f"  {name:42s} {statistics.median(xs):7.2f} us (median of {len(xs)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
