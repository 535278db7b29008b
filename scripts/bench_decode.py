#!/usr/bin/env python3
"""Decode benchmark, one run, peers side by side: this runtime's megakernel vs peers vs the weight-streaming floor,
on seeded random bf16 weights (model shapes llama-3.2-1b and qwen3-8b); one GPU (issue 3) or TP=2 (--tp 2, issue 4).

  megakernel   one persistent launch runs N decode steps; ms/token = (CUDA-event time of the launch) / N,
               each launch synchronised before the next (no back-to-back pipelining); median over launches.
  gptfast      gpt-fast-style decoder (plain torch, static KV cache, torch.compile(mode="reduce-overhead"));
               adapted from the project's ../shared/gpu/peer_baseline_tp.py (tp=1) with a batch dimension.
  planned      the planner's chosen plan (plan_book, default profile) where it is not the one megakernel (from
               batch 32: attention as megakernels, the rest conventional): the step as one CUDA graph, each replay
               timed alone with CUDA events, median. Ratios compare the peers with this runtime's choice.
  hf           HF transformers + StaticCache + torch.compile(mode="reduce-overhead")
               (as ../shared/gpu/peer_baseline_hf.py).
  Peers: every step timed on its own with CUDA events (record, step, record), median over steps.
  floor        bytes of weights streamed per step / 4.55 TB/s (measured read-only streaming on one H200);
               an untied embedding table is gathered, not streamed, so it is left out.
Context c: the KV cache holds c random (megakernel) or prefilled (peers) positions; decode at positions >= c.

    GIT_COMMIT=$(git rev-parse HEAD) PYTHONPATH=. python3 scripts/bench_decode.py [--budget-s 300]
Writes $OUT/bench_decode.json (or ./gpu_out). Work runs in priority order; what does not fit in the time
budget is reported as skipped, never silently dropped.

--tp 2 (two GPUs; one spawned process per GPU through mpk_runtime.runtime.tp_launch, NVSHMEM heap + NCCL):
  megakernel_tp2  this runtime's TP=2 megakernel (partial sums pushed through NVSHMEM peer pointers inside the
                  kernel); N steps per launch, both ranks released together by a barrier before every launch,
                  CUDA events on each rank, median over launches; ms/token = launch time / N (the slower rank's).
  gptfast_tp2     the gpt-fast-style decoder sharded Megatron-style (column-parallel q/k/v and gate/up, row-parallel
                  o_proj and down, vocab-parallel LM head) with torch.distributed._functional_collectives all_reduce
                  (NCCL) after o_proj and down, and one all_gather of each rank's (max, argmax) for the token;
                  static KV cache, torch.compile(mode="reduce-overhead"); each step timed alone, median (the slower
                  rank's); ms_pipelined: the same steps queued back to back, total / steps.
  megakernel      the single-GPU megakernel (bench_megakernel, on GPU 0 in rank 0's process while rank 1 idles:
                  never overlapping a TP measurement), same seeded weights.
  floor           per GPU: bytes of weights one rank streams per step / 4.55 TB/s (_tp_rig.rank_weight_bytes).
  --comm-trace    one extra traced launch of the TP=2 megakernel per rank (per-task globaltimer): all-reduce task
                  time, waits before the cross-rank tiles, exposed communication per step (_tp_rig.analyze_comm);
                  Chrome traces of two steps as $OUT/tp2_trace_<model>_b<B>_r<rank>.json.gz.
    source .gpubundle/install.sh; export PYTHONPATH=$PWD:$PYTHONPATH     # keeps the bundle's /tmp/site
    GIT_COMMIT=$(git rev-parse --short HEAD) python3 scripts/bench_decode.py --tp 2 --budget-s 240
Writes $OUT/bench_decode_tp2.json: machine, date, commit, every cell (ok / skipped / error with its reason).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import gzip
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# NVLink multicast stays off in this process and in every process it starts (before torch / NCCL / NVSHMEM load)
os.environ.update({"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})

import torch  # noqa: E402

HBM = 4.55e12
OUT = Path(os.environ.get("OUT") or "gpu_out")
T0 = time.time()
ROWS: list[dict] = []


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def _ints(csv: str) -> list[int]:
    """'1,8' -> [1, 8]; '' -> [] (a peer switched off)."""
    return [int(x) for x in csv.split(",") if x.strip()]


def floor_ms(cfg) -> tuple[float, int]:
    from mpk_runtime.models.weights import weight_shapes
    n = 0
    for name, shape in weight_shapes(cfg).items():
        k = 1
        for s in shape:
            k *= s
        if name.endswith("embed_tokens.weight") and not cfg.tie_word_embeddings:
            continue
        n += 2 * k
    return n / HBM * 1e3, n


# ------------------------------------------------------------------------------------------------ megakernel
def bench_megakernel(model, weights, B, ctx, nsteps=8, launches=12, trace=False, splits=None, l2_prefetch_mb=0.0,
                     waves=1.0):
    """ms per step of the one-GPU megakernel. trace: one extra traced launch after the timed ones (per-task
    globaltimer, so the timed launches run untraced), its last two steps written as a Chrome trace under $OUT.
    splits: attention key splits (default tasks.tiling.attn_splits_for: fill the SMs). l2_prefetch_mb: Tiling's
    per-layer weight prefetch into L2 during attention (tasks/ops/prefetch.py; 0 = off). waves: Tiling.waves
    (linear tiles per SM per op; 2 puts two tiles of one op back to back on an SM)."""
    from mpk_runtime.ir.build import build_graph
    from mpk_runtime.models.config import load_config
    from mpk_runtime.models.reference import rope_inv_freq
    from mpk_runtime.runtime.megakernel import Megakernel
    from mpk_runtime.runtime.memory import KVStore, RankMemory
    from mpk_runtime.tasks.build import build_task_graphs
    from mpk_runtime.tasks.tiling import Tiling, attn_splits_for
    cfg = load_config(model)
    ps = 16
    max_seq = ctx + nsteps + 16
    S = splits or attn_splits_for(B, cfg.num_kv_heads, ctx)
    t = time.time()
    g = build_graph(cfg, mode="decode", batch=B, context_len=ctx, max_seq_len=max_seq, attn_splits=S, dtype="bfloat16")
    tg = build_task_graphs([g], Tiling(num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                                       l2_prefetch_mb=l2_prefetch_mb, waves=waves))[0]
    pps = -(-max_seq // ps)
    kv = KVStore(cfg.num_layers, B * pps + 1, ps, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, device="cuda",
                 poison=False)
    for c in kv.k + kv.v:
        c.normal_(0, 1.0)
    mem = RankMemory(g, weights, kv, device="cuda")
    tables = (torch.arange(B * pps) + 1).view(B, pps).to("cuda")
    pos = torch.full((B,), ctx, dtype=torch.int64, device="cuda")
    mk = Megakernel(tg, mem, page_size=ps, block_tables=tables, pos=pos, inv_freq=rope_inv_freq(cfg),
                    head_dim=cfg.head_dim, timeout_s=5.0, trace_steps=nsteps if trace else 0)
    mem.t("tokens").copy_(torch.randint(0, cfg.vocab_size, (B,)))
    setup = time.time() - t
    from _tp_rig import set_trace, time_launches
    if trace:
        set_trace(mk, 0)
    ms, ms_min = time_launches(mk, pos, torch.full((B,), ctx, dtype=torch.int64, device="cuda"), nsteps, launches)
    extra = {}
    if trace:
        set_trace(mk, nsteps)
        mk.trace.zero_()
        pos.fill_(ctx); mk.launch(nsteps); torch.cuda.synchronize(); mk.check()
        d = mk.chrome_trace()
        d["traceEvents"] = [e for e in d["traceEvents"] if e["args"]["step"] >= nsteps - 2]
        name = f"trace_{model}_b{B}_c{ctx}_s{S}" + (f"_w{waves:g}" if waves != 1.0 else "") + ".json.gz"
        with gzip.open(OUT / name, "wt") as f:
            json.dump(d, f)
        extra["chrome_trace"] = name
        if mk.stage_words:
            extra["stages"] = stage_summary(mk, nsteps - 1, OUT / name.replace("trace_", "stages_"))
    r = dict(**extra, system="megakernel", ms=ms, ms_min=ms_min, timing=f"{nsteps} steps per launch / {nsteps}, "
             f"median of {launches} synchronised launches", attn_splits=S, l2_prefetch_mb=l2_prefetch_mb,
             waves=waves, tasks=len(tg.tasks),
             setup_s=round(setup, 1), registers=mk.build.resources)
    del mk, mem, kv
    return r


def stage_summary(mk, step: int, path) -> dict:
    """Per op (layer prefix dropped): median us from the task's start (after its waits) to each stage stamp of a
    -DMPK_STAGE_WORDS build, over the tasks of one traced step; the raw rows go to `path` (.json.gz)."""
    import statistics
    st = mk.stage_stamps()[step]
    tr = mk.trace_times()[step]
    rows, by = [], {}
    for t in mk.tg.tasks:
        a, b = int(tr[t.id, 0]), int(tr[t.id, 1])
        if not (a and b):
            continue
        ks = [int(v) for v in st[t.id]]
        rows.append([t.id, t.kind, t.op, t.sm, a, b, ks])
        key = f"{t.kind}:{t.op.split('.', 1)[-1]}"
        d = by.setdefault(key, {"n": 0, "dur": [], "stages": [[] for _ in ks]})
        d["n"] += 1
        d["dur"].append((b - a) / 1e3)
        for k, v in enumerate(ks):
            if v:
                d["stages"][k].append((v - a) / 1e3)
    with gzip.open(path, "wt") as f:
        json.dump({"stage_words": mk.stage_words, "step": step, "rows": rows}, f)
    return {k: {"n": d["n"], "dur_us": round(statistics.median(d["dur"]), 3),
                "stage_us": [round(statistics.median(x), 3) if x else None for x in d["stages"]]}
            for k, d in by.items()}


# --------------------------------------------------------------------------------- planned (what a user gets)
def chosen_plans(cfg, batches, ctx) -> dict:
    """{batch: Plan}: the planner's choice per batch at this context (plan_book, the default hardware profile), as
    LLM(..., plan="auto") would run it."""
    from mpk_runtime.planner import plan_book
    from mpk_runtime.planner.plan import Plan
    book = plan_book(cfg, 1, tuple(batches), context=ctx)
    return {int(b): Plan.from_dict(d) for b, d in book["buckets"].items()}


def bench_planned(cfg, weights, B, ctx, plan, steps=12):
    """ms per step of the planner's chosen plan when it is not the one megakernel (attention as megakernels and the
    rest conventional, ...): the whole step as one CUDA graph, each replay timed alone with CUDA events (as the
    peers), median (validate_planner.measure_plan; greedy steps)."""
    from validate_planner import Point, measure_plan
    t = time.time()
    pt = Point(cfg, weights, B, ctx, "cuda", plan.attn_splits)
    m = measure_plan(plan, pt, steps, cpu=False)
    ms = sorted(m["step_ms"])[len(m["step_ms"]) // 2]
    del pt
    return dict(system="planned", ms=ms, ms_min=min(m["step_ms"]), plan=plan.name, predicted_ms=plan.predicted_us / 1e3,
                exec=m.get("exec"), timing=f"each step timed alone (CUDA events, synchronised), median of {steps}",
                setup_s=round(time.time() - t, 1))


# ------------------------------------------------------------------------ peers (scripts/_peers.py, re-exported)
from _peers import GptFast, NcclComm, bench_gptfast, bench_hf  # noqa: E402,F401


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-8b")
    ap.add_argument("--batches", default=None, help="default 1,8,32,128 (--tp 1) / 1,8 (--tp 2)")
    ap.add_argument("--contexts", default=None, help="default 512,4096 (--tp 1) / 512 (--tp 2)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="whole run; work beyond it is skipped")
    ap.add_argument("--peer-batches", default="1,8", help="batches for the gpt-fast peer")
    ap.add_argument("--hf-batches", default="1", help="batches for the HF peer (--tp 1); \"\" = none")
    ap.add_argument("--mk-max-batch", type=int, default=128)
    ap.add_argument("--trace", action="store_true", help="--tp 1: one traced megakernel launch per cell -> "
                    "$OUT/trace_<model>_b<B>_c<ctx>_s<splits>.json.gz (scripts/trace_phases.py reads it)")
    ap.add_argument("--no-peers", action="store_true", help="--tp 1: the megakernel only (A/B runs)")
    ap.add_argument("--planned", action=argparse.BooleanOptionalAction, default=True,
                    help="--tp 1: also time the planner's chosen plan where it is not the one megakernel")
    ap.add_argument("--attn-splits", type=int, default=None, help="--tp 1: attention key splits (default: fill the SMs)")
    ap.add_argument("--l2-prefetch-mb", type=float, default=0.0,
                    help="--tp 1: weight bytes per layer prefetched into L2 during attention (Tiling.l2_prefetch_mb)")
    ap.add_argument("--waves", type=float, default=1.0,
                    help="--tp 1: linear tiles per SM per op (Tiling.waves; 2 = two tiles of an op back to back per SM)")
    ap.add_argument("--tp", type=int, default=1, help="2: TP=2 megakernel vs TP=2 gpt-fast peer vs 1-GPU megakernel")
    ap.add_argument("--steps-per-launch", type=int, default=8, help="--tp 2: megakernel steps per launch (ms = launch / N)")
    ap.add_argument("--launches", type=int, default=12, help="--tp 2: timed megakernel launches (median)")
    ap.add_argument("--tp-invariant", type=int, default=1,
                    help="--tp 2: build_graph tp_invariant of the TP megakernel (1 = the engine's setting; 2 = bitwise "
                         "TP=1 reductions, Tensor Core tiles unsliced: slower at batch >= 3)")
    ap.add_argument("--comm-trace", action=argparse.BooleanOptionalAction, default=True,
                    help="--tp 2: one traced TP megakernel launch per rank -> exposed-communication numbers")
    ap.add_argument("--comm-trace-batches", default="1", help="--tp 2: batches that get the traced launch")
    ap.add_argument("--grace-s", type=float, default=45.0,
                    help="--tp 2: the rank processes are killed at budget + grace (a hang becomes an error)")
    args = ap.parse_args(argv)
    tp1 = args.tp == 1
    args.batches = args.batches or ("1,8,32,128" if tp1 else "1,8")
    args.contexts = args.contexts or ("512,4096" if tp1 else "512")
    return args


def main():
    args = parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.tp > 1:
        return main_tp(args)
    from mpk_runtime.models.config import load_config
    from mpk_runtime.models.weights import random_weights
    torch.backends.cuda.matmul.allow_tf32 = True
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "16")
    models = args.models.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    ctxs = [int(c) for c in args.contexts.split(",")]
    share = args.budget_s / len(models)
    meta = dict(machine=f"{torch.cuda.get_device_name(0)} (GPU 0 of {torch.cuda.device_count()} visible), {platform.node()}", date=datetime.datetime.now().isoformat(),
                git_commit=os.environ.get("GIT_COMMIT", "unknown"), torch=torch.__version__, hbm_bytes_per_s=HBM,
                note="floor = streamed weight bytes / 4.55 TB/s; untied embedding excluded")
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass

    def save():
        (OUT / "bench_decode.json").write_text(json.dumps(dict(meta=meta, rows=ROWS), indent=1))

    for mi, model in enumerate(models):
        cfg = load_config(model)
        fl, nbytes = floor_ms(cfg)
        deadline = T0 + share * (mi + 1)
        # priority order inside one model's share: B=1 everywhere first, then peers, then larger batches
        work = [("megakernel", 1, c) for c in ctxs] if 1 in batches else []
        work += [("gptfast", 1, ctxs[0])] if 1 in batches else []
        work += [("hf", 1, ctxs[0])] if 1 in batches and 1 in _ints(args.hf_batches) else []
        work += [("megakernel", b, c) for b in batches if 1 < b <= args.mk_max_batch for c in ctxs]
        # the planner's choice where it is not the one megakernel (at B >= 32 attention-only megakernels)
        chosen = {c: chosen_plans(cfg, batches, c) for c in ctxs} if args.planned else {}
        work += [("planned", b, c) for b in batches for c in ctxs if c in chosen and chosen[c][b].name != "mono"]
        work += [("gptfast", 1, c) for c in ctxs[1:]] if 1 in batches else []
        work += [("gptfast", b, c) for c in ctxs for b in _ints(args.peer_batches) if b > 1]   # first context first
        work += [("hf", b, c) for c in ctxs for b in _ints(args.hf_batches) if (b, c) != (1, ctxs[0])]
        if args.no_peers:
            work = [w for w in work if w[0] in ("megakernel", "planned")]
        weights = None
        for system, B, ctx in work:
            key = dict(model=model, system=system, batch=B, context=ctx, floor_ms=fl, weight_bytes=nbytes)
            est = {"megakernel": 8, "planned": 25 if "8b" in model else 12, "gptfast": 45 if "8b" in model else 25,
                   "hf": 90 if "8b" in model else 45}[system]
            if time.time() + est > deadline:
                ROWS.append(dict(key, status="skipped (time budget)")); save()
                log(f"skip {system} {model} B={B} ctx={ctx} (budget)")
                continue
            try:
                if system in ("megakernel", "planned") and weights is None:
                    from mpk_runtime.runtime.conventional_ops import prepare_weights
                    weights = prepare_weights(random_weights(cfg, seed=0, dtype="bfloat16", device="cuda"), cfg)
                if system == "planned":
                    r = bench_planned(cfg, weights, B, ctx, chosen[ctx][B])
                elif system == "megakernel":
                    r = bench_megakernel(model, weights, B, ctx, *((8, 12) if B <= 8 else (2, 4)), trace=args.trace,
                                         splits=args.attn_splits, l2_prefetch_mb=args.l2_prefetch_mb,
                                         waves=args.waves)
                else:
                    if weights is not None:   # peers bring their own weights: free ours first
                        weights = None
                        gc.collect(); torch.cuda.empty_cache()
                    r = (bench_gptfast if system == "gptfast" else bench_hf)(cfg, B, ctx)
                r = dict(key, **r, status="ok", pct_of_floor=100 * fl / r["ms"])
                log(f"{system:10s} {model:13s} B={B:<3d} ctx={ctx:<5d} {r['ms']:.3f} ms/token "
                    f"({r['pct_of_floor']:.0f}% of floor {fl:.3f})")
            except Exception as e:  # noqa: BLE001
                r = dict(key, status=f"error: {type(e).__name__}: {e}"[:600])
                log(f"{system} {model} B={B} ctx={ctx} FAILED {type(e).__name__}: {e}")
                traceback.print_exc()
            ROWS.append(r); save()
            gc.collect(); torch.cuda.empty_cache()
        weights = None
        gc.collect(); torch.cuda.empty_cache()
        try:
            torch._dynamo.reset()
        except Exception:  # noqa: BLE001
            pass
    # ratios: peer / ours at the same (model, batch, context); ours = the planner's choice (the one megakernel
    # where it chose that, else its 'planned' row)
    ours = {(r["model"], r["batch"], r["context"]): r["ms"] for r in ROWS
            if r["system"] == "megakernel" and r.get("status") == "ok"}
    ours.update({(r["model"], r["batch"], r["context"]): r["ms"] for r in ROWS
                 if r["system"] == "planned" and r.get("status") == "ok"})
    for r in ROWS:
        k = (r["model"], r["batch"], r["context"])
        if r.get("status") == "ok" and k in ours:
            r["ratio_vs_ours"] = r["ms"] / ours[k]   # > 1: this runtime (its chosen plan) is faster
    save()
    print("\n==== bench_decode (ms/token, median) ====")
    print(f"{'model':13s} {'B':>3s} {'ctx':>5s} {'system':10s} {'ms':>8s} {'floor':>7s} {'%floor':>6s} {'peer/ours':>9s}")
    for r in ROWS:
        if r.get("status") != "ok":
            print(f"{r['model']:13s} {r['batch']:3d} {r['context']:5d} {r['system']:10s} {r['status'][:60]}")
            continue
        print(f"{r['model']:13s} {r['batch']:3d} {r['context']:5d} {r['system']:10s} {r['ms']:8.3f} {r['floor_ms']:7.3f} "
              f"{r['pct_of_floor']:6.0f} {r.get('ratio_vs_ours', float('nan')):9.2f}"
              + (f"  ({r['plan']})" if r["system"] == "planned" else ""))
    print(f"wrote {OUT / 'bench_decode.json'}  total {time.time() - T0:.0f}s")


# ================================================================================================= --tp 2
def tp_cells(models, batches, ctx, trace_batches, n_layers, peer_batches=None) -> list[dict]:
    """The TP run's cells in priority order: for each batch (ascending), the megakernel cells of every model
    (TP=2, then 1 GPU: cheap), then the TP peers (torch.compile is the expensive part). est_s: a conservative
    wall estimate; a cell that would not end within the budget is skipped, not started."""
    cells = []
    for B in sorted(batches):
        for m in models:
            L = n_layers[m]
            tr = B in trace_batches
            cells.append(dict(system="megakernel_tp2", model=m, batch=B, context=ctx, trace=tr,
                              est_s=round(6 + 0.35 * L + (4 + 0.1 * L if tr else 0), 1)))
            cells.append(dict(system="megakernel", model=m, batch=B, context=ctx, trace=False,
                              est_s=round(4 + 0.2 * L, 1)))
        for m in models if peer_batches is None or B in peer_batches else ():
            cells.append(dict(system="gptfast_tp2", model=m, batch=B, context=ctx, trace=False,
                              est_s=round(20 + 1.6 * n_layers[m], 1)))
    for i, c in enumerate(cells):
        c["cell"] = i
    return cells


def _tp_log(rank, *a):
    print(f"[{time.time() - T0:6.1f}s r{rank}]", *a, flush=True)


class _Weights:
    """One model's megakernel weights at a time on each rank: the full seeded set (rank 0 keeps it for the
    single-GPU cell) and this rank's shard."""

    def __init__(self):
        self.model, self.full, self.part = None, None, None

    def get(self, model, cfg, rank, world):
        from _tp_rig import shard_weights
        if self.model != model:
            self.drop()
            self.full, self.part = shard_weights(cfg, 0, rank, world)
            if rank != 0:
                self.full = None
            self.model = model
            torch.cuda.synchronize()
        return self.full, self.part

    def drop(self):
        self.model = self.full = self.part = None
        gc.collect(); torch.cuda.empty_cache()


