"""Where a conventional (torch ops) decode step spends GPU time: one eager step per (model, batch) under
torch.profiler, kernels grouped by name, top-N by total GPU time, plus the kernel count per step.
--family attn-mk profiles the plan with attention as megakernels (its conventional segments' kernels, the
megakernel launches as one name); MPK_CONV_COMPILE=1 profiles the compiled segments. --family gptfast profiles the
gpt-fast-style peer of bench_decode (scripts/_peers.py; its inductor kernels launched without CUDA graphs, so the
profiler sees each): where the peer's step goes, kernel by kernel, beside ours.

    PYTHONPATH=. python3 scripts/profile_conventional.py --models qwen3-8b --batches 1,128 --out $OUT
    PYTHONPATH=. python3 scripts/profile_conventional.py --models llama-3.2-1b --batches 32,128 --family attn-mk
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _plan_measure import Point  # noqa: E402

from mpk_runtime.models import load_config, random_weights  # noqa: E402
from mpk_runtime.runtime.conventional_fused import prepare_weights  # noqa: E402
from mpk_runtime.planner import candidates  # noqa: E402
from mpk_runtime.runtime.plan_exec import PlanExecutor  # noqa: E402


def _gptfast_step(cfg, B: int, context: int):
    """One decode step of the gpt-fast-style peer at `context` (torch.compile, default mode: no CUDA graphs)."""
    from _peers import GptFast
    m = GptFast(cfg, B, context + 16)
    step = torch.compile(m.forward, fullgraph=True)
    tok = torch.zeros(B, 1, dtype=torch.long, device="cuda")
    ar = torch.arange(context + 16, device="cuda")
    pos = torch.tensor([context], device="cuda")
    mask = (ar <= context).view(1, 1, 1, -1)
    return lambda: step(tok, pos, mask), m


def profile(model: str, B: int, context: int, top: int, family: str = "conventional") -> dict:
    cfg = load_config(model).replace(dtype="bfloat16")
    if family == "gptfast":
        run, keep = _gptfast_step(cfg, B, context)
    else:
        w = prepare_weights(random_weights(cfg, seed=0, device="cuda"), cfg)   # (MPK_CONV_FUSE_PROJ)
        plan = candidates(cfg, tp=1, batch=B, context=context, families=(family,))[0]
        pt = Point(cfg, w, B, context, "cuda", plan.attn_splits)
        ex = PlanExecutor(plan, pt.graphs, [pt.mem], backend="megakernel", check=False, make_megakernel=pt.make_mk)
        run, keep = (lambda: ex.run(lambda r: pt.ctx)), (ex, pt, w)
    with torch.no_grad():
        for _ in range(3):   # torch.compile (MPK_CONV_COMPILE=1, the peer) compiles in the first ones
            run()
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile as tprof
        with tprof(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
    rows = {}
    n = 0
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        n += 1
        r = rows.setdefault(e.name[:90], [0, 0.0])
        r[0] += 1
        r[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    tot = sum(v[1] for v in rows.values())
    out = sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]
    print(f"== {model} B={B} ctx={context} {family}: {n} GPU kernels/copies per step, {tot / 1e3:.2f} ms GPU busy")
    for name, (c, us) in out:
        print(f"  {us:10.1f} us {c:6d}x  {name}")
    del keep, run
    torch.cuda.empty_cache()
    return dict(model=model, batch=B, context=context, family=family, kernels=n, gpu_busy_us=tot,
                compiled=os.environ.get("MPK_CONV_COMPILE", "0") == "1",
                top=[dict(name=k, count=c, us=us) for k, (c, us) in out])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-8b")
    ap.add_argument("--batches", default="1,128")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--family", default="conventional",
                    help="plan family profiled (conventional, attn-mk, ...), or gptfast: the peer")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    res = [profile(m, int(b), a.context, a.top, a.family) for m in a.models.split(",") for b in a.batches.split(",")]
    os.makedirs(a.out, exist_ok=True)   # (session 37's varq lost its three JSONs to a missing --out folder)
    with open(os.path.join(a.out, f"profile_{a.family}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
