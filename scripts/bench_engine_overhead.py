#!/usr/bin/env python3
"""Host overhead of the engine per step, without a model: a runner that returns its tokens instantly (device
sampling, no logits), so the time measured is the engine's own work (scheduling, paged KV bookkeeping, chunk
building, output snapshots, stop checks) plus the in-process executor's hop. On the GPU this work sits between two
replayed CUDA graphs; docs/perf-notes.md "Engine on the GPU with plans" measured ~8.7 ms of host work per step at
128 requests on an H200 host.

    PYTHONPATH=. python3 scripts/bench_engine_overhead.py [--requests 128] [--max-tokens 256] [--prompt-len 16,48]
Prints ms per engine step for generate() and writes $OUT/bench_engine_overhead.json (or ./gpu_out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

import torch

from mpk_runtime import LLM, SamplingParams
from mpk_runtime.models.config import load_config
from mpk_runtime.runtime.base import KVSpec, ModelRunner, register_runner
from mpk_runtime.runtime.device_sampling import host_logits_needed, step_output


@register_runner("instant")
class InstantRunner(ModelRunner):
    """Returns token (start_pos % 7) + 1 for every chunk at once: no compute."""

    def __init__(self, model: str = "llama-3.2-1b", max_batch: int = 128, max_seq_len: int = 512,
                 page_size: int = 16, **_: object):
        self.config = load_config(model)
        self._spec = KVSpec(page_size, max_batch * (-(-max_seq_len // page_size)) + 1, max_batch, max_seq_len)

    def kv_spec(self) -> KVSpec:
        return self._spec

    def step(self, chunks):
        lg = torch.zeros(len(chunks), self.config.vocab_size) if host_logits_needed(chunks) else None
        return step_output(chunks, lg, [1 + (c.start_pos % 7) for c in chunks])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", default="16,48")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    lo, hi = (int(x) for x in a.prompt_len.split(","))
    llm = LLM("llama-3.2-1b", backend="instant", max_batch=a.requests, max_seq_len=hi + a.max_tokens + 16)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(lo, hi))] for _ in range(a.requests)]
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:4], sp, use_tqdm=False)
    runs = []
    for _ in range(a.repeats):
        s0 = llm.engine.stats["steps"]
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        runs.append(1e3 * dt / (llm.engine.stats["steps"] - s0))
    llm.shutdown()
    res = {"requests": a.requests, "max_tokens": a.max_tokens, "prompt_len": [lo, hi],
           "ms_per_step": sorted(runs), "median_ms_per_step": sorted(runs)[len(runs) // 2],
           "commit": os.environ.get("GIT_COMMIT", "unknown"), "cpu_count": os.cpu_count(),
           "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs)",
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(os.environ.get("OUT") or "gpu_out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_engine_overhead.json").write_text(json.dumps(res, indent=1))
    print(f"{a.requests} requests x {a.max_tokens} tokens: {res['median_ms_per_step']:.2f} ms per engine step "
          f"(runs {', '.join(f'{x:.2f}' for x in runs)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