def _cell_megakernel_tp2(tctx, heap, cell, cfg, wts, opts):
    import gzip

    from _tp_rig import analyze_comm, bench_rig, chrome_trace, comm_meta, set_trace, time_launches

    from mpk_runtime.ir.shard import shard_for
    from mpk_runtime.tasks.tiling import attn_splits_for
    rank, W = tctx.rank, tctx.nranks
    B, ctx, n = cell["batch"], cell["context"], opts["steps_per_launch"]
    if heap is None:
        raise RuntimeError(f"no NVSHMEM heap: {opts.get('heap_error')}")
    t = time.time()
    _, part = wts.get(cell["model"], cfg, rank, W)
    S = attn_splits_for(B, shard_for(cfg, W, rank).n_kv, ctx, torch.cuda.get_device_properties(rank).multi_processor_count)
    r = bench_rig(cfg, part, B, rank, W, heap, context_len=ctx, max_seq=ctx + n + 16, attn_splits=S,
                  trace_steps=n if cell["trace"] else 0, tp_invariant=opts.get("tp_invariant", 1))
    g = torch.Generator().manual_seed(1)
    r.mem.t("tokens").copy_(torch.randint(0, cfg.vocab_size, (B,), generator=g))   # same on every rank
    if cell["trace"]:
        set_trace(r.mk, 0)                                                           # timed launches untraced
    setup = time.time() - t
    pos = torch.full((B,), ctx, dtype=torch.int64)
    med, mn = time_launches(r.mk, r.pos, pos, n, opts["launches"], barrier=heap.barrier)
    res = dict(ms=med, ms_min=mn, attn_splits=S, tasks=len(r.tg.tasks), setup_s=round(setup, 1),
               tp_invariant=opts.get("tp_invariant", 1),
               cross_rank_signals=sum(1 for x in r.tg.tasks for q, _ in x.signals if q != rank),
               timing=f"{n} steps per launch / {n}, median of {opts['launches']} launches, both ranks released "
                      "together by an NVSHMEM barrier before each launch (CUDA events on each rank; ms = the slower "
                      "rank's median)")
    if cell["trace"]:
        set_trace(r.mk, n)
        r.mk.trace.zero_()
        heap.barrier()
        r.pos.copy_(pos)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); r.mk.launch(n); b.record(); b.synchronize()
        r.mk.check()
        tr = r.mk.trace_times()[:n].tolist()
        meta = comm_meta(r.tg)
        res["comm"] = analyze_comm(tr, meta)
        res["comm"]["traced_launch_ms_per_step"] = a.elapsed_time(b) / n
        name = f"tp2_trace_{cell['model']}_b{B}_r{rank}.json.gz"
        with gzip.open(OUT / name, "wt") as f:
            json.dump(chrome_trace(tr, meta, steps=(1, 2)), f)
        res["comm"]["chrome_trace"] = name
    del r
    return res


