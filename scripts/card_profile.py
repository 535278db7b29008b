"""Assemble a card's profile from its measured parts, before the calibration is fitted (docs/planner.md, "Another
card"):

    PYTHONPATH=. python3 scripts/card_profile.py --measured <out>/prof/h100_measured.json \\
        --curves <out>/prof/conv_attn.json[,more conv_attn.json] --name h100_m1 > /tmp/h100_m1.json
    python -m mpk_runtime.planner.fit --profile /tmp/h100_m1.json --rows <this card's validation rows> ...

--measured is scripts/profile_hw.py's output run on a card_base.py base (this card's stream, latencies, task terms,
launch, conventional fixed costs). The conventional attention curves of --curves (scripts/profile_conv_attn.py on
the same card, later files' points over earlier ones) replace the base's: every shape the base had a curve for that
this card did not measure is dropped (an H200 curve must not price an H100's op), so such a shape falls back to the
attention terms. Nothing is fitted here."""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_conv_attn import merge_points  # noqa: E402
from mpk_runtime.planner.profile import HardwareProfile  # noqa: E402

CURVE_FIELDS = ("conv_attn_us_by_shape", "conv_attn_step_us_by_shape", "conv_attn_shape_by_shape")


def assemble(measured: dict, curve_files: list[dict], name: str) -> dict:
    d = dict(measured)
    machines = sorted({c.get("meta", {}).get("machine", "?") for c in curve_files})
    for field in CURVE_FIELDS:
        got: dict = {}
        for c in curve_files:
            got = merge_points(got, c.get(field, {}))
        d[field] = got
    dropped = sorted(set(measured.get("conv_attn_us_by_shape", {})) - set(d["conv_attn_us_by_shape"]))
    d["name"] = name
    d.pop("log", None)
    d["source"] = (f"{name}: {measured.get('name')} ({measured.get('source', '')}) with the conventional attention "
                   f"curves measured by scripts/profile_conv_attn.py on {', '.join(machines)}"
                   + (f" (the base's curves of {', '.join(dropped)} dropped: not measured on this card)" if dropped
                      else "") + "; assembled by scripts/card_profile.py, not yet calibrated")
    HardwareProfile(**{k: v for k, v in d.items() if k in HardwareProfile.__dataclass_fields__})   # loads
    return d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measured", required=True, help="profile_hw.py's JSON for this card")
    ap.add_argument("--curves", required=True, help="profile_conv_attn.py's conv_attn.json files, comma-separated")
    ap.add_argument("--name", required=True)
    a = ap.parse_args()
    with open(a.measured) as f:
        measured = json.load(f)
    curves = []
    for p in a.curves.split(","):
        with open(p) as f:
            curves.append(json.load(f))
    json.dump(assemble(measured, curves, a.name), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
