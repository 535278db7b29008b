"""Concurrent load through the OpenAI-compatible HTTP server: N requests at once, all must succeed.

    PYTHONPATH=. python3 scripts/load_test.py --model tiny-qwen3 --backend pyvm --requests 100      # CPU
    PYTHONPATH=. python3 scripts/load_test.py --model llama-3.2-1b --backend megakernel --tp 2 \
        --executor ray --requests 100 --max-batch 32                                              # GPUs

The HTTP clients run in separate processes (--clients, default 4; in the server's process the client shared the GIL
with the server and the engine loop, and the harness's own work showed up as per-step time). Reports throughput (generated tokens/s),
request latency p50/p99, time to first token p50/p99, errors, and batch occupancy (sequences per engine step: > 1
means the requests really shared decode steps), and writes
load_test.json under --out. It also prints where the engine's time went during the load, in ms per step (engine loop
idle / admitting / stepping / delivering; inside a step: scheduling, the executor call - split into dispatch,
waiting, the model's own runner time on the critical rank and the transfer either side - output work and freeing;
prefill vs decode-only steps), from the engine's always-on phase counters (mpk_runtime/engine/step_stats.py), and
writes it to load_test.json as "time_breakdown".
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def fire(url: str, model: str, n: int, max_tokens: int, vocab: int, seed: int, part: int = 0,
               parts: int = 1, stream: bool = False) -> list[dict]:
    """Requests i = part, part + parts, ... of the load's n (the prompts depend on the seed alone, not on how many
    client processes share the load), all at once, one connection each. stream: server-sent events, the tokens
    counted from the chunks' token_ids and the time to first token taken here, at the first chunk that has one."""
    import httpx
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 24))] for _ in range(n)]

    async def one(i: int, client) -> dict:
        body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0}
        t0 = time.perf_counter()
        try:
            if stream:
                return await one_stream(i, client, {**body, "stream": True}, t0)
            r = await client.post(url + "/v1/completions", json=body)
            dt = time.perf_counter() - t0
            if r.status_code != 200:
                return {"i": i, "ok": False, "status": r.status_code, "error": r.text[:200], "latency_s": dt}
            d = r.json()
            return {"i": i, "ok": True, "latency_s": dt, "done": time.monotonic(),
                    "tokens": d["usage"]["completion_tokens"], "ttft_s": d["choices"][0].get("metrics", {}).get("time_to_first_token")}
        except Exception as e:  # noqa: BLE001 - counted as an error
            return {"i": i, "ok": False, "error": f"{type(e).__name__}: {e}"[:200], "latency_s": time.perf_counter() - t0}

    async def one_stream(i: int, client, body: dict, t0: float) -> dict:
        toks, ttft = 0, None
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"i": i, "ok": False, "status": r.status_code, "error": (await r.aread())[:200].decode(),
                        "latency_s": time.perf_counter() - t0}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    return {"i": i, "ok": False, "error": str(d["error"])[:200], "latency_s": time.perf_counter() - t0}
                got = sum(len(c.get("token_ids") or []) for c in d.get("choices", []))
                if got and ttft is None:
                    ttft = time.perf_counter() - t0
                toks += got
        return {"i": i, "ok": True, "latency_s": time.perf_counter() - t0, "done": time.monotonic(), "tokens": toks,
                "ttft_s": ttft}

    mine = range(part, n, parts)
    # (httpx's default pool of 100 connections queued the rest of a larger load inside the client)
    async with httpx.AsyncClient(timeout=600.0, limits=httpx.Limits(max_connections=max(1, len(mine)))) as client:
        return await asyncio.gather(*(one(i, client) for i in mine))


def _fire_in_child(args: tuple) -> list[dict]:
    return asyncio.run(fire(*args))


def _fire(pool, clients: int, url: str, model: str, n: int, max_tokens: int, vocab: int, seed: int,
          stream: bool = False) -> list[dict]:
    """The load split over the pool's `clients` processes (one Python client issued ~1-2 ms of requests a request
    on its own event loop: 256 requests took it ~0.5 s to send, and the engine idled meanwhile; session 64)."""
    parts = pool.map(_fire_in_child, [(url, model, n, max_tokens, vocab, seed, k, clients, stream)
                                       for k in range(clients)], chunksize=1)
    return sorted((r for p in parts for r in p), key=lambda r: r["i"])


def _warm_child(_: int) -> None:
    import httpx  # noqa: F401 - the import, in every client process before the measured load
    time.sleep(0.2)   # (so that the pool hands one warm-up to each process)


