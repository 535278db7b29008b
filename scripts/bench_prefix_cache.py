#!/usr/bin/env python3
"""Prefix caching (LLM(enable_prefix_caching=True), engine/prefix_cache.py) on a chat-like workload, caching off and
on in the same run: N requests share a system prompt of --system tokens, each with its own --suffix tokens.

  sequential: requests one after another (an interactive user): time to first token of each, after a first request
              that fills the cache (its TTFT is reported apart).
  batch:      all N at once after a priming request: wall time and generated tokens per second.

Printed: median TTFT off / on and their ratio, batch wall time ratio, prompt tokens computed, the cache's hit
tokens. No peer runs here: HF transformers' generate keeps no cache across requests (a user would pass
past_key_values by hand), so the comparison is this engine with and without the cache.

    PYTHONPATH=. python3 scripts/bench_prefix_cache.py [--model llama-3.2-1b --backend megakernel --plan auto]
        [--system 1024] [--suffix 32] [--requests 16] [--max-tokens 16]
Writes $OUT/bench_prefix_cache.json (or ./gpu_out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from mpk_runtime import LLM, SamplingParams
from mpk_runtime.models.config import load_config


def _run(a, caching: bool, system: list[int], suffixes: list[list[int]], warm: list[list[int]]) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    llm = LLM(a.model, backend=a.backend, dtype=a.dtype, max_batch=a.requests,
              max_seq_len=a.system + a.suffix + a.max_tokens + 16, enable_prefix_caching=caching,
              **({"plan": a.plan} if a.plan != "none" else {}))
    try:
        # warm-up on another system prompt: captures / plans for these shapes, cached and not
        llm.generate([w for w in warm], sp, use_tqdm=False)
        llm.generate([warm[0][:-1] + [1]], sp, use_tqdm=False)
        st0 = dict(llm.engine.stats)
        first = llm.generate([system + suffixes[0]], sp, use_tqdm=False)[0]
        ttft = []
        for s in suffixes[1:]:
            ttft.append(llm.generate([system + s], sp, use_tqdm=False)[0].metrics.time_to_first_token)
        st1 = dict(llm.engine.stats)
        llm.generate([system + [2, 3]], sp, use_tqdm=False)   # (primes the batch run's system prompt, either way)
        t0 = time.perf_counter()
        outs = llm.generate([system + s[::-1] for s in suffixes], sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        st2 = dict(llm.engine.stats)
    finally:
        llm.shutdown()
    row = {"prefix_caching": caching, "first_ttft_s": first.metrics.time_to_first_token,
           "ttft_s": ttft, "median_ttft_s": statistics.median(ttft),
           "sequential_prompt_tokens_computed": st1["prompt_tokens"] - st0["prompt_tokens"],
           "sequential_hit_tokens": st1["prefix_cache_hit_tokens"] - st0["prefix_cache_hit_tokens"],
           "batch_wall_s": wall, "batch_tokens_per_s": sum(len(o.token_ids) for o in outs) / wall,
           "batch_prompt_tokens_computed": st2["prompt_tokens"] - st1["prompt_tokens"],
           "batch_cached_tokens": sum(o.num_cached_tokens for o in outs)}
    print(f"prefix caching {'on ' if caching else 'off'}: first TTFT {1e3 * row['first_ttft_s']:.2f} ms, median TTFT "
          f"{1e3 * row['median_ttft_s']:.2f} ms ({row['sequential_prompt_tokens_computed']} prompt tokens computed, "
          f"{row['sequential_hit_tokens']} cached); batch of {a.requests}: {wall * 1e3:.1f} ms "
          f"({row['batch_tokens_per_s']:.0f} tokens/s, {row['batch_cached_tokens']} cached tokens)", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--plan", default="none", choices=["none", "auto"])
    ap.add_argument("--system", type=int, default=256, help="system prompt tokens shared by every request")
    ap.add_argument("--suffix", type=int, default=16, help="each request's own tokens after it")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    a = ap.parse_args()
    rng = random.Random(0)
    vocab = min(1000, load_config(a.model).vocab_size)
    draw = lambda n: [rng.randrange(1, vocab) for _ in range(n)]   # noqa: E731
    system = draw(a.system)
    suffixes = [draw(a.suffix) for _ in range(a.requests)]
    warm = [draw(a.system) + draw(a.suffix) for _ in range(2)]
    rows = [_run(a, c, system, suffixes, warm) for c in (False, True)]
    off, on = rows
    summary = {"median_ttft_ratio_off_to_on": off["median_ttft_s"] / on["median_ttft_s"],
               "batch_wall_ratio_off_to_on": off["batch_wall_s"] / on["batch_wall_s"]}
    print(f"median TTFT {summary['median_ttft_ratio_off_to_on']:.2f}x lower with the cache; batch wall time "
          f"{summary['batch_wall_ratio_off_to_on']:.2f}x")
    res = {"model": a.model, "backend": a.backend, "plan": a.plan, "dtype": a.dtype, "system_tokens": a.system,
           "suffix_tokens": a.suffix, "requests": a.requests, "max_tokens": a.max_tokens, "rows": rows,
           "summary": summary, "commit": os.environ.get("GIT_COMMIT", "unknown"),
           "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs)",
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(os.environ.get("OUT") or "gpu_out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_prefix_cache.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
