"""Validate the partition planner against measurements: every candidate plan it keeps is run and timed.

    PYTHONPATH=. python3 scripts/validate_planner.py [--models llama-3.2-1b,qwen3-8b] [--batches 1,8,32,128]
        [--tp 1|2] [--budget-s 330] [--hf off|measure|PATH]
    PYTHONPATH=. python3 scripts/validate_planner.py --hf-only --budget-s 540          # HF peer numbers only
    PYTHONPATH=. python3 scripts/validate_planner.py --summarize ROWS.jsonl[,planner_validation.json] --hf hf_peer.json
    PYTHONPATH=. python3 scripts/validate_planner.py --cpu --models tiny-qwen3 --batches 1,4   # logic check only
    PYTHONPATH=. python3 scripts/validate_planner.py --predict-only --out DIR    # CPU, ~20 s: DIR/plans_tp1.json
    PYTHONPATH=. python3 scripts/validate_planner.py --plans DIR/plans_tp1.json  # GPU: measure those plans

For each (model, batch): candidates() predicts the plans of --families; each is executed on the GPU through
PlanExecutor, captured as CUDA graphs: the step time is one whole-step graph replay (megakernel launches
inside the graph at TP=1), segment times come from per-segment graphs with CUDA events between them; each
replay is timed alone (synchronised), median. TP=2 runs two processes (runtime/tp_launch.py, NVSHMEM peers for
the megakernels, NCCL for conventional segments; megakernel launches stay eager between segment graphs).
Work runs in priority order (per point: the chosen plan, mono, conventional; then the other families) inside
--budget-s; what does not fit is recorded as skipped with the reason. Reports per-segment MAPE, step MAPE,
Spearman rank correlation of plans per point, regret of the chosen plan, chosen vs best of {mono,
conventional}, and chosen vs the HF transformers + torch.compile peer (scripts/bench_decode.py's bench_hf);
writes planner_validation.json, planner_validation_rows.jsonl and planner_pred_vs_measured.png under --out.
The rows carry each segment's cost features, so `python -m mpk_runtime.planner.fit` can refit the profile.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.update({"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
from mpk_runtime.envflags import resolved_switches  # noqa: E402
from mpk_runtime.models import load_config, random_weights  # noqa: E402
from mpk_runtime.runtime.conventional_fused import prepare_weights  # noqa: E402
from mpk_runtime.planner import HardwareProfile, candidates  # noqa: E402
from mpk_runtime.planner.score import load_rows, summarize  # noqa: E402
from _plan_measure import Point, measure_cap, measure_plan, med  # noqa: E402,F401

T0 = time.time()
DEFAULT_FAMILIES = "mono,mega2,mega3,per-layer,attn-conv,attn-mk,conventional"
PRIORITY = ("mono", "mega3", "conventional")   # issue 5: one, three and no megakernels at every point


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def _quartiles(xs) -> tuple[float, float]:
    """(25th, 75th) percentile of the step times (one sample: itself twice)."""
    v = [float(x) for x in xs]
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else v * 3
    return q[0], q[2]


def plan_row(model, B, context, tp, plan, chosen, m, setup_s) -> dict:
    # re-planned as it ran by planner.fit (defaults included: envflags.py), and the key cap it was measured under
    env = dict(resolved_switches(), MPK_MEASURE_CAP=measure_cap())
    # attn_wide_passes: this code has attention's wide passes (tasks/tiling.py attn_wide; rows without the field
    # ran narrow ones and are re-priced so: planner/score.py _point)
    return {"model": model, "batch": B, "context": context, "tp": tp, "attn_splits": plan.attn_splits,
            "attn_wide_passes": True,
            **({"env": env} if env else {}),
            "plan": plan.name, "chosen": chosen,
            "predicted_us": plan.predicted_us, "measured_us": 1e3 * med(m["step_ms"]),
            # the spread of the timed steps (quartiles): whether two plans' medians differ by more than noise
            "measured_q_us": [1e3 * float(x) for x in _quartiles(m["step_ms"])],
            "exec": m.get("exec"), "exec_segments": m.get("exec_segments"),
            "segments": [{"kind": sg.kind, "ops": len(sg.ops), "first_op": sg.ops[0], "predicted_us": sg.predicted_us,
                          "measured_us": 1e3 * med(ms), "features": sg.features}
                         for sg, ms in zip(plan.segments, m["seg_ms"])],
            "setup_s": round(setup_s, 1)}


def _predict(args):
    m, B, tp, context, prof, families, cpu, exact = args
    cfg = load_config(m).replace(dtype="float32" if cpu else "bfloat16")
    t = time.time()
    plans = candidates(cfg, tp=tp, batch=B, context=context, prof=prof, families=families, extrapolate=not exact)
    return (m, B), plans, time.time() - t


def _log_pred(key, plans, dt, tp):
    log(f"predicted {key[0]} B={key[1]} tp={tp} in {dt:.1f}s: " +
        ", ".join(f"{p.name} {p.predicted_us:.0f}" for p in plans))


def predict_all(models, batches, families, context, tp, prof, cpu, parallel: bool = False,
                exact: bool = False) -> dict:
    """Predicted candidates per point; in parallel processes (fork, before CUDA is touched) when asked, one per
    core, the largest points first; each point is logged as soon as it is done."""
    jobs = [(m, B, tp, context, prof, families, cpu, exact) for m in models for B in batches]
    done = {}
    if parallel and len(jobs) > 1 and (os.cpu_count() or 1) > 1:
        import concurrent.futures as cf
        import multiprocessing as mp
        order = sorted(jobs, key=lambda j: -_job_size(j))
        n = min(len(jobs), os.cpu_count() or 2)
        with cf.ProcessPoolExecutor(n, mp_context=mp.get_context("fork")) as pool:
            futs = [pool.submit(_predict, j) for j in order]
            for f in cf.as_completed(futs):
                key, plans, dt = f.result()
                done[key] = plans
                _log_pred(key, plans, dt, tp)
    else:
        for j in jobs:
            key, plans, dt = _predict(j)
            done[key] = plans
            _log_pred(key, plans, dt, tp)
    return {(m, B): done[(m, B)] for m in models for B in batches}   # the order of --models / --batches


def _job_size(job) -> float:
    """Rough prediction cost of a point: tasks ~ layers x (tiles + batch x KV heads)."""
    cfg = load_config(job[0])
    return cfg.num_layers * (600 + job[1] * cfg.num_kv_heads)


def save_plans(preds: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump([{"model": m, "batch": B, "plans": [p.to_dict() for p in ps]} for (m, B), ps in preds.items()], f)


def load_plans(path: str) -> dict:
    from mpk_runtime.planner import Plan
    return {(d["model"], d["batch"]): [Plan.from_dict(p) for p in d["plans"]] for d in json.load(open(path))}


def work_list(preds: dict):
    """(model, B, plan, chosen) in run order: every point's chosen/mono/conventional plans first."""
    first, rest = [], []
    for (m, B), plans in preds.items():
        for p in plans:
            item = (m, B, p, p is plans[0])
            (first if (p is plans[0] or p.name in PRIORITY) else rest).append(item)
    return first + rest