def _cell_megakernel_1gpu(tctx, heap, cell, cfg, wts, opts):
    if tctx.rank != 0:
        return None     # rank 1 idles (no GPU work) while rank 0 measures on GPU 0
    full, _ = wts.get(cell["model"], cfg, tctx.rank, tctx.nranks)
    r = bench_megakernel(cell["model"], full, cell["batch"], cell["context"], opts["steps_per_launch"],
                         opts["launches"])
    r.pop("system", None)
    return r


def _cell_gptfast_tp2(tctx, heap, cell, cfg, wts, opts):
    wts.drop()                               # the peer brings its own (sharded) weights
    try:
        r = bench_gptfast(cfg, cell["batch"], cell["context"], tp=tctx.nranks, rank=tctx.rank,
                          comm=NcclComm(tctx.nranks))
    finally:
        try:
            torch._dynamo.reset()
        except Exception:  # noqa: BLE001
            pass
    r.pop("system", None)
    return r


def _row_key(cell, floors) -> dict:
    """A row's identity and its floor: the whole model's for the 1-GPU megakernel, one rank's for TP=2."""
    fl1, fl2 = floors[cell["model"]]
    fl = fl1 if cell["system"] == "megakernel" else fl2
    return dict({k: cell[k] for k in ("cell", "system", "model", "batch", "context")}, floor_ms=fl[0],
                weight_bytes=fl[1])


