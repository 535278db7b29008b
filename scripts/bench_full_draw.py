#!/usr/bin/env python3
"""The full-vocabulary draw alone (runtime/full_sampling.py, DeviceSampling(full=True)): microseconds per draw of B
rows from fp32 logits of V entries, by the Triton kernels (full_sampling_triton.py: chunks of CHUNK entries) and by
the torch-ops twin, beside torch.argmax of the same logits (what a greedy row costs after the step: the floor of
any draw that reads the row). impl "graph": the Triton launches replayed as one CUDA graph (runtime/draw_graphs.py,
what a decode step runs since session 53): back to back, the kernels' own time plus one graph launch each. Modes: plain (temperature 1, top_k 0), nucleus (top_p 0.95), ranked (top_k 100).
Each cell: CUDA-event time of `--reps` draws back to back / reps, median of 5; the kernels JIT-compile in a warm-up.

    PYTHONPATH=. python3 scripts/bench_full_draw.py [--vocab 128256,151936] [--batch 1,8,128] [--chunk 4096]
Writes $OUT/bench_full_draw.json (or ./gpu_out).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpk_runtime.runtime import full_sampling_triton as fst  # noqa: E402
from mpk_runtime.runtime.device_sampling import DeviceSampling  # noqa: E402
from mpk_runtime.runtime.draw_graphs import DrawGraphs  # noqa: E402
from mpk_runtime.runtime.full_sampling import FullRows  # noqa: E402

from _bench_common import write_result  # noqa: E402

MODES = {"plain": dict(temperature=1.0, top_k=0, top_p=1.0), "nucleus": dict(temperature=0.8, top_k=0, top_p=0.95),
         "ranked": dict(temperature=0.8, top_k=100, top_p=0.95)}


def _us(fn, reps: int) -> float:
    ts = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        e1.synchronize()
        ts.append(1e3 * e0.elapsed_time(e1) / reps)
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", default="128256,151936")
    ap.add_argument("--batch", default="1,8,32,128")
    ap.add_argument("--modes", default="plain,nucleus,ranked")
    ap.add_argument("--chunk", type=int, default=fst.CHUNK)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--impls", default="triton,graph,torch")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_full_draw.py times CUDA kernels: run it on a GPU machine")
    fst.CHUNK = a.chunk
    rows = []
    for V in (int(v) for v in a.vocab.split(",")):
        for B in (int(b) for b in a.batch.split(",")):
            g = torch.Generator(device="cuda").manual_seed(B)
            logits = torch.randn(B, V, device="cuda", generator=g) * 3   # a spread like a model's (few dominant)
            pos = torch.arange(B, device="cuda", dtype=torch.int64) + 17
            out = torch.empty(B, dtype=torch.int64, device="cuda")
            argmax_us = _us(lambda: torch.argmax(logits, -1, out=out), a.reps)
            for m in a.modes.split(","):
                fr = FullRows([DeviceSampling(seed=i, full=True, **MODES[m]) for i in range(B)], "cuda", V)
                for impl in a.impls.split(","):
                    if impl == "graph":
                        dg = DrawGraphs()
                        fn = (lambda: dg.draw(fr, logits, pos, out, graph=True))
                    else:
                        fn = (lambda: fr.draw(logits, pos, out, impl))
                    fn()   # warm-up: the JIT, the workspace (graph: the capture)
                    torch.cuda.synchronize()
                    reps = a.reps if impl != "torch" else max(3, a.reps // 10)
                    us = _us(fn, reps)
                    rows.append(dict(vocab=V, batch=B, mode=m, impl=impl, us=us, argmax_us=argmax_us))
                    print(f"V={V} B={B} {m:8s} {impl:6s}: {us:9.1f} us a draw (argmax {argmax_us:.1f} us)", flush=True)
    write_result("bench_full_draw.json", {"chunk": a.chunk, "reps": a.reps, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
