"""The GPU's clocks, power and temperature during each bench_decode cell, from an nvidia-smi trace taken beside it.

    python3 scripts/smi_join.py <bench_decode.json> <smi_trace.csv>
    python3 scripts/smi_join.py - <smi_trace.csv>        # the whole trace as one window (A/B modes)

scripts/gpu_pending.sh (mode bench) runs `nvidia-smi --query-gpu=timestamp,clocks.sm,... --format=csv -lms 500` for
the whole bench and this script afterwards. A cell's window runs from its row's start (meta.t0_local + t_s) to the
next row's start, so it holds the cell's setup (weights, compile, capture) and its timed steps; the samples under
load are those drawing more than --load-w watts. Why (docs/perf-notes.md session 43): the bench measured the same
conventional plan 4-8% slower than the A/B harness on one machine start, and whether the GPU's clocks differed
between the two was not recorded.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import statistics
import sys


def _num(v: str) -> float | None:
    v = v.strip().split(" ")[0]
    try:
        return float(v)
    except ValueError:
        return None


def read_trace(path: str) -> list[dict]:
    """Rows of the csv as {t: naive local datetime, sm, mem, power, temp, reasons}; unparsable lines skipped."""
    out = []
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return out
    head = [h.strip().split(" [")[0] for h in rows[0]]
    for r in rows[1:]:
        if len(r) != len(head):
            continue
        d = dict(zip(head, (c.strip() for c in r)))
        try:
            t = datetime.datetime.strptime(d["timestamp"], "%Y/%m/%d %H:%M:%S.%f")
        except (KeyError, ValueError):
            continue
        out.append(dict(t=t, sm=_num(d.get("clocks.current.sm", "")), mem=_num(d.get("clocks.current.memory", "")),
                        power=_num(d.get("power.draw", "")), temp=_num(d.get("temperature.gpu", "")),
                        reasons=d.get("clocks_event_reasons.active", d.get("clocks_throttle_reasons.active", ""))))
    return out


def windows(bench: dict) -> list[tuple[dict, datetime.datetime, datetime.datetime]]:
    """(row, start, end) per bench row, in the order the bench ran them."""
    t0 = datetime.datetime.fromisoformat(bench["meta"]["t0_local"])
    rows = sorted((r for r in bench["rows"] if "t_s" in r), key=lambda r: r["t_s"])
    out = []
    for i, r in enumerate(rows):
        a = t0 + datetime.timedelta(seconds=r["t_s"])
        b = t0 + datetime.timedelta(seconds=rows[i + 1]["t_s"]) if i + 1 < len(rows) else datetime.datetime.max
        out.append((r, a, b))
    return out


def summarize(samples: list[dict], load_w: float) -> dict:
    """Clock / power / temperature over a window's samples under load (power > load_w)."""
    busy = [s for s in samples if s["power"] is not None and s["power"] > load_w]
    if not busy:
        return dict(n=len(samples), n_load=0)
    sm = [s["sm"] for s in busy if s["sm"] is not None]
    return dict(n=len(samples), n_load=len(busy), sm_min=min(sm), sm_med=statistics.median(sm), sm_max=max(sm),
                power_max=max(s["power"] for s in busy), temp_max=max(s["temp"] or 0 for s in busy),
                reasons=sorted({s["reasons"] for s in busy if s["reasons"] not in ("", "0x0000000000000000")}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bench")
    ap.add_argument("trace")
    ap.add_argument("--load-w", type=float, default=150.0, help="samples above this power count as under load")
    a = ap.parse_args(argv)
    if a.bench == "-":
        trace = read_trace(a.trace)
        s = summarize(trace, a.load_w)
        print(json.dumps({k: v for k, v in s.items()}, default=str) if s["n_load"] else
              f"{a.trace}: {s['n']} samples, none under load")
        return 0
    bench = json.load(open(a.bench))
    if "t0_local" not in bench.get("meta", {}):
        print(f"{a.bench} has no meta.t0_local (a bench_decode.json from before session 43): nothing to join")
        return 1
    trace = read_trace(a.trace)
    if not trace:
        print(f"{a.trace}: no samples")
        return 1
    print(f"{'system':10s} {'model':13s} {'B':>3s} {'ctx':>5s} {'ms':>8s}  samples  SM MHz min/med/max  W max  C max"
          "  reasons")
    for r, lo, hi in windows(bench):
        s = summarize([x for x in trace if lo <= x["t"] < hi], a.load_w)
        ms = f"{r['ms']:8.3f}" if r.get("status") == "ok" else f"{'-':>8s}"
        cell = f"{r['system']:10s} {r['model']:13s} {r['batch']:3d} {r['context']:5d} {ms}"
        if not s["n_load"]:
            print(f"{cell}  {s['n']:3d}/0    (none under load)")
            continue
        print(f"{cell}  {s['n']:3d}/{s['n_load']:<3d}  {s['sm_min']:5.0f}/{s['sm_med']:5.0f}/{s['sm_max']:5.0f}  "
              f"{s['power_max']:5.0f}  {s['temp_max']:4.0f}  {','.join(s['reasons']) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
