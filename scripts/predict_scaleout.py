"""Planner predictions for TP = 1, 2, 4, 8 (what issue 7 will measure on 4- and 8-GPU machines).

    PYTHONPATH=. python3 scripts/predict_scaleout.py [--models qwen3-8b,qwen3-32b] [--out bench/results]

Writes predictions_scaleout.json: per model, TP and batch, the plan the engine's book takes (engine_plan: at tp > 1
one megakernel or the conventional plan, runtime/tp_buckets.py), the chosen plan among mono / mega3 / conventional,
its predicted step time and band, the one-megakernel and all-conventional predictions, and the per-GPU
weight-streaming floor.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpk_runtime.models import load_config  # noqa: E402
from mpk_runtime.planner import HardwareProfile, candidates  # noqa: E402
from mpk_runtime.runtime.tp_buckets import plan_families  # noqa: E402


def stream_bytes_per_gpu(cfg, tp: int) -> int:
    """Weight bytes the busiest rank streams per decode step: its slices, the norms and its vocabulary rows of the
    LM head (a tied head reads those rows of the replicated embedding table; an embedding table is gathered, not
    streamed). The same count as the TP benchmarks' floor (scripts/_tp_rig.py rank_weight_bytes)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _tp_rig import rank_weight_bytes
    return max(rank_weight_bytes(cfg, tp, r) for r in range(tp))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-8b,qwen3-32b")
    ap.add_argument("--tps", default="1,2,4,8")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    prof = HardwareProfile.load(a.profile)
    rows = []
    for m in a.models.split(","):
        cfg = load_config(m)
        for tp in map(int, a.tps.split(",")):
            for b in map(int, a.batches.split(",")):
                plans = candidates(cfg, tp=tp, batch=b, context=512, prof=prof,
                                   families=("mono", "mega3", "conventional"))
                stream = stream_bytes_per_gpu(cfg, tp)
                by = {p.name: p.predicted_us for p in plans}
                # what LLM(backend="megakernel", tp=tp) runs: its book's families (runtime/tp_buckets.py at tp > 1)
                eng = candidates(cfg, tp=tp, batch=b, context=512, prof=prof,
                                 families=plan_families("megakernel", tp))[0]
                rows.append({"model": m, "tp": tp, "batch": b, "engine_plan": eng.name,
                             "engine_ms": eng.predicted_us / 1e3, "chosen": plans[0].name,
                             "predicted_ms": plans[0].predicted_us / 1e3, "band_ms": [x / 1e3 for x in plans[0].band],
                             "mono_ms": by.get("mono", 0) / 1e3, "conventional_ms": by.get("conventional", 0) / 1e3,
                             "floor_ms_per_gpu": stream / prof.bw(prof.num_sms) * 1e3})
                print(json.dumps(rows[-1]), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "predictions_scaleout.json"), "w") as f:
        json.dump({"meta": {"date": time.strftime("%Y-%m-%d"), "profile": prof.name, "source": prof.source,
                            "note": "predictions only: 4- and 8-GPU machines were not lent"}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