def _thread_cpu(router) -> dict:
    """CPU seconds so far of each live thread of this process by name (the HTTP server's, each engine loop's, the
    client pool's helpers: they share one GIL) and, with --engine-process, of each engine process's threads as
    "<replica>/<thread>" (Linux; {} where the clock is missing)."""
    from mpk_runtime.engine.engine_process import EngineProcess, thread_cpu
    out = thread_cpu()
    for r in router.replicas:
        if isinstance(r.loop, EngineProcess):
            try:
                out.update({f"{r.name}/{k}": v for k, v in r.loop.rpc("thread_cpu").items()})
            except Exception:   # noqa: BLE001 - a diagnostic
                pass
    return out


def _graphs(router) -> dict:
    """Each replica's rank-0 runner graph counts (worker health "graphs": captures and their seconds; {} where the
    runner keeps none), read on the replica's engine loop between steps."""
    from mpk_runtime.engine.engine_process import workers_health
    out = {}
    for r in router.replicas:
        try:
            h = r.loop.call(workers_health).result(timeout=60)
            out[r.name] = {k: v for k, v in (h[0].get("graphs") or {}).items() if isinstance(v, (int, float, str))}
        except Exception as e:  # noqa: BLE001 - a diagnostic: the load's numbers stand without it
            out[r.name] = {"error": str(e)[:200]}
    return out


def _idle_in(router, t0: float, t1: float) -> dict:
    """Each replica's engine-loop idle stretches (nothing to run) inside [t0, t1] (time.monotonic(), shared by the
    client process), as [ms from t0, ms long]: where in the load the engine waited for requests."""
    out = {}
    for r in router.replicas:
        log = list(getattr(r.loop, "idle_log", ()))
        out[r.name] = [[round((max(a, t0) - t0) * 1e3, 1), round((min(a + d, t1) - max(a, t0)) * 1e3, 1)]
                       for a, d in log if a < t1 and a + d > t0]
    return out


