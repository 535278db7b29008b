#!/usr/bin/env python3
"""TP=2 megakernel check on two GPUs (one process per GPU via mpk_runtime.runtime.tp_launch, NVSHMEM peers):

  1. correctness: TP=2 greedy tokens vs the single-GPU (TP=1) megakernel for --steps free-running steps, same
     seeded random bf16 weights generated on each GPU (random_weights(cfg, seed, device="cuda") then sliced),
     batch 1 and 8; relative logit error per step (full vocabulary gathered through the symmetric heap);
  2. timing: decode ms/step at batch 1 (context 256, random KV), TP=2 vs TP=1, 1 and 16 steps per launch;
  3. stall: rank 1 never launches; rank 0 must get KernelTimeout within seconds (the bounded spin), not hang.

    PYTHONPATH=. python3 scripts/gpu_check_tp.py [--models llama-3.2-1b,qwen3-8b] [--steps 128] [--quick]
Writes $OUT/gpu_check_tp.json and $OUT/gpu_check_tp.log (or ./gpu_out).
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
os.environ.update({"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})

from _tp_rig import TokenCheck, rig as _rig, shard_weights as _weights, time_launches as _time  # noqa: E402

OUT = Path(os.environ.get("OUT") or "gpu_out")
HBM = 4.55e12


def _log(rank, *a):
    s = f"[r{rank} {time.strftime('%H:%M:%S')}] " + " ".join(str(x) for x in a)
    print(s, flush=True)
    with open(OUT / "gpu_check_tp.log", "a") as f:
        f.write(s + "\n")


class Gather:
    """Full-vocabulary logits of a TP group on every rank: each rank copies its slice into a symmetric buffer,
    peers read it through nvshmem_ptr views after a barrier."""

    def __init__(self, heap, cfg, B, world):
        import torch
        from nvshmem.core.interop import torch as nt

        from mpk_runtime.ir.shard import shard_for
        self.heap = heap
        self.nv = [shard_for(cfg, world, q).n_vocab for q in range(world)]
        self.buf = heap.tensor((B, max(self.nv)), torch.float32)
        self.views = [self.buf if q == heap.rank else nt.get_peer_tensor(self.buf, q) for q in range(world)]

    def __call__(self, local):
        import torch
        self.buf[:, :local.shape[1]].copy_(local)
        self.heap.barrier()
        out = torch.cat([v[:, :n] for v, n in zip(self.views, self.nv)], dim=-1).clone()
        self.heap.barrier()
        return out


def check_model(ctx, model, steps, batches, res, do_timing, tp_invariant=1):
    import torch

    from mpk_runtime.models.config import load_config
    cfg = load_config(model)
    heap, rank, W = ctx.heap(), ctx.rank, ctx.nranks
    t0 = time.time()
    full, part = _weights(cfg, 0, rank, W)
    if rank != 0:
        full = None
    torch.cuda.synchronize()
    _log(rank, f"{model}: weights {time.time() - t0:.1f}s")
    for B in batches:
        t0 = time.time()
        ref = _rig(cfg, full, B, 0, 1, None, tp_invariant=tp_invariant) if rank == 0 else None
        tp = _rig(cfg, part, B, rank, W, heap, tp_invariant=tp_invariant)
        gather = Gather(heap, cfg, B, W)
        _log(rank, f"{model} B={B}: rigs built {time.time() - t0:.1f}s; {tp.tg.summary().splitlines()[0]}")
        g = torch.Generator().manual_seed(1)
        tok0 = torch.randint(0, cfg.vocab_size, (B,), generator=g)
        for r_ in ([ref] if ref else []) + [tp]:
            r_.mem.t("tokens").copy_(tok0)
        chk = TokenCheck()
        for s in range(steps):
            pos = torch.full((B,), s, dtype=torch.int64)
            if ref is not None:
                ref.pos.copy_(pos); ref.mk.launch(1); torch.cuda.synchronize(); ref.mk.check()
            tp.pos.copy_(pos)
            heap.barrier()
            tp.mk.launch(1)
            torch.cuda.synchronize()
            tp.mk.check()
            lg = gather(tp.mem.t("logits"))
            if rank == 0:
                lr = ref.mem.t("logits")
                chk.step(s, lr, lg, ref.mem.t("next_tokens").cpu(), tp.mem.t("next_tokens").cpu())
        if rank == 0:
            r = dict(model=model, batch=B, steps=steps, **chk.result(tp_invariant), tp_invariant=tp_invariant,
                     tp_tasks=len(tp.tg.tasks),
                     tp_cross_rank_signals=sum(1 for t in tp.tg.tasks for q, _ in t.signals if q != rank))
            _log(rank, json.dumps(r))
            res.append(r)
        if do_timing and B == 1:
            timing(ctx, model, cfg, ref, tp, part, full, res)
        del ref, tp
        torch.cuda.empty_cache()


def timing(ctx, model, cfg, ref, tp, part, full, res, ctx_len=256):
    import torch
    heap, rank = ctx.heap(), ctx.rank
    pos = torch.full((1,), ctx_len, dtype=torch.int64)
    for r_ in ([ref] if ref else []) + [tp]:
        for c in r_.kv.k + r_.kv.v:
            c.normal_(0, 1.0)
    wb = sum(t.numel() * t.element_size() for t in part.values())
    if not cfg.tie_word_embeddings:
        wb -= part["model.embed_tokens.weight"].numel() * 2
    out = dict(model=model, batch=1, ctx=ctx_len)
    for n in (1, 16):
        med, mn = _time(tp.mk, tp.pos, pos, n, 20, barrier=heap.barrier)
        out[f"tp2_ms_per_step_n{n}"] = med
        out[f"tp2_ms_min_n{n}"] = mn
    heap.barrier()
    if rank == 0:
        fb = sum(t.numel() * t.element_size() for t in full.values())
        if not cfg.tie_word_embeddings:
            fb -= full["model.embed_tokens.weight"].numel() * 2
        for n in (1, 16):
            med, mn = _time(ref.mk, ref.pos, pos, n, 20)
            out[f"tp1_ms_per_step_n{n}"] = med
        out["tp1_floor_ms"] = fb / HBM * 1e3
        out["tp2_floor_ms_per_gpu"] = wb / HBM * 1e3
        out["speedup_tp2_vs_tp1_n16"] = out["tp1_ms_per_step_n16"] / out["tp2_ms_per_step_n16"]
        _log(rank, json.dumps(out))
        res.append(out)
    heap.barrier()


def stall(ctx, res):
    """Rank 1 never launches its step: rank 0's kernel must time out (KernelTimeout) within seconds."""
    import torch

    from mpk_runtime.models.config import load_config
    from mpk_runtime.runtime.base import KernelTimeout
    cfg = load_config("llama-3.2-1b")
    heap, rank, W = ctx.heap(), ctx.rank, ctx.nranks
    _, part = _weights(cfg, 0, rank, W)
    tp = _rig(cfg, part, 1, rank, W, heap, timeout_s=2.0)
    tp.pos.fill_(0)
    heap.barrier()
    if rank == 0:
        t0 = time.time()
        tp.mk.launch(1)
        try:
            torch.cuda.synchronize()
            tp.mk.check()
            r = dict(stall_test="no error (FAIL)", seconds=time.time() - t0, ok=False)
        except KernelTimeout as e:
            r = dict(stall_test="KernelTimeout", seconds=time.time() - t0, message=str(e)[:600], ok=True)
        _log(rank, json.dumps(r))
        res.append(r)
    else:
        time.sleep(6.0)   # "stalled": never launches this step
    heap.barrier()


