#!/usr/bin/env python3
"""Long contexts on one GPU (issue 3: "context up to the model's max"): prompts of 8k to 128k tokens, on seeded bf16
weights.

  forced   per model and prompt length P: the prompt prefilled through ConventionalPrefill in chunks of --chunk
           tokens (the engine's default step budget), then --steps decode steps through PlannedDecoder (the plan book
           the engine makes; its key cap grows past P), teacher-forced on the pure-torch reference's tokens: relative
           logit error and argmax agreement of the prefill's last token and of every decode step vs ReferenceModel
           (bf16 on the GPU). Up to --ref-prefill-max tokens the reference prefills the prompt itself (in chunks of
           --ref-chunk: its attention is explicit fp32 scores); beyond that its cache is filled from our prefill's
           pages (the check is then the decode's, over 128k keys, against the reference's own attention).
  engine   LLM(model, backend="megakernel", plan="auto") generate() of each prompt alone, greedy: time to first token,
           ms per decode token, and how many of its tokens equal the reference's greedy tokens from `forced` (a
           near-tie flip is the only acceptable divergence). --book-at-ctx adds a run whose plan book was made at the
           prompt's context (plan="auto" plans at 512: attention splits for 512 keys).

    PYTHONPATH=. python3 scripts/gpu_check_long.py [--models llama-3.2-1b] [--lens 8192,32768,130944] [--steps 16]
Writes $OUT/gpu_check_long.json. Exit status 1 when a check fails.
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
TOL = 3e-2   # gpu_check_ref.py's bound for the megakernel's logits against the reference


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def prompt_of(cfg, P: int) -> list[int]:
    return torch.randint(0, cfg.vocab_size, (P,), generator=torch.Generator().manual_seed(1)).tolist()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def forced(name: str, P: int, steps: int, chunk: int, ref_chunk: int, ref_prefill_max: int, dev: str) -> dict:
    from mpk_runtime.runtime.conventional_prefill import ConventionalPrefill
    from mpk_runtime.runtime.megakernel_plans import PlannedDecoder
    from mpk_runtime.runtime.memory import KVStore
    from mpk_runtime.runtime.pyvm_runner import resolve_plan
    cfg = load_config(name).replace(dtype="bfloat16")
    dev = torch.device(dev)
    gpu = dev.type == "cuda"
    w = random_weights(cfg, seed=0, dtype="bfloat16", device=dev)
    ps, max_seq = 16, P + steps + 16
    pps = -(-max_seq // ps)
    book = resolve_plan("auto", cfg, 1, 1, max_seq)   # what LLM(plan="auto", max_batch=1) plans
    kv = KVStore(cfg.num_layers, pps + 1, ps, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, device=dev, poison=False)
    nsm = torch.cuda.get_device_properties(0).multi_processor_count if gpu else 8
    dec = PlannedDecoder(cfg, w, kv, book, max_seq_len=max_seq, page_size=ps, num_sms=nsm, dtype="bfloat16",
                         device=dev, timeout_s=10.0, backend="megakernel" if gpu else "pyvm")
    pre = ConventionalPrefill(cfg, w, kv, max_seq_len=max_seq, page_size=ps, dtype="bfloat16", device=dev)
    ref = ReferenceModel(cfg, w)
    table = list(range(1, pps + 1))   # (page 0 unused, as the engine's tables never name it first)
    prompt = prompt_of(cfg, P)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        sync()
        t0 = time.time()
        chunk_ms = []
        for c in range(0, P, chunk):
            t1 = time.time()
            lg, _ = pre.run(prompt[c:c + chunk], c, table)   # (returns the logits on the CPU: synchronised)
            chunk_ms.append(round(1e3 * (time.time() - t1), 1))
        sync()
        t_pre = time.time() - t0
        peak_pre = torch.cuda.max_memory_allocated() / 2 ** 30 if gpu else 0.0
        cache = ref.new_cache(1, max_seq)
        ref_pre = P <= ref_prefill_max
        t0 = time.time()
        if ref_pre:
            pt = torch.tensor(prompt, device=dev)[None]
            for c in range(0, P, ref_chunk):
                lr = ref.forward(pt[:, c:c + ref_chunk], torch.tensor([c], device=dev), cache)[:, -1].float()
            pre_err, pre_agree = rel(lg.to(dev), lr[0]), int(lg.argmax()) == int(lr[0].argmax())
        else:   # the reference's cache from our prefill's pages: (pages, ps, nkv, D) -> (1, nkv, P, D)
            for i in range(cfg.num_layers):
                for src, dst in ((kv.k[i], cache.k[i]), (kv.v[i], cache.v[i])):
                    dst[0, :, :P] = src[1:pps + 1].reshape(pps * ps, cfg.num_kv_heads, cfg.head_dim)[:P].transpose(0, 1)
            lr = lg.to(dev)[None]
            pre_err, pre_agree = None, None
        t_ref = time.time() - t0
        tok = lr.argmax(-1)          # (1,)
        ref_tokens = [int(tok)]
        worst, agree, far = 0.0, 0, 0
        dec_ms, differ = [], []
        for s in range(steps):
            p = P + s
            sync()
            t1 = time.time()
            lm, nm = dec.decode(tok.tolist(), [p], [table])
            sync()
            dec_ms.append(1e3 * (time.time() - t1))
            lr = ref.forward(tok[:, None], torch.tensor([p], device=dev), cache)[:, 0].float()
            worst = max(worst, rel(lm.to(dev), lr))
            agree += int((nm.to(dev) == lr.argmax(-1)).sum())
            if int(nm[0]) != int(lr[0].argmax()):
                differ.append(s + 1)   # the index of the generated token it would be
            gap = lr.max(-1).values - lr.gather(1, nm.to(dev).long()[:, None])[:, 0]
            far += int((gap > 2 * TOL * lr.abs().max(-1).values).sum())
            tok = lr.argmax(-1)
            ref_tokens.append(int(tok))
    bk = dec._buckets[dec.bucket_of(1)]
    res = dict(model=name, prompt_len=P, steps=steps, chunk=chunk, plan=bk.plan.name, plan_splits=bk.plan.attn_splits,
               attn_splits=bk.splits, prefill_chunk_ms=chunk_ms,
               key_cap=bk.cap, reference_prefill=ref_pre, prefill_s=round(t_pre, 2),
               prefill_peak_gib=round(peak_pre, 2),
               reference_s=round(t_ref, 1), prefill_rel_err=pre_err, prefill_argmax_agree=pre_agree,
               decode_max_rel_err=worst, decode_argmax_agree=f"{agree}/{steps}", decode_far_tokens=far,
               differ_at=([0] if pre_agree is False else []) + differ,
               decode_call_ms_median=round(sorted(dec_ms)[len(dec_ms) // 2], 3), ref_tokens=ref_tokens,
               ok=bool((pre_err is None or pre_err < TOL) and worst < TOL and far == 0))
    del dec, pre, ref, w, kv, cache
    if gpu:
        torch.cuda.empty_cache()
    return res


def engine(name: str, lens: list[int], max_tokens: int, ref_tokens: dict, book_at_ctx: bool, gpu: bool,
           prefill_ab: bool = False) -> list[dict]:
    from mpk_runtime import LLM, SamplingParams
    from mpk_runtime.planner import plan_book
    cfg = load_config(name)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    variants = [("auto", lambda P: "auto")]
    if prefill_ab:   # the prefill's graphs over the power-of-two key cap at every length (before session 55)
        variants.append(("prefill_graphs", lambda P: "auto"))
    if book_at_ctx:
        variants.append(("book_at_ctx", lambda P: plan_book(cfg.replace(dtype="bfloat16"), 1, (1,), context=P)))
    for P in lens:
        for tag, plan in variants:
            t0 = time.time()
            r = dict(model=name, prompt_len=P, variant=tag)
            llm = None
            env0 = os.environ.get("MPK_PREFILL_EXACT_KEYS")
            if tag == "prefill_graphs":   # (read when the runner's ConventionalPrefill is made)
                os.environ["MPK_PREFILL_EXACT_KEYS"] = "0"
            try:
                llm = LLM(name, backend="megakernel" if gpu else "pyvm", max_batch=1, dtype="bfloat16", seed=0,
                          max_seq_len=min(P + max_tokens + 16, cfg.max_position_embeddings), plan=plan(P),
                          enable_prefix_caching=False)   # (every run prefills)
                r["setup_s"] = round(time.time() - t0, 1)
                prompt = prompt_of(cfg, P)
                llm.generate([prompt[:64]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                             use_tqdm=False)   # warm-up: decode graphs of the short cap
                ttft_cold = None
                for rep in range(2):   # the second run: the long prefill's graphs and the long caps captured
                    t0 = time.time()
                    o = llm.generate([prompt], sp, use_tqdm=False)[0]
                    dt = time.time() - t0
                    ttft_cold = o.metrics.time_to_first_token if rep == 0 else ttft_cold
                m = o.metrics
                ref = ref_tokens.get((name, P))
                same = 0
                if ref:
                    for a, b in zip(o.token_ids, ref):
                        if a != b:
                            break
                        same += 1
                r.update(seconds=round(dt, 3), tokens=len(o.token_ids), ttft_s=round(m.time_to_first_token, 3),
                         ttft_first_run_s=round(ttft_cold, 3),
                         ms_per_decode_token=round(1e3 * m.per_token_latency, 3) if m.per_token_latency else None,
                         tokens_equal_reference_prefix=f"{same}/{min(len(o.token_ids), len(ref))}" if ref else None,
                         plans_used=llm.executor.collective_rpc("health")[0].get("plans_used"),
                         peak_gib=round(torch.cuda.max_memory_allocated() / 2 ** 30, 2) if gpu else None)
            except Exception:  # noqa: BLE001 - report, go on with the next length
                r["error"] = traceback.format_exc()[-1500:]
            finally:
                if env0 is None:
                    os.environ.pop("MPK_PREFILL_EXACT_KEYS", None)
                else:
                    os.environ["MPK_PREFILL_EXACT_KEYS"] = env0
                if llm is not None:
                    llm.shutdown()
                if gpu:
                    torch.cuda.empty_cache()
            rows.append(r)
            log(json.dumps(r))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.2-1b")
    ap.add_argument("--lens", default="8192,32768,130944", help="prompt lengths (forced and engine)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk (the engine's default step budget)")
    ap.add_argument("--ref-chunk", type=int, default=512)
    ap.add_argument("--ref-prefill-max", type=int, default=32768)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--book-at-ctx", action="store_true")
    ap.add_argument("--prefill-ab", action="store_true", help="engine runs with MPK_PREFILL_EXACT_KEYS=0 too")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--cpu", action="store_true",
                    help="a smoke run of this script on the CPU (pyvm decode; tiny models)")
    a = ap.parse_args()
    gpu = not a.cpu
    OUT.mkdir(parents=True, exist_ok=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": os.environ.get("GIT_COMMIT", "unknown"),
           "device": torch.cuda.get_device_name(0) if gpu else "cpu", "forced": [], "engine": [], "errors": []}

    def save():
        (OUT / "gpu_check_long.json").write_text(json.dumps(res, indent=1))
    lens = [int(x) for x in a.lens.split(",")]
    ref_tokens = {}
    for name in a.models.split(","):
        for P in lens:
            try:
                r = forced(name, P, a.steps, a.chunk, a.ref_chunk, a.ref_prefill_max, "cuda" if gpu else "cpu")
                ref_tokens[(name, P)] = r["ref_tokens"]
                res["forced"].append(r)
                log(json.dumps({k: v for k, v in r.items() if k != "ref_tokens"}))
            except Exception as e:  # noqa: BLE001 - keep checking the rest, report
                res["errors"].append({"model": name, "prompt_len": P, "error": traceback.format_exc()[-1500:]})
                log("ERROR", name, P, e)
                if gpu:
                    torch.cuda.empty_cache()
            save()
        if not a.skip_engine:
            try:
                res["engine"] += engine(name, lens, a.max_tokens, ref_tokens, a.book_at_ctx, gpu, a.prefill_ab)
            except Exception as e:  # noqa: BLE001
                res["errors"].append({"model": name, "engine": True, "error": traceback.format_exc()[-1500:]})
                log("ERROR engine", name, e)
            save()
    save()
    print("\n==== gpu_check_long ====")
    for r in res["forced"]:
        pe = "-" if r["prefill_rel_err"] is None else f"{r['prefill_rel_err']:.2e}"
        print(f"{r['model']:13s} P={r['prompt_len']:6d} plan={r['plan']} splits={r['attn_splits']} prefill "
              f"{r['prefill_s']} s peak {r['prefill_peak_gib']} GiB err {pe}  decode err {r['decode_max_rel_err']:.2e} "
              f"agree {r['decode_argmax_agree']} (differ at {r['differ_at']}) far {r['decode_far_tokens']} call "
              f"{r['decode_call_ms_median']} ms "
              f"ok={r['ok']}")
    for e in res["engine"]:
        print(json.dumps(e)[:600])
    for e in res["errors"]:
        print("ERROR", json.dumps(e)[:1200])
    bad = res["errors"] or any(e.get("error") for e in res["engine"]) or not all(r["ok"] for r in res["forced"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
