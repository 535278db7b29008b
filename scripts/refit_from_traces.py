#!/usr/bin/env python3
"""Refit the planner's per-kind megakernel task costs from stored traces (no GPU), and score the simulator's
step time against the same run's measured ms per token.

    PYTHONPATH=. python3 scripts/refit_from_traces.py --traces bench/results/v17_smem_state/traces \
        --bench bench/results/v17_smem_state/bench_decode_v17.json [--base h200_measured] [--out DIR] \
        [--write-profile h200_v17]

Traces: `bench_decode.py --trace` files, trace_<model>_b<B>_c<context>_s<splits>.json.gz (each one launch of
`nsteps` steps; the last traced step is fitted). For each, the task graph is rebuilt as bench_decode builds it
(1 GPU, `--num-sms` SMs, the traced attention splits), the durations are fitted per task kind
(mpk_runtime/planner/trace_fit.py, the fit profile_hw.py runs on the GPU), and the one-megakernel step is
simulated (planner/simulate.py) with: the base profile; the refit on every trace (in sample); and the refit on the
other model's traces only (hold-out by model). Predicted ms per token = (megakernel launch + simulated makespan of
`nsteps` steps) / nsteps, the bench's timing (one launch of nsteps steps). Writes refit_scores.json and, with
--write-profile, the in-sample refit as mpk_runtime/planner/profiles/<name>.json (base terms otherwise kept).
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpk_runtime.ir.build import build_graph  # noqa: E402
from mpk_runtime.models.config import load_config  # noqa: E402
from mpk_runtime.planner.profile import HardwareProfile  # noqa: E402
from mpk_runtime.planner.simulate import simulate  # noqa: E402
from mpk_runtime.planner.trace_fit import fit_task_costs, merge_points, task_points  # noqa: E402
from mpk_runtime.tasks.build import build_task_graphs  # noqa: E402
from mpk_runtime.tasks.tiling import Tiling  # noqa: E402

NAME = re.compile(r"trace_(?P<model>.+)_b(?P<b>\d+)_c(?P<c>\d+)_s(?P<s>\d+)\.json(\.gz)?$")


def load_trace(path: Path) -> list[dict]:
    op = gzip.open if path.suffix == ".gz" else open
    with op(path, "rt") as f:
        d = json.load(f)
    return d["traceEvents"] if isinstance(d, dict) else d


def rebuild(model: str, B: int, ctx: int, S: int, nsteps: int, num_sms: int):
    """The task graph bench_decode.bench_megakernel traced (same max_seq_len, splits, tiling)."""
    cfg = load_config(model)
    g = build_graph(cfg, mode="decode", batch=B, context_len=ctx, max_seq_len=ctx + nsteps + 16, attn_splits=S,
                    dtype="bfloat16")
    return build_task_graphs([g], Tiling(num_sms=num_sms))[0]


def with_fit(base: HardwareProfile, pts: dict) -> HardwareProfile:
    fixed, eff, fl = fit_task_costs(pts, base.bw(base.num_sms) / base.num_sms / 1e6)
    return replace(base, task_fixed_us_by_kind={**base.task_fixed_us_by_kind, **fixed},
                   stream_eff_by_kind={**base.stream_eff_by_kind, **eff},
                   flop_us_by_kind={**base.flop_us_by_kind, **fl},
                   mk_scale=1.0, mk_offset_us=0.0, regimes={})


def sim_us(tg, prof: HardwareProfile, nsteps: int) -> float:
    """Simulated makespan of nsteps steps, from 1 and 2 simulated steps (the steady-state step is the
    difference: the schedule repeats)."""
    s1 = simulate([tg], prof, steps=1).makespan_us
    s2 = simulate([tg], prof, steps=2).makespan_us
    return s1 + (nsteps - 1) * (s2 - s1)


def predict_ms(tg, prof: HardwareProfile, nsteps: int) -> float:
    """ms per token as planner/cost.py prices a megakernel segment: (launch + mk_scale x makespan of nsteps
    steps + mk_offset_us) / nsteps."""
    return (prof.megakernel_launch_us + prof.mk_scale * sim_us(tg, prof, nsteps) + prof.mk_offset_us) / nsteps / 1e3


def fit_scale(pairs: list[tuple[float, float]], launch_us: float) -> float:
    """mk_scale minimising the squared relative error of launch + scale x sim against measured, over
    (simulated makespan us, measured us) pairs of one launch each."""
    num = sum(s * (m - launch_us) / m ** 2 for s, m in pairs)
    den = sum(s * s / m ** 2 for s, m in pairs)
    return num / den if den else 1.0


def mape(rows: list[dict], key: str) -> float:
    return 100 * sum(abs(r[key] - r["measured_ms"]) / r["measured_ms"] for r in rows) / len(rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", required=True, help="folder of trace_<model>_b<B>_c<ctx>_s<S>.json.gz")
    ap.add_argument("--bench", required=True, help="bench_decode.json of the same run (measured ms per token)")
    ap.add_argument("--base", default="h200_measured")
    ap.add_argument("--nsteps", type=int, default=8, help="steps per launch in the bench (bench_decode: 8)")
    ap.add_argument("--num-sms", type=int, default=132)
    ap.add_argument("--out", default=None, help="default: the traces folder")
    ap.add_argument("--write-profile", default=None, help="save the in-sample refit under planner/profiles/")
    ap.add_argument("--fit-scale", action="store_true",
                    help="also fit mk_scale (launch + mk_scale x simulated = measured, least relative squares), in "
                         "sample and per hold-out, and write it into the profile")
    a = ap.parse_args()
    base = HardwareProfile.load(a.base)
    bench = json.loads(Path(a.bench).read_text())
    measured = {(r["model"], r["batch"], r["context"]): r["ms"] for r in bench["rows"]
                if r.get("system") == "megakernel" and r.get("ms")}
    cells = []
    for p in sorted(Path(a.traces).glob("trace_*.json*")):
        m = NAME.search(p.name)
        if not m:
            continue
        model, B, ctx, S = m["model"], int(m["b"]), int(m["c"]), int(m["s"])
        if (model, B, ctx) not in measured:
            print(f"skip {p.name}: no measured megakernel row in {a.bench}")
            continue
        tg = rebuild(model, B, ctx, S, a.nsteps, a.num_sms)
        cells.append(dict(model=model, batch=B, context=ctx, splits=S, tg=tg, pts=task_points(load_trace(p), tg),
                          measured_ms=measured[(model, B, ctx)]))
        print(f"{p.name}: {sum(len(v) for v in cells[-1]['pts'].values())} traced tasks", flush=True)
    if not cells:
        print("no trace matched a measured row", file=sys.stderr)
        return 2
    models = sorted({c["model"] for c in cells})
    insample = with_fit(base, merge_points(*(c["pts"] for c in cells)))
    holdout = {m: with_fit(base, merge_points(*(c["pts"] for c in cells if c["model"] != m))) for m in models}
    if a.fit_scale:   # the simulated step misses what no task's duration holds (gaps between tasks, waits)
        def scaled(prof, cs):
            pairs = [(sim_us(c["tg"], prof, a.nsteps), c["measured_ms"] * 1e3 * a.nsteps) for c in cs]
            return replace(prof, mk_scale=fit_scale(pairs, prof.megakernel_launch_us))
        insample = scaled(insample, cells)
        holdout = {m: scaled(p, [c for c in cells if c["model"] != m]) for m, p in holdout.items()}
        print(f"mk_scale in sample {insample.mk_scale:.4f}; hold-out "
              + ", ".join(f"without {m} {p.mk_scale:.4f}" for m, p in holdout.items()))
    rows = []
    for c in cells:
        B = c["batch"]
        r = {k: c[k] for k in ("model", "batch", "context", "splits", "measured_ms")}
        r["base_ms"] = predict_ms(c["tg"], base.for_batch(B), a.nsteps)
        r["base_raw_ms"] = predict_ms(c["tg"], replace(base, mk_scale=1.0, mk_offset_us=0.0, regimes={}), a.nsteps)
        r["refit_in_sample_ms"] = predict_ms(c["tg"], insample, a.nsteps)
        if len(models) > 1:
            r["refit_holdout_ms"] = predict_ms(c["tg"], holdout[c["model"]], a.nsteps)
        rows.append(r)
        print(f"{r['model']:14s} B={B:<3d} ctx={r['context']:<5d} measured {r['measured_ms']:7.3f}  base "
              f"{r['base_ms']:7.3f} (raw {r['base_raw_ms']:7.3f})  refit {r['refit_in_sample_ms']:7.3f}"
              + (f"  hold-out {r['refit_holdout_ms']:7.3f}" if "refit_holdout_ms" in r else ""), flush=True)
    keys = ["base_ms", "base_raw_ms", "refit_in_sample_ms"] + (["refit_holdout_ms"] if len(models) > 1 else [])
    summary = {k: mape(rows, k) for k in keys}
    print("MAPE vs measured: " + ", ".join(f"{k} {v:.1f}%" for k, v in summary.items()))
    fitted = {"task_fixed_us_by_kind": insample.task_fixed_us_by_kind, "stream_eff_by_kind": insample.stream_eff_by_kind,
              "flop_us_by_kind": insample.flop_us_by_kind, "mk_scale": insample.mk_scale}
    out = Path(a.out or a.traces)
    out.mkdir(parents=True, exist_ok=True)
    (out / "refit_scores.json").write_text(json.dumps(dict(base=a.base, bench=a.bench, bench_meta=bench.get("meta"),
                                                           nsteps=a.nsteps, rows=rows, mape_pct=summary,
                                                           in_sample_fit=fitted), indent=1))
    print("wrote", out / "refit_scores.json")
    if a.write_profile:
        d = json.loads(base.to_json())
        cal = (f"mk_scale {insample.mk_scale:.4f} fitted on the same traces' measured steps (--fit-scale), offset 0, "
               "no regimes") if a.fit_scale else "calibration terms reset (mk_scale 1, offset 0, no regimes)"
        d.update(fitted, name=a.write_profile, mk_scale=insample.mk_scale, mk_offset_us=0.0, regimes={},
                 source=f"{base.source}; megakernel task terms refit offline from the traces in {a.traces} "
                        f"(scripts/refit_from_traces.py), {cal}")
        path = Path(__file__).resolve().parents[1] / "mpk_runtime/planner/profiles" / f"{a.write_profile}.json"
        path.write_text(json.dumps(d, indent=1))
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
