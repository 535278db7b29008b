#!/usr/bin/env python3
"""Where the megakernel's warps stall, per function and per source line, from Nsight Compute's per-instruction
warp-state sampling.

On the GPU machine (one profiled launch; clocks are locked by ncu, so read shares, not times):
    ncu --section WarpStateStats --section SourceCounters -k regex:mpk --launch-skip 2 --launch-count 1 -o prof \\
        python3 scripts/bench_decode.py --models llama-3.2-1b --batches 8 --contexts 4096 --no-peers
    ncu -i prof.ncu-rep --page source --csv --print-source sass > src.csv
Here (the same cubin: MPK_CACHE_DIR/<key>/megakernel.cubin; nvdisasm from the nvidia-cuda-nvdisasm wheel):
    nvdisasm -gi megakernel.cubin > mk.sass
    python3 scripts/ncu_stalls.py mk.sass src.csv [--top 40] [--function op_small]
ncu's addresses are absolute; the kernel's functions lie in one .text section in nvdisasm's order, so
address - (first address) is nvdisasm's offset.
"""
from __future__ import annotations

import argparse
import collections
import csv
import re


def sass_map(path: str) -> dict[int, tuple[str, str, str]]:
    """offset -> (function, 'file:line' of the nearest preceding line annotation, instruction)."""
    fn, loc, out, started = "?", "?", {}, False
    for line in open(path):
        if ".text.mpk_megakernel," in line:
            started = True
        if not started:
            continue
        t = re.match(r"\s*\.type\s+(\S+),@function", line)
        if t:
            fn = t.group(1).replace("$mpk_megakernel$", "")
            continue
        f = re.match(r'\s*//## File "([^"]+)", line (\d+)', line)
        if f:
            loc = f"{f.group(1).split('/')[-1]}:{f.group(2)}"
            continue
        a = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*$", line)
        if a:
            out[int(a.group(1), 16)] = (fn, loc, a.group(2)[:64])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sass")
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--function", default=None, help="list this function's hottest instructions")
    a = ap.parse_args()
    m = sass_map(a.sass)
    rows = list(csv.reader(open(a.csv)))
    hi = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr, body = rows[hi], [r for r in rows[hi + 1:] if r and r[0].startswith("0x")]
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "(Not" not in h]
    base = int(body[0][0], 16)
    by_fn: dict = collections.defaultdict(collections.Counter)
    by_loc: dict = collections.defaultdict(collections.Counter)
    hot = []
    total: collections.Counter = collections.Counter()
    for r in body:
        fn, loc, ins = m.get(int(r[0], 16) - base, ("?", "?", "?"))
        c = collections.Counter({k[6:]: float(r[ix[k]] or 0) for k in reasons})
        by_fn[fn].update(c)
        by_loc[(fn, loc)].update(c)
        total.update(c)
        if a.function and a.function in fn:
            hot.append((sum(c.values()), r[0], loc, ins, c.most_common(2)))
    n = sum(total.values()) or 1.0

    def top(c: collections.Counter, k: int = 4) -> str:
        s = sum(c.values()) or 1.0
        return ", ".join(f"{r} {v / s:.0%}" for r, v in c.most_common(k))

    print(f"{n:.0f} samples; {top(total, 8)}")
    print("\nby function:")
    for fn, c in sorted(by_fn.items(), key=lambda kv: -sum(kv[1].values()))[:10]:
        print(f"  {sum(c.values()) / n:6.1%}  {fn[:60]:60s} {top(c)}")
    print("\nby source line (nearest annotation):")
    for (fn, loc), c in sorted(by_loc.items(), key=lambda kv: -sum(kv[1].values()))[:a.top]:
        print(f"  {sum(c.values()) / n:6.2%}  {fn[:40]:40s} {loc:22s} {top(c, 3)}")
    if hot:
        print(f"\nhottest instructions of {a.function}:")
        for s, addr, loc, ins, mc in sorted(hot, reverse=True)[:a.top]:
            print(f"  {s / n:6.2%}  {addr}  {loc:22s} {ins:64s} {mc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
