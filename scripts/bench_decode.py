#!/usr/bin/env python3
"""Decode benchmark, one run, peers side by side: this runtime's megakernel vs peers vs the weight-streaming floor,
on seeded random bf16 weights (model shapes llama-3.2-1b and qwen3-8b); one GPU (issue 3) or TP=2 (--tp 2, issue 4).

  megakernel   one persistent launch runs N decode steps; ms/token = (CUDA-event time of the launch) / N,
               each launch synchronised before the next (no back-to-back pipelining); median over launches.
  gptfast      gpt-fast-style decoder (plain torch, static KV cache, torch.compile(mode="reduce-overhead"));
               adapted from the project's ../shared/gpu/peer_baseline_tp.py (tp=1) with a batch dimension.
  planned      the planner's chosen plan (plan_book, default profile) where it is not the one megakernel (from
               batch 8: the conventional plan, or attention as megakernels and the rest conventional): the step as
               one CUDA graph, each replay timed alone with CUDA events, median. Ratios compare the peers with this
               runtime's choice.
  hf           HF transformers + StaticCache + torch.compile(mode="reduce-overhead")
               (as ../shared/gpu/peer_baseline_hf.py).
  Peers: every step timed on its own with CUDA events (record, step, record), median over steps, after ~0.3 s of
  untimed steps (as ours); both also queued back to back (ms_pipelined). ratio_vs_ours = the peer's lower of the
  two / ours (summarize): ours runs 8 steps a launch, so the peer's per-step host work is not counted against it.
  floor        bytes of weights streamed per step / 4.55 TB/s (measured read-only streaming on one H200); another
               card at its own rate measured in the run (stream_bandwidth); floor_kv_ms adds every row's cached K / V
               at the context; an untied embedding table is gathered, not streamed, so it is left out.
Context c: the KV cache holds c random (megakernel, gpt-fast) or prefilled (HF) positions; decode at positions c ..
c + 7 (the peers cycle over them, their static caches c + 8 keys long: they read every key of the cache).

    GIT_COMMIT=$(git rev-parse HEAD) PYTHONPATH=. python3 scripts/bench_decode.py [--budget-s 300]
Writes $OUT/bench_decode.json (or ./gpu_out). Work runs in the order of work_order() (this runtime's cells, then the
peers'); what does not fit in the time budget is reported as skipped, never silently dropped. --isolate runs each
system's cells in a fresh process of its own (run_isolated) and merges the rows.

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
  floor           per GPU: bytes of weights one rank streams per step / the card's rate as above, measured by rank
                  0 in the run (_tp_rig.rank_weight_bytes); peer/mk = the peer's lower of its two times / ours.
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

from _bench_common import (HBM, OUT, T0, _ints, bench_megakernel, floor_kv_ms, floor_ms, git_commit,  # noqa: E402,F401
                           log, stage_summary, stream_bandwidth, with_lib_versions)
from _bench_tp import main_tp  # noqa: E402  (--tp 2)
from mpk_runtime.envflags import resolved_switches, switches  # noqa: E402

ROWS: list[dict] = []


# --------------------------------------------------------------------------------- planned (what a user gets)
def chosen_plans(cfg, batches, ctx) -> dict:
    """{batch: Plan}: the planner's choice per batch at this context (plan_book, the default hardware profile), as
    LLM(..., plan="auto") would run it."""
    from mpk_runtime.planner import plan_book
    from mpk_runtime.planner.plan import Plan
    book = plan_book(cfg, 1, tuple(batches), context=ctx)
    return {int(b): Plan.from_dict(d) for b, d in book["buckets"].items()}


SYSTEMS = ("planned", "megakernel", "gptfast", "hf")


def parse_cells(spec: str) -> list[tuple]:
    """--before's cells: "system:batch:context,..." (e.g. "megakernel:1:512,gptfast:1:512") as (system, B, ctx)."""
    cells = []
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        f = part.split(":")
        if len(f) != 3 or f[0] not in SYSTEMS or not f[1].isdigit() or not f[2].isdigit() or int(f[1]) < 1:
            raise SystemExit(f"--before {spec!r}: expected system:batch:context[,...] with system one of "
                             f"{', '.join(SYSTEMS)}, e.g. megakernel:1:512,gptfast:1:512")
        cells.append((f[0], int(f[1]), int(f[2])))
    return cells


