"""Where the GPU runner's prompt prefill (ConventionalPrefill, the path the engine uses for prompt chunks) spends
its time, in the shape of a serving load: steps of N prompt chunks of random lengths (scripts/load_test.py's
4-24 tokens by default), fresh block tables each step. Prints per-step wall times (first steps vs steady state,
executor-cache misses) and a torch.profiler table of one steady step (CPU and CUDA time per op).

    python3 scripts/profile_prefill.py --model llama-3.2-1b --tp 1
    python3 scripts/profile_prefill.py --model llama-3.2-1b --tp 2      # one process per GPU, NCCL
Writes $OUT/profile_prefill_tp<N>.json (rank 0) when OUT is set. GPU machine only.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def rank_main(rank: int, a, port: int) -> None:
    import torch.distributed as dist
    from mpk_runtime.ir.shard import shard_for, weight_slice
    from mpk_runtime.models.config import load_config
    from mpk_runtime.models.weights import get_weights, torch_dtype
    from mpk_runtime.runtime.comm import TorchDistComm
    from mpk_runtime.runtime.conventional_prefill import ConventionalPrefill
    from mpk_runtime.runtime.memory import KVStore

    cpu = a.device == "cpu"
    if not cpu:
        torch.cuda.set_device(rank)
    dev = torch.device("cpu") if cpu else torch.device("cuda", rank)
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    comm = None
    if a.tp > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl", rank=rank, world_size=a.tp, device_id=dev)
        comm = TorchDistComm()
    cfg = load_config(a.model)
    sh = shard_for(cfg, a.tp, rank)
    slicer = (lambda n, shape: weight_slice(cfg, sh, n, shape)) if a.tp > 1 else None
    w = get_weights(a.model, cfg, seed=0, dtype="bfloat16", device=dev, slicer=slicer)
    ps, maxlen = 16, a.max_seq_len
    width = -(-maxlen // ps)
    kv = KVStore(cfg.num_layers, a.chunks * width + 1, ps, sh.n_kv, cfg.head_dim, torch_dtype("bfloat16"),
                 device=dev, poison=False)
    pre = ConventionalPrefill(cfg, w, kv, max_seq_len=maxlen, page_size=ps, dtype="bfloat16", device=dev,
                              tp=a.tp, rank=rank, comm=comm)
    if a.packed_rows is not None:
        pre.packed_rows = a.packed_rows
    if a.warm:   # the server's start-up captures (ConventionalPrefill.warm), so the steps time replays only
        pre.warm(a.chunks, 64)
    rng = random.Random(1)

    def step():
        chunks = []
        for i in range(a.chunks):
            n = rng.randint(a.min_len, a.max_len)
            table = [1 + i * width + j for j in range(width)]
            chunks.append(([rng.randrange(cfg.vocab_size) for _ in range(n)], 0, table, None))
        before = set(pre._ex)
        sync()
        t0 = time.perf_counter()
        pre.run_many(chunks, want_logits=False)
        sync()
        return (time.perf_counter() - t0) * 1e3, len(set(pre._ex) - before)   # executors built this step

    if a.busy_thread:   # a Python thread that never blocks, as the server's HTTP thread answering a wave's requests:
        # every call of this thread that lets go of the GIL waits up to the switch interval (5 ms) to get it back
        import threading
        busy = threading.Event()

        def spin():
            x = 0
            while not busy.is_set():
                x += 1
        threading.Thread(target=spin, daemon=True).start()
    times = [step() for _ in range(a.steps // 2)]
    pre.timing = dict.fromkeys(pre.timing, 0.0)   # run_many's laps over the steady half (ConventionalPrefill.timing)
    times += [step() for _ in range(a.steps - a.steps // 2)]
    laps = {k.removesuffix("_s"): round(v * 1e3 / (a.steps - a.steps // 2), 3) for k, v in pre.timing.items()}
    res = {"model": a.model, "tp": a.tp, "chunks": a.chunks, "len": [a.min_len, a.max_len],
           "packed_rows": pre.packed_rows, "graph_runs_per_step": round(pre.graph_runs / a.steps, 2),
           "packed_runs": pre.packed_runs, "late_captures": pre.late_captures,
           "step_ms": [round(t, 2) for t, _ in times], "new_executors": [m for _, m in times],
           "steady_ms_median": round(statistics.median(t for t, _ in times[a.steps // 2:]), 2),
           "executors_cached": len(pre._ex), "graphs_captured": pre.captures, "graph_replays": pre.replays,
           "run_many_ms": laps}
    if a.busy_thread:
        busy.set()
    res["busy_thread"] = a.busy_thread
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        res["profiled_step_ms"] = round(step()[0], 2)
    ka = prof.key_averages()
    res["top_cpu"] = ka.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50)
    res["top_cuda"] = "" if cpu else ka.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50)
    res["cuda_total_ms"] = round(sum(getattr(e, "self_device_time_total", 0) for e in ka) / 1e3, 2)
    if rank == 0:
        print(json.dumps({k: v for k, v in res.items() if not k.startswith("top_")}, indent=1))
        print(res["top_cpu"])
        print(res["top_cuda"])
        if os.environ.get("OUT"):
            os.makedirs(os.environ["OUT"], exist_ok=True)
            with open(os.path.join(os.environ["OUT"], f"profile_prefill_tp{a.tp}{a.tag}.json"), "w") as f:
                json.dump(res, f, indent=1)
    if a.tp > 1:   # NCCL teardown at exit hung the spawned ranks once (H200, 6f69d3a): leave without it
        dist.barrier()
        sys.stdout.flush()
        os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--chunks", type=int, default=7, help="prompt chunks per step")
    ap.add_argument("--min-len", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=24)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--tag", default="", help="suffix of the result file's name")
    ap.add_argument("--packed-rows", type=int, default=None,
                    help="ConventionalPrefill.packed_rows (default: MPK_PREFILL_PACKED_ROWS or 2048; 0: grouped)")
    ap.add_argument("--warm", action="store_true", help="capture the start-up graphs first (as the GPU runner)")
    ap.add_argument("--busy-thread", action="store_true",
                    help="a spinning Python thread beside the steps (the server's HTTP thread: the GIL's price)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself (tp 1)")
    a = ap.parse_args()
    if a.device == "cpu":
        a.tp = 1
    elif not torch.cuda.is_available() or torch.cuda.device_count() < a.tp:
        sys.exit(f"needs {a.tp} CUDA GPU(s); this machine has {torch.cuda.device_count()}")
    if a.tp == 1:
        rank_main(0, a, 0)
    else:
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        torch.multiprocessing.spawn(rank_main, args=(a, port), nprocs=a.tp)


if __name__ == "__main__":
    main()
