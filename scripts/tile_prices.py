#!/usr/bin/env python3
"""Traced against simulated durations of the one megakernel's linear tiles, grouped by tile shape (no GPU).

    PYTHONPATH=. python3 scripts/tile_prices.py bench/results/s34/run6_stamps_big/bench/trace_*.json.gz \
        [--profile h200_v42] [--num-sms 132] [--nsteps 8]

Each trace (`bench_decode.py --trace`: trace_<model>_b<B>_c<ctx>_s<splits>.json.gz) is matched to the task graph
bench_decode built (scripts/refit_from_traces.rebuild); its last step's tasks are grouped by op and tile shape
(rows M, K, tile width w x weights nw, Tensor Core rows a pass x passes: codegen/layout.linear_geometry, the
packer's function), and each group's median traced duration is set beside the simulator's (planner/simulate.py
with the profile's regime for that batch, one step, the same schedule). "short a pass" is (traced - simulated) /
passes: what a per-pass term would have to carry (docs/planner.md session 34).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from refit_from_traces import NAME, load_trace, rebuild  # noqa: E402

from mpk_runtime.planner.profile import HardwareProfile  # noqa: E402
from mpk_runtime.planner.simulate import linear_passes, linear_shape, simulate  # noqa: E402
from mpk_runtime.planner.trace_fit import _TASK_ID  # noqa: E402


def tile_groups(events: list[dict], tg, prof: HardwareProfile) -> list[dict]:
    """One row per (op, tile shape) of the linear tiles in the last traced step of `events`: median traced and
    simulated durations (us), passes and the shortfall a pass. `prof` is used as given (pick the regime first)."""
    ev = [e for e in events if e.get("ph") == "X"]
    step = max(e["args"]["step"] for e in ev)
    sim = simulate([tg], prof, steps=1, record=True)
    groups: dict[tuple, list[tuple[float, float]]] = {}
    for e in ev:
        if e["args"]["step"] != step:
            continue
        t = tg.tasks[int(_TASK_ID.search(e["args"]["label"]).group(1))]
        if t.kind != "linear":
            continue
        M, K, w, nw, _ = linear_shape(t)
        rows, passes = linear_passes(t)
        key = (t.op.split(".")[-1], M, K, w, nw, rows, passes)
        groups.setdefault(key, []).append((float(e["dur"]), sim.end[(0, 1, t.id)] - sim.start[(0, 1, t.id)]))
    out = []
    for (op, M, K, w, nw, rows, passes), v in groups.items():
        traced = statistics.median(x[0] for x in v)
        simulated = statistics.median(x[1] for x in v)
        out.append(dict(op=op, M=M, K=K, w=w, nw=nw, tc_rows=rows, passes=passes, tasks=len(v), traced_us=traced,
                        simulated_us=simulated, short_per_pass_us=(traced - simulated) / passes))
    return sorted(out, key=lambda r: -r["traced_us"] * r["tasks"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--profile", default=None, help="default: the planner's default profile")
    ap.add_argument("--num-sms", type=int, default=132)
    ap.add_argument("--nsteps", type=int, default=8, help="steps per launch the bench traced (bench_decode: 8)")
    a = ap.parse_args()
    prof = HardwareProfile.load(a.profile)
    for path in map(Path, a.traces):
        m = NAME.search(path.name)
        if not m:
            print(f"skip {path.name}: not trace_<model>_b<B>_c<ctx>_s<splits>.json(.gz)", file=sys.stderr)
            continue
        B = int(m["b"])
        tg = rebuild(m["model"], B, int(m["c"]), int(m["s"]), a.nsteps, a.num_sms)
        print(f"== {m['model']} B={B} ctx={m['c']} ({prof.name}, regime of B={B})")
        print(f"  {'op':10s} {'M':>4s} {'K':>6s} {'w x nw':>8s} {'rows x passes':>13s} {'tasks':>5s} {'traced':>8s} "
              f"{'sim':>8s} {'short/pass':>10s}")
        for r in tile_groups(load_trace(path), tg, prof.for_batch(B)):
            print(f"  {r['op']:10s} {r['M']:4d} {r['K']:6d} {r['w']:5d} x{r['nw']} {r['tc_rows']:6d} x {r['passes']:4d} "
                  f"{r['tasks']:5d} {r['traced_us']:8.1f} {r['simulated_us']:8.1f} {r['short_per_pass_us']:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