def _merge(cell, outs, floors) -> dict:
    """One row from every rank's result of a cell. ms = the slower rank's median (the ranks run in lockstep)."""
    key = _row_key(cell, floors)
    errs = [f"rank {q}: {o['err']}" for q, o in enumerate(outs) if o.get("err")]
    if errs:
        return dict(key, status="error: " + " | ".join(errs)[:1200], seconds=max(o.get("s", 0) for o in outs))
    res = [o["res"] for o in outs]
    if cell["system"] == "megakernel":
        r = dict(key, **res[0])
    else:
        r = dict(key, **{k: v for k, v in res[0].items() if k != "comm"})
        r["ms_per_rank"] = [x["ms"] for x in res]
        r["ms"] = max(r["ms_per_rank"])
        if "ms_pipelined" in res[0]:
            r["ms_pipelined_per_rank"] = [x["ms_pipelined"] for x in res]
            r["ms_pipelined"] = max(r["ms_pipelined_per_rank"])
        if any("comm" in x for x in res):
            r["comm"] = [x.get("comm") for x in res]
    r.update(status="ok", pct_of_floor=100 * r["floor_ms"] / r["ms"], seconds=max(o.get("s", 0) for o in outs))
    return r


CELL_FNS = {"megakernel_tp2": _cell_megakernel_tp2, "megakernel": _cell_megakernel_1gpu,
            "gptfast_tp2": _cell_gptfast_tp2}