def rank_main(ctx, args):
    import torch
    res: list[dict] = []
    rank = ctx.rank
    from mpk_runtime.codegen import nvcc
    t0 = time.time()
    b = nvcc.build()
    _log(rank, f"build cached={b.cached} {time.time() - t0:.1f}s {b.resources}")
    ctx.heap()
    _log(rank, f"nvshmem up: rank {rank}/{ctx.nranks} on {torch.cuda.get_device_name(rank)}")
    sections = []
    for m in args.models.split(","):
        sections.append((f"model {m}", lambda m=m: check_model(ctx, m, args.steps, [int(x) for x in args.batches.split(",")],
                                                               res, not args.no_timing, args.tp_invariant)))
    if not args.skip_stall:
        sections.append(("stall", lambda: stall(ctx, res)))
    for name, fn in sections:
        t = time.time()
        try:
            fn()
            _log(rank, f"--- {name}: done in {time.time() - t:.1f}s")
        except Exception as e:  # noqa: BLE001 - keep going where the group is still consistent
            _log(rank, f"--- {name}: FAILED {type(e).__name__}: {e}\n{traceback.format_exc()}")
            res.append(dict(section=name, rank=rank, error=f"{type(e).__name__}: {e}"[:2000]))
            if rank == 0:
                (OUT / "gpu_check_tp.json").write_text(json.dumps(res, indent=1))
            raise   # a failed collective section leaves the peers unsynchronised: stop both ranks
        if rank == 0:
            (OUT / "gpu_check_tp.json").write_text(json.dumps(res, indent=1))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-8b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--skip-stall", action="store_true")
    ap.add_argument("--timeout", type=float, default=540)
    ap.add_argument("--tp-invariant", type=int, default=1,
                    help="build both TP=1 and TP=2 graphs with this tp_invariant (2: bit-identical reductions; "
                         "then any token mismatch fails the check)")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    from mpk_runtime.runtime import tp_launch
    t0 = time.time()
    try:
        out = tp_launch.run(rank_main, 2, (args,), timeout_s=args.timeout)
        res = out[0]
    except tp_launch.TPLaunchError as e:
        print(f"TP launch failed:\n{e}", flush=True)
        res = json.loads((OUT / "gpu_check_tp.json").read_text()) if (OUT / "gpu_check_tp.json").exists() else []
        res.append(dict(launch_error=str(e)[-3000:]))
        (OUT / "gpu_check_tp.json").write_text(json.dumps(res, indent=1))
    print(f"\n==== gpu_check_tp summary ({time.time() - t0:.0f}s) ====")
    for r in res:
        print(json.dumps(r)[:400])
    bad = [r for r in res if "launch_error" in r or "error" in r or r.get("ok") is False]
    print(f"gpu_check_tp: {len(bad)} of {len(res)} checks failed" if bad else f"gpu_check_tp: all {len(res)} ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
