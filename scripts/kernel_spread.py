#!/usr/bin/env python3
"""Kernel-by-kernel spread across several profile logs of the same step (scripts/profile_conventional.py's table:
`<us> us <calls>x <kernel name>` lines), e.g. gpu_pending.sh varq's three fresh processes: which kernels moved
between them, and by how much of the step.

    python3 scripts/kernel_spread.py profile_p1.log profile_p2.log profile_p3.log [--top 12] [--min-ratio 1.1]

Prints, per kernel (names cut to 70 characters, as the logs print them), its us a step in each log, max / min,
and max - min; kernels whose ratio reaches --min-ratio are marked, heaviest first."""
from __future__ import annotations

import argparse
import re
import sys

LINE = re.compile(r"^\s+([\d.]+) us\s+(\d+)x\s+(.+?)\s*$")


def parse(path: str) -> dict[str, float]:
    """kernel name (first 70 characters) -> us a step, summed over the log's first table (one model / batch)."""
    out: dict[str, float] = {}
    with open(path) as f:
        for ln in f:
            if ln.startswith("==") and out:
                break   # a second table (another point): only the first is compared
            m = LINE.match(ln)
            if m:
                name = m.group(3)[:70]
                out[name] = out.get(name, 0.0) + float(m.group(1))
    return out


def spread(tables: list[dict[str, float]]) -> list[tuple[str, list[float], float, float]]:
    """(name, us per log (0 where absent), max / min, max - min), by max - min, largest first."""
    names = {n for t in tables for n in t}
    rows = []
    for n in names:
        v = [t.get(n, 0.0) for t in tables]
        lo, hi = min(v), max(v)
        rows.append((n, v, hi / lo if lo > 0 else float("inf"), hi - lo))
    return sorted(rows, key=lambda r: -r[3])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--min-ratio", type=float, default=1.1)
    a = ap.parse_args(argv)
    if len(a.logs) < 2:
        raise SystemExit("kernel_spread: give two or more profile logs to compare")
    tables = [parse(p) for p in a.logs]
    empty = [p for p, t in zip(a.logs, tables) if not t]
    if empty:
        raise SystemExit(f"kernel_spread: no kernel table in {', '.join(empty)} (a profile_conventional.py log?)")
    totals = [sum(t.values()) for t in tables]
    print("us a step (listed kernels): " + " / ".join(f"{x:.1f}" for x in totals))
    for n, v, ratio, d in spread(tables)[:a.top]:
        mark = "*" if ratio >= a.min_ratio else " "
        print(f"{mark} " + " ".join(f"{x:8.1f}" for x in v) + f"  x{ratio:5.2f} {d:+7.1f}  {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