def _default_store(dist):
    return dist.distributed_c10d._get_default_store()   # the TCPStore behind tp_launch's init_process_group


def tp_rank_main(tctx, cells, deadline, opts, rows_path):
    """One rank of the --tp 2 run: every cell in order; rank 0 decides run/skip against the deadline and both
    ranks exchange results through the c10d store after every cell (so a failure on one rank is recorded and
    both go on). Rank 0 rewrites rows_path after every cell."""
    global T0
    T0 = opts["t0"]
    from _tp_rig import SAFE_ENV, StoreSync

    from mpk_runtime.models.config import load_config
    torch.backends.cuda.matmul.allow_tf32 = True
    rank, W = tctx.rank, tctx.nranks
    env = {k: os.environ.get(k) for k in SAFE_ENV}
    heap = None
    try:
        heap = tctx.heap()
    except Exception as e:  # noqa: BLE001 - both ranks see the same missing library; the peer still runs
        opts = dict(opts, heap_error=f"{type(e).__name__}: {e}"[:600])
        _tp_log(rank, f"NVSHMEM heap unavailable: {opts['heap_error']}")
    dist = tctx.dist()
    sync = StoreSync(_default_store(dist), rank, W, timeout_s=opts["sync_timeout_s"])
    gpu = torch.cuda.get_device_name(rank) if torch.cuda.is_available() else "no CUDA"
    ranks = sync.gather("env", dict(rank=rank, gpu=gpu, env=env,
                                    env_ok=all(env[k] == v for k, v in SAFE_ENV.items()),
                                    heap=heap is not None, heap_error=opts.get("heap_error")))
    _tp_log(rank, f"up on {ranks[rank]['gpu']}; NVSHMEM heap {'ok' if heap else 'MISSING'}; env {env}")
    floors = {}
    for m in {c["model"] for c in cells}:
        cfg = load_config(m)
        floors[m] = (floor_ms(cfg), floor_ms_tp(cfg, W))
    state = dict(ranks=ranks, rows=[])

    def save():   # atomically: the parent reads it even if this process is killed later
        if rank == 0:
            tmp = Path(rows_path).with_suffix(".tmp")
            tmp.write_text(json.dumps(state, indent=1, default=str))
            os.replace(tmp, rows_path)

    save()
    wts = _Weights()
    for i, cell in enumerate(cells):
        left = deadline - time.time()
        dec = sync.bcast(f"go{i}", ("run" if cell["est_s"] <= left else f"skipped (time budget: needs ~{cell['est_s']:.0f}"
                                    f" s, {max(left, 0):.0f} s left)") if rank == 0 else None)
        label = f"{cell['system']} {cell['model']} B={cell['batch']} ctx={cell['context']}"
        if dec != "run":
            _tp_log(rank, f"skip {label}: {dec}")
            if rank == 0:
                state["rows"].append(dict(_row_key(cell, floors), status=dec))
                save()
            continue
        t = time.time()
        res, err = None, None
        try:
            res = CELL_FNS[cell["system"]](tctx, heap, cell, load_config(cell["model"]), wts, opts)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - recorded; the next cell still runs
            err = f"{type(e).__name__}: {e}"
            _tp_log(rank, f"{label} FAILED {err}\n{traceback.format_exc()}")
        outs = sync.gather(f"res{i}", dict(res=res, err=err, s=round(time.time() - t, 1)))
        gc.collect(); torch.cuda.empty_cache()
        if rank == 0:
            row = _merge(cell, outs, floors)
            state["rows"].append(row)
            save()
            if row["status"] == "ok":
                _tp_log(rank, f"{label}: {row['ms']:.3f} ms/token ({row['pct_of_floor']:.0f}% of floor "
                              f"{row['floor_ms']:.3f}) in {row['seconds']:.0f}s")
            else:
                _tp_log(rank, f"{label}: {row['status'][:300]}")
    return dict(rank=rank, env=env)