def work_order(batches, ctxs, planned, mk_max_batch, peer_batches, hf_batches, peers=True, before=()) -> list[tuple]:
    """The cells of one model, (system, batch, context), in the order they run.

    This runtime's cells first: the planned ones (what a user gets from B=8), then the megakernel's (B=1 first),
    then the peers (B=1 first, then the first context's batches). Session 44 measured why the planned cells go
    first (bench/results/s44, llama-3.2-1b ctx 512, one H200): after the megakernel's and the peers' batch-1 cells
    in the same process the conventional plan's steps took ~95 us more at B=8 and B=32 (1.352 / 1.562 ms against
    1.259-1.268 / 1.460-1.477 with nothing or only the megakernel's B=8 / 32 cells before them; no clock or power
    difference in the nvidia-smi trace; with MPK_CONV_FIXED_CONFIGS=1 too, so not inductor's first-call pick).
    Which of the cells before them leaves the state behind was not separated (`--before` runs chosen cells ahead of
    the order, recorded like any other, to find out); a fresh process per system is the stronger fix. The peers come last, so their numbers carry whatever our cells leave behind, as before: gpt-fast
    B=8 ctx 512 measured 1.36-1.58 ms across seven processes that session, with no order that explained it."""
    work = list(before) + [("planned", b, c) for b, c in planned]
    work += [("megakernel", 1, c) for c in ctxs] if 1 in batches else []
    work += [("megakernel", b, c) for b in batches if 1 < b <= mk_max_batch for c in ctxs]
    if not peers:
        return work
    # a peer's B=1 cells need 1 in --batches and in its own list (--peer-batches "" switches gpt-fast off at B=1 too)
    g1, h1 = 1 in batches and 1 in peer_batches, 1 in batches and 1 in hf_batches
    work += [("gptfast", 1, ctxs[0])] if g1 else []
    work += [("hf", 1, ctxs[0])] if h1 else []
    work += [("gptfast", 1, c) for c in ctxs[1:]] if g1 else []
    work += [("gptfast", b, c) for c in ctxs for b in peer_batches if b > 1]   # first context first
    work += [("hf", b, c) for c in ctxs for b in hf_batches if (b > 1 or h1) and (b, c) != (1, ctxs[0])]
    return work


def best_ms(r: dict) -> float:
    """The time a row's ratios and % of floor use: the lower of each step timed alone (ms) and the steps queued back to
    back (ms_pipelined, where the system has it). The % of floor used `ms` alone, so a peer's % and its ratio were of
    two different times."""
    return min(r["ms"], r.get("ms_pipelined") or r["ms"])


