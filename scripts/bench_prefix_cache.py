#!/usr/bin/env python3
"""Prefix caching (LLM(enable_prefix_caching=True), engine/prefix_cache.py) on a chat-like workload, caching off and
on in the same run: N requests share a system prompt of --system tokens, each with its own --suffix tokens.

  sequential: requests one after another (an interactive user): time to first token of each, after a first request
              that fills the cache (its TTFT is reported apart).
  batch:      all N at once after a priming request: wall time and generated tokens per second.
  cold:       all N at once with a system prompt nothing has computed yet (a burst of arrivals, or n samples of one
              prompt): with the cache the first computes it while the others are held back, then take its pages.

Printed: median TTFT off / on and their ratio, batch wall time ratio, prompt tokens computed, the cache's hit
tokens. The peer, in the same run: HF transformers (eager, bf16 on a GPU / fp32 on the CPU, a model of the same
shape) timed to the first token of each sequential request, without reuse (the whole prompt) and with its documented
prompt reuse (the system prompt's DynamicCache computed once, deep-copied for each request, the suffix run on it).
--no-peer leaves it out.

    PYTHONPATH=. python3 scripts/bench_prefix_cache.py [--model llama-3.2-1b --backend megakernel --plan auto]
        [--system 1024] [--suffix 32] [--requests 16] [--max-tokens 16]
Writes $OUT/bench_prefix_cache.json (or ./gpu_out).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpk_runtime import LLM, SamplingParams  # noqa: E402
from mpk_runtime.engine.cli_flags import plan_kw  # noqa: E402
from mpk_runtime.models.config import load_config  # noqa: E402

from _bench_common import write_result  # noqa: E402


def _hf_peer(a, system: list[int], suffixes: list[list[int]], warm: list[list[int]]) -> dict:
    """HF transformers' time to the first token, the whole prompt vs a deep copy of the system prompt's cache."""
    import copy

    from transformers import DynamicCache

    from _peers import hf_model
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m, _ = hf_model(load_config(a.model), a.system + a.suffix + a.max_tokens + 16, dev,
                    torch.bfloat16 if dev == "cuda" else torch.float32)

    def first_token(ids: list[int], cache=None) -> float:
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = m(input_ids=torch.tensor([ids], device=dev), past_key_values=cache if cache is not None else
                    DynamicCache(), use_cache=True, logits_to_keep=1)
            int(out.logits[0, -1].argmax())
        return time.perf_counter() - t0

    def prefix_cache(ids: list[int]):
        c = DynamicCache()
        with torch.no_grad():
            m(input_ids=torch.tensor([ids], device=dev), past_key_values=c, use_cache=True, logits_to_keep=1)
        return c

    for w in warm:   # allocator, kernels' first calls
        first_token(w)
        first_token(w[-a.suffix:], copy.deepcopy(prefix_cache(w[:-a.suffix])))
    whole = [first_token(system + s) for s in suffixes[1:]]
    sc = prefix_cache(system)
    reuse = []
    for s in suffixes[1:]:
        t0 = time.perf_counter()
        c = copy.deepcopy(sc)
        reuse.append(time.perf_counter() - t0 + first_token(s, c))
    del m
    row = {"system": "hf", "device": dev, "ttft_s": whole, "median_ttft_s": statistics.median(whole),
           "reuse_ttft_s": reuse, "median_reuse_ttft_s": statistics.median(reuse)}
    print(f"HF transformers (eager, {dev}): median TTFT {1e3 * row['median_ttft_s']:.2f} ms whole prompt, "
          f"{1e3 * row['median_reuse_ttft_s']:.2f} ms reusing the system prompt's cache", flush=True)
    return row


def _run(a, caching: bool, system: list[int], suffixes: list[list[int]], warm: list[list[int]],
         cold: list[int]) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    llm = LLM(a.model, backend=a.backend, dtype=a.dtype, max_batch=a.requests,
              max_seq_len=a.system + a.suffix + a.max_tokens + 16, enable_prefix_caching=caching,
              **plan_kw(a.plan, a.backend))
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
        t0 = time.perf_counter()
        cold_outs = llm.generate([cold + s for s in suffixes], sp, use_tqdm=False)
        cold_wall = time.perf_counter() - t0
        st3 = dict(llm.engine.stats)
    finally:
        llm.shutdown()
    row = {"prefix_caching": caching, "first_ttft_s": first.metrics.time_to_first_token,
           "ttft_s": ttft, "median_ttft_s": statistics.median(ttft),
           "sequential_prompt_tokens_computed": st1["prompt_tokens"] - st0["prompt_tokens"],
           "sequential_hit_tokens": st1["prefix_cache_hit_tokens"] - st0["prefix_cache_hit_tokens"],
           "batch_wall_s": wall, "batch_tokens_per_s": sum(len(o.token_ids) for o in outs) / wall,
           "batch_prompt_tokens_computed": st2["prompt_tokens"] - st1["prompt_tokens"],
           "batch_cached_tokens": sum(o.num_cached_tokens for o in outs),
           "cold_batch_wall_s": cold_wall, "cold_batch_prompt_tokens_computed": st3["prompt_tokens"] - st2["prompt_tokens"],
           "cold_batch_cached_tokens": sum(o.num_cached_tokens for o in cold_outs),
           "cold_batch_mean_ttft_s": statistics.mean(o.metrics.time_to_first_token for o in cold_outs)}
    print(f"prefix caching {'on ' if caching else 'off'}: first TTFT {1e3 * row['first_ttft_s']:.2f} ms, median TTFT "
          f"{1e3 * row['median_ttft_s']:.2f} ms ({row['sequential_prompt_tokens_computed']} prompt tokens computed, "
          f"{row['sequential_hit_tokens']} cached); batch of {a.requests}: {wall * 1e3:.1f} ms "
          f"({row['batch_tokens_per_s']:.0f} tokens/s, {row['batch_cached_tokens']} cached tokens); cold batch: "
          f"{cold_wall * 1e3:.1f} ms ({row['cold_batch_prompt_tokens_computed']} prompt tokens computed, mean TTFT "
          f"{1e3 * row['cold_batch_mean_ttft_s']:.1f} ms)", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--plan", default=None, choices=["none", "auto"],
                    help="default: the backend's (megakernel at tp=1: auto, runtime/executor.default_plan)")
    ap.add_argument("--system", type=int, default=256, help="system prompt tokens shared by every request")
    ap.add_argument("--suffix", type=int, default=16, help="each request's own tokens after it")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--no-peer", action="store_true", help="leave out the HF transformers peer")
    a = ap.parse_args()
    rng = random.Random(0)
    vocab = min(1000, load_config(a.model).vocab_size)
    draw = lambda n: [rng.randrange(1, vocab) for _ in range(n)]   # noqa: E731
    system = draw(a.system)
    suffixes = [draw(a.suffix) for _ in range(a.requests)]
    warm = [draw(a.system) + draw(a.suffix) for _ in range(2)]
    cold = draw(a.system)
    rows = [_run(a, c, system, suffixes, warm, cold) for c in (False, True)]
    off, on = rows
    summary = {"median_ttft_ratio_off_to_on": off["median_ttft_s"] / on["median_ttft_s"],
               "batch_wall_ratio_off_to_on": off["batch_wall_s"] / on["batch_wall_s"],
               "cold_batch_wall_ratio_off_to_on": off["cold_batch_wall_s"] / on["cold_batch_wall_s"]}
    print(f"median TTFT {summary['median_ttft_ratio_off_to_on']:.2f}x lower with the cache; batch wall time "
          f"{summary['batch_wall_ratio_off_to_on']:.2f}x; cold batch {summary['cold_batch_wall_ratio_off_to_on']:.2f}x")
    peer = None if a.no_peer else _hf_peer(a, system, suffixes, warm)
    if peer is not None:
        summary["hf_whole_ttft_over_ours_cached"] = peer["median_ttft_s"] / on["median_ttft_s"]
        summary["hf_reuse_ttft_over_ours_cached"] = peer["median_reuse_ttft_s"] / on["median_ttft_s"]
        print(f"ours cached vs HF: {summary['hf_whole_ttft_over_ours_cached']:.2f}x faster than HF's whole prompt, "
              f"{summary['hf_reuse_ttft_over_ours_cached']:.2f}x than HF reusing the cache")
    write_result("bench_prefix_cache.json", {
        "model": a.model, "backend": a.backend, "plan": a.plan or "default", "dtype": a.dtype, "system_tokens": a.system,
        "suffix_tokens": a.suffix, "requests": a.requests, "max_tokens": a.max_tokens, "rows": rows, "peer": peer,
        "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
