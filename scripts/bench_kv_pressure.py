#!/usr/bin/env python
"""KV pages short of the batch: kv_allocation "reserve" (a request takes its whole length, prompt + max_tokens, at
admission) against "lazy" (pages as tokens need them, the newest request preempted and computed again when they run
out; engine/scheduler.py), in one run, on the same requests.

The workload is a chat service's: max_tokens a generous cap (1536) while answers end much earlier (an EOS drawn with
probability 1 / mean-out a token: geometric lengths). The model is a *modelled* runner, not a GPU: every call sleeps
(GIL released, as a GPU wait is) for a step time interpolated from measured GPU decode steps (default: llama-3.2-1b's
planned decode on one H200 at B = 1 / 8 / 32 / 128, ctx 512, session 45: 1.073 / 1.253 / 1.432 / 2.081 ms) plus
--prefill-us a prompt token (a preempted request's recomputed tokens are charged the same), and draws each token from a
hash of (sequence, position), so both modes produce the same outputs (checked). What it measures is the engine's
scheduling policy, under that cost model: requests in flight, steps, tokens/s, time to first token. The engine's host
work (scheduling, detokenizing-free outputs) is real.

With --backend megakernel (or torch / pyvm) the model is real (a preset's seeded weights), wrapped in a length oracle
(LengthOracle): each request's answer length is drawn (exponential, mean --mean-out, capped) and the runner returns
the stop token at that position in place of the model's token, so the engine cannot foresee the lengths (as with a
real EOS) and both modes do the same work even where the model's bf16 tokens differ between batch sizes (session
52: stopping on calibrated stop tokens instead was confounded by exactly that).

    OUT=bench/results/s52 python scripts/bench_kv_pressure.py --requests 512 --kv-seqs 16,32
    python scripts/bench_kv_pressure.py --backend megakernel --plan auto --requests 256 --max-tokens 512 \
        --mean-out 100 --max-seq-len 1024 --kv-seqs 8,16,64 --prompt-len 64,256        # on a GPU
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpk_runtime.engine import LLM, SamplingParams  # noqa: E402
from mpk_runtime.models.config import load_config  # noqa: E402
from mpk_runtime.runtime.base import (KVSpec, ModelRunner, Pending, check_decode_steps, make_runner,  # noqa: E402
                                      register_runner)
from mpk_runtime.runtime.device_sampling import step_output  # noqa: E402

from _bench_common import ModelledDevice, write_result  # noqa: E402

EOS = 0


def _interp(table: list[tuple[int, float]], b: int) -> float:
    """Step ms at b rows, linear between the measured batch sizes (flat outside them)."""
    if b <= table[0][0]:
        return table[0][1]
    for (b0, t0), (b1, t1) in zip(table, table[1:]):
        if b <= b1:
            return t0 + (t1 - t0) * (b - b0) / (b1 - b0)
    return table[-1][1]


class ModelledRunner(ModelRunner):
    """Sleeps a modelled step time; the token at (sequence, position) is EOS with probability 1 / mean_out."""
    samples_on_device = True
    shares_kv_pages = True

    def __init__(self, model: str = "llama-3.2-1b", max_batch: int = 128, max_seq_len: int = 2048,
                 page_size: int = 16, num_pages: int | None = None, step_table=(), prefill_us: float = 10.0,
                 mean_out: float = 200.0, **_: object):
        self.config = load_config(model)
        self.table, self.prefill_s, self.mean_out = list(step_table), prefill_us / 1e6, mean_out
        self._spec = KVSpec(page_size, num_pages or max_batch * (-(-max_seq_len // page_size)) + 1, max_batch,
                            max_seq_len)
        self.device_s = 0.0
        self.device = ModelledDevice()

    def kv_spec(self) -> KVSpec:
        return self._spec

    def _token(self, seq: int, pos: int) -> int:
        h = int.from_bytes(hashlib.blake2b(f"{seq}:{pos}".encode(), digest_size=8).digest(), "little")
        return EOS if h % 1_000_003 < 1_000_003 / self.mean_out else 1 + h % 1000

    def step(self, chunks):
        prompt = sum(len(c.token_ids) for c in chunks if len(c.token_ids) > 1)
        s = _interp(self.table, len(chunks)) / 1e3 + prompt * self.prefill_s
        self.device_s += s
        self.device.run(s)
        toks = [self._token(c.seq_id, c.start_pos + len(c.token_ids)) for c in chunks]
        lg = None
        if any(c.wants_logits for c in chunks):
            lg = torch.zeros(len(chunks), self.config.vocab_size)
        return step_output(chunks, lg, toks)

    def decode_steps(self, chunks, num_steps: int, resume: bool = False):
        return self.launch_steps(chunks, num_steps, resume).wait()

    def launch_steps(self, chunks, num_steps: int, resume: bool = False):
        check_decode_steps(chunks, num_steps)
        s = num_steps * _interp(self.table, len(chunks)) / 1e3
        self.device_s += s
        return self.device.pending(s, torch.tensor([[self._token(c.seq_id, c.start_pos + 1 + j)
                                                     for j in range(num_steps)] for c in chunks]))


register_runner("modelled")(ModelledRunner)


def _prompts(a) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lo, hi = a.prompt_len
    vocab = min(1000, load_config(a.model).vocab_size)
    return [torch.randint(1, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(a.requests)]


def _llm(a, table, **kw) -> LLM:
    backend = a.backend
    if a.backend == "modelled":
        kw.update(step_table=table, prefill_us=a.prefill_us, mean_out=a.mean_out)
    else:
        backend = "length-oracle"
        kw.update(inner=a.backend, targets=a.targets,
                  **({} if a.plan is None else {"inner_plan": None if a.plan == "none" else a.plan}))
    asy = {"auto": None, "on": True, "off": False}[a.async_bursts]
    return LLM(a.model, backend=backend, max_batch=a.max_batch, max_seq_len=a.max_seq_len, page_size=a.page_size,
               decode_steps=a.decode_steps, max_num_batched_tokens=a.max_num_batched_tokens,
               **({} if asy is None or a.decode_steps < 2 else {"async_bursts": asy}), **kw)


class LengthOracle(ModelRunner):
    """A real runner (inner) whose drawn token at a request's target position is replaced by EOS: the request ends
    there, whatever the model drew. Requests are told apart by their prompt's first tokens (seen when a chunk starts
    at position 0, a readmission's too); targets: {prompt head: position of the last generated token}."""

    def __init__(self, **kw):
        self.targets = kw.pop("targets")
        inner = kw.pop("inner")
        # (the executor resolves plan="auto" and the default plan for known backends only: here, for the inner one)
        from mpk_runtime.runtime.executor import plan_once
        kw = plan_once(inner, 1, {**kw, **({"plan": kw.pop("inner_plan")} if "inner_plan" in kw else {})})
        self.inner = make_runner(inner, **kw)
        self.config, self.samples_on_device = self.inner.config, self.inner.samples_on_device
        self.samples_full_on_device = self.inner.samples_full_on_device
        self.shares_kv_pages = self.inner.shares_kv_pages
        self.stop_at: dict[int, int] = {}
        self._head: dict[int, list[int]] = {}

    def kv_spec(self):
        return self.inner.kv_spec()

    def _see(self, chunks) -> None:
        """A request's first HEAD prompt tokens, gathered over its first chunks (a step's token budget can split a
        prompt's start into chunks shorter than HEAD), name its target."""
        for c in chunks:
            if c.start_pos == 0:
                self._head[c.seq_id] = []
            head = self._head.get(c.seq_id)
            if head is not None and c.start_pos == len(head):
                head += list(c.token_ids[:HEAD - len(head)])
                if len(head) == HEAD:
                    self.stop_at[c.seq_id] = self.targets[tuple(head)]
                    del self._head[c.seq_id]

    def step(self, chunks):
        self._see(chunks)
        out = self.inner.step(chunks)
        toks = getattr(out, "tokens", None)
        if toks is not None:
            for i, c in enumerate(chunks):
                if c.start_pos + len(c.token_ids) == self.stop_at.get(c.seq_id):
                    toks[i] = EOS
        return out

    def decode_steps(self, chunks, num_steps: int, resume: bool = False):
        return self.launch_steps(chunks, num_steps, resume).wait()

    def launch_steps(self, chunks, num_steps: int, resume: bool = False):
        p = self.inner.launch_steps(chunks, num_steps, resume)

        def wait():
            out = p.wait().clone()
            for i, c in enumerate(chunks):
                j = self.stop_at.get(c.seq_id, -1) - (c.start_pos + 1)
                if 0 <= j < num_steps:
                    out[i, j] = EOS
            return out
        return Pending(wait)

    def free(self, seq_id: int) -> None:
        fn = getattr(self.inner, "free", None)
        if fn is not None:
            fn(seq_id)

    def shutdown(self) -> None:
        self.inner.shutdown()


