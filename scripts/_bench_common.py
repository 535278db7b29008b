"""What scripts/bench_decode.py's one-GPU run and its --tp 2 run (scripts/_bench_tp.py) share: the floor, the log,
and the one-GPU megakernel measurement (bench_megakernel, with its optional trace and stage stamps)."""
from __future__ import annotations

import gzip
import statistics
import json
import os
import time
from pathlib import Path

import torch

HBM = 4.55e12
WARM_S = 0.3   # seconds of untimed megakernel launches before the timed ones
OUT = Path(os.environ.get("OUT") or "gpu_out")
T0 = time.time()   # the run's start (a --tp 2 rank process sets it to its parent's)


def git_commit() -> str:
    """$GIT_COMMIT, else this checkout's HEAD (with "-dirty" when tracked files differ from it), else "unknown"."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    import subprocess
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def with_lib_versions(meta: dict) -> dict:
    """meta with the versions of the peers' libraries (transformers, triton) where they import."""
    for mod in ("transformers", "triton"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    return meta


def write_result(name: str, res: dict) -> Path:
    """res + where and when it ran (commit from GIT_COMMIT, machine, device, date) as $OUT/<name> (./gpu_out)."""
    import platform
    res = {**res, "commit": git_commit(), "cpu_count": os.cpu_count(),
           "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs)",
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(os.environ.get("OUT") or "gpu_out")
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(res, indent=1))
    return out / name


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def _ints(csv: str) -> list[int]:
    """'1,8' -> [1, 8]; '' -> [] (a peer switched off)."""
    return [int(x) for x in csv.split(",") if x.strip()]


def graph_us(unit, reps: int, replays: int = 10) -> float:
    """Median microseconds per call of unit(i) (i = 0 .. reps - 1: e.g. which weight copy to read) over `replays`
    replays of one CUDA graph of `reps` calls."""
    unit(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            unit(i)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(ts)

def floor_ms(cfg, bw: float = HBM) -> tuple[float, int]:
    """(ms to stream the weights one decode step reads at `bw` bytes/s, those bytes)."""
    from mpk_runtime.models.weights import weight_shapes
    n = 0
    for name, shape in weight_shapes(cfg).items():
        k = 1
        for s in shape:
            k *= s
        if name.endswith("embed_tokens.weight") and not cfg.tie_word_embeddings:
            continue
        n += 2 * k
    return n / bw * 1e3, n


def kv_bytes_per_token(cfg) -> int:
    """Bytes of K and V one cached token holds across the layers (bf16): what a decode step reads per key."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2


def floor_kv_ms(cfg, batch: int, context: int, bw: float = HBM) -> float:
    """ms to stream the weights and every row's cached K / V (batch x context keys) once at `bw`: the floor that
    counts what a long context adds (floor_ms counts the weights only, the issue's definition at context 512)."""
    return (floor_ms(cfg, bw)[1] + batch * context * kv_bytes_per_token(cfg)) / bw * 1e3


def stream_bandwidth(device_name: str, measure=None) -> tuple[float, str]:
    """(read-only streaming bytes/s of this GPU, where the number comes from). An H200: HBM, the rate measured by
    our own streaming kernel (the floor of every table so far). Another card: measured now by `measure` (default:
    torch.sum over 4 GiB of bf16, the median of 10), so its floor is its own and not the H200's."""
    if "H200" in device_name:
        return HBM, "4.55 TB/s: read-only streaming measured on one H200 (the issue's floor)"
    bw = (measure or _measure_sum_bandwidth)()
    return bw, f"{bw / 1e12:.2f} TB/s: torch.sum over 4 GiB of bf16 on this {device_name}, median of 10 (measured now)"


def _measure_sum_bandwidth(nbytes: int = 4 << 30, reps: int = 10) -> float:
    a = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    ts = []
    for i in range(reps + 2):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        a.sum(dtype=torch.float32)
        e1.record()
        e1.synchronize()
        if i >= 2:
            ts.append(e0.elapsed_time(e1) / 1e3)
    del a
    torch.cuda.empty_cache()
    return nbytes / statistics.median(ts)


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
    start = torch.full((B,), ctx, dtype=torch.int64, device="cuda")
    # untimed launches for ~WARM_S first (a hot GPU, as validate_planner's plans since session 16)
    pos.copy_(start); t1 = time.time(); mk.launch(nsteps); torch.cuda.synchronize(); mk.check()
    warm = max(2, min(200, int(WARM_S / max(time.time() - t1, 1e-4))))
    ms, ms_min = time_launches(mk, pos, start, nsteps, launches, warm=warm)
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
             setup_s=round(setup, 1), registers=mk.build.resources,
             kernel_defines=[f for f in mk.build.flags if f.startswith("-D")])   # the build this graph launched
    del mk, mem, kv
    return r


def stage_summary(mk, step: int, path) -> dict:
    """Per op (layer prefix dropped): median us from the task's start (after its waits) to each stage stamp of a
    -DMPK_STAGE_WORDS build, over the tasks of one traced step; the raw rows go to `path` (.json.gz): [task id, kind,
    op, SM, start, end, [stamps], label] (the label since session 35; scripts/trace_phases.py --merge reads it)."""
    st = mk.stage_stamps()[step]
    tr = mk.trace_times()[step]
    rows, by = [], {}
    for t in mk.tg.tasks:
        a, b = int(tr[t.id, 0]), int(tr[t.id, 1])
        if not (a and b):
            continue
        ks = [int(v) for v in st[t.id]]
        rows.append([t.id, t.kind, t.op, t.sm, a, b, ks, t.label()])
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


class ModelledDevice:
    """A device's queue for the modelled runners (bench_engine_overhead's instant runner, bench_kv_pressure's):
    work issued runs after the work issued before it, for the seconds it is given; the host sleeps (the GIL
    released, as a CUDA wait does) only where it waits for a result. A burst launched without waiting
    (ModelRunner.launch_steps) is a Pending whose wait sleeps until the burst's end."""

    def __init__(self):
        self.free_at = 0.0   # time.perf_counter() when the last work issued ends

    def issue(self, seconds: float) -> float:
        """Queue `seconds` of work; returns when it ends."""
        self.free_at = max(time.perf_counter(), self.free_at) + seconds
        return self.free_at

    @staticmethod
    def until(t: float) -> None:
        left = t - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def run(self, seconds: float) -> None:
        """Queue the work and wait for it (a synchronous step)."""
        self.until(self.issue(seconds))

    def pending(self, seconds: float, value):
        """Queue the work; a runtime.base.Pending of value, ready when it ends."""
        from mpk_runtime.runtime.base import Pending
        end = self.issue(seconds)
        return Pending(lambda: (self.until(end), value)[1])