def floor_ms_tp(cfg, tp) -> tuple[float, int]:
    from _tp_rig import floor_ms_per_rank
    return floor_ms_per_rank(cfg, tp, HBM)


def summarize_tp(rows) -> list[dict]:
    """Per (model, batch, context): the three systems side by side and their ratios."""
    ok = {(r["model"], r["batch"], r["context"], r["system"]): r for r in rows if r.get("status") == "ok"}
    out = []
    seen = []
    for r in rows:
        k = (r["model"], r["batch"], r["context"])
        if k in seen:
            continue
        seen.append(k)
        mk2, peer, mk1 = (ok.get(k + (s,)) for s in ("megakernel_tp2", "gptfast_tp2", "megakernel"))
        g = lambda x, f: x[f] if x else None  # noqa: E731
        fl = {x["system"]: x.get("floor_ms") for x in rows if (x["model"], x["batch"], x["context"]) == k}
        s = dict(model=k[0], batch=k[1], context=k[2], megakernel_tp2_ms=g(mk2, "ms"), gptfast_tp2_ms=g(peer, "ms"),
                 megakernel_1gpu_ms=g(mk1, "ms"),
                 floor_per_gpu_ms=fl.get("megakernel_tp2") or fl.get("gptfast_tp2"), floor_1gpu_ms=fl.get("megakernel"),
                 megakernel_tp2_pct_of_floor=g(mk2, "pct_of_floor"), gptfast_tp2_pct_of_floor=g(peer, "pct_of_floor"),
                 megakernel_1gpu_pct_of_floor=g(mk1, "pct_of_floor"))
        if mk2 and peer:
            s["peer_over_megakernel_tp2"] = peer["ms"] / mk2["ms"]          # > 1: the TP=2 megakernel is faster
        if mk2 and mk1:
            s["megakernel_1gpu_over_tp2"] = mk1["ms"] / mk2["ms"]           # > 1: TP=2 beats one GPU
        if mk2 and mk2.get("comm"):
            s["comm"] = [{"rank": c.get("rank"), "step_us": c.get("step_us"),
                          **{f"allreduce_{k2}": (c["kinds"].get("allreduce") or {}).get(k2)
                             for k2 in ("tile_us_sum", "wait_us_mean", "remote_wait_us_mean", "exposed_us",
                                        "exposed_frac_of_step", "ops_per_step")}}
                         for c in mk2["comm"] if c]
        out.append(s)
    return out


