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

    OUT=bench/results/s52 python scripts/bench_kv_pressure.py --requests 512 --kv-seqs 16,32
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
from mpk_runtime.runtime.base import KVSpec, ModelRunner, check_decode_steps, register_runner  # noqa: E402
from mpk_runtime.runtime.device_sampling import step_output  # noqa: E402

from _bench_common import write_result  # noqa: E402

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

    def kv_spec(self) -> KVSpec:
        return self._spec

    def _token(self, seq: int, pos: int) -> int:
        h = int.from_bytes(hashlib.blake2b(f"{seq}:{pos}".encode(), digest_size=8).digest(), "little")
        return EOS if h % 1_000_003 < 1_000_003 / self.mean_out else 1 + h % 1000

    def _sleep(self, s: float) -> None:
        self.device_s += s
        time.sleep(s)

    def step(self, chunks):
        prompt = sum(len(c.token_ids) for c in chunks if len(c.token_ids) > 1)
        self._sleep(_interp(self.table, len(chunks)) / 1e3 + prompt * self.prefill_s)
        toks = [self._token(c.seq_id, c.start_pos + len(c.token_ids)) for c in chunks]
        lg = None
        if any(c.wants_logits for c in chunks):
            lg = torch.zeros(len(chunks), self.config.vocab_size)
        return step_output(chunks, lg, toks)

    def decode_steps(self, chunks, num_steps: int, resume: bool = False):
        check_decode_steps(chunks, num_steps)
        if self.launched is not None:
            self.launched()
        self._sleep(num_steps * _interp(self.table, len(chunks)) / 1e3)
        return torch.tensor([[self._token(c.seq_id, c.start_pos + 1 + j) for j in range(num_steps)]
                             for c in chunks])


register_runner("modelled")(ModelledRunner)


def run(a, table, mode: str, kv_seqs: int, caching: bool) -> dict:
    pages_per_seq = -(-a.max_seq_len // a.page_size)
    num_pages = kv_seqs * pages_per_seq
    g = torch.Generator().manual_seed(0)
    lo, hi = a.prompt_len
    prompts = [torch.randint(1, 1000, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
               for _ in range(a.requests)]
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, stop_token_ids=[EOS])
    with LLM(a.model, backend="modelled", max_batch=a.max_batch, max_seq_len=a.max_seq_len, page_size=a.page_size,
             num_pages=num_pages, step_table=table, prefill_us=a.prefill_us, mean_out=a.mean_out,
             decode_steps=a.decode_steps, kv_allocation=mode, enable_prefix_caching=caching,
             max_num_batched_tokens=a.max_num_batched_tokens) as llm:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        st = dict(llm.engine.stats)
        dev = llm.executor.workers[0].runner.device_s
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
    ap.add_argument("--model", default="llama-3.2-1b", help="its config only (the vocabulary): no weights")
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
    ap.add_argument("--prefix-caching", action="store_true", help="also run lazy with prefix caching")
    a = ap.parse_args(argv)
    a.prompt_len = [int(x) for x in a.prompt_len.split(",")]
    table = sorted((int(b), float(t)) for b, t in (x.split(":") for x in a.step_ms.split(",")))
    rows = []
    for kv in [int(x) for x in a.kv_seqs.split(",")]:
        runs = [(m, False) for m in a.modes.split(",")] + ([("lazy", True)] if a.prefix_caching else [])
        base = None
        for mode, caching in runs:
            r = run(a, table, mode, kv, caching)
            outs = r.pop("outputs")
            if base is None:
                base = (r, outs)
            elif outs != base[1]:
                raise SystemExit(f"{mode} gave other outputs than {base[0]['mode']}: an engine bug")
            r["tokens_per_s_vs_first"] = r["tokens_per_s"] / base[0]["tokens_per_s"]
            rows.append(r)
            print(f"kv {kv:3d} seqs ({r['num_pages']} pages) {mode:7s}{' +cache' if caching else '':7s} "
                  f"wall {r['wall_s']:6.2f} s  {r['tokens_per_s']:8.0f} tok/s (x{r['tokens_per_s_vs_first']:.2f})  "
                  f"rows mean {r['mean_rows']:5.1f} max {r['max_rows']:3d}  steps {r['engine_steps']:5d}  "
                  f"preempt {r['preemptions']:4d} recomputed {r['recomputed_tokens']:6d}  "
                  f"TTFT p50 {r['ttft_p50_s']:.2f} s p99 {r['ttft_p99_s']:.2f} s", flush=True)
    write_result("bench_kv_pressure.json", {"args": vars(a), "step_table_ms": table, "rows": rows,
                                            "note": "modelled runner (sleeps a step time interpolated from measured "
                                                    "GPU steps): the engine's policy, not a GPU measurement"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
