#!/usr/bin/env python3
"""Side-by-side table of bench_decode.json / planner_validation_rows.jsonl files of an A/B (same points, different
builds or switches): ms per step of each file at every point, and each file's change against the first.

    python3 scripts/ab_table.py base=run/ab_base/bench_decode.json warp=run/ab_warp/bench_decode.json [--md]

A point is (model, batch, context, plan or peer): bench_decode's megakernel row is the mono plan and its planned
row the plan it ran, so a bench file pairs with a validate file (mind the timing: bench times the one megakernel
8 steps per launch, validate every plan a graph replay per step). Rows that were skipped or failed show their
status. Only the first file's points are listed, in its order.

--kv-rates: per file, the marginal K/V streaming rate of each (model, batch, system) measured at two contexts: the
extra K and V bytes a step reads at the longer context (layers x batch x extra keys x KV heads x head_dim x 2 x 2 B)
over the extra time (docs/perf-notes.md session 18: llama-3.2-1b 2.2 TB/s token-major, the gpt-fast peer's dense
cache 4.2).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mpk_runtime.planner.score import stored_path  # noqa: E402


def load(path: str) -> dict[tuple, dict]:
    """{(model, batch, context, system/plan): row} of a bench_decode.json or a validate_planner rows file."""
    p = Path(stored_path(path))
    text = (gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()).decode()
    if p.name.removesuffix(".gz").endswith(".jsonl"):
        rows = [json.loads(x) for x in text.splitlines() if x.strip()]
    else:
        d = json.loads(text)
        rows = d["rows"] if isinstance(d, dict) and "rows" in d else d
    out = {}
    for r in rows:   # one name space for both: bench's megakernel is the mono plan, its planned row the plan's name
        what = r.get("system") or r.get("plan")
        what = {"megakernel": "mono", "planned": r.get("plan", "planned")}.get(what, what)
        out[(r["model"], r["batch"], r["context"], what)] = r
    return out


def ms(r: dict | None) -> float | None:
    if r is None:
        return None
    if "measured_us" in r:
        return r["measured_us"] / 1e3
    return r.get("ms") if r.get("status", "ok") == "ok" else None


def table(named: list[tuple[str, dict]]) -> list[list[str]]:
    names = [n for n, _ in named]
    head = ["model", "B", "ctx", "system"] + names + [f"{n} vs {names[0]}" for n in names[1:]]
    lines = [head]
    for key, r0 in named[0][1].items():
        vals = [ms(d.get(key)) for _, d in named]
        cells = [f"{v:.3f}" if v is not None else (d.get(key, {}).get("status") or
                                                     d.get(key, {}).get("skipped") or "-")[:24]
                 for v, (_, d) in zip(vals, named)]
        rel = [f"{100 * (v / vals[0] - 1):+.1f}%" if v is not None and vals[0] else "-" for v in vals[1:]]
        lines.append([key[0], str(key[1]), str(key[2]), key[3]] + cells + rel)
    return lines


def kv_rates(named: list[tuple[str, dict]]) -> list[list[str]]:
    """[file, model, batch, system, ctx0 -> ctx1, extra GB, TB/s] for every point measured at two contexts."""
    import sys as _sys
    _sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mpk_runtime.models import load_config
    lines = [["file", "model", "B", "system", "contexts", "extra K/V GB", "TB/s"]]
    for name, d in named:
        by: dict[tuple, dict[int, float]] = {}
        for (m, b, c, what), r in d.items():
            v = ms(r)
            if v is not None and r.get("tp", 1) == 1:
                by.setdefault((m, b, what), {})[c] = v
        for (m, b, what), cs in by.items():
            if len(cs) < 2:
                continue
            c0, c1 = min(cs), max(cs)
            cfg = load_config(m)
            extra = cfg.num_layers * b * (c1 - c0) * cfg.num_kv_heads * cfg.head_dim * 2 * 2
            dt = (cs[c1] - cs[c0]) * 1e-3
            rate = f"{extra / dt / 1e12:.2f}" if dt > 0 else "-"
            lines.append([name, m, str(b), what, f"{c0} -> {c1}", f"{extra / 1e9:.2f}", rate])
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="name=path (or a path: its parent folder names it)")
    ap.add_argument("--md", action="store_true", help="a markdown table")
    ap.add_argument("--kv-rates", action="store_true", help="marginal K/V rates between two contexts instead")
    a = ap.parse_args(argv)
    named = []
    for f in a.files:
        name, _, path = f.partition("=") if "=" in f else (Path(f).parent.name, "", f)
        named.append((name, load(path)))
    lines = kv_rates(named) if a.kv_rates else table(named)
    if a.md:
        print("| " + " | ".join(lines[0]) + " |\n|" + "---|" * len(lines[0]))
        for ln in lines[1:]:
            print("| " + " | ".join(ln) + " |")
        return
    w = [max(len(ln[i]) for ln in lines) for i in range(len(lines[0]))]
    for ln in lines:
        print("  ".join(c.rjust(w[i]) if i > (4 if a.kv_rates else 3) else c.ljust(w[i]) for i, c in enumerate(ln)))


if __name__ == "__main__":
    main()