def print_tp(rows, summary):
    f = lambda x, w=8, p=3: f"{x:{w}.{p}f}" if isinstance(x, (int, float)) else f"{'-':>{w}s}"  # noqa: E731
    print("\n==== bench_decode --tp 2 (ms/token, median; floor = per-GPU weight bytes / 4.55 TB/s) ====")
    print(f"{'model':13s} {'B':>3s} {'ctx':>5s} {'TP2 mk':>8s} {'TP2 peer':>8s} {'1GPU mk':>8s} {'floor/GPU':>9s} "
          f"{'peer/mk':>7s} {'1gpu/mk':>7s} {'mk%flr':>6s} {'peer%flr':>8s}")
    for s in summary:
        print(f"{s['model']:13s} {s['batch']:3d} {s['context']:5d} {f(s['megakernel_tp2_ms'])} {f(s['gptfast_tp2_ms'])} "
              f"{f(s['megakernel_1gpu_ms'])} {f(s['floor_per_gpu_ms'], 9)} {f(s.get('peer_over_megakernel_tp2'), 7, 2)} "
              f"{f(s.get('megakernel_1gpu_over_tp2'), 7, 2)} {f(s['megakernel_tp2_pct_of_floor'], 6, 0)} "
              f"{f(s['gptfast_tp2_pct_of_floor'], 8, 0)}")
    for s in summary:
        for c in s.get("comm", []):
            print(f"  comm {s['model']} B={s['batch']} rank {c['rank']}: step {f(c['step_us'], 0, 1)} us; all-reduce "
                  f"{f(c['allreduce_ops_per_step'], 0, 0)} ops, tiles {f(c['allreduce_tile_us_sum'], 0, 1)} SM-us/step, "
                  f"wait before a tile {f(c['allreduce_wait_us_mean'], 0, 2)} us (remote part "
                  f"{f(c['allreduce_remote_wait_us_mean'], 0, 2)}), exposed ~{f(c['allreduce_exposed_us'], 0, 1)} us/step "
                  f"({f(100 * c['allreduce_exposed_frac_of_step'] if c['allreduce_exposed_frac_of_step'] else None, 0, 0)}%)")
    for r in rows:
        if r.get("status") != "ok":
            print(f"  {r['system']:15s} {r['model']:13s} B={r['batch']:<3d} ctx={r['context']:<5d} {r['status'][:200]}")


