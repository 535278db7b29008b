#!/usr/bin/env python3
"""Issue 6 on two GPUs: the Ray-placed TP=2 megakernel generates the same tokens as the in-process TP=2 run.

  in-process  two processes (runtime.tp_launch: NVSHMEM from a unique id passed as bytes), each running the same
              LLM engine in lockstep over its own rank (SPMDExecutor) - no Ray anywhere;
  ray         cluster.RayExecutor: one actor per GPU in a STRICT_PACK placement group, NVSHMEM unique id and
              torch.distributed rendezvous through Ray, the engine in this driver.
Both generate greedy continuations of the same prompts (different lengths, one batch) with the same seeded
weights, then seeded nucleus samples (temperature 0.8, top_p 0.95, top_k 0: the full-vocabulary draw, on the device
from the gathered vocab shards since session 53, no logits to the host); the token ids must be identical.

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
    return dict(max_batch=a.max_batch, max_seq_len=a.max_seq_len, dtype="bfloat16", seed=0)


def spmd_rank(ctx, a):
    """One rank of the in-process TP=2 run: same engine, same requests, this rank's shard."""
    from mpk_runtime import LLM
    from mpk_runtime.models.config import load_config
    from mpk_runtime.runtime.executor import SPMDExecutor
    from mpk_runtime.runtime.comm import TorchDistComm
    ctx.heap()   # NVSHMEM up (the unique id travelled from rank 0 as bytes); the runner attaches to it
    ctx.dist()   # and an NCCL group, as Ray workers have: prefill runs through the conventional path over it
    llm = LLM(a.model, backend="megakernel", tp=ctx.nranks,
              executor=SPMDExecutor(ctx.rank, ctx.nranks, comm_spec=TorchDistComm()), **runner_kwargs(a))
    t0 = time.time()
    toks = []
    for sp in params(a):
        outs = llm.generate(prompts(load_config(a.model).vocab_size, a.prompts), sp, use_tqdm=False)
        toks += [list(o.token_ids) for o in outs]
    dt = time.time() - t0
    host_logits = llm.engine.stats["logits_bytes"]
    llm.shutdown()
    return {"tokens": toks, "seconds": dt, "logits_bytes": host_logits}


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
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    res: dict = {"model": a.model, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "commit": os.environ.get("GIT_COMMIT", "?"), "errors": []}
    try:
        from mpk_runtime.runtime import tp_launch
        t0 = time.time()
        r = tp_launch.run(spmd_rank, 2, (a,), timeout_s=300)
        res["inprocess"] = {"tokens": r[0]["tokens"], "seconds": round(time.time() - t0, 1),
                            "ranks_agree": r[0]["tokens"] == r[1]["tokens"], "logits_bytes": r[0]["logits_bytes"]}
        print("in-process TP=2:", json.dumps(res["inprocess"])[:300], flush=True)
    except Exception:  # noqa: BLE001
        res["errors"].append("inprocess: " + traceback.format_exc()[-3000:])
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
    return 0 if res.get("identical") and not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