def summarize(rows: list[dict]) -> None:
    """Each ok row's ratio_vs_ours (peer / ours at its (model, batch, context); > 1: this runtime is faster) and the
    table. Ours = the planner's choice: the 'planned' row where the run has one for that cell (no ratio when it
    failed or was skipped: the one megakernel is not what a user gets there), else the one megakernel's row;
    ratio_vs names it. The peer's time is the lower of its two (peer_ms_basis): each step timed alone (ms) and the
    steps queued back to back (ms_pipelined, gpt-fast and HF). The megakernel runs 8 steps a launch, so a peer timed
    step by step with its host overhead exposed would flatter ours (s62, H100: gpt-fast B=8 ctx 512 1.94 ms alone, 1.50
    queued). Ours, likewise, is the lower of a planned cell's ms and its replays queued back to back (ms_pipelined,
    since session 69; older files have only ms, so a ratio against them is a lower bound). ratio_synced_vs_ours: the
    peer's ms (each step alone) / ours' ms, as the tables before session 69."""
    planned = {(r["model"], r["batch"], r["context"]): r for r in rows if r["system"] == "planned"}
    ours = {(r["model"], r["batch"], r["context"]): r for r in rows if r["system"] == "megakernel"}
    ours.update(planned)
    for r in rows:
        for f in ("ratio_vs_ours", "ratio_vs", "ratio_synced_vs_ours", "peer_ms_basis", "ours_ms_basis"):
            r.pop(f, None)   # a merged (--isolate) row's ratio from its child's own, partial, rows
        k = (r["model"], r["batch"], r["context"])
        o = ours.get(k)
        if r.get("status") != "ok" or o is None or o.get("status") != "ok":
            continue
        ms = best_ms(r)
        basis = "ms_pipelined" if ms < r["ms"] else "ms"
        o_ms = best_ms(o)   # a planned cell's replays back to back too
        r["ratio_vs_ours"] = ms / o_ms
        r["ratio_vs"] = o["system"] + (f" ({o['plan']})" if o.get("plan") else "")
        if r["system"] not in ("planned", "megakernel"):
            r["peer_ms_basis"] = basis
            r["ratio_synced_vs_ours"] = r["ms"] / o["ms"]
            r["ours_ms_basis"] = "ms_pipelined" if o_ms < o["ms"] else "ms"
    print("\n==== bench_decode (ms per decode step of B rows, median) ====")
    print(f"{'model':13s} {'B':>3s} {'ctx':>5s} {'system':10s} {'ms':>8s} {'floor':>7s} {'%floor':>6s} "
          f"{'peer/ours':>9s} {'alone/ours':>10s} {'floor+kv':>8s} {'%':>4s}")
    nan = float("nan")
    for r in rows:
        if r.get("status") != "ok":
            print(f"{r['model']:13s} {r['batch']:3d} {r['context']:5d} {r['system']:10s} {r['status'][:60]}")
            continue
        print(f"{r['model']:13s} {r['batch']:3d} {r['context']:5d} {r['system']:10s} {r['ms']:8.3f} "
              f"{r['floor_ms']:7.3f} {r['pct_of_floor']:6.0f} {r.get('ratio_vs_ours', nan):9.2f} "
              f"{r.get('ratio_synced_vs_ours', nan):10.2f} "
              f"{r.get('floor_kv_ms', nan):8.3f} {r.get('pct_of_floor_kv', nan):4.0f}"
              + (f"  ({r.get('plan')})" if r["system"] == "planned" else "")
              + (f"  [{r['peer_ms_basis']}]" if r.get("peer_ms_basis") == "ms_pipelined" else ""))


def pending_rows(done: list[dict], cells: list[tuple]) -> list[dict]:
    """A row "pending (not reached ...)" for each of the run's cells, (model, system, batch, context) in order, that
    no row of `done` records yet (a --before cell and its place in the usual order count as two). save() writes them
    with the rows so far: a run killed by its wall-clock limit (gpu_pending.sh's timeout) left a file whose cells
    after the kill were simply absent, nothing saying that they had been asked for; the --tp run has done so since
    it began."""
    from collections import Counter
    seen = Counter((r["model"], r["system"], r["batch"], r["context"]) for r in done)
    out = []
    for c in cells:
        if seen[c] > 0:
            seen[c] -= 1
            continue
        out.append(dict(model=c[0], system=c[1], batch=c[2], context=c[3],
                        status="pending (not reached: the run ended before this cell)"))
    return out


def isolated_commands(argv: list[str], budget_s: float, out: Path) -> list[tuple[str, list[str], Path]]:
    """--isolate: one child process per system, in the order work_order runs them, each with the same arguments
    (without --isolate) plus --systems <it>, its own $OUT and the budget left when it starts (the caller fills it
    in: "{budget}"). [(system, argv, out dir), ...]"""
    base = [a for a in argv if a != "--isolate"]
    return [(sysname, base + ["--systems", sysname, "--budget-s", "{budget}"], out / f"iso_{sysname}")
            for sysname in SYSTEMS]