def _machine() -> str:
    """The GPU (or the CPU machine) the load ran on, for the result file."""
    import platform
    import torch
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (GPU 0 of {torch.cuda.device_count()} visible), {platform.node()}"
    return f"CPU ({os.cpu_count()} cores), {platform.node()}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-qwen3")
    ap.add_argument("--backend", default="pyvm")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--executor", default="inprocess", choices=["inprocess", "ray"])
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--max-seq-len", type=int, default=256,
                    help="the engine's positions a sequence (prompts are 4-24 tokens, so > 24 + --max-tokens)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="fire the load this many times in one server process and measure the last (earlier rounds "
                         "warm it up: a cost that goes away after the first round is a one-time cost)")
    ap.add_argument("--clients", type=int, default=4,
                    help="client processes the requests are split over (each sends its share at once)")
    ap.add_argument("--stream", action="store_true",
                    help="stream every response (server-sent events, as chat clients do): the server reports each "
                         "request after every step, so its HTTP thread works through the decode, not only at the end")
    ap.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                    help="each replica's engine in a process of its own, as the server's --engine-process (default, "
                         "as there: on with --executor inprocess, opt-in with ray); --no-engine-process: in this "
                         "process, sharing the HTTP thread's GIL")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if a.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {a.rounds}")
    if a.clients < 1:
        raise SystemExit(f"--clients must be >= 1, got {a.clients}")
    if a.engine_process is None:
        a.engine_process = a.executor == "inprocess"
    from cluster.router import build_router
    from mpk_runtime.engine.step_stats import breakdown, diff_stats, format_breakdown, sum_stats
    from cluster.server import ServerThread, create_app
    from mpk_runtime.models import load_config
    if a.executor == "ray":
        from cluster.ray_utils import ensure_ray
        ensure_ray()
    router = build_router(a.model, backend=a.backend, tp=a.tp, num_replicas=a.replicas, executor=a.executor,
                          dtype=a.dtype, max_batch=a.max_batch, max_seq_len=a.max_seq_len, step_timeout=120.0,
                          engine_process=a.engine_process)
    srv = ServerThread(create_app(router))
    try:
        # the client runs in its own process: in this one it would share the GIL with the server and the engine
        import multiprocessing as mp
        with mp.get_context("spawn").Pool(a.clients) as pool:
            pool.map(_warm_child, range(a.clients), chunksize=1)
            pool.apply(_fire_in_child, ((srv.url, a.model, 1, 1, load_config(a.model).vocab_size, 1),))  # warm
            earlier = []   # {wall_s, tokens, errors} of the rounds before the measured one
            for rnd in range(a.rounds):
                before = router.stats()
                graphs_before = _graphs(router)
                cpu_before = _thread_cpu(router)
                t0, t0m = time.perf_counter(), time.monotonic()
                res = _fire(pool, a.clients, srv.url, a.model, a.requests, a.max_tokens,
                            load_config(a.model).vocab_size, rnd, a.stream)
                wall = time.perf_counter() - t0
                cpu = {k: round(v - cpu_before.get(k, 0.0), 3) for k, v in _thread_cpu(router).items()}
                idle = _idle_in(router, t0m, t0m + wall)
                if rnd + 1 < a.rounds:
                    earlier.append({"wall_s": wall, "tokens": sum(r.get("tokens", 0) for r in res if r["ok"]),
                                    "errors": sum(not r["ok"] for r in res)})
                    print(f"round {rnd + 1}: {earlier[-1]['tokens'] / wall:.1f} tokens/s (not the measured round)")
        # the load alone (no start-up idle, no warm-up request): counters differenced over the measured window
        stats = {k: diff_stats(v, before.get(k, {})) for k, v in router.stats().items()}
        # CUDA graphs the replicas captured inside the measured window (a capture there is a one-time cost, not a
        # steady-state one: the runner captures its buckets at start-up, so any here is a shape it did not expect)
        graphs_after = _graphs(router)
        graphs = {k: {c: (round(v - graphs_before.get(k, {}).get(c, 0), 3) if isinstance(v, (int, float)) else v)
                      for c, v in g.items()} for k, g in graphs_after.items()}
    finally:
        srv.stop()
        router.shutdown()
    ok = [r for r in res if r["ok"]]
    steps = sum(s.get("steps", 0) for s in stats.values())
    seqs = sum(s.get("sequences_scheduled", 0) for s in stats.values())
    toks = sum(r["tokens"] for r in ok)
    summary = {"model": a.model, "backend": a.backend, "tp": a.tp, "executor": a.executor, "replicas": a.replicas,
               "requests": a.requests, "succeeded": len(ok), "errors": len(res) - len(ok),
               "wall_s": wall, "tokens": toks, "tokens_per_s": toks / wall,
               "latency_p50_s": pct([r["latency_s"] for r in ok], 0.5),
               "latency_p99_s": pct([r["latency_s"] for r in ok], 0.99),
               "ttft_p50_s": pct([r["ttft_s"] for r in ok if r.get("ttft_s") is not None], 0.5),
               "ttft_p99_s": pct([r["ttft_s"] for r in ok if r.get("ttft_s") is not None], 0.99),
               "engine_steps": steps, "mean_batch_occupancy": seqs / steps if steps else 0.0,
               "max_batch": a.max_batch, "max_batch_seen": max((s.get("max_batch_size_seen", 0) for s in stats.values()), default=0),
               "time_breakdown": breakdown(sum_stats(list(stats.values())), wall),
               "graphs_in_window": graphs, "idle_stretches_ms": idle, "thread_cpu_s": cpu,
               # the scheduler's events in the window (a preempted request's prompt and tokens are prefilled again)
               "engine_events": {k: sum(s.get(k, 0) or 0 for s in stats.values())
                                 for k in ("preemptions", "recomputed_tokens", "prefix_cache_hit_tokens",
                                           "requests_failed")},
               "client_done_ms": [round((min(r["done"] for r in ok) - t0m) * 1e3, 1),
                                  round((max(r["done"] for r in ok) - t0m) * 1e3, 1)] if ok else None,
               "rounds": a.rounds, "earlier_rounds": earlier,
               "first_errors": [r for r in res if not r["ok"]][:3], "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "machine": _machine(), "git_commit": os.environ.get("GIT_COMMIT", "unknown"),
               "max_tokens": a.max_tokens, "max_seq_len": a.max_seq_len, "clients": a.clients, "stream": a.stream,
               "engine_process": a.engine_process}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "load_test.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("first_errors", "time_breakdown")}, indent=1))
    print(format_breakdown(summary["time_breakdown"]))
    print("  engine events in the window: " + ", ".join(f"{k} {v}" for k, v in summary["engine_events"].items()))
    for name, st in idle.items():
        if st:
            big = sorted(st, key=lambda x: -x[1])[:4]
            print(f"  engine idle in the window ({name}): {len(st)} stretches, {sum(d for _, d in st):.0f} ms; "
                  "longest at +ms (ms): " + ", ".join(f"{a:.0f} ({d:.0f})" for a, d in big))
    print("  CPU seconds of the threads in the window (those of one process share a GIL; an engine process's as "
          "<replica>/<thread>): " + ", ".join(f"{k} {v}" for k, v in sorted(cpu.items(), key=lambda x: -x[1])[:8]))
    for name, g in graphs.items():
        if g:
            print(f"  CUDA graphs captured during the load ({name}): " + ", ".join(f"{k} {v}" for k, v in g.items()))


if __name__ == "__main__":
    main()
