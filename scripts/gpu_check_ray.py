#!/usr/bin/env python3
"""Issue 6 on two GPUs: the Ray-placed TP=2 megakernel generates the same tokens as the in-process TP=2 run.

  in-process  two processes (runtime.tp_launch: NVSHMEM from a unique id passed as bytes), each running the same
              LLM engine in lockstep over its own rank (SPMDExecutor) - no Ray anywhere;
  ray         cluster.RayExecutor: one actor per GPU in a STRICT_PACK placement group, NVSHMEM unique id and
              torch.distributed rendezvous through Ray, the engine in this driver.
Both generate greedy continuations of the same prompts (different lengths, one batch) with the same seeded
weights, then seeded nucleus samples (temperature 0.8, top_p 0.95, top_k 0: the full-vocabulary draw, on the device
from the gathered vocab shards since session 53, no logits to the host); the token ids must be identical.

Each in-process run also times LLM.generate's decode steps (greedy, prefill and first step out) for one request and
for max_batch at once: b1_ms_per_step / bmax_ms_per_step, under the engine's default book at tp=2 (one megakernel or
the conventional plan per batch bucket, runtime/tp_buckets.py) and, with --compare-plan-none / --compare-tp-bursts,
under plan=None and MPK_TP_BURSTS=1.

    source .gpubundle/install.sh; PYTHONPATH=$PWD:/tmp/site python3 scripts/gpu_check_ray.py [--model llama-3.2-1b]
Writes $OUT/gpu_check_ray.json (or ./gpu_out); exit status 1 on a mismatch or an error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.update({"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
OUT = Path(os.environ.get("OUT") or "gpu_out")


def prompts(vocab: int, n: int) -> list[list[int]]:
    import random
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 20))] for _ in range(n)]


def runner_kwargs(a) -> dict:
    kw = dict(max_batch=a.max_batch, max_seq_len=a.max_seq_len, dtype="bfloat16", seed=0)
    if a.families:   # a book among these families only (else the engine's default book at tp=2)
        from mpk_runtime.models.config import load_config
        from mpk_runtime.planner.book import DEFAULT_BUCKETS, plan_book
        buckets = sorted({b for b in DEFAULT_BUCKETS if b < a.max_batch} | {a.max_batch})
        kw["plan"] = plan_book(load_config(a.model), 2, buckets, families=tuple(a.families.split(",")))
    return kw


def spmd_rank(ctx, a, plan="default"):
    """One rank of the in-process TP=2 run: same engine, same requests, this rank's shard. plan: "default" (the
    engine's choice: one megakernel per batch bucket since session 57, runtime/tp_buckets.py) or None (one
    megakernel for max_batch rows). Also times one request alone (ms a decode step, LLM.generate)."""
    from mpk_runtime import LLM, SamplingParams
    from mpk_runtime.models.config import load_config
    from mpk_runtime.runtime.executor import SPMDExecutor
    from mpk_runtime.runtime.comm import TorchDistComm
    ctx.heap()   # NVSHMEM up (the unique id travelled from rank 0 as bytes); the runner attaches to it
    ctx.dist()   # and an NCCL group, as Ray workers have: prefill runs through the conventional path over it
    kw = runner_kwargs(a) if plan == "default" else dict(runner_kwargs(a), plan=plan)
    llm = LLM(a.model, backend="megakernel", tp=ctx.nranks,
              executor=SPMDExecutor(ctx.rank, ctx.nranks, comm_spec=TorchDistComm()), **kw)
    t0 = time.time()
    toks = []
    for sp in params(a):
        outs = llm.generate(prompts(load_config(a.model).vocab_size, a.prompts), sp, use_tqdm=False)
        toks += [list(o.token_ids) for o in outs]
    dt = time.time() - t0
    host_logits = llm.engine.stats["logits_bytes"]
    timed = {}
    for rows in (1, a.max_batch):   # one request alone, then max_batch at once
        batch = prompts(load_config(a.model).vocab_size, rows)
        ms = []
        for n in (8, 8 + a.timed_tokens):   # the difference: decode steps only, prefill and first step out
            llm.generate(batch, SamplingParams(max_tokens=n, temperature=0.0), use_tqdm=False)   # warm
            t1 = time.perf_counter()
            llm.generate(batch, SamplingParams(max_tokens=n, temperature=0.0), use_tqdm=False)
            ms.append((time.perf_counter() - t1) * 1e3)
        timed[rows] = round((ms[1] - ms[0]) / a.timed_tokens, 4)
    used = llm.executor.collective_rpc("health")[0].get("plans_used")
    llm.shutdown()
    return {"tokens": toks, "seconds": dt, "logits_bytes": host_logits, "plans_used": used,
            "b1_ms_per_step": timed[1], "bmax_ms_per_step": timed[a.max_batch]}


def params(a) -> list:
    from mpk_runtime import SamplingParams
    return [SamplingParams(max_tokens=a.max_tokens, temperature=0.0),
            SamplingParams(max_tokens=a.max_tokens, temperature=0.8, top_p=0.95, seed=7)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--timed-tokens", type=int, default=64, help="decode steps timed for one request alone")
    ap.add_argument("--compare-plan-none", action="store_true",
                    help="also run in-process with plan=None (one megakernel for max_batch rows): tokens compared "
                         "(the kernels of other batch sizes round differently: reported, the greedy prefix must "
                         "agree for --agree tokens) and one request's ms a step")
    ap.add_argument("--agree", type=int, default=4)
    ap.add_argument("--compare-tp-bursts", action="store_true",
                    help="also run in-process with MPK_TP_BURSTS=1 (a one-megakernel bucket's burst launched back to "
                         "back, no barrier between its steps): the tokens must be identical")
    ap.add_argument("--families", default="", help="plan families of the book (e.g. conventional: every bucket runs "
                                                   "the conventional plan over NCCL); default: the engine's book")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    res: dict = {"model": a.model, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "commit": os.environ.get("GIT_COMMIT", "?"), "errors": [], "max_batch": a.max_batch,
                 "families": a.families or "default"}
    try:
        import torch
        res["device"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001
        res["device"] = "?"
    try:
        from mpk_runtime.runtime import tp_launch
        t0 = time.time()
        r = tp_launch.run(spmd_rank, 2, (a,), timeout_s=300)
        res["inprocess"] = {"tokens": r[0]["tokens"], "seconds": round(time.time() - t0, 1),
                            "ranks_agree": r[0]["tokens"] == r[1]["tokens"], "logits_bytes": r[0]["logits_bytes"],
                            "plans_used": r[0]["plans_used"], "b1_ms_per_step": r[0]["b1_ms_per_step"],
                            "bmax_ms_per_step": r[0]["bmax_ms_per_step"]}
        print("in-process TP=2:", json.dumps(res["inprocess"])[:300], flush=True)
    except Exception:  # noqa: BLE001
        res["errors"].append("inprocess: " + traceback.format_exc()[-3000:])
        print(res["errors"][-1], flush=True)
    if a.compare_tp_bursts and "inprocess" in res:   # the same run with the one-megakernel buckets' bursts on
        try:
            from mpk_runtime.runtime import tp_launch
            os.environ["MPK_TP_BURSTS"] = "1"   # (the spawned ranks inherit it)
            r = tp_launch.run(spmd_rank, 2, (a,), timeout_s=300)
            res["tp_bursts"] = {"identical": r[0]["tokens"] == res["inprocess"]["tokens"],
                                "ranks_agree": r[0]["tokens"] == r[1]["tokens"],
                                "b1_ms_per_step": r[0]["b1_ms_per_step"], "bmax_ms_per_step": r[0]["bmax_ms_per_step"],
                                "plans_used": r[0]["plans_used"]}
            print("in-process TP=2 MPK_TP_BURSTS=1:", json.dumps(res["tp_bursts"]), flush=True)
        except Exception:  # noqa: BLE001
            res["errors"].append("tp_bursts: " + traceback.format_exc()[-3000:])
            print(res["errors"][-1], flush=True)
        finally:
            os.environ.pop("MPK_TP_BURSTS", None)
    if a.compare_plan_none and "inprocess" in res:
        try:
            from mpk_runtime.runtime import tp_launch
            r = tp_launch.run(spmd_rank, 2, (a, None), timeout_s=300)
            mine, none = res["inprocess"]["tokens"], r[0]["tokens"]
            agree = [next((j for j, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
                     for p, q in zip(mine, none)]
            greedy = agree[:a.prompts]   # the first a.prompts outputs are greedy (params' order)
            res["plan_none"] = {"b1_ms_per_step": r[0]["b1_ms_per_step"], "bmax_ms_per_step": r[0]["bmax_ms_per_step"],
                                "plans_used": r[0]["plans_used"],
                                "agreeing_prefix": agree, "identical": mine == none,
                                "greedy_prefix_ok": min(greedy) >= min(a.agree, a.max_tokens)}
            print("in-process TP=2 plan=None:", json.dumps(res["plan_none"])[:400], flush=True)
        except Exception:  # noqa: BLE001
            res["errors"].append("plan_none: " + traceback.format_exc()[-3000:])
            print(res["errors"][-1], flush=True)
    try:
        import torch

        import cluster  # noqa: F401  (registers the "ray" executor)
        from cluster.ray_utils import ensure_ray
        from mpk_runtime import LLM
        from mpk_runtime.models.config import load_config
        t0 = time.time()
        ensure_ray(num_gpus=torch.cuda.device_count(), include_dashboard=False)
        llm = LLM(a.model, backend="megakernel", tp=2, executor="ray", **runner_kwargs(a))
        info = llm.executor.collective_rpc("node_info", timeout=30)
        t1 = time.time()
        toks = []
        for sp in params(a):
            outs = llm.generate(prompts(load_config(a.model).vocab_size, a.prompts), sp, use_tqdm=False)
            toks += [list(o.token_ids) for o in outs]
        res["ray"] = {"tokens": toks, "setup_s": round(t1 - t0, 1), "generate_s": round(time.time() - t1, 1),
                      "actors": info, "logits_bytes": llm.engine.stats["logits_bytes"]}
        llm.shutdown()
        print("ray TP=2:", json.dumps(res["ray"])[:600], flush=True)
    except Exception:  # noqa: BLE001
        res["errors"].append("ray: " + traceback.format_exc()[-3000:])
        print(res["errors"][-1], flush=True)
    if "inprocess" in res and "ray" in res:
        a_, b_ = res["inprocess"]["tokens"], res["ray"]["tokens"]
        res["identical"] = a_ == b_ and res["inprocess"]["logits_bytes"] == 0 == res["ray"]["logits_bytes"]
        res["mismatching_prompts"] = [i for i, (x, y) in enumerate(zip(a_, b_)) if x != y]
    (OUT / "gpu_check_ray.json").write_text(json.dumps(res, indent=1))
    print("identical:", res.get("identical"), "errors:", len(res["errors"]), flush=True)
    ok = (res.get("identical") and not res["errors"] and res.get("plan_none", {}).get("greedy_prefix_ok", True)
          and res.get("tp_bursts", {}).get("identical", True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