def run_isolated(args, argv: list[str]) -> None:
    """Each system's cells in a fresh process (no state one system's cells leave behind reaches another's:
    session 44's order effect), the rows merged into one bench_decode.json with the children's metas. A child not
    started (no budget left) or that left no bench_decode.json is named in meta.missing_systems and its reason in
    meta.children, never silently left out."""
    import subprocess
    rows, metas, missing = [], {}, {}
    for sysname, cmd, out in isolated_commands(argv, args.budget_s, OUT):
        left = args.budget_s - (time.time() - T0)
        if left < 5:
            log(f"isolate: no budget left for {sysname}")
            missing[sysname] = f"skipped (time budget: {left:.0f} s left, not started)"
            continue
        out.mkdir(parents=True, exist_ok=True)
        f = out / "bench_decode.json"
        if f.exists():
            f.unlink()   # an older run's file is not this child's result
        cmd = [sys.executable, str(Path(__file__).resolve())] + [c.replace("{budget}", f"{left:.0f}") for c in cmd]
        log(f"isolate: {sysname} in its own process ({left:.0f} s left)")
        rc = subprocess.run(cmd, env=dict(os.environ, OUT=str(out)), check=False).returncode
        if f.exists():
            d = json.loads(f.read_text())
            metas[sysname] = dict(d["meta"], returncode=rc)
            rows += [dict(r, process=sysname) for r in d["rows"]]
        else:
            log(f"isolate: {sysname} exited {rc} without {f}")
            missing[sysname] = f"error: child exited {rc} without a bench_decode.json"
    summarize(rows)
    for sysname, why in missing.items():
        print(f"{sysname}: no rows, {why}")
    meta = dict(next(iter(metas.values()), {}), order="--isolate: one process per system (planned, megakernel, "
                "gptfast, hf), each fresh", children={**metas, **{k: {"status": v} for k, v in missing.items()}},
                missing_systems=sorted(missing), args=dict(vars(args)), argv=list(argv))   # the parent's settings
    meta.pop("returncode", None)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench_decode.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {OUT / 'bench_decode.json'}  total {time.time() - T0:.0f}s")


