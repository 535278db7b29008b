"""A card's base profile: a copy of a profile with the terms shared/gpu/sync_bw.cu measures on this card put in.

    python3 scripts/card_base.py --sync-log sync_bw.log --base h200_v56 --out h100_base.json

sync_bw prints a flag's one-way latency between two SMs, a counter barrier of every SM and the read-only stream on
16 .. 132 SMs; these become sync_us, barrier_us and hbm_bw_by_sms (the 1-SM point scaled with the 16-SM one). The
rest is --base's until scripts/profile_hw.py (run with --base <out>) and the fit replace it: step one of measuring a
card's profile (docs/planner.md, "Another card")."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpk_runtime.planner import HardwareProfile  # noqa: E402


def parse_sync_log(text: str) -> dict:
    """{"sync_us", "barrier_us", "hbm_bw_by_sms" {sms: B/s}, "num_sms"} from sync_bw's output; a missing line is an
    error naming it (a truncated run must not leave the base's numbers in place silently)."""
    rt = [float(x) for x in re.findall(r"flag one-way latency: ([\d.]+) us", text)]
    bar = re.findall(r"grid counter barrier, (\d+) CTAs: ([\d.]+) us", text)
    bw = {int(n): float(tb) * 1e12 for n, tb in re.findall(r"read-only stream on\s+(\d+) SMs: ([\d.]+) TB/s", text)}
    missing = [k for k, v in (("flag latency", rt), ("counter barrier", bar), ("stream by SMs", bw)) if not v]
    if missing:
        raise ValueError(f"sync_bw log lacks {', '.join(missing)}: rerun shared/gpu/sync_bw.cu to completion")
    return {"sync_us": min(rt), "barrier_us": min(float(u) for _, u in bar), "num_sms": int(bar[-1][0]),
            "hbm_bw_by_sms": bw}


def card_base(base: HardwareProfile, meas: dict, name: str) -> dict:
    d = json.loads(base.to_json())
    bw = dict(meas["hbm_bw_by_sms"])
    old = {int(k): v for k, v in base.hbm_bw_by_sms.items()}
    if 1 in old and 16 in old and 16 in bw:
        bw[1] = old[1] * bw[16] / old[16]
    d.update(name=name, sync_us=round(meas["sync_us"], 3), barrier_us=round(meas["barrier_us"], 3),
             num_sms=meas["num_sms"], hbm_bw_by_sms={str(k): bw[k] for k in sorted(bw)})
    d["source"] = (f"{base.name} with sync_us, barrier_us, num_sms and hbm_bw_by_sms from shared/gpu/sync_bw.cu on "
                   "this card (scripts/card_base.py)")
    return d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sync-log", required=True)
    ap.add_argument("--base", default="h200_v56")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with open(a.sync_log) as f:
        meas = parse_sync_log(f.read())
    name = os.path.basename(a.out)[:-5] if a.out.endswith(".json") else os.path.basename(a.out)
    d = card_base(HardwareProfile.load(a.base), meas, name)
    with open(a.out, "w") as f:
        json.dump(d, f, indent=1)
    print(f"wrote {a.out}: sync {d['sync_us']} us, barrier {d['barrier_us']} us, stream "
          + ", ".join(f"{k} SMs {v / 1e12:.2f} TB/s" for k, v in d["hbm_bw_by_sms"].items()))


if __name__ == "__main__":
    main()
