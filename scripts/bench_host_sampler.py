#!/usr/bin/env python3
"""The host sampler's draw alone (engine/sampling.py `sample(logits, params, seed, pos)`): milliseconds per call for
one row of fp32 logits of V entries, per sampling case and logits kind. Each cell: the median over `--reps` calls
(positions 0, 1, ... so nucleus rows see their usual mix of rejection rounds), after `--warm` warm-up calls.

Logits kinds: random (N(0, 1)), flat (all 0: one big tie), wide (N(0, 1) * 4), llm (N(0, 2.5) with 8 entries
lifted by 20 to 30: an LLM-like row, the vocabulary ~25 below the top, so that at a low temperature much of it
underflows exp).

--baseline DIR times an older sampler instead of this tree's: DIR holds that tree's package renamed mpk_base, e.g.
`mkdir -p /tmp/b && git archive HEAD mpk_runtime | tar -x -C /tmp/b && mv /tmp/b/mpk_runtime /tmp/b/mpk_base` (its
modules import each other relatively). Time the two in separate processes, in turn, a few times each (on a shared
host the load moves): calling both in one process evicts each other's buffers from the caches and slows both.
--check DIR draws every cell's tokens with both samplers and fails where they differ (no timing).

    PYTHONPATH=. python3 scripts/bench_host_sampler.py [--vocab 152064] [--reps 50] [--kinds random,flat,wide,llm]
        [--cases 'temperature,top_k 20'] [--baseline /tmp/b | --check /tmp/b]
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mpk_runtime.engine.sampling import SamplingParams, sample  # noqa: E402

CASES = {"temperature": dict(temperature=1.0),
         "temperature 0.3": dict(temperature=0.3),
         "top_p 0.9": dict(temperature=1.0, top_p=0.9),
         "top_k 20": dict(temperature=1.0, top_k=20),
         "top_k 100 + top_p 0.95": dict(temperature=0.8, top_k=100, top_p=0.95),
         "min_p 0.05": dict(temperature=1.0, min_p=0.05),
         "min_p 0.05 + top_p 0.9": dict(temperature=1.0, min_p=0.05, top_p=0.9)}


def logits_of(kind: str, V: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "flat":
        return torch.zeros(V)
    x = torch.randn(V, generator=g)
    if kind == "llm":
        x = x * 2.5
        x[torch.randint(0, V, (8,), generator=g)] += 20 + 10 * torch.rand(8, generator=g)
    return x * 4 if kind == "wide" else x


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--kinds", default="random,flat,wide,llm")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--baseline", default=None, help="time the sampler of the package mpk_base in this directory")
    ap.add_argument("--check", default=None, help="compare this tree's tokens with mpk_base's in this directory")
    a = ap.parse_args()
    samplers = {"new": (SamplingParams, sample)}
    if a.baseline or a.check:
        sys.path.insert(0, a.baseline or a.check)
        base = importlib.import_module("mpk_base.engine.sampling")
        samplers = {"base": (base.SamplingParams, base.sample)}
        if a.check:
            samplers["new"] = (SamplingParams, sample)
    kinds = a.kinds.split(",")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, V = {a.vocab}; " +
          ("tokens compared" if a.check else f"{','.join(samplers)}: ms / call, median of {a.reps}"))
    w = 9
    print(f"{'case':24s}" + "".join(f"{k:>{w}s}" for k in kinds))
    for case in a.cases.split(","):
        cells = []
        for kind in kinds:
            x = logits_of(kind, a.vocab)
            ps = {n: P(**CASES[case]) for n, (P, _) in samplers.items()}
            for i in range(a.warm):
                for n, (_, fn) in samplers.items():
                    fn(x, ps[n], 1234, i)
            ts = {n: [] for n in samplers}
            for i in range(a.reps):
                toks = set()
                for n, (_, fn) in samplers.items():
                    t0 = time.perf_counter()
                    toks.add(fn(x, ps[n], 1234, i))
                    ts[n].append(time.perf_counter() - t0)
                if len(toks) != 1:
                    raise SystemExit(f"{case} / {kind} / pos {i}: the samplers drew different tokens {toks}")
            cells.append("same" if a.check else f"{1e3 * statistics.median(next(iter(ts.values()))):.3f}")
        print(f"{case:24s}" + "".join(f"{c:>{w}s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