HEAD = 12   # prompt tokens that tell requests apart (random prompts of >= 12 tokens)
register_runner("length-oracle")(LengthOracle)


def oracle_targets(a, prompts) -> dict:
    g = torch.Generator().manual_seed(1)   # exponential lengths of mean mean_out, capped
    lens = [min(a.max_tokens, 1 + int(-torch.log(torch.rand((), generator=g)).item() * a.mean_out)) for _ in prompts]
    t = {tuple(p[:HEAD]): len(p) + n - 1 for p, n in zip(prompts, lens)}
    if len(t) != len(prompts):
        raise SystemExit("two prompts share their first tokens: use longer prompts (--prompt-len)")
    return t


def run(a, table, mode: str, kv_seqs: int, caching: bool, prompts, params) -> dict:
    pages_per_seq = -(-a.max_seq_len // a.page_size)
    num_pages = kv_seqs * pages_per_seq
    with _llm(a, table, num_pages=num_pages, kv_allocation=mode, enable_prefix_caching=caching) as llm:
        llm.generate(prompts[:4], params[:4], use_tqdm=False)   # warm: graphs, plans
        llm.reset_prefix_cache()
        st0 = dict(llm.engine.stats)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        st = {k: v - st0[k] if isinstance(v, (int, float)) and k in st0 else v for k, v in llm.engine.stats.items()}
        st["max_batch_size_seen"] = llm.engine.stats["max_batch_size_seen"]
        dev = getattr(llm.executor.workers[0].runner, "device_s", None) if a.backend == "modelled" else None
    ntok = sum(len(o.token_ids) for o in outs)
    ttft = sorted(o.metrics.time_to_first_token for o in outs)
    return {"mode": mode, "prefix_caching": caching, "kv_seqs": kv_seqs, "num_pages": num_pages, "wall_s": wall,
            "modelled_device_s": dev, "tokens": ntok, "tokens_per_s": ntok / wall,
            "mean_rows": st["sequences_scheduled"] / max(st["steps"], 1), "max_rows": st["max_batch_size_seen"],
            "engine_steps": st["steps"], "preemptions": st["preemptions"],
            "recomputed_tokens": st["recomputed_tokens"], "prompt_tokens": st["prompt_tokens"],
            "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": ttft[int(0.99 * (len(ttft) - 1))],
            "outputs": [o.token_ids for o in outs]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b",
                    help="modelled backend: its config only (the vocabulary); others: the preset's seeded weights")
    ap.add_argument("--backend", default="modelled", help="modelled (no model: step times slept) | megakernel | torch "
                                                          "| pyvm")
    ap.add_argument("--plan", default=None, choices=["none", "auto"],
                    help="the inner backend's plan (default: its default, runtime/executor.default_plan)")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--prompt-len", default="128,512", help="uniform in [lo, hi]")
    ap.add_argument("--max-tokens", type=int, default=1536)
    ap.add_argument("--mean-out", type=float, default=200.0, help="mean answer length (geometric)")
    ap.add_argument("--max-batch", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-seqs", default="16,32", help="KV cache sizes, in full-length sequences (comma-separated)")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--step-ms", default="1:1.073,8:1.253,32:1.432,128:2.081",
                    help="measured decode step ms by rows, 'B:ms,...' (default: llama-3.2-1b, one H200, session 45)")
    ap.add_argument("--prefill-us", type=float, default=10.0, help="modelled cost of a prompt token (us)")
    ap.add_argument("--modes", default="reserve,lazy")
    ap.add_argument("--async-bursts", default="auto", choices=["auto", "on", "off"],
                    help="LLM(async_bursts=...): auto = the default (pipelined bursts); off = synchronous bursts")
    ap.add_argument("--prefix-caching", action="store_true", help="also run lazy with prefix caching")
    a = ap.parse_args(argv)
    a.prompt_len = [int(x) for x in a.prompt_len.split(",")]
    table = sorted((int(b), float(t)) for b, t in (x.split(":") for x in a.step_ms.split(",")))
    prompts = _prompts(a)
    params = [SamplingParams(temperature=0, max_tokens=a.max_tokens, stop_token_ids=[EOS])] * len(prompts)
    if a.backend != "modelled":
        a.targets = oracle_targets(a, prompts)
    rows = []
    for kv in [int(x) for x in a.kv_seqs.split(",")]:
        runs = [(m, False) for m in a.modes.split(",")] + ([("lazy", True)] if a.prefix_caching else [])
        base = None
        for mode, caching in runs:
            r = run(a, table, mode, kv, caching, prompts, params)
            outs = r.pop("outputs")
            if base is None:
                base = (r, outs)
            elif outs != base[1]:
                diff = sum(x != y for x, y in zip(outs, base[1]))
                if a.backend == "modelled":
                    raise SystemExit(f"{mode} gave other outputs than {base[0]['mode']}: an engine bug")
                # a real model: bf16 results depend on the batch (plan bucket) and on K/V recomputed by a prefill
                print(f"({diff} of {len(outs)} outputs differ from {base[0]['mode']}'s: bf16 numerics by batch)")
                r["outputs_differing"] = diff
            r["tokens_per_s_vs_first"] = r["tokens_per_s"] / base[0]["tokens_per_s"]
            rows.append(r)
            print(f"kv {kv:3d} seqs ({r['num_pages']} pages) {mode:7s}{' +cache' if caching else '':7s} "
                  f"wall {r['wall_s']:6.2f} s  {r['tokens_per_s']:8.0f} tok/s (x{r['tokens_per_s_vs_first']:.2f})  "
                  f"rows mean {r['mean_rows']:5.1f} max {r['max_rows']:3d}  steps {r['engine_steps']:5d}  "
                  f"preempt {r['preemptions']:4d} recomputed {r['recomputed_tokens']:6d}  "
                  f"TTFT p50 {r['ttft_p50_s']:.2f} s p99 {r['ttft_p99_s']:.2f} s", flush=True)
    note = ("modelled runner (sleeps a step time interpolated from measured GPU steps): the engine's policy, not a "
            "GPU measurement") if a.backend == "modelled" else f"backend {a.backend}, lengths set by LengthOracle"
    args = {k: v for k, v in vars(a).items() if k != "targets"}
    write_result("bench_kv_pressure.json", {"args": args, "step_table_ms": table, "rows": rows, "note": note})
    return 0


if __name__ == "__main__":
    sys.exit(main())
