"""scripts/bench_decode.py --tp 2: the TP=2 megakernel, the PyTorch TP=2 peer and the one-GPU megakernel, one spawned
process per GPU (mpk_runtime.runtime.tp_launch); the columns are described in bench_decode.py's docstring."""
from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

import _bench_common as C
from _bench_common import HBM, OUT, _ints, bench_megakernel, floor_ms, log, stream_bandwidth, with_lib_versions
from _peers import NcclComm, bench_gptfast


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
    print(f"[{time.time() - C.T0:6.1f}s r{rank}]", *a, flush=True)


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
    C.T0 = opts["t0"]
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
    # the floor at this card's own streaming rate, measured once by rank 0 (rank 1 idle) and shared, as the one-GPU
    # run does since session 55; before, every TP row used the H200's 4.55 TB/s, whatever the card (an H100 pair's
    # % of floor ~1.5x too low)
    bw, bw_source = sync.bcast("bandwidth", list(_bandwidth(gpu)) if rank == 0 else None)
    floors = {}
    for m in {c["model"] for c in cells}:
        cfg = load_config(m)
        floors[m] = (floor_ms(cfg, bw), floor_ms_tp(cfg, W, bw))
    state = dict(ranks=ranks, rows=[], hbm_bytes_per_s=bw, bandwidth_source=bw_source)

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


def floor_ms_tp(cfg, tp, bw: float = HBM) -> tuple[float, int]:
    from _tp_rig import floor_ms_per_rank
    return floor_ms_per_rank(cfg, tp, bw)


def _bandwidth(gpu: str) -> tuple[float, str]:
    """(bytes/s, source) of this rank's card (_bench_common.stream_bandwidth: an H200's 4.55 TB/s, another card
    measured now); without a GPU (the CPU tests) the H200's rate, said so."""
    if not torch.cuda.is_available():
        return HBM, f"{HBM / 1e12:.2f} TB/s: the H200's rate, not measured (no GPU in this process)"
    return stream_bandwidth(gpu)


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
                 gptfast_tp2_ms_pipelined=peer.get("ms_pipelined") if peer else None,
                 megakernel_1gpu_ms=g(mk1, "ms"),
                 floor_per_gpu_ms=fl.get("megakernel_tp2") or fl.get("gptfast_tp2"), floor_1gpu_ms=fl.get("megakernel"),
                 megakernel_tp2_pct_of_floor=g(mk2, "pct_of_floor"), gptfast_tp2_pct_of_floor=g(peer, "pct_of_floor"),
                 megakernel_1gpu_pct_of_floor=g(mk1, "pct_of_floor"))
        if mk2 and peer:
            # > 1: the TP=2 megakernel is faster. The peer's lower of each step alone (ms) and its steps queued back
            # to back (ms_pipelined), as bench_decode.summarize since session 69: the megakernel runs N steps a
            # launch, so the peer's per-step host work (exposed when every step is synchronised) is not its GPU time.
            # Before, this ratio used the peer's ms alone and flattered the megakernel.
            pp = peer.get("ms_pipelined")
            basis = "ms_pipelined" if pp and pp < peer["ms"] else "ms"
            s["peer_over_megakernel_tp2"] = peer[basis] / mk2["ms"]
            s["peer_ms_basis"] = basis
            s["peer_synced_over_megakernel_tp2"] = peer["ms"] / mk2["ms"]   # both each step / launch synchronised
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


def print_tp(rows, summary, bw: float | None = HBM):
    f = lambda x, w=8, p=3: f"{x:{w}.{p}f}" if isinstance(x, (int, float)) else f"{'-':>{w}s}"  # noqa: E731
    rate = f"{bw / 1e12:.2f} TB/s" if bw else "the card's rate"
    print(f"\n==== bench_decode --tp 2 (ms/token, median; floor = per-GPU weight bytes / {rate}; peer/mk: the peer's "
          "lower of each step alone and back to back) ====")
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


def tp_meta(args, ngpu: int) -> dict:
    """The --tp run's meta: where (GPU name, count, host), when (date with its zone), which code (git_commit: $GIT_COMMIT,
    else this checkout's HEAD, as the one-GPU run; it was "unknown" without the variable), torch / CUDA / library
    versions and every setting (args). hbm_bytes_per_s stays None until the ranks report the rate they measured."""
    meta = dict(machine=dict(gpu=torch.cuda.get_device_name(0) if ngpu else None, count=ngpu, host=platform.node()),
                date=datetime.datetime.now().astimezone().isoformat(), git_commit=C.git_commit(),
                torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(), tp=args.tp,
                budget_s=args.budget_s, hbm_bytes_per_s=None, bandwidth_source="not measured (no rank reported)",
                steps_per_launch=args.steps_per_launch, launches=args.launches, args=dict(vars(args)),
                argv=sys.argv[1:],
                env={k: os.environ.get(k) for k in ("NVSHMEM_DISABLE_NVLS", "NCCL_NVLS_ENABLE",
                                                     "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
                note=("megakernel_tp2 / gptfast_tp2: the slower rank's median; floor for them = the bytes of weights one "
                      "rank streams per step / the card's streaming rate (hbm_bytes_per_s, bandwidth_source; its "
                      "q/k/v/o, MLP and vocab-parallel LM head shards + norms), for megakernel (1 GPU) the whole "
                      "model's; untied embedding tables are gathered, not streamed, and left out; seeded random bf16 "
                      "weights; peer_over_megakernel_tp2 = the peer's lower of ms and ms_pipelined / the megakernel's"))
    return with_lib_versions(meta)


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
    meta = tp_meta(args, ngpu)
    out_path = OUT / "bench_decode_tp2.json"
    rows: list[dict] = []

    def finish(extra=None, show=True):
        summary = summarize_tp(rows)
        bw = meta.get("hbm_bytes_per_s")
        out_path.write_text(json.dumps(dict(meta=meta, **(extra or {}), rows=rows, summary=summary,
                                            skipped=[{k: r[k] for k in ("system", "model", "batch", "context", "status")}
                                                     for r in rows if r.get("status") != "ok"]),
                                       indent=1, default=str))
        if show:
            print_tp(rows, summary, bw)
            print(f"wrote {out_path}  total {time.time() - C.T0:.0f}s")

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
    deadline = C.T0 + args.budget_s
    rows_path = Path(tempfile.mkdtemp(prefix="bench_tp_")) / "rows.json"
    opts = dict(t0=C.T0, steps_per_launch=args.steps_per_launch, launches=args.launches,
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
    if got.get("hbm_bytes_per_s"):   # the rate rank 0 measured (or took) for this card: the rows' floors
        meta.update(hbm_bytes_per_s=got["hbm_bytes_per_s"], bandwidth_source=got.get("bandwidth_source"))
    rows = list(got.get("rows", []))
    done = {r["cell"] for r in rows}
    for c in cells:
        if c["cell"] not in done:
            rows.append(dict(key(c), status="error: the rank processes ended before this cell: "
                                            + (launch_error or "no result")[-600:]))
    rows.sort(key=lambda r: r["cell"])
    return finish(dict(launch_error=launch_error[-4000:] if launch_error else None))