def _bundle_path(meta, site="/tmp/site"):
    """nvshmem4py lives in the GPU bundle's /tmp/site (.gpubundle/install.sh puts it on PYTHONPATH); a later
    `export PYTHONPATH=$PWD` drops it. Then put it back (logged and recorded) instead of failing every TP
    megakernel cell; spawned ranks inherit sys.path and the environment."""
    import importlib.util
    if importlib.util.find_spec("nvshmem") is None and Path(site, "nvshmem").is_dir():
        sys.path.append(site)
        os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (os.environ.get("PYTHONPATH"), site) if x)
        meta["pythonpath_added"] = site
        log(f"nvshmem4py was not importable: added {site} (the GPU bundle) to the path")


def main_tp(args):
    """Parent of the --tp run: plans the cells, builds the kernel once, launches the rank processes, merges."""
    import tempfile

    from mpk_runtime.models.config import load_config
    from mpk_runtime.runtime import tp_launch
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "16")
    models = args.models.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    ctxs = [int(c) for c in args.contexts.split(",")]
    trace_b = {int(b) for b in args.comm_trace_batches.split(",")} if args.comm_trace else set()
    n_layers = {m: load_config(m).num_layers for m in models}
    peer_b = set(_ints(args.peer_batches))
    cells = [c for ctx in ctxs for c in tp_cells(models, batches, ctx, trace_b, n_layers, peer_b)]
    for i, c in enumerate(cells):
        c["cell"] = i
    ngpu = torch.cuda.device_count()
    meta = dict(machine=dict(gpu=torch.cuda.get_device_name(0) if ngpu else None, count=ngpu, host=platform.node()),
                date=datetime.datetime.now().isoformat(), git_commit=os.environ.get("GIT_COMMIT", "unknown"),
                torch=torch.__version__, tp=args.tp, budget_s=args.budget_s, hbm_bytes_per_s=HBM,
                steps_per_launch=args.steps_per_launch, launches=args.launches,
                env={k: os.environ.get(k) for k in ("NVSHMEM_DISABLE_NVLS", "NCCL_NVLS_ENABLE",
                                                     "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
                note=("megakernel_tp2 / gptfast_tp2: the slower rank's median; floor for them = the bytes of weights one "
                      "rank streams per step / 4.55 TB/s (its q/k/v/o, MLP and vocab-parallel LM head shards + norms), "
                      "for megakernel (1 GPU) the whole model's; untied embedding tables are gathered, not streamed, "
                      "and left out; seeded random bf16 weights"))
    out_path = OUT / "bench_decode_tp2.json"
    rows: list[dict] = []

    def finish(extra=None, show=True):
        summary = summarize_tp(rows)
        out_path.write_text(json.dumps(dict(meta=meta, **(extra or {}), rows=rows, summary=summary,
                                            skipped=[{k: r[k] for k in ("system", "model", "batch", "context", "status")}
                                                     for r in rows if r.get("status") != "ok"]),
                                       indent=1, default=str))
        if show:
            print_tp(rows, summary)
            print(f"wrote {out_path}  total {time.time() - T0:.0f}s")

    key = lambda c: {k: c[k] for k in ("cell", "system", "model", "batch", "context")}  # noqa: E731
    if ngpu < args.tp:
        rows = [dict(key(c), status=f"skipped (needs {args.tp} GPUs, this machine shows {ngpu})") for c in cells]
        return finish()
    _bundle_path(meta)
    try:
        from mpk_runtime.codegen import nvcc
        t = time.time()
        b = nvcc.build()
        meta["kernel_build"] = dict(cached=b.cached, seconds=round(time.time() - t, 1), resources=b.resources)
        log(f"megakernel build cached={b.cached} {time.time() - t:.1f}s")
    except Exception as e:  # noqa: BLE001 - the megakernel cells then fail with it, the peer still runs
        meta["kernel_build"] = dict(error=f"{type(e).__name__}: {e}"[:2000])
        log(f"megakernel build FAILED: {e}")
    rows = [dict(key(c), status="pending (the run was cut before it ended)") for c in cells]
    finish(show=False)   # a result file exists even if this process is killed
    deadline = T0 + args.budget_s
    rows_path = Path(tempfile.mkdtemp(prefix="bench_tp_")) / "rows.json"
    opts = dict(t0=T0, steps_per_launch=args.steps_per_launch, launches=args.launches,
                sync_timeout_s=args.budget_s + args.grace_s + 120, tp_invariant=args.tp_invariant)
    launch_error = None
    try:
        res = tp_launch.run(tp_rank_main, args.tp, (cells, deadline, opts, str(rows_path)),
                            timeout_s=max(60.0, deadline - time.time() + args.grace_s))
        meta["ranks_returned"] = res
    except Exception as e:  # noqa: BLE001 - TPLaunchError (a rank failed / was killed) or the launch itself
        launch_error = f"{type(e).__name__}: {e}"
        log(f"TP launch failed:\n{launch_error[-3000:]}")
    try:
        got = json.loads(rows_path.read_text()) if rows_path.exists() else {}
    except ValueError as e:
        got = {}
        log(f"unreadable rank-0 results {rows_path}: {e}")
    meta["ranks"] = got.get("ranks")
    rows = list(got.get("rows", []))
    done = {r["cell"] for r in rows}
    for c in cells:
        if c["cell"] not in done:
            rows.append(dict(key(c), status="error: the rank processes ended before this cell: "
                                            + (launch_error or "no result")[-600:]))
    rows.sort(key=lambda r: r["cell"])
    return finish(dict(launch_error=launch_error[-4000:] if launch_error else None))


if __name__ == "__main__":
    main()
