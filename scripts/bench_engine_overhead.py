#!/usr/bin/env python3
"""The engine's time per decode step, end to end through LLM.generate.

With the default backend "instant" (a runner that returns its tokens at once: device sampling, no logits) the time
measured is the engine's own host work (scheduling, paged KV bookkeeping, chunk building, output snapshots, stop
checks) plus the in-process executor's hop. With a real backend (--backend megakernel --plan auto on the GPU) it is
what a user of LLM.generate gets per token position, host work included: compare it with bench_decode's graph-replay
time of the same plan. --decode-steps 1,8 runs each batch with one decode step per engine step and with bursts of 8
(LLM(decode_steps=8): the drawn tokens stay on the device between the steps, one host round trip a burst).
--sampling greedy,topk,plain,nucleus,host: how the requests sample (SAMPLINGS below): greedy; top_k 50 (the graph's
top-64 sampler); top_k 0 at temperature 1 ("plain") and with top_p 0.95 ("nucleus"): the full-vocabulary draw on
the device (runtime/full_sampling.py); "host": the nucleus requests with device_sampling="off" (logits copied, the
host sampler; one decode step per engine step), what such requests cost before the full draw. --async-bursts runs each
decode_steps > 1 again with LLM(async_bursts=True) (the next burst in flight while the engine reads the last);
--tokenizer DIR gives the requests text out (the engine detokenizes each token); --step-ms T makes the instant
runner wait T ms a step with the GIL released, as a GPU step does. --profile N: after each cell's timed runs, one
more generate of N tokens under torch.profiler: its Chrome trace ($OUT/profile_<cell>.json.gz) and, from it, each
kernel's time, the device's busy share between the first and last kernel, and the idle gaps (profile_summary below).

    PYTHONPATH=. python3 scripts/bench_engine_overhead.py [--requests 1,128] [--max-tokens 256] [--prompt-len 16,48]
        [--decode-steps 1,8] [--sampling greedy,nucleus,host] [--backend megakernel --model llama-3.2-1b --plan auto]
Prints ms per decode step and writes $OUT/bench_engine_overhead.json (or ./gpu_out).
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from mpk_runtime import LLM, SamplingParams
from mpk_runtime.engine.cli_flags import plan_kw
from mpk_runtime.engine.step_stats import breakdown, diff_stats, format_breakdown
from mpk_runtime.models.config import load_config
from mpk_runtime.runtime.base import KVSpec, ModelRunner, check_decode_steps, register_runner
from mpk_runtime.runtime.device_sampling import host_logits_needed, step_output

from _bench_common import ModelledDevice, write_result   # (scripts/, this script's folder)


@register_runner("instant")
class InstantRunner(ModelRunner):
    """Returns token (start_pos % 7) + 1 for every chunk at once: no compute (step_ms > 0: sleeps that long a step,
    the GIL released, as a GPU step's CUDA wait is)."""
    samples_on_device = True
    shares_kv_pages = True   # (no K/V at all)

    def __init__(self, model: str = "llama-3.2-1b", max_batch: int = 128, max_seq_len: int = 512,
                 page_size: int = 16, step_ms: float = 0.0, **_: object):
        self.config = load_config(model)
        self.step_s = step_ms / 1e3
        self.device = ModelledDevice()
        self._spec = KVSpec(page_size, max_batch * (-(-max_seq_len // page_size)) + 1, max_batch, max_seq_len)

    def kv_spec(self) -> KVSpec:
        return self._spec

    def step(self, chunks):
        self.device.run(self.step_s)
        lg = torch.zeros(len(chunks), self.config.vocab_size) if host_logits_needed(chunks) else None
        return step_output(chunks, lg, [1 + (c.start_pos % 7) for c in chunks])

    def decode_steps(self, chunks, num_steps: int, resume: bool = False):
        return self.launch_steps(chunks, num_steps, resume).wait()

    def launch_steps(self, chunks, num_steps: int, resume: bool = False):
        """As a GPU burst: every step's work queued at once behind the device's earlier work (num_steps x step_ms;
        _bench_common.ModelledDevice), read by one wait; the tokens step by step as step() gives them."""
        check_decode_steps(chunks, num_steps)
        if resume and [c.seq_id for c in chunks] != getattr(self, "_rows", None):
            raise ValueError("decode_steps(resume=True) continues the last call's rows")
        self._rows = [c.seq_id for c in chunks]
        return self.device.pending(self.step_s * num_steps, torch.tensor(
            [[1 + ((c.start_pos + j) % 7) for j in range(num_steps)] for c in chunks]))


SAMPLINGS = {"greedy": dict(temperature=0.0), "topk": dict(temperature=0.8, top_k=50),
             "plain": dict(temperature=1.0), "nucleus": dict(temperature=0.8, top_p=0.95),
             "host": dict(temperature=0.8, top_p=0.95)}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _device_steps(st: dict) -> int:
    return st["steps"] - st["multi_steps"] + st["device_steps_in_multi"]


def _decode_device_steps(st: dict) -> int:
    """Decode steps run (a burst of k counts k; engine steps holding a prompt chunk are not counted)."""
    return st["decode_steps"] - st["multi_steps"] + st["device_steps_in_multi"]


def _measure(llm, a, prompts: list, mode: str, k: int) -> dict:
    """One batch of requests sampled as `mode`, a.repeats times after a warm-up: its result row."""
    b = len(prompts)
    llm.generate(prompts, SamplingParams(max_tokens=2 * k + 2, ignore_eos=True, **SAMPLINGS[mode]),
                 use_tqdm=False)   # warm: captures, the prefill graph, a burst
    sp = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, seed=1, **SAMPLINGS[mode])
    runs, toks, dec = [], [], []
    for _ in range(a.repeats):
        st0 = dict(llm.engine.stats)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        st = llm.engine.stats
        runs.append(1e3 * dt / (_device_steps(st) - _device_steps(st0)))
        # the decode steps alone (the engine's decode-kind steps, host work included; no prefill)
        dec.append(1e3 * (st["t_step_decode_s"] - st0["t_step_decode_s"])
                   / max(1, _decode_device_steps(st) - _decode_device_steps(st0)))
        toks.append(sum(len(o.token_ids) for o in outs) / dt)
    med = sorted(runs)[len(runs) // 2]
    dmed = sorted(dec)[len(dec) // 2]
    print(format_breakdown(breakdown(diff_stats(dict(llm.engine.stats), st0), dt)))   # the last run's
    row = {"requests": b, "decode_steps": k, "sampling": mode, "ms_per_decode_step": sorted(runs),
           "median_ms_per_decode_step": med, "tokens_per_s": sorted(toks)[len(toks) // 2],
           "median_ms_per_decode_step_without_prefill": dmed}
    print(f"{a.model} {a.backend} B={b} {mode} decode_steps={k}{' async' if llm.engine.async_bursts else ''}: "
          f"{med:.3f} ms per decode step, {dmed:.3f} "
          f"without the prefill steps ({row['tokens_per_s']:.0f} tokens/s; runs {', '.join(f'{x:.3f}' for x in runs)})",
          flush=True)
    return row


def profile_summary(trace: dict, top: int = 25) -> dict:
    """From a Chrome trace (torch.profiler's export): the kernels' total and count by name (the `top` largest),
    the device busy time (union of kernel intervals) over the span from the first kernel's start to the last's end,
    and the idle gaps between kernels (count and sum of those > 5 us, the largest)."""
    ks = sorted(((float(e["ts"]), float(e.get("dur", 0)), e["name"]) for e in trace.get("traceEvents", [])
                 if e.get("cat") == "kernel" and "ts" in e), key=lambda k: k[0])
    if not ks:
        return {"kernels": 0}
    by: dict[str, list[float]] = {}
    busy, gaps, end = 0.0, [], ks[0][0]
    for ts, dur, name in ks:
        by.setdefault(name, []).append(dur)
        if ts > end:
            gaps.append(ts - end)
        busy += max(0.0, ts + dur - max(ts, end))
        end = max(end, ts + dur)
    span = end - ks[0][0]
    names = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:top]
    big = [g for g in gaps if g > 5.0]
    return {"kernels": len(ks), "span_us": span, "busy_us": busy, "busy_share": busy / span if span else 1.0,
            "gaps_over_5us": len(big), "gap_us_over_5us": sum(big), "largest_gaps_us": sorted(gaps)[-5:],
            "by_kernel": [{"name": n[:120], "count": len(d), "total_us": sum(d), "mean_us": sum(d) / len(d)}
                          for n, d in names]}


def _profile(llm, a, prompts: list, mode: str, k: int) -> dict:
    """One more generate of a.profile tokens under torch.profiler: its trace written, its profile_summary."""
    import gzip
    import json
    import os
    import tempfile
    from pathlib import Path
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sp = SamplingParams(max_tokens=a.profile, ignore_eos=True, seed=2, **SAMPLINGS[mode])
    with profile(activities=acts, with_stack=a.profile_stack) as prof:
        llm.generate(prompts, sp, use_tqdm=False)
    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(f"{d}/t.json")
        trace = json.loads(Path(f"{d}/t.json").read_text())
    out = Path(os.environ.get("OUT") or "gpu_out")
    out.mkdir(parents=True, exist_ok=True)
    name = f"profile_B{len(prompts)}_{mode}_k{k}{'_async' if llm.engine.async_bursts else ''}"
    with gzip.open(out / f"{name}.json.gz", "wt") as f:
        json.dump(trace, f)
    summ = profile_summary(trace)
    print(f"profile {name}: {summ['kernels']} kernels, busy {summ.get('busy_us', 0) / 1e3:.2f} of "
          f"{summ.get('span_us', 0) / 1e3:.2f} ms ({100 * summ.get('busy_share', 1):.1f}%), "
          f"{summ.get('gaps_over_5us', 0)} gaps > 5 us ({summ.get('gap_us_over_5us', 0) / 1e3:.2f} ms)", flush=True)
    for r in summ.get("by_kernel", [])[:12]:
        print(f"    {r['count']:6d} x {r['mean_us']:8.2f} us = {r['total_us'] / 1e3:8.3f} ms  {r['name'][:90]}")
    return summ


def _summary(rows: list[dict]) -> None:
    """Each sampling mode's ms per decode step (without the prefill steps) beside greedy's at the same batch."""
    greedy = {(r["requests"], r["decode_steps"]): r["median_ms_per_decode_step_without_prefill"]
              for r in rows if r["sampling"] == "greedy" and not r.get("async_bursts")}
    base = {b: v for (b, k), v in sorted(greedy.items(), key=lambda kv: -kv[0][1])}   # the largest k's greedy
    for r in rows:
        g = base.get(r["requests"])
        if g and r["sampling"] != "greedy":
            r["ratio_to_greedy"] = r["median_ms_per_decode_step_without_prefill"] / g
            print(f"B={r['requests']} {r['sampling']} k={r['decode_steps']}: "
                  f"{r['median_ms_per_decode_step_without_prefill']:.3f} ms, {r['ratio_to_greedy']:.3f}x greedy "
                  f"({g:.3f})")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", default="128", help="batch sizes (comma-separated): requests run together")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", default="16,48")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-steps", default="1", help="LLM(decode_steps=...) values (comma-separated)")
    ap.add_argument("--backend", default="instant")
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--plan", default=None, choices=["none", "auto"],
                    help="default: the backend's (megakernel at tp=1: auto, runtime/executor.default_plan)")
    ap.add_argument("--sampling", default="greedy", help=f"comma-separated, of {', '.join(SAMPLINGS)}")
    ap.add_argument("--async-bursts", action="store_true",
                    help="also run each decode_steps > 1 with LLM(async_bursts=True) (engine/bursts.py)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory: text out (the engine detokenizes)")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="the instant runner's time a step (slept, the GIL released, as a GPU step waits)")
    ap.add_argument("--max-seq-len", type=int, default=0,
                    help="LLM(max_seq_len=...) (default: the longest prompt + max_tokens + 16); a long one makes the "
                         "page tables wide (fill_step's host cost before session 53's write_tables)")
    ap.add_argument("--profile", type=int, default=0,
                    help="N > 0: each cell once more, N tokens, under torch.profiler (trace + kernel summary)")
    ap.add_argument("--profile-stack", action="store_true",
                    help="with --profile: the Python tracer too (python_function events: where the host time goes)")
    ap.add_argument("--kv-allocation", default="lazy", choices=["lazy", "reserve"],
                    help="LLM(kv_allocation=...): pages as tokens need them, or the whole length at admission")
    a = ap.parse_args()
    modes = [m for m in a.sampling.split(",") if m]
    bad = [m for m in modes if m not in SAMPLINGS]
    if bad:
        ap.error(f"--sampling {bad}: choose from {', '.join(SAMPLINGS)}")
    lo, hi = (int(x) for x in a.prompt_len.split(","))
    batches, ks = _ints(a.requests), _ints(a.decode_steps)
    rng = random.Random(0)
    vocab = min(1000, load_config(a.model).vocab_size)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(max(batches))]
    rows = []
    # (decode_steps, device_sampling, sampling modes) of each LLM: "host" runs apart (device_sampling off, k = 1)
    # (--async-bursts: each k > 1 run again with LLM(async_bursts=True), in the same process, after it)
    runs_of = [(k, "auto", [m for m in modes if m != "host"], False) for k in ks] + \
        ([(k, "auto", [m for m in modes if m != "host"], True) for k in ks if k > 1] if a.async_bursts else []) + \
        ([(1, "off", ["host"], False)] if "host" in modes else [])
    for k, dmode, mlist, asy in runs_of:
        if not mlist:
            continue
        llm = LLM(a.model, backend=a.backend, max_batch=max(batches), max_seq_len=a.max_seq_len or hi + a.max_tokens + 16,
                  decode_steps=k, device_sampling=dmode, async_bursts=asy, tokenizer=a.tokenizer,
                  kv_allocation=a.kv_allocation,
                  **plan_kw(a.plan, a.backend), **({"step_ms": a.step_ms} if a.step_ms else {}))
        try:
            for mode in mlist:
                for b in batches:
                    rows.append({**_measure(llm, a, prompts[:b], mode, k), "async_bursts": asy})
                    if a.profile:
                        rows[-1]["profile"] = _profile(llm, a, prompts[:b], mode, k)
        finally:
            llm.shutdown()
    _summary(rows)
    write_result("bench_engine_overhead.json", {"model": a.model, "backend": a.backend, "plan": a.plan or "default",
                                                "kv_allocation": a.kv_allocation,
                                                "max_tokens": a.max_tokens, "prompt_len": [lo, hi], "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