def est_s(plan, steps, tp) -> float:
    """Time a plan's measurement takes: setup (task graphs, packing; per segment) + ~(3 + 2 steps) steps."""
    return 3.0 + 0.15 * len(plan.segments) + (5 + 2 * steps) * plan.predicted_us * 1.6e-6 + (2.0 if tp > 1 else 0)


def validate(preds, context, tp, steps, budget_s, cpu, out, rank=0, heap=None, comm=None,
             deadline=None, sampled=False, trace_plans: tuple[str, ...] = ()) -> list[dict]:
    deadline = deadline or (T0 + budget_s)
    dev = "cpu" if cpu else "cuda"
    work = work_list(preds)
    rows: list[dict] = []
    weights: dict = {}
    cur = None   # (model, B) -> Point
    partial = os.path.join(out, "planner_validation_rows.jsonl" if tp == 1 else f"planner_validation_rows_tp{tp}.jsonl")
    for m, B, plan, chosen in work:
        pred = plan.notes.get("sampled_us", plan.predicted_us) if sampled else plan.predicted_us
        key = dict(model=m, batch=B, context=context, tp=tp, plan=plan.name, chosen=chosen, predicted_us=pred)
        left = deadline - time.time()
        need = est_s(plan, steps, tp)
        if comm is not None:   # every rank takes the same decision (rank 0's clock)
            t = torch.tensor([left], dtype=torch.float64, device=dev)
            left = float(comm.all_gather(t, dim=0)[0])
        if need > left:
            row = dict(key, skipped=f"time budget: needs ~{need:.0f}s, {max(0.0, left):.0f}s left of --budget-s")
            rows.append(row)
            log(json.dumps(row))
            if rank == 0:
                with open(partial, "a") as f:
                    f.write(json.dumps(row) + "\n")
            continue
        t0 = time.time()
        try:
            cfg = load_config(m).replace(dtype="float32" if cpu else "bfloat16")
            if m not in weights:
                w = random_weights(cfg, seed=0, device=dev)
                if tp > 1:
                    from mpk_runtime.ir.shard import shard_for, weight_slice
                    sh = shard_for(cfg, tp, rank)
                    for n, t in list(w.items()):
                        idx = weight_slice(cfg, sh, n, tuple(t.shape))
                        if idx is not None:
                            w[n] = t[idx].contiguous()
                weights[m] = prepare_weights(w, cfg)   # (MPK_CONV_FUSE_PROJ: q/k/v and gate/up back to back)
            if cur is None or cur[0] != (m, B):
                cur = None
                gc.collect()
                if not cpu:
                    torch.cuda.empty_cache()
                cur = ((m, B), Point(cfg, weights[m], B, context, dev, plan.attn_splits, tp, rank, heap,
                                           sampled=sampled))
            # (greedy steps only: a sampled step may run other segments than the plan's, and records no segments)
            traced = not cpu and not sampled and ("all" in trace_plans or plan.name in trace_plans)
            cur[1].trace_steps = 1 if traced else 0
            meas = measure_plan(plan, cur[1], steps if plan.predicted_us < 50e3 else max(2, steps // 2), cpu, comm,
                                trace_dir=os.path.join(out, "traces") if traced else None,
                                trace_tag=f"{m}_b{B}_c{context}_{plan.name}")
            row = plan_row(m, B, context, tp, plan, chosen, meas, time.time() - t0)
            if "spans" in meas:   # megakernel segments' task windows (segment_spans)
                row["segment_spans"] = meas["spans"]
                for sp, sg in ((sp, row["segments"][sp["segment"]]) for sp in meas["spans"]):
                    log(f"  span {plan.name} seg {sp['segment']} ({sg['first_op']}): tasks {sp['span_us']:.1f} us of "
                        f"{sg['measured_us']:.1f} measured alone, {sg['predicted_us']:.1f} priced; gap before "
                        f"{'-' if sp['gap_before_us'] is None else format(sp['gap_before_us'], '.1f')} us")
            row["predicted_us"] = pred   # sampled: the sampled variant's price (notes["sampled_us"])
        except Exception as e:  # noqa: BLE001 - report, keep validating the others
            row = dict(key, error=f"{type(e).__name__}: {e}"[:400], trace=traceback.format_exc()[-1500:])
            if not cpu:
                torch.cuda.synchronize()
        rows.append(row)
        log(json.dumps({k: v for k, v in row.items() if k not in ("segments", "trace")}))
        if rank == 0:
            with open(partial, "a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


# ------------------------------------------------------------------------------------------------- HF peer
def _bench_decode():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_decode.py")
    spec = importlib.util.spec_from_file_location("bench_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def measure_hf(models, batches, context, deadline, out) -> list[dict]:
    """HF transformers + StaticCache + torch.compile peer per point (bench_decode.bench_hf), within the budget."""
    bd = _bench_decode()
    torch.backends.cuda.matmul.allow_tf32 = True
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "16")
    rows = []
    for m in models:
        cfg = load_config(m)
        for B in batches:
            est = (90 if "8b" in m else 45) + (20 if B >= 32 else 0)
            key = dict(model=m, batch=B, context=context, system="hf")
            if time.time() + est > deadline:
                rows.append(dict(key, skipped=f"time budget (HF compile+run ~{est}s)"))
            else:
                try:
                    r = bd.bench_hf(cfg, B, context, steps=12, warm=4)
                    rows.append(dict(key, ms=r["ms"], compile_s=r["compile_s"], timing=r["timing"]))
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(key, error=f"{type(e).__name__}: {e}"[:400]))
                gc.collect()
                torch.cuda.empty_cache()
                try:
                    torch._dynamo.reset()
                except Exception:  # noqa: BLE001
                    pass
            log(json.dumps(rows[-1]))
            with open(os.path.join(out, "hf_peer.json"), "w") as f:
                json.dump({"rows": rows}, f, indent=1)
    return rows


def load_hf(spec: str) -> dict:
    """HF ms per (model, batch, context) from hf_peer.json, bench_decode.json or a planner_validation.json."""
    if not spec or spec in ("off", "measure"):
        return {}
    out = {}
    for path in spec.split(","):
        d = json.load(open(path))
        rows = d.get("rows", []) + d.get("hf", [])
        for r in rows:
            if r.get("system") == "hf" and "ms" in r and r.get("status", "ok") == "ok":
                out[(r["model"], int(r["batch"]), int(r.get("context", 512)))] = float(r["ms"])
    return out


# -------------------------------------------------------------------------------------------------- TP > 1
def _tp_worker(ctx, args_d, plans_path):
    from mpk_runtime.runtime.comm import TorchDistComm
    ctx.dist()
    comm = TorchDistComm()
    heap = ctx.heap()
    rows = validate(load_plans(plans_path), args_d["context"], args_d["tp"], args_d["steps"], args_d["budget_s"],
                    False, args_d["out"], rank=ctx.rank, heap=heap, comm=comm, deadline=args_d["deadline"])
    return rows if ctx.rank == 0 else None


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [r for r in rows if "measured_us" in r]
    if not ok:
        return
    fig, axs = plt.subplots(1, 2, figsize=(12, 6))
    for m in sorted({(r["model"], r.get("tp", 1)) for r in ok}):
        sel = [r for r in ok if (r["model"], r.get("tp", 1)) == m]
        axs[0].scatter([r["measured_us"] for r in sel], [r["predicted_us"] for r in sel], s=14,
                       label=f"{m[0]} tp{m[1]}")
        segs = [s for r in sel for s in r["segments"]]
        axs[1].scatter([s["measured_us"] for s in segs], [s["predicted_us"] for s in segs], s=6,
                       label=f"{m[0]} tp{m[1]}")
    for ax, what in zip(axs, ("step (every candidate plan)", "segment")):
        pts = [c.get_offsets() for c in ax.collections if len(c.get_offsets())]   # --sampled: no segment points
        lo = min([min(o[:, 0].min(), o[:, 1].min()) for o in pts] + [1e9])
        hi = max([max(o[:, 0].max(), o[:, 1].max()) for o in pts] + [1])
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.plot([lo, hi], [lo * 1.1, hi * 1.1], "k:", lw=0.5)
        ax.plot([lo, hi], [lo / 1.1, hi / 1.1], "k:", lw=0.5)
        ax.set_xscale("log"), ax.set_yscale("log")
        ax.set_xlabel("measured (us)"), ax.set_ylabel("predicted (us)")
        ax.set_title(f"planner: predicted vs measured, {what}")
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def write_report(rows, hf, meta, out, tag=""):
    summ = summarize(rows, hf)
    with open(os.path.join(out, f"planner_validation{tag}.json"), "w") as f:
        json.dump({"meta": meta, "summary": summ, "hf": [dict(model=m, batch=b, context=c, system="hf", ms=v)
                                                        for (m, b, c), v in sorted(hf.items())], "rows": rows},
                  f, indent=1)
    plot(rows, os.path.join(out, f"planner_pred_vs_measured{tag}.png"))
    print(f"segment MAPE {summ['segment_mape']}, step MAPE {summ['step_mape']}, resolved plan pairs ordered "
          f"{summ['resolved_pairs_ordered']}, all targets met: {summ['targets_met']}"
          + (f" (not measured: {', '.join(summ['targets_unmeasured'])})" if summ.get("targets_unmeasured") else ""))
    for p in summ["points"]:
        print(f"{p['model']:14s} tp={p['tp']} ctx={p.get('context', '-')} B={p['batch']:4d} plans={p['plans']} step_mape={p['step_mape']} spearman={p['spearman']} "
              f"pairs_ordered={p['pairs_ordered']} chosen={p['chosen']} best={p['best_measured']} regret={p['regret']} "
              f"vs_best_mono_conv={p['chosen_vs_best_of_mono_conv']} vs_hf={p['chosen_vs_hf']}")
    return summ


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-8b")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--families", default=DEFAULT_FAMILIES)
    ap.add_argument("--budget-s", type=float, default=330.0, help="whole run; work beyond it is recorded as skipped")
    ap.add_argument("--hf", default="off", help="off | measure (after the plans, inside the budget) | JSON path(s)")
    ap.add_argument("--hf-only", action="store_true", help="measure the HF peer per point only (hf_peer.json)")
    ap.add_argument("--summarize", default="", help="rows JSONL path(s): recompute the summary, no GPU")
    ap.add_argument("--cpu", action="store_true", help="pyvm + CPU timers: checks the script's logic only")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--plans", default="", help="predicted plans JSON (--predict-only) instead of predicting here")
    ap.add_argument("--predict-only", action="store_true", help="write the predicted plans (plans_tpN.json), CPU")
    ap.add_argument("--exact", action="store_true",
                    help="simulate long segments in full (no extrapolation from short ones; ~3x slower, same "
                         "predictions to ~1e-7)")
    ap.add_argument("--sampled", action="store_true",
                    help="--tp 1: every row samples (temperature 0.8, top-k 50, top-p 0.9) instead of greedy: what a "
                         "sampled step costs each plan (its argmax as a megakernel where the plan's is conventional)")
    ap.add_argument("--trace-plans", default="",
                    help="comma-separated plan names (or 'all'): trace their megakernel segments in the last whole-"
                         "step replay (rows get segment_spans: each segment's task window and the gap before it; "
                         "Chrome traces under OUT/traces). GPU, greedy steps only; the traced plans' times include the trace writes")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    models, batches = a.models.split(","), [int(b) for b in a.batches.split(",")]
    families = tuple(a.families.split(","))
    prof = HardwareProfile.load(a.profile)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": os.environ.get("GIT_COMMIT", "?"),
            "profile": prof.name, "families": families, "context": a.context, "steps": a.steps, "tp": a.tp,
            "budget_s": a.budget_s, "sampled": a.sampled}
    if a.summarize:
        rows = load_rows(a.summarize)   # rows JSONL or planner_validation.json files
        meta["machine"] = "summary of " + a.summarize
        write_report(rows, load_hf(a.hf), meta, a.out, "_summary")
        return
    meta["machine"] = "cpu (logic check)" if a.cpu or a.predict_only else torch.cuda.get_device_name()
    if a.hf_only:
        measure_hf(models, batches, a.context, T0 + a.budget_s, a.out)
        return
    if a.plans:
        preds = load_plans(a.plans)
        preds = {k: v for k, v in preds.items() if k[0] in models and k[1] in batches}
    else:
        preds = predict_all(models, batches, families, a.context, a.tp, prof, a.cpu, parallel=not a.cpu,
                            exact=a.exact)
    plans_path = os.path.join(a.out, f"plans_tp{a.tp}.json")
    save_plans(preds, plans_path)
    if a.predict_only:
        log(f"wrote {plans_path}")
        return
    if a.tp > 1:
        from mpk_runtime.runtime import tp_launch
        args_d = dict(context=a.context, tp=a.tp, steps=a.steps, budget_s=a.budget_s, out=a.out,
                      deadline=T0 + a.budget_s - 20)
        try:
            res = tp_launch.run(_tp_worker, nranks=a.tp, args=(args_d, plans_path), timeout_s=a.budget_s + 120)
            rows = res[0]
        except Exception as e:  # noqa: BLE001 - keep what rank 0 wrote before it failed
            log(f"TP={a.tp} run failed: {type(e).__name__}: {str(e)[:2000]}")
            p = os.path.join(a.out, f"planner_validation_rows_tp{a.tp}.jsonl")
            rows = [json.loads(x) for x in open(p)] if os.path.exists(p) else []
            meta["tp_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        write_report(rows, load_hf(a.hf), meta, a.out, f"_tp{a.tp}")
        return
    rows = validate(preds, a.context, 1, a.steps, a.budget_s, a.cpu, a.out, sampled=a.sampled,
                    trace_plans=tuple(x for x in a.trace_plans.split(",") if x))
    hf = load_hf(a.hf)
    if a.hf == "measure" and not a.cpu:
        gc.collect()
        torch.cuda.empty_cache()
        for r in measure_hf(models, batches, a.context, T0 + a.budget_s, a.out):
            if "ms" in r:
                hf[(r["model"], r["batch"], a.context)] = r["ms"]
    write_report(rows, hf, meta, a.out)


if __name__ == "__main__":
    main()
