#!/usr/bin/env python3
"""The planner's plans in the GPU engine (issue 5 "run what it picks"; issue 3 prefill through the conventional
path), on one GPU, seeded bf16 weights:

  forced   per model and batch: B prompts of --prompt-len tokens prefilled through ConventionalPrefill, then
           --steps decode steps through PlannedDecoder (the book's plan for the batch's bucket, replayed as a CUDA
           graph; the steps cross the 256-key cap, so the bucket re-captures), teacher-forced on the pure-torch
           reference's tokens: worst relative logit error and argmax agreement of prefill and decode vs
           ReferenceModel (bf16 on the GPU). ok: error < 3e-2 (gpu_check_ref.py's bound for the megakernel).
  engine   LLM(model, backend="megakernel", max_batch=128, plan=book) vs plan=None (one megakernel over 128
           rows): generate() of 128 prompts x --max-tokens greedy tokens and of 1 prompt; wall time, tokens/s,
           ms per engine step (after a warm-up generate that captures the graphs), plans used, and whether the
           planned and unplanned runs produced the same tokens (near-tie flips are expected between plans).

    PYTHONPATH=. python3 scripts/gpu_check_plans.py [--models ...] [--books DIR with book_<model>.json]
Writes $OUT/gpu_check_plans.json. Exit status 1 when a forced check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from mpk_runtime.models import ReferenceModel, random_weights  # noqa: E402
from mpk_runtime.models.config import load_config  # noqa: E402

OUT = Path(os.environ.get("OUT") or "gpu_out")


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def book_for(name: str, books: str | None) -> dict:
    if books and (Path(books) / f"book_{name}.json").exists():
        return json.loads((Path(books) / f"book_{name}.json").read_text())
    from mpk_runtime.planner import plan_book
    return plan_book(load_config(name), 1, (1, 8, 32, 128), context=512)


def forced(name: str, book: dict, B: int, prompt_len: int, steps: int) -> dict:
    from mpk_runtime.runtime.conventional_prefill import ConventionalPrefill
    from mpk_runtime.runtime.megakernel_plans import PlannedDecoder
    from mpk_runtime.runtime.memory import KVStore
    cfg = load_config(name).replace(dtype="bfloat16")
    dev = torch.device("cuda")
    w = random_weights(cfg, seed=0, dtype="bfloat16", device="cuda")
    ps, max_seq = 16, 512
    pps = max_seq // ps
    kv = KVStore(cfg.num_layers, B * pps + 1, ps, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, device=dev,
                 poison=False)
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    dec = PlannedDecoder(cfg, w, kv, book, max_seq_len=max_seq, page_size=ps, num_sms=nsm, dtype="bfloat16",
                         device=dev, timeout_s=5.0)
    pre = ConventionalPrefill(cfg, w, kv, max_seq_len=max_seq, page_size=ps, dtype="bfloat16", device=dev)
    ref = ReferenceModel(cfg, w)
    tables = [list(range(1 + b * pps, 1 + (b + 1) * pps)) for b in range(B)]
    prompts = torch.randint(0, cfg.vocab_size, (B, prompt_len), generator=torch.Generator().manual_seed(1)).cuda()
    cache = ref.new_cache(B, max_seq)
    t0 = time.time()
    with torch.no_grad():
        lr = ref.forward(prompts, torch.zeros(B, dtype=torch.long, device="cuda"), cache)[:, -1].float()
        worst_pre, agree_pre = 0.0, 0
        for b in range(B):
            lg, tok = pre.run(prompts[b].tolist(), 0, tables[b])
            worst_pre = max(worst_pre, ((lg.cuda() - lr[b]).abs().max() / lr[b].abs().max()).item())
            agree_pre += int(tok == int(lr[b].argmax()))
        t_pre = time.time() - t0
        tok = lr.argmax(-1)
        worst, agree, far = 0.0, 0, 0
        for s in range(steps):
            p = prompt_len + s
            lm, nm = dec.decode(tok.tolist(), [p] * B, tables)
            lr = ref.forward(tok[:, None], torch.full((B,), p, device="cuda"), cache)[:, 0].float()
            worst = max(worst, ((lm.cuda() - lr).abs().max() / lr.abs().max()).item())
            agree += int((nm.cuda() == lr.argmax(-1)).sum())
            # a token that differs from the reference's must be a near tie there: its reference logit within twice
            # the logit tolerance below the top (a wrong token lands far below it)
            gap = lr.max(-1).values - lr.gather(1, nm.cuda().long()[:, None])[:, 0]
            far += int((gap > 2 * 3e-2 * lr.abs().max(-1).values).sum())
            tok = lr.argmax(-1)
    bk = dec._buckets[dec.bucket_of(B)]
    res = dict(model=name, batch=B, plan=bk.plan.name, segments=[s.kind for s in bk.plan.segments],
               prompt_len=prompt_len, steps=steps, captures=bk.captures, key_cap=bk.cap,
               prefill_max_rel_err=worst_pre, prefill_argmax_agree=f"{agree_pre}/{B}",
               decode_max_rel_err=worst, decode_argmax_agree=f"{agree}/{B * steps}", decode_far_tokens=far,
               prefill_s=round(t_pre, 2), ok=bool(worst_pre < 3e-2 and worst < 3e-2 and far == 0))
    del dec, pre, ref, w, kv, cache
    torch.cuda.empty_cache()
    return res


def engine(name: str, book: dict, max_tokens: int) -> dict:
    import random
    from mpk_runtime import LLM, SamplingParams
    from mpk_runtime.engine.step_stats import diff_stats
    vocab = load_config(name).vocab_size
    rng = random.Random(0)
    many = [[rng.randrange(vocab) for _ in range(rng.randint(16, 48))] for _ in range(128)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out: dict = {"model": name}
    toks = {}
    for tag, plan in (("planned", book), ("one_megakernel", None)):
        t0 = time.time()
        llm = LLM(name, backend="megakernel", max_batch=128, max_seq_len=512, dtype="bfloat16", seed=0, plan=plan)
        r = {"setup_s": round(time.time() - t0, 1)}
        try:
            llm.generate(many, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
            llm.generate([many[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
            for wl, prompts in (("b128", many), ("b1", [many[0]])):
                s0, st0 = llm.engine.stats["steps"], dict(llm.engine.stats)
                g0 = llm.executor.collective_rpc("health")[0].get("graphs", {})
                torch.cuda.synchronize()
                t0 = time.time()
                o = llm.generate(prompts, sp, use_tqdm=False)
                dt = time.time() - t0
                steps = llm.engine.stats["steps"] - s0
                g1 = llm.executor.collective_rpc("health")[0].get("graphs", {})
                st = diff_stats(llm.engine.stats, st0)
                n = sum(len(x.token_ids) for x in o)
                toks[(tag, wl)] = [list(x.token_ids) for x in o]
                ttft = sorted(x.metrics.time_to_first_token for x in o if x.metrics.time_to_first_token is not None)
                tpot = sorted(x.metrics.per_token_latency for x in o if x.metrics.per_token_latency is not None)
                r[wl] = dict(seconds=round(dt, 3), tokens=n, tokens_per_s=round(n / dt, 1), engine_steps=steps,
                             ms_per_step=round(1e3 * dt / max(steps, 1), 3),
                             ttft_p50_ms=round(1e3 * ttft[len(ttft) // 2], 2) if ttft else None,
                             per_token_ms_p50=round(1e3 * tpot[len(tpot) // 2], 3) if tpot else None,
                             # where the time went (engine step stats) and the graphs captured inside the timed run
                             prefill_steps=st.get("prefill_steps"), decode_steps=st.get("decode_steps"),
                             worker_prefill_s=round(st.get("t_exec_worker_prefill_s", 0.0), 3),
                             worker_decode_s=round(st.get("t_exec_worker_decode_s", 0.0), 3),
                             graphs_captured={k: round(g1[k] - g0.get(k, 0), 3) for k in g1})
            r["plans_used"] = llm.executor.collective_rpc("health")[0]["plans_used"]
        finally:
            llm.shutdown()
            torch.cuda.empty_cache()
        out[tag] = r
        log(name, tag, json.dumps(r))
    for wl in ("b128", "b1"):
        a, b = toks.get(("planned", wl)), toks.get(("one_megakernel", wl))
        if a and b:
            out[f"{wl}_same_tokens_rows"] = f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"
    if "b128" in out.get("planned", {}) and "b128" in out.get("one_megakernel", {}):
        out["b128_speedup_planned"] = round(out["one_megakernel"]["b128"]["seconds"] / out["planned"]["b128"]["seconds"], 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-8b")
    ap.add_argument("--batches", default="1,8,128")
    ap.add_argument("--prompt-len", type=int, default=250)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--books", default=None)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-forced", action="store_true", help="the engine comparison alone")
    a = ap.parse_args()
    import logging   # every decode capture with its variant and seconds (PlannedDecoder._ready's debug line)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("mpk_runtime.runtime.megakernel_plans").setLevel(logging.DEBUG)
    OUT.mkdir(parents=True, exist_ok=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": os.environ.get("GIT_COMMIT", "unknown"),
           "device": torch.cuda.get_device_name(0), "forced": [], "engine": [], "errors": []}

    def save():
        (OUT / "gpu_check_plans.json").write_text(json.dumps(res, indent=1))
    for name in a.models.split(","):
        book = book_for(name, a.books)
        res.setdefault("books", {})[name] = {k: v["name"] for k, v in book["buckets"].items()}
        for B in [] if a.skip_forced else [int(x) for x in a.batches.split(",")]:
            try:
                r = forced(name, book, B, a.prompt_len, a.steps)
                res["forced"].append(r)
                log(json.dumps(r))
            except Exception as e:  # noqa: BLE001 - keep checking the rest, report
                res["errors"].append({"model": name, "batch": B, "error": traceback.format_exc()[-1500:]})
                log("ERROR", name, B, e)
            save()
    if not a.skip_engine:
        for name in a.models.split(","):
            try:
                res["engine"].append(engine(name, book_for(name, a.books), a.max_tokens))
            except Exception as e:  # noqa: BLE001
                res["errors"].append({"model": name, "engine": True, "error": traceback.format_exc()[-1500:]})
                log("ERROR engine", name, e)
            save()
    save()
    print("\n==== gpu_check_plans ====")
    for r in res["forced"]:
        print(f"{r['model']:14s} B={r['batch']:4d} plan={r['plan']:13s} prefill err {r['prefill_max_rel_err']:.2e} "
              f"agree {r['prefill_argmax_agree']}  decode err {r['decode_max_rel_err']:.2e} agree "
              f"{r['decode_argmax_agree']} captures={r['captures']} cap={r['key_cap']} ok={r['ok']}")
    for e in res["engine"]:
        print(json.dumps(e))
    for e in res["errors"]:
        print("ERROR", json.dumps(e)[:800])
    return 0 if not res["errors"] and all(r["ok"] for r in res["forced"]) else 1


if __name__ == "__main__":
    sys.exit(main())
