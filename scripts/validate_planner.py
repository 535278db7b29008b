"""Validate the partition planner against measurements: every candidate plan it keeps is run and timed.

    PYTHONPATH=. python3 scripts/validate_planner.py [--models llama-3.2-1b,qwen3-8b] [--batches 1,8,32,128]
    PYTHONPATH=. python3 scripts/validate_planner.py --cpu --models tiny-qwen3 --batches 1,4   # logic check only

For each (model, batch): candidates() predicts every plan (mono, megaK, per-layer, attn-conv, conventional);
each is executed on the GPU (megakernel segments as Megakernel launches sharing one RankMemory, conventional
segments as torch ops captured in a CUDA graph), each step timed alone (CUDA events, synchronised, median),
and per segment. Reports per-segment MAPE, Spearman rank correlation of plans, and the regret of the chosen
plan; writes planner_validation.json and a predicted-vs-measured plot under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpk_runtime.ir import build_graph  # noqa: E402
from mpk_runtime.models import load_config, random_weights  # noqa: E402
from mpk_runtime.models.reference import rope_inv_freq  # noqa: E402
from mpk_runtime.planner import HardwareProfile, candidates  # noqa: E402
from mpk_runtime.runtime.memory import KVStore, RankMemory, StepCtx  # noqa: E402
from mpk_runtime.runtime.plan_exec import PlanExecutor  # noqa: E402


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    if n < 2:
        return 1.0
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else 1.0


class Timer:
    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3


PARTIAL = ""


def run_model(model: str, batches: list[int], context: int, cpu: bool, steps: int, prof, out_rows: list) -> None:
    dev = "cpu" if cpu else "cuda"
    dtype = "float32" if cpu else "bfloat16"
    cfg = load_config(model).replace(dtype=dtype)
    w = random_weights(cfg, seed=0, device=dev)
    for B in batches:
        plans = candidates(cfg, tp=1, batch=B, context=context, prof=prof)
        ps, max_seq = 16, context + 64
        pps = -(-max_seq // ps)
        g = build_graph(cfg, batch=B, context_len=context, max_seq_len=max_seq, attn_splits=plans[0].attn_splits)
        kv = KVStore(cfg.num_layers, B * pps + 1, ps, g.tensors["L0.k_cache"].shape[1], cfg.head_dim,
                     w["model.norm.weight"].dtype, device=dev, poison=False)
        for c in kv.k + kv.v:
            c.normal_(0, 1.0)
        mem = RankMemory(g, w, kv, device=dev)
        tables = ((torch.arange(B * pps) + 1).view(B, pps)).to(dev)
        pos = torch.full((B,), context, dtype=torch.int64, device=dev)
        mem.t("tokens").copy_(torch.randint(0, cfg.vocab_size, (B,)))
        inv = rope_inv_freq(cfg).to(dev)
        ctx = StepCtx(cfg, 0, pos, tables, ps, 1, inv, kv_len_cap=context + 1)

        def make_mk(tg, m):
            from mpk_runtime.runtime.megakernel import Megakernel
            return Megakernel(tg, m, page_size=ps, block_tables=tables, pos=pos, inv_freq=inv.cpu(),
                              head_dim=cfg.head_dim)

        for plan in plans:
            t0 = time.time()
            try:
                ex = PlanExecutor(plan, [g], [mem], backend="pyvm" if cpu else "megakernel", check=False,
                                  num_sms=None if not cpu else 4, make_megakernel=make_mk, mode="ordered")
            except Exception as e:  # noqa: BLE001 - report, keep validating the others
                out_rows.append({"model": model, "batch": B, "plan": plan.name, "error": f"{type(e).__name__}: {e}"[:300]})
                print(json.dumps(out_rows[-1]), flush=True)
                continue
            graphs = {}
            if not cpu:  # conventional segments as CUDA graphs (capture after a warm-up run)
                for i, (kind, seg) in enumerate(ex.segments):
                    if kind == "conventional":
                        seg.run([ctx])
                        torch.cuda.synchronize()
                        cg = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(cg):
                            seg.run([ctx])
                        graphs[i] = cg
            timer = Timer(not cpu)
            seg_ms = [[] for _ in ex.segments]
            tot_ms = []
            for s in range(steps + 2):
                marks = [timer.mark()]
                for i, (kind, seg) in enumerate(ex.segments):
                    if i in graphs:
                        graphs[i].replay()
                    elif kind == "conventional":
                        seg.run([ctx])
                    elif cpu:
                        seg.launch(lambda r, k: ctx, 1)
                    else:
                        seg.launch(1)
                    marks.append(timer.mark())
                if not cpu:
                    torch.cuda.synchronize()
                    for kind, seg in ex.segments:
                        if kind == "megakernel":
                            seg.check()
                if s >= 2:  # warm-up steps excluded
                    for i in range(len(ex.segments)):
                        seg_ms[i].append(timer.ms(marks[i], marks[i + 1]))
                    tot_ms.append(timer.ms(marks[0], marks[-1]))
            med = lambda x: sorted(x)[len(x) // 2]
            row = {"model": model, "batch": B, "context": context, "plan": plan.name, "chosen": plan is plans[0],
                   "predicted_us": plan.predicted_us, "measured_us": 1e3 * med(tot_ms),
                   "segments": [{"kind": sg.kind, "ops": len(sg.ops), "predicted_us": sg.predicted_us,
                                 "measured_us": 1e3 * med(m)} for sg, m in zip(plan.segments, seg_ms)],
                   "setup_s": round(time.time() - t0, 1)}
            out_rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "segments"}), flush=True)
            if PARTIAL:  # keep what was measured even if the run is cut short
                with open(PARTIAL, "a") as f:
                    f.write(json.dumps(row) + "\n")
            del ex, graphs
        del mem, kv
        if not cpu:
            torch.cuda.empty_cache()


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if "measured_us" in r]
    seg_err = [abs(s["predicted_us"] - s["measured_us"]) / s["measured_us"] for r in ok for s in r["segments"]
               if s["measured_us"] > 0]
    groups: dict = {}
    for r in ok:
        groups.setdefault((r["model"], r["batch"]), []).append(r)
    per_point = []
    for (m, b), rs in groups.items():
        best = min(x["measured_us"] for x in rs)
        chosen = next((x for x in rs if x["chosen"]), None)
        conv = next((x["measured_us"] for x in rs if x["plan"] == "conventional"), None)
        mono = next((x["measured_us"] for x in rs if x["plan"] == "mono"), None)
        per_point.append({"model": m, "batch": b, "plans": len(rs),
                          "spearman": spearman([x["predicted_us"] for x in rs], [x["measured_us"] for x in rs]),
                          "regret": (chosen["measured_us"] / best - 1) if chosen else None,
                          "chosen": chosen["plan"] if chosen else None,
                          "best_measured": min(rs, key=lambda x: x["measured_us"])["plan"],
                          "chosen_vs_best_of_mono_conv": (chosen["measured_us"] / min(v for v in (conv, mono) if v)
                                                          - 1) if chosen and (conv or mono) else None})
    return {"segment_mape": sum(seg_err) / len(seg_err) if seg_err else None,
            "step_mape": (sum(abs(r["predicted_us"] - r["measured_us"]) / r["measured_us"] for r in ok) / len(ok))
            if ok else None,
            "points": per_point, "errors": [r for r in rows if "error" in r]}


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [r for r in rows if "measured_us" in r]
    fig, ax = plt.subplots(figsize=(6, 6))
    for m in sorted({r["model"] for r in ok}):
        xs = [r["measured_us"] for r in ok if r["model"] == m]
        ys = [r["predicted_us"] for r in ok if r["model"] == m]
        ax.scatter(xs, ys, label=m, s=14)
    allv = [r["measured_us"] for r in ok] + [r["predicted_us"] for r in ok]
    lim = [min(allv + [1e9]), max(allv + [1])]
    ax.plot(lim, lim, "k--", lw=0.8)
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlabel("measured step time (us)"), ax.set_ylabel("predicted (us)")
    ax.set_title("planner: predicted vs measured, every candidate plan")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-8b")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cpu", action="store_true", help="pyvm + CPU timers: checks the script's logic only")
    ap.add_argument("--profile", default="h200_measured")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    prof = HardwareProfile.load(a.profile)
    global PARTIAL
    PARTIAL = os.path.join(a.out, "planner_validation_rows.jsonl")
    rows: list[dict] = []
    for m in a.models.split(","):
        run_model(m, [int(b) for b in a.batches.split(",")], a.context, a.cpu, a.steps, prof, rows)
    summ = summarize(rows)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": os.environ.get("GIT_COMMIT", "?"),
            "machine": "cpu (logic check)" if a.cpu else torch.cuda.get_device_name(), "profile": prof.name}
    with open(os.path.join(a.out, "planner_validation.json"), "w") as f:
        json.dump({"meta": meta, "summary": summ, "rows": rows}, f, indent=1)
    plot(rows, os.path.join(a.out, "planner_pred_vs_measured.png"))
    print(f"segment MAPE {summ['segment_mape']}, step MAPE {summ['step_mape']}")
    for p in summ["points"]:
        print(f"{p['model']:14s} B={p['batch']:4d} plans={p['plans']} spearman={p['spearman']:.2f} "
              f"chosen={p['chosen']} best={p['best_measured']} regret={p['regret']}")


if __name__ == "__main__":
    main()
