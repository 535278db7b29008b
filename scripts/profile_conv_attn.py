"""Measure the conventional attention op whole, for the planner's profile (HardwareProfile.conv_attn_us_by_shape).

    PYTHONPATH=. python3 scripts/profile_conv_attn.py --out $OUT [--models llama-3.2-1b,qwen3-8b] [--tp 1,2]
        [--batches 1,2,4,8,16,32,64,128] [--keys 257,513,1025,2049,4097,8193] [--merge h200_v33_cal --name h200_v35]

Per attention shape of the models' TP ranks (KV heads of a rank x head dim x q heads per KV head), one layer's
attention op as the conventional path runs it (runtime/conventional_ops.attention: the page gather, the masks, one
SDPA call; greedy, every sequence at position keys - 1, the key cap a step at that context runs: $MPK_MEASURE_CAP,
scripts/_plan_measure.key_cap, the engine's power of two by default), alone in a CUDA graph of 10 calls,
median over 10 replays, on a grid of batches and key counts: per layer (the step's shared per-step values already
computed) and once per step (what the step's first attention adds: its pages, masks, live rows). With
MPK_CONV_TRITON_ATTN=1 the op takes runtime/paged_attention.py instead, and the curves are keyed "<shape>@paged". Writes
<out>/conv_attn.json ({shape: [[batch, keys, us], ...]} for both, after every shape); with --merge, also
<out>/<name>.json = that profile with the curves, to refit (`python -m mpk_runtime.planner.fit --profile
<out>/<name>.json`) before it is copied to mpk_runtime/planner/profiles/. Why: the fixed + KV-passes + per-key terms of the conventional attention are not
identified by one context's validation rows (docs/planner.md sessions 19-20: cross-context hold-out 16-26% on
conventional segments); a measured curve is the term measured apart. `--device cpu` runs the same code without
graphs (a smoke run of the script; its numbers mean nothing).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import graph_us  # noqa: E402
from _plan_measure import key_cap  # noqa: E402
from mpk_runtime.ir import build_graph  # noqa: E402
from mpk_runtime.ir.defer import conv_attn_appends, defer_kv_appends  # noqa: E402
from mpk_runtime.ir.shard import shard_for  # noqa: E402
from mpk_runtime.models import load_config  # noqa: E402
from mpk_runtime.models.reference import rope_inv_freq  # noqa: E402
from mpk_runtime.planner.profile import HardwareProfile, conv_attn_shape  # noqa: E402
from mpk_runtime.runtime.memory import KVStore, RankMemory, StepCtx  # noqa: E402
from mpk_runtime.runtime.paged_shapes import curve_shapes  # noqa: E402
from mpk_runtime.runtime.torch_exec import ConventionalExecutor  # noqa: E402

PAGE = 16


def _ints(s: str) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"expected comma-separated integers, got {s!r}")
    if not v or min(v) < 1:
        raise SystemExit(f"expected positive integers, got {s!r}")
    return v


def attention_us(cfg, tp: int, batch: int, keys: int, device: str, reps: int = 10,
                 cycle_mb: float = 0.0, appends: bool = False) -> tuple[float, float]:
    """One layer's conventional attention at (batch, keys) for rank 0 of a TP group, in microseconds: (per layer,
    once per step). A step's conventional ops share its per-step values (conventional_ops._attn_step: pages, masks,
    live rows), computed by the first attention of the step: per layer = the op with them already computed; once
    per step = what a fresh step's first attention costs beyond that. cycle_mb > 0: the timed calls cycle through
    copies of the KV (one cache, each copy its own pages and block table) of at least that many MB in all, so the
    K / V come from HBM as in a step, where 16-36 layers' caches and the weights pass between two reads of a layer's
    (0: one copy, which the L2 holds at small batch x keys). appends: the step's new K / V rows deferred into the op
    (ir/defer.py), as the whole conventional plan runs it (qkv_rope conventional too); off, as attn-conv's attention
    segments (and every curve before session 39) run it."""
    c1 = cfg.replace(num_layers=1)
    g = build_graph(c1, batch=batch, context_len=keys - 1, max_seq_len=keys + PAGE, tp=tp, rank=0,
                    dtype="bfloat16")
    if appends:
        g = defer_kv_appends(g, {0})
    sh = shard_for(c1, tp, 0)
    pps = -(-(keys + PAGE) // PAGE)
    cap = key_cap(keys - 1, cfg)
    cols = max(pps, -(-cap // PAGE))   # a cap past the pages: the table's extra columns name scratch page 0
    kv_mb = 2 * batch * pps * PAGE * sh.n_kv * cfg.head_dim * 2 / 1e6
    n = max(1, min(512, math.ceil(cycle_mb / kv_mb))) if cycle_mb > 0 else 1
    kv = KVStore(1, n * batch * pps + 1, PAGE, sh.n_kv, cfg.head_dim, torch.bfloat16, device=device, poison=False)
    for t in kv.k + kv.v:
        t.normal_()
    mem = RankMemory(g, _no_weights(cfg.name, tp, g, device), kv, device=device)
    mem.t("L0.q").normal_()
    if appends:
        mem.t(next(o for o in g.ops if o.kind == "attention").attrs["kv_new"]).normal_()
    pos = torch.full((batch,), keys - 1, dtype=torch.int64, device=device)
    def table(i):
        t = torch.zeros(batch, cols, dtype=torch.int64, device=device)
        t[:, :pps] = (torch.arange(batch * pps, device=device) + 1 + i * batch * pps).view(batch, pps)
        return t
    ctxs = [StepCtx(c1, 0, pos, table(i), PAGE, 1, rope_inv_freq(c1).to(device), kv_len_cap=cap, greedy=True)
            for i in range(n)]
    ex = ConventionalExecutor([g.subgraph(["L0.attention"])], [mem])
    shared = [ex.new_step() for _ in range(n)]
    for c, sd in zip(ctxs, shared):
        ex.run([c], sd)   # the per-step values computed once, as the step's first attention does
    reps = max(reps, n)
    fresh = _time(lambda i: ex.run([ctxs[i % n]]), device, reps)
    layer = _time(lambda i: ex.run([ctxs[i % n]], shared[i % n]), device, reps)
    return layer, max(0.0, fresh - layer)


def _time(fn, device: str, reps: int) -> float:
    """Median microseconds of fn(i): on a GPU, calls i = 0 .. reps - 1 captured in one CUDA graph, median of 10
    replays."""
    fn(0)
    if device != "cuda":
        ts = []
        for i in range(3):
            t0 = time.perf_counter(); fn(i); ts.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(ts)
    return graph_us(fn, reps, 10)


_WEIGHTS: dict = {}


def _no_weights(model: str, tp: int, g, device):
    """The graph's weights as zeros of their shapes, once per (model, TP) (attention reads none of them; RankMemory
    wants them all; a one-layer graph's do not depend on the batch or the context)."""
    key = (model, tp, device)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        _WEIGHTS[key] = {n: torch.zeros(t.shape, dtype=torch.bfloat16, device=device) for n, t in g.tensors.items()
                         if t.kind == "weight"}
    return _WEIGHTS[key]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-8b")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    # a decode step at context C reads C + 1 keys under a key cap of C + 1 (scripts/_plan_measure.py, bench_decode):
    # the grid sits there. At the powers of two themselves the paged kernel's launch has one split of programs fewer
    # (cap 1024: 4 splits of 2 x 128 keys and an empty 5th; cap 1025: the 5th holds one key), and session 38 measured
    # llama-3.2-1b B=32 at 43.2 us a layer at ctx 1024 in the step against 34.0 on a curve point taken at 1024 keys
    ap.add_argument("--keys", default="257,513,1025,2049,4097,8193")
    ap.add_argument("--merge", default="", help="profile to copy with the measured curves added")
    ap.add_argument("--name", default="", help="name of the merged profile (default: <merge>_attn)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop measuring new shapes after this long")
    ap.add_argument("--cycle-mb", type=float, default=0.0,
                    help="cycle the timed calls through KV copies of this many MB in all (past the L2: K / V from "
                         "HBM, as in a step); 0: one copy (how the gather curves of h200_v35..v36 were measured)")
    ap.add_argument("--appends", action="store_true",
                    help="the step's new K / V rows deferred into the op, as the whole conventional plan runs it "
                         "(MPK_PAGED_APPEND says how the kernel takes them); curves keyed <shape>+append")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible: run this on the GPU machine (or --device cpu for a smoke run)")
    t0 = time.time()
    curves: dict[str, list] = {}
    steps: dict[str, list] = {}
    shapes: dict[str, list] = {}
    os.makedirs(a.out, exist_ok=True)
    # MPK_CONV_TRITON_ATTN=1 on a GPU: the op takes runtime/paged_attention.py, and its curves get their own keys
    impl = "paged" if conv_attn_appends() and a.device == "cuda" else ""
    meta = {"machine": torch.cuda.get_device_name() if a.device == "cuda" else "cpu (smoke run)",
            "date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("GIT_COMMIT", "?"), "page_size": PAGE,
            "impl": impl or "gather + SDPA", "cycle_mb": a.cycle_mb, "appends": a.appends}
    for model in a.models.split(","):
        cfg = load_config(model.strip())
        for tp in _ints(a.tp):
            sh = shard_for(cfg, tp, 0)
            key = conv_attn_shape(sh.n_kv, cfg.head_dim, sh.n_q // sh.n_kv, impl) + ("+append" if a.appends else "")
            if key in curves:
                continue
            if time.time() - t0 > a.budget_s:
                print(f"budget spent: {key} not measured", flush=True)
                continue
            pts, once = [], []
            for B in _ints(a.batches):
                for L in _ints(a.keys):
                    us, step_us = attention_us(cfg, tp, B, L, a.device, cycle_mb=a.cycle_mb, appends=a.appends)
                    pts.append([B, L, round(us, 2)])
                    once.append([B, L, round(step_us, 2)])
                    print(f"{model} tp={tp} {key} B={B:4d} keys={L:5d}: {us:9.1f} us per layer "
                          f"(+{step_us:7.1f} us once per step)", flush=True)
            curves[key], steps[key] = pts, once
            if impl == "paged":   # the launch shape each point ran (paged_shapes.stale_curve_points reads it)
                shapes.update(curve_shapes({key: pts}, lambda k, cfg=cfg: key_cap(k - 1, cfg)))
            _write(a.out, meta, curves, steps, shapes)   # after every shape: a run cut short keeps what it measured
    _write(a.out, meta, curves, steps, shapes)
    print("wrote", os.path.join(a.out, "conv_attn.json"))
    if a.merge:
        prof = json.loads(HardwareProfile.load(a.merge).to_json())
        prof["name"] = a.name or f"{a.merge}_attn"
        for field, new in (("conv_attn_us_by_shape", curves), ("conv_attn_step_us_by_shape", steps),
                           ("conv_attn_shape_by_shape", shapes)):
            prof[field] = merge_points(prof.get(field, {}), new)
        prof["source"] = (prof.get("source", "") + f"; conventional attention curves measured by "
                          f"scripts/profile_conv_attn.py on {meta['machine']} {meta['date']} (commit {meta['commit']})"
                          "; NOT CALIBRATED: the regimes' conventional terms were fit without the curves - refit "
                          "(planner.fit --profile this file) before using it")
        path = os.path.join(a.out, f"{prof['name']}.json")
        with open(path, "w") as f:
            json.dump(prof, f, indent=1)
        print("wrote", path, "(refit it with python -m mpk_runtime.planner.fit --profile before use: its regimes' "
              "conventional terms were fit without the curves)")


def merge_points(old: dict[str, list], new: dict[str, list]) -> dict[str, list]:
    """{shape: [[batch, keys, value], ...]} with `new`'s points added to `old`'s per shape: a point measured again
    replaces the old one, the rest are kept (a run over more keys, e.g. --keys 16385,...,131073, extends a shape's
    curve instead of replacing the whole grid with its own points), sorted by (batch, keys)."""
    out = {k: list(v) for k, v in old.items()}
    for key, pts in new.items():
        mine = {(int(p[0]), int(p[1])): p for p in out.get(key, [])}
        mine.update({(int(p[0]), int(p[1])): p for p in pts})
        out[key] = [mine[bk] for bk in sorted(mine)]
    return out


def _write(out: str, meta: dict, curves: dict, steps: dict, shapes: dict) -> None:
    with open(os.path.join(out, "conv_attn.json"), "w") as f:
        json.dump({"meta": meta, "conv_attn_us_by_shape": curves, "conv_attn_step_us_by_shape": steps,
                   "conv_attn_shape_by_shape": shapes}, f, indent=1)


if __name__ == "__main__":
    main()