def bench_planned(cfg, weights, B, ctx, plan, steps=12):
    """ms per step of the planner's chosen plan when it is not the one megakernel (attention as megakernels and the
    rest conventional, ...): the whole step as one CUDA graph, each replay timed alone with CUDA events (as the
    peers), median (_plan_measure.measure_plan, as validate_planner; greedy steps)."""
    from _plan_measure import Point, measure_plan
    t = time.time()
    pt = Point(cfg, weights, B, ctx, "cuda", plan.attn_splits)
    m = measure_plan(plan, pt, steps, cpu=False)
    ms = sorted(m["step_ms"])[len(m["step_ms"]) // 2]
    del pt
    return dict(system="planned", ms=ms, ms_min=min(m["step_ms"]), ms_pipelined=m.get("step_ms_pipelined"),
                plan=plan.name, predicted_ms=plan.predicted_us / 1e3,
                attn_splits=plan.attn_splits, planner_profile=plan.profile,
                exec=m.get("exec"), timing=f"each step timed alone (CUDA events, synchronised), median of {steps}; "
                                           f"ms_pipelined: {steps} replays queued back to back / {steps}",
                setup_s=round(time.time() - t, 1))


# ------------------------------------------------------------------------ peers (scripts/_peers.py, re-exported)
from _peers import GptFast, NcclComm, bench_gptfast, bench_hf  # noqa: E402,F401


def run_meta(args, device_name: str, n_visible: int, bw: float, bw_source: str) -> dict:
    """The run's meta: where, when, which code and versions, and every setting it ran with (args)."""
    from mpk_runtime.planner.profile import default_profile_name
    meta = dict(machine=f"{device_name} (GPU 0 of {n_visible} visible), {platform.node()}",
                date=datetime.datetime.now().astimezone().isoformat(),
                t0_local=datetime.datetime.fromtimestamp(T0).isoformat(),   # rows' t_s count from here (smi_join.py)
                git_commit=git_commit(), torch=torch.__version__, cuda=torch.version.cuda,
                python=platform.python_version(), hbm_bytes_per_s=bw, bandwidth_source=bw_source,
                dtype="bfloat16", weights="seeded random (ours: seed 0; peers: their own seeds), greedy decode",
                planner_profile=default_profile_name(),   # the profile the planned cells' plans were chosen under
                args=dict(vars(args)), argv=sys.argv[1:],
                note="floor = streamed weight bytes / the card's streaming rate (bandwidth_source); untied embedding "
                     "excluded; floor_kv_ms adds every row's cached K / V at the context; ratio_vs_ours = the peer's "
                     "lower of ms (each step alone) and ms_pipelined (steps back to back) / ours (summarize)",
                switches=switches(), graph_switches=resolved_switches(),
                order="work_order: --before cells, this runtime's planned cells, its megakernel cells (B=1 first), "
                      "then the peers (gpt-fast / HF B=1 first), one process (since session 44; before it the batch-1 "
                      "cells of every system ran first); each row's seq is its place", before=args.before)
    return with_lib_versions(meta)


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
    ap.add_argument("--before", default="", help="--tp 1: cells run ahead of the usual order, recorded like the "
                    "rest (order effects: e.g. megakernel:1:512 or gptfast:1:512 before the planned cells)")
    ap.add_argument("--isolate", action="store_true", help="--tp 1: each system's cells in a fresh process of its "
                    "own, the rows merged (no state of one system's cells reaches another's)")
    ap.add_argument("--systems", default="", help="--tp 1: only these systems' cells (comma-separated; --isolate "
                    "runs one child per system with it)")
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
    check_args(ap, args)
    return args


def _positive_ints(ap, flag: str, csv: str, empty_ok: bool) -> list[int]:
    """A comma list of positive integers, or ap.error naming the flag and the bad item."""
    items = [x.strip() for x in csv.split(",") if x.strip()]
    bad = [x for x in items if not x.isdigit() or int(x) < 1]
    if bad or (not items and not empty_ok):
        ap.error(f"{flag} {csv!r}: expected a comma-separated list of positive integers"
                 + (f" ({', '.join(repr(b) for b in bad)} is not one)" if bad else " (it is empty)"))
    if len(set(items)) != len(items):
        ap.error(f"{flag} {csv!r}: a value is listed twice (each cell would run, and be recorded, twice)")
    return [int(x) for x in items]


def check_args(ap, args) -> None:
    """Bad --models / --batches / --contexts / peer batch lists / --systems / counts stop the run with one line
    (argparse's exit 2) before any GPU work: before, "1,x" was a ValueError traceback, 0 or a negative batch or
    context was built and failed (or measured an empty step) as a cell, and an unknown model name failed at its
    load_config after every cell of the models before it had run (no summary printed)."""
    from mpk_runtime.models.config import load_config
    models = [m.strip() for m in args.models.split(",")]
    if not all(models):
        ap.error(f"--models {args.models!r}: an empty name in the list")
    for m in models:
        try:
            load_config(m)
        except Exception as e:  # noqa: BLE001 - ConfigError (unknown preset, no config.json): its message
            ap.error(f"--models: {m!r}: {e}")
    if len(set(models)) != len(models):
        ap.error(f"--models {args.models!r}: a model is listed twice")
    _positive_ints(ap, "--batches", args.batches, empty_ok=False)
    _positive_ints(ap, "--contexts", args.contexts, empty_ok=False)
    for flag in ("peer_batches", "hf_batches", "comm_trace_batches"):   # "" switches that peer / trace off
        _positive_ints(ap, "--" + flag.replace("_", "-"), getattr(args, flag), empty_ok=True)
    bad = set(filter(None, args.systems.split(","))) - set(SYSTEMS)
    if bad:
        ap.error(f"--systems {args.systems!r}: unknown {sorted(bad)}; choose from {', '.join(SYSTEMS)}")
    if args.budget_s <= 0:
        ap.error(f"--budget-s {args.budget_s:g}: must be > 0")
    if args.tp < 1 or args.mk_max_batch < 0 or args.steps_per_launch < 1 or args.launches < 1:
        ap.error("--tp, --steps-per-launch and --launches must be >= 1, --mk-max-batch >= 0")
    parse_cells(args.before)   # --before's format, its own message


def main():
    args = parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.tp > 1:
        return main_tp(args)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode times GPU kernels and found no CUDA GPU: run it on the GPU machine "
                         "(scripts/gpu_pending.sh bench), not here")
    if args.isolate:
        return run_isolated(args, sys.argv[1:])
    from mpk_runtime.models.config import load_config
    from mpk_runtime.models.weights import random_weights
    torch.backends.cuda.matmul.allow_tf32 = True
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "16")
    models = [m.strip() for m in args.models.split(",")]
    batches = _ints(args.batches)
    ctxs = _ints(args.contexts)
    share = args.budget_s / len(models)
    bw, bw_source = stream_bandwidth(torch.cuda.get_device_name(0))
    meta = run_meta(args, torch.cuda.get_device_name(0), torch.cuda.device_count(), bw, bw_source)
    todo = {}   # every model's cells, planned before the first runs (the planner's choices: CPU only)
    for model in models:
        cfg = load_config(model)
        # the planner's choice where it is not the one megakernel (from B=8: the conventional plan)
        chosen = {c: chosen_plans(cfg, batches, c) for c in ctxs} if args.planned else {}
        planned = [(b, c) for b in batches for c in ctxs if c in chosen and chosen[c][b].name != "mono"]
        before = parse_cells(args.before)
        for system, b, c in before:   # a planned cell ahead of the order needs its plan
            if system == "planned" and b not in chosen.get(c, {}):
                chosen.setdefault(c, {}).update(chosen_plans(cfg, [b], c))
        work = work_order(batches, ctxs, planned, args.mk_max_batch, _ints(args.peer_batches),
                          _ints(args.hf_batches), peers=not args.no_peers, before=before)
        if args.systems:
            work = [w for w in work if w[0] in args.systems.split(",")]
        todo[model] = (cfg, chosen, work)
    cells = [(m, *w) for m in models for w in todo[m][2]]

    def save():   # the cells not reached yet as pending rows: a run killed on the way says what it lost
        (OUT / "bench_decode.json").write_text(json.dumps(dict(meta=meta, rows=ROWS + pending_rows(ROWS, cells)),
                                                          indent=1))

    save()
    for mi, model in enumerate(models):
        cfg, chosen, work = todo[model]
        fl, nbytes = floor_ms(cfg, bw)
        deadline = T0 + share * (mi + 1)
        weights = None
        for system, B, ctx in work:
            # seq / t_s: the cell's place in this process's order and its start (s after the process began), kept
            # with each number (session 36: the same plan moves ~4% between machine starts, < 1% between orders)
            key = dict(model=model, system=system, batch=B, context=ctx, floor_ms=fl, weight_bytes=nbytes,
                       floor_kv_ms=floor_kv_ms(cfg, B, ctx, bw),
                       seq=len(ROWS), t_s=round(time.time() - T0, 1))
            est = {"megakernel": 8, "planned": 25 if "8b" in model else 12, "gptfast": 45 if "8b" in model else 25,
                   "hf": 90 if "8b" in model else 45}[system]
            if time.time() + est > deadline:
                ROWS.append(dict(key, status="skipped (time budget)")); save()
                log(f"skip {system} {model} B={B} ctx={ctx} (budget)")
                continue
            try:
                if system in ("megakernel", "planned") and weights is None:
                    from mpk_runtime.runtime.conventional_fused import prepare_weights
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
                best = best_ms(r)   # the time the ratios use (each system's lower of alone / back to back)
                r = dict(key, **r, status="ok", pct_of_floor=100 * fl / best,
                         pct_of_floor_kv=100 * key["floor_kv_ms"] / best)
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
    summarize(ROWS)
    save()
    print(f"wrote {OUT / 'bench_decode.json'}  total {time.time() - T0:.0f}s")


if __name__ == "__main__":
    main()
