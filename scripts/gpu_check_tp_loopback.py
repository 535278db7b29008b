#!/usr/bin/env python3
"""The TP=2 megakernel's device protocol on ONE GPU (runtime/loopback.py): both ranks' kernels are built in this
process, each for half of the SMs, their symmetric buffers and event counters plain tensors of this GPU, and every
step launches the two kernels on two streams at once. The cross-rank pushes, remote signals and waits then run as
on two GPUs; the bytes move through this GPU's memory instead of NVLink.

  1. correctness: TP=2 greedy tokens and full-vocabulary logits against the one-rank (TP=1) megakernel for --steps
     free-running steps, seeded random bf16 weights; batches --batches; tp_invariant 1 (what the engine runs) and 2
     (reductions ordered as a TP=2 group: tokens must then be identical);
  2. stall: rank 1's kernel is never launched; rank 0's must raise KernelTimeout within seconds.

Not checked here: the NVLink transport (nvshmem_ptr addresses of another GPU) and any TP speed (the ranks share the
SMs and HBM of one GPU): scripts/gpu_check_tp.py on two GPUs does both.

    PYTHONPATH=. python3 scripts/gpu_check_tp_loopback.py [--models tiny-llama,llama-3.2-1b] [--steps 32]
Writes $OUT/gpu_check_tp_loopback.json (or ./gpu_out).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _tp_rig import TokenCheck, rig as _rig  # noqa: E402  (also sets NVSHMEM_DISABLE_NVLS / NCCL_NVLS_ENABLE)

OUT = Path(os.environ.get("OUT") or "gpu_out")
W = 2


def _log(*a):
    s = f"[{time.strftime('%H:%M:%S')}] " + " ".join(str(x) for x in a)
    print(s, flush=True)
    with open(OUT / "gpu_check_tp_loopback.log", "a") as f:
        f.write(s + "\n")


def build_ranks(cfg, parts, B, tpi, timeout_s=5.0):
    import torch

    from mpk_runtime.runtime.loopback import LoopbackGroup
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    group = LoopbackGroup(W, "cuda")
    # rank after rank in this thread: the group allocates every rank's copy of a symmetric tensor at rank 0's call
    ranks = [_rig(cfg, parts[r], B, r, W, group.heap(r), timeout_s=timeout_s, num_sms=nsm // W, tp_invariant=tpi)
             for r in range(W)]
    return group, ranks


def launch_all(ranks, streams, only=None):
    import torch
    torch.cuda.synchronize()   # pos / tokens written on the default stream are visible to both launches
    for i, (rk, st) in enumerate(zip(ranks, streams)):
        if only is None or i in only:
            with torch.cuda.stream(st):
                rk.mk.launch(1)


def check(cfg, model, full, parts, B, tpi, steps):
    import torch

    from mpk_runtime.ir.shard import shard_for
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    t0 = time.time()
    ref = _rig(cfg, full, B, 0, 1, None, num_sms=nsm, tp_invariant=tpi)
    group, ranks = build_ranks(cfg, parts, B, tpi)
    streams = [torch.cuda.Stream() for _ in ranks]
    nv = [shard_for(cfg, W, r).n_vocab for r in range(W)]
    _log(f"{model} B={B} tp_invariant={tpi}: built in {time.time() - t0:.1f}s; rank 0: "
         f"{ranks[0].tg.summary().splitlines()[0]}")
    tok0 = torch.randint(0, cfg.vocab_size, (B,), generator=torch.Generator().manual_seed(1))
    for r_ in [ref] + ranks:
        r_.mem.t("tokens").copy_(tok0)
    chk, bitwise, ranks_agree = TokenCheck(), True, True
    for s in range(steps):
        pos = torch.full((B,), s, dtype=torch.int64)
        ref.pos.copy_(pos)
        ref.mk.launch(1)
        torch.cuda.synchronize()
        ref.mk.check()
        for rk in ranks:
            rk.pos.copy_(pos)
        launch_all(ranks, streams)
        torch.cuda.synchronize()
        for rk in ranks:
            rk.mk.check()
        lg = torch.cat([rk.mem.t("logits")[:, :n] for rk, n in zip(ranks, nv)], dim=-1)
        lr = ref.mem.t("logits")
        nts = [rk.mem.t("next_tokens").cpu() for rk in ranks]
        ranks_agree &= all(torch.equal(nts[0], x) for x in nts[1:])
        chk.step(s, lr, lg, ref.mem.t("next_tokens").cpu(), nts[0])
        if chk.first < 0:
            bitwise &= torch.equal(lg, lr)
    r = dict(model=model, batch=B, tp_invariant=tpi, steps=steps, sms_per_rank=nsm // W, sms_ref=nsm,
             **chk.result(tpi), logits_bitwise_before_divergence=bitwise, ranks_agree=ranks_agree,
             tp_tasks=len(ranks[0].tg.tasks),
             tp_cross_rank_signals=sum(1 for t in ranks[0].tg.tasks for q, _ in t.signals if q != 0))
    r["ok"] = r["ok"] and ranks_agree
    _log(json.dumps(r))
    del ref, ranks, group
    torch.cuda.empty_cache()
    return r


def stall(cfg, parts):
    """Rank 1 never launches: rank 0's kernel waits on rank 1's signals and must time out as a KernelTimeout."""
    import torch

    from mpk_runtime.runtime.base import KernelTimeout
    group, ranks = build_ranks(cfg, parts, 1, 1, timeout_s=2.0)
    for rk in ranks:
        rk.pos.fill_(0)
    t0 = time.time()
    launch_all(ranks, [torch.cuda.Stream() for _ in ranks], only={0})
    try:
        torch.cuda.synchronize()
        ranks[0].mk.check()
        r = dict(stall_test="no error (FAIL)", seconds=time.time() - t0, ok=False)
    except KernelTimeout as e:
        r = dict(stall_test="KernelTimeout", seconds=time.time() - t0, message=str(e)[:600],
                 ok=time.time() - t0 < 10)
    _log(json.dumps(r))
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny-llama,tiny-qwen3,llama-3.2-1b,qwen3-8b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tp-invariant", default="1,2", help="comma list of tp_invariant modes to check (1 and/or 2)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--skip-stall", action="store_true")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    import torch

    from mpk_runtime.codegen import nvcc
    from mpk_runtime.models.config import load_config
    from mpk_runtime.models.weights import random_weights
    from mpk_runtime.runtime.pyvm_runner import shard_weights
    t0 = time.time()
    b = nvcc.build()
    _log(f"build cached={b.cached} {time.time() - t0:.1f}s on {torch.cuda.get_device_name(0)}")
    res: list[dict] = []
    path = OUT / "gpu_check_tp_loopback.json"
    for model in args.models.split(","):
        try:
            cfg = load_config(model)
            full = random_weights(cfg, 0, dtype="bfloat16", device="cuda")
            parts = [shard_weights(cfg, full, W, r) for r in range(W)]
            for tpi in (int(x) for x in args.tp_invariant.split(",")):
                for B in (int(x) for x in args.batches.split(",")):
                    res.append(check(cfg, model, full, parts, B, tpi, args.steps))
                    path.write_text(json.dumps(res, indent=1))
            if not args.skip_stall and model == args.models.split(",")[0]:
                res.append(stall(cfg, parts))
            del full, parts
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - record and go on to the next model
            _log(f"--- {model}: FAILED {type(e).__name__}: {e}\n{traceback.format_exc()}")
            res.append(dict(model=model, error=f"{type(e).__name__}: {e}"[:2000], ok=False))
            if "KernelTimeout" in type(e).__name__ or "timed out" in str(e):
                break   # a kernel left spinning would hold the SMs the next model needs
        path.write_text(json.dumps(res, indent=1))
    print(f"\n==== gpu_check_tp_loopback summary ({time.time() - t0:.0f}s) ====")
    for r in res:
        print(json.dumps(r)[:400])
    bad = [r for r in res if not r.get("ok")]
    print(f"gpu_check_tp_loopback: {len(bad)} of {len(res)} checks failed" if bad
          else f"gpu_check_tp_loopback: all {len(res)} ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
