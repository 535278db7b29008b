#!/usr/bin/env python3
"""What a megakernel segment costs beyond its tasks, timed inside CUDA graphs (no host gaps).

    PYTHONPATH=. python3 scripts/bench_mk_launch.py --out $OUT [--model llama-3.2-1b] [--batches 1,32] [--reps 20]

Why: in attn-mk plans each layer's attention is a megakernel of its own, and those segments cost ~20 us more than
their simulated tasks (session 20's validate rows: llama B=1 ctx 512 23.2 us measured vs 3.7 us simulated; B=32 36.0
vs 13.3; the CUPTI kernel time at B=32 is 31 us): 16 x ~20 us of a llama step, 36 x of a qwen3-8b one. Each row
below is one CUDA graph of `reps` back-to-back units, replayed 10 times (median us per unit):
  torch_add       a one-element torch add: what any kernel costs in a graph
  zero            the segment's counter zeroing alone (PlanExecutor's graph launch does it before each launch)
  mk_one_132      zeroing + a one-task megakernel (embed of one token) on a 132-CTA grid
  mk_one_1        the same task on a 1-CTA grid (CTA launch and drain of 131 empty CTAs)
  attn_B          zeroing + the L0.attention megakernel at batch B; a warm traced launch gives the task span
                  (span_us: first task start to last task end over all SMs; sm_span_us: the longest single SM's;
                  skew_us: the spread of the SMs' first starts), so fixed_us = attn_B - span_us is launch, zeroing,
                  prologue and drain. (Rig's graph: the appends in qkv_rope, not deferred; a default Tiling.)
  attn_B_mm       the same with a bf16 matmul of the layer's o_proj shape between launches (what the real step
                  interleaves: the SMs' instruction and L1 state evicted), minus the matmul alone
Writes <out>/mk_launch.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mpk_runtime.runtime.plan_exec import _graph_launch  # noqa: E402
from _bench_common import graph_us  # noqa: E402
from profile_hw import Rig  # noqa: E402  (scripts/profile_hw.py: model, weights, KV cache, step inputs)


def task_spans(mk, warm: int = 3) -> dict:
    """The last of `warm` + 1 launches, traced (each launch overwrites the trace; the first ones warm the module):
    span_us = first task start on any SM to last task end on any (globaltimer), sm_span_us = the longest one SM's
    first start to last end, skew_us = the spread of the SMs' first task starts (CTA launch, prologue, first waits)."""
    for _ in range(warm + 1):
        _graph_launch(mk)
    torch.cuda.synchronize()
    mk.check()
    tr = mk.trace_times()[0]
    span: dict[int, list[int]] = {}
    for t in mk.tg.tasks:
        a, b = int(tr[t.id, 0]), int(tr[t.id, 1])
        if a and b:
            s = span.setdefault(t.sm, [a, b])
            s[0], s[1] = min(s[0], a), max(s[1], b)
    if not span:
        return {"span_us": 0.0, "sm_span_us": 0.0, "skew_us": 0.0}
    starts = [s[0] for s in span.values()]
    return {"span_us": round((max(s[1] for s in span.values()) - min(starts)) / 1e3, 2),
            "sm_span_us": round(max(s[1] - s[0] for s in span.values()) / 1e3, 2),
            "skew_us": round((max(starts) - min(starts)) / 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible: run this on the GPU machine")
    os.makedirs(a.out, exist_ok=True)
    rows = {}

    def put(name, us, **kw):
        rows[name] = {"us": round(us, 2), **kw}
        print(f"{name:14s} {us:8.2f} us per unit " + " ".join(f"{k}={v}" for k, v in kw.items()), flush=True)

    x = torch.zeros(1, device="cuda")
    put("torch_add", graph_us(lambda _: x.add_(1), a.reps))
    batches = [int(b) for b in a.batches.split(",")]
    rig = Rig(a.model, batches[0], a.context)
    _, mk = rig.megakernel(["embed"], sms=132)
    put("zero", graph_us(lambda _: mk.counters.zero_(), a.reps))
    put("mk_one_132", graph_us(lambda _: _graph_launch(mk), a.reps), smem=mk.smem)
    _, mk1 = rig.megakernel(["embed"], sms=1)
    put("mk_one_1", graph_us(lambda _: _graph_launch(mk1), a.reps), smem=mk1.smem)
    del mk, mk1
    for B in batches:
        rig = rig if B == batches[0] else Rig(a.model, B, a.context)
        _, mk = rig.megakernel(["L0.attention"], sms=132, trace=1)
        sp = task_spans(mk)
        _, mk = rig.megakernel(["L0.attention"], sms=132)
        us = graph_us(lambda _: _graph_launch(mk), a.reps)
        put(f"attn_{B}", us, **sp, fixed_us=round(us - sp["span_us"], 2), smem=mk.smem, tasks=len(mk.tg.tasks))
        cfg = rig.cfg
        h = torch.randn(B, cfg.num_heads * cfg.head_dim, device="cuda", dtype=torch.bfloat16)
        wo = torch.randn(cfg.hidden_size, cfg.num_heads * cfg.head_dim, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(B, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        mm = graph_us(lambda _: torch.matmul(h, wo.t(), out=y), a.reps)

        def both():
            torch.matmul(h, wo.t(), out=y)
            _graph_launch(mk)
        put(f"attn_{B}_mm", graph_us(lambda _: both(), a.reps) - mm, matmul_us=round(mm, 2))
        mk.check()
        del mk
    meta = {"machine": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
            "commit": os.environ.get("GIT_COMMIT", "?"), "model": a.model, "context": a.context, "reps": a.reps}
    with open(os.path.join(a.out, "mk_launch.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("wrote", os.path.join(a.out, "mk_launch.json"))


if __name__ == "__main__":
    main()
