#!/usr/bin/env python3
"""Issue 3's decode benchmark, one GPU, one run: this runtime's megakernel vs two peers vs the weight-streaming
floor, on seeded random bf16 weights (model shapes llama-3.2-1b and qwen3-8b).

  megakernel   one persistent launch runs N decode steps; ms/token = (CUDA-event time of the launch) / N,
               each launch synchronised before the next (no back-to-back pipelining); median over launches.
  gptfast      gpt-fast-style decoder (plain torch, static KV cache, torch.compile(mode="reduce-overhead"));
               adapted from the project's ../shared/gpu/peer_baseline_tp.py (tp=1) with a batch dimension.
  hf           HF transformers + StaticCache + torch.compile(mode="reduce-overhead")
               (as ../shared/gpu/peer_baseline_hf.py).
  Peers: every step timed on its own with CUDA events (record, step, record), median over steps.
  floor        bytes of weights streamed per step / 4.55 TB/s (measured read-only streaming on one H200);
               an untied embedding table is gathered, not streamed, so it is left out.
Context c: the KV cache holds c random (megakernel) or prefilled (peers) positions; decode at positions >= c.

    GIT_COMMIT=$(git rev-parse HEAD) PYTHONPATH=. python3 scripts/bench_decode.py [--budget-s 300]
Writes $OUT/bench_decode.json (or ./gpu_out). Work runs in priority order; what does not fit in the time
budget is reported as skipped, never silently dropped.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HBM = 4.55e12
OUT = Path(os.environ.get("OUT") or "gpu_out")
OUT.mkdir(parents=True, exist_ok=True)
T0 = time.time()
ROWS: list[dict] = []


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def floor_ms(cfg) -> tuple[float, int]:
    from mpk_runtime.models.weights import weight_shapes
    n = 0
    for name, shape in weight_shapes(cfg).items():
        k = 1
        for s in shape:
            k *= s
        if name.endswith("embed_tokens.weight") and not cfg.tie_word_embeddings:
            continue
        n += 2 * k
    return n / HBM * 1e3, n


def attn_splits(cfg, B: int, ctx: int, num_sms: int = 132) -> int:
    """Split the keys so that batch x KV groups x splits roughly fills the SMs, >= 64 keys per split."""
    return max(1, min(num_sms // max(1, B * cfg.num_kv_heads), -(-ctx // 64), 32))


# ------------------------------------------------------------------------------------------------ megakernel
def bench_megakernel(model, weights, B, ctx, nsteps=8, launches=12):
    from mpk_runtime.ir.build import build_graph
    from mpk_runtime.models.config import load_config
    from mpk_runtime.models.reference import rope_inv_freq
    from mpk_runtime.runtime.megakernel import Megakernel
    from mpk_runtime.runtime.memory import KVStore, RankMemory
    from mpk_runtime.tasks.build import build_task_graphs
    from mpk_runtime.tasks.tiling import Tiling
    cfg = load_config(model)
    ps = 16
    max_seq = ctx + nsteps + 16
    S = attn_splits(cfg, B, ctx)
    t = time.time()
    g = build_graph(cfg, mode="decode", batch=B, context_len=ctx, max_seq_len=max_seq, attn_splits=S, dtype="bfloat16")
    tg = build_task_graphs([g], Tiling(num_sms=torch.cuda.get_device_properties(0).multi_processor_count))[0]
    pps = -(-max_seq // ps)
    kv = KVStore(cfg.num_layers, B * pps + 1, ps, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, device="cuda",
                 poison=False)
    for c in kv.k + kv.v:
        c.normal_(0, 1.0)
    mem = RankMemory(g, weights, kv, device="cuda")
    tables = (torch.arange(B * pps) + 1).view(B, pps).to("cuda")
    pos = torch.full((B,), ctx, dtype=torch.int64, device="cuda")
    mk = Megakernel(tg, mem, page_size=ps, block_tables=tables, pos=pos, inv_freq=rope_inv_freq(cfg),
                    head_dim=cfg.head_dim, timeout_s=5.0)
    mem.t("tokens").copy_(torch.randint(0, cfg.vocab_size, (B,)))
    setup = time.time() - t
    for _ in range(2):
        pos.fill_(ctx); mk.launch(nsteps)
    torch.cuda.synchronize(); mk.check()
    ts = []
    for _ in range(launches):
        pos.fill_(ctx)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); mk.launch(nsteps); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) / nsteps)
    mk.check()
    ts.sort()
    r = dict(system="megakernel", ms=ts[len(ts) // 2], ms_min=ts[0], timing=f"{nsteps} steps per launch / {nsteps}, "
             f"median of {launches} synchronised launches", attn_splits=S, tasks=len(tg.tasks),
             setup_s=round(setup, 1), registers=mk.build.resources)
    del mk, mem, kv
    return r


# ---------------------------------------------------------------------------------------- gpt-fast-style peer
class GptFast(torch.nn.Module):
    """peer_baseline_tp.py's decoder at tp=1, with a batch dimension (all sequences at the same position)."""

    def __init__(self, cfg, B, max_ctx):
        super().__init__()
        D, L, H, KV, hd, I, V = (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                 cfg.intermediate_size, cfg.vocab_size)
        self.h, self.kv, self.hd, self.qk_norm = H, KV, hd, cfg.family == "qwen3"
        g = torch.Generator(device="cuda").manual_seed(1234)
        r = lambda *s: (torch.randn(*s, device="cuda", generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731
        one = lambda n: torch.ones(n, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        self.emb = r(V, D)
        self.lm = self.emb if cfg.tie_word_embeddings else r(V, D)
        self.norm = one(D)
        self.layers = []
        for _ in range(L):
            kc = torch.randn(B, KV, max_ctx, hd, device="cuda", generator=g).to(torch.bfloat16)
            self.layers.append(dict(wqkv=r((H + 2 * KV) * hd, D), wo=r(D, H * hd), w13=r(2 * I, D), w2=r(D, I),
                                    n1=one(D), n2=one(D), qn=one(hd), kn=one(hd), kc=kc, vc=torch.randn_like(kc)))
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device="cuda").float() / hd))
        f = torch.outer(torch.arange(max_ctx, device="cuda").float(), inv)
        self.cos, self.sin = f.cos(), f.sin()

    def rope(self, x, pos):
        c, s = self.cos[pos].view(1, 1, 1, -1), self.sin[pos].view(1, 1, 1, -1)
        x1, x2 = x[..., ::2].float(), x[..., 1::2].float()
        return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2).to(x.dtype)

    def forward(self, tok, pos, mask):
        B = tok.shape[0]
        x = self.emb[tok]                                  # (B, 1, D)
        for lyr in self.layers:
            h = F.rms_norm(x, (x.shape[-1],), lyr["n1"])
            q, k, v = F.linear(h, lyr["wqkv"]).split([self.h * self.hd, self.kv * self.hd, self.kv * self.hd], -1)
            q, k = q.view(B, 1, self.h, self.hd), k.view(B, 1, self.kv, self.hd)
            if self.qk_norm:
                q, k = F.rms_norm(q, (self.hd,), lyr["qn"]), F.rms_norm(k, (self.hd,), lyr["kn"])
            q, k = self.rope(q, pos).transpose(1, 2), self.rope(k, pos).transpose(1, 2)
            v = v.view(B, 1, self.kv, self.hd).transpose(1, 2)
            lyr["kc"].index_copy_(2, pos, k)
            lyr["vc"].index_copy_(2, pos, v)
            o = F.scaled_dot_product_attention(q, lyr["kc"], lyr["vc"], attn_mask=mask, enable_gqa=True)
            x = x + F.linear(o.transpose(1, 2).reshape(B, 1, -1), lyr["wo"])
            h = F.rms_norm(x, (x.shape[-1],), lyr["n2"])
            gte, up = F.linear(h, lyr["w13"]).chunk(2, -1)
            x = x + F.linear(F.silu(gte) * up, lyr["w2"])
        x = F.rms_norm(x, (x.shape[-1],), self.norm)
        return F.linear(x, self.lm).argmax(-1)


def bench_gptfast(cfg, B, ctx, steps=40, warm=6):
    max_ctx = ctx + steps + warm + 8
    t = time.time()
    m = GptFast(cfg, B, max_ctx)
    step = torch.compile(m.forward, mode="reduce-overhead", fullgraph=True)
    tok = torch.zeros(B, 1, dtype=torch.long, device="cuda")
    ar = torch.arange(max_ctx, device="cuda")
    ts = []
    with torch.no_grad():
        for i in range(steps + warm):
            p = ctx + i
            pos = torch.tensor([p], device="cuda")
            mask = (ar <= p).view(1, 1, 1, max_ctx)
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            torch.compiler.cudagraph_mark_step_begin()
            e0.record(); tok = step(tok, pos, mask).clone(); e1.record()
            e1.synchronize()
            if i == warm - 1:
                compile_s = time.time() - t
            if i >= warm:
                ts.append(e0.elapsed_time(e1))
    ts.sort()
    del m, step
    return dict(system="gptfast", ms=ts[len(ts) // 2], ms_min=ts[0], compile_s=round(compile_s, 1),
                timing=f"each step timed alone (CUDA events, synchronised), median of {steps}")


# ------------------------------------------------------------------------------------------------ HF peer
def bench_hf(cfg, B, ctx, steps=32, warm=6):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, StaticCache
    common = dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
                  tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=ctx + steps + warm + 8,
                  rope_theta=cfg.rope_theta)
    hcfg = (Qwen3Config if cfg.family == "qwen3" else LlamaConfig)(**common)
    t = time.time()
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(hcfg, torch_dtype=torch.bfloat16)
    m.eval()
    cache = StaticCache(config=hcfg, max_batch_size=B, max_cache_len=ctx + steps + warm + 8, device="cuda",
                        dtype=torch.bfloat16)
    fwd = torch.compile(m.forward, mode="reduce-overhead", fullgraph=True)
    ts = []
    with torch.no_grad():
        ids = torch.randint(0, cfg.vocab_size, (B, ctx), device="cuda")
        out = m(input_ids=ids, past_key_values=cache, cache_position=torch.arange(ctx, device="cuda"), use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        del out
        for i in range(steps + warm):
            p = ctx + i
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            torch.compiler.cudagraph_mark_step_begin()
            e0.record()
            o = fwd(input_ids=tok, past_key_values=cache, cache_position=torch.tensor([p], device="cuda"),
                    use_cache=True)
            tok = o.logits[:, -1:].argmax(-1)
            e1.record(); e1.synchronize()
            if i == warm - 1:
                compile_s = time.time() - t
            if i >= warm:
                ts.append(e0.elapsed_time(e1))
    ts.sort()
    del m, cache, fwd
    return dict(system="hf", ms=ts[len(ts) // 2], ms_min=ts[0], compile_s=round(compile_s, 1),
                timing=f"each step timed alone (CUDA events, synchronised), median of {steps}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-8b")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--budget-s", type=float, default=300.0, help="whole run; work beyond it is skipped")
    ap.add_argument("--peer-batches", default="1,8", help="batches for the gpt-fast peer")
    ap.add_argument("--hf-batches", default="1", help="batches for the HF peer")
    ap.add_argument("--mk-max-batch", type=int, default=128)
    args = ap.parse_args()
    from mpk_runtime.models.config import load_config
    from mpk_runtime.models.weights import random_weights
    torch.backends.cuda.matmul.allow_tf32 = True
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "16")
    models = args.models.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    ctxs = [int(c) for c in args.contexts.split(",")]
    share = args.budget_s / len(models)
    meta = dict(machine=f"{torch.cuda.get_device_name(0)} (GPU 0 of {torch.cuda.device_count()} visible), {platform.node()}", date=datetime.datetime.now().isoformat(),
                git_commit=os.environ.get("GIT_COMMIT", "unknown"), torch=torch.__version__, hbm_bytes_per_s=HBM,
                note="floor = streamed weight bytes / 4.55 TB/s; untied embedding excluded")
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass

    def save():
        (OUT / "bench_decode.json").write_text(json.dumps(dict(meta=meta, rows=ROWS), indent=1))

    for mi, model in enumerate(models):
        cfg = load_config(model)
        fl, nbytes = floor_ms(cfg)
        deadline = T0 + share * (mi + 1)
        # priority order inside one model's share: B=1 everywhere first, then peers, then larger batches
        work = [("megakernel", 1, c) for c in ctxs]
        work += [("gptfast", 1, ctxs[0]), ("hf", 1, ctxs[0])]
        work += [("megakernel", b, c) for b in batches if 1 < b <= args.mk_max_batch for c in ctxs]
        work += [("gptfast", 1, c) for c in ctxs[1:]]
        work += [("gptfast", b, c) for b in (int(x) for x in args.peer_batches.split(",")) if b > 1 for c in ctxs]
        work += [("hf", b, c) for b in (int(x) for x in args.hf_batches.split(",")) for c in ctxs
                 if (b, c) != (1, ctxs[0])]
        weights = None
        for system, B, ctx in work:
            key = dict(model=model, system=system, batch=B, context=ctx, floor_ms=fl, weight_bytes=nbytes)
            est = {"megakernel": 8, "gptfast": 45 if "8b" in model else 25, "hf": 90 if "8b" in model else 45}[system]
            if time.time() + est > deadline:
                ROWS.append(dict(key, status="skipped (time budget)")); save()
                log(f"skip {system} {model} B={B} ctx={ctx} (budget)")
                continue
            try:
                if system == "megakernel":
                    if weights is None:
                        weights = random_weights(cfg, seed=0, dtype="bfloat16", device="cuda")
                    r = bench_megakernel(model, weights, B, ctx, *((8, 12) if B <= 8 else (2, 4)))
                else:
                    if weights is not None:   # peers bring their own weights: free ours first
                        weights = None
                        gc.collect(); torch.cuda.empty_cache()
                    r = (bench_gptfast if system == "gptfast" else bench_hf)(cfg, B, ctx)
                r = dict(key, **r, status="ok", pct_of_floor=100 * fl / r["ms"])
                log(f"{system:10s} {model:13s} B={B:<3d} ctx={ctx:<5d} {r['ms']:.3f} ms/token "
                    f"({r['pct_of_floor']:.0f}% of floor {fl:.3f})")
            except Exception as e:  # noqa: BLE001
                r = dict(key, status=f"error: {type(e).__name__}: {e}"[:600])
                log(f"{system} {model} B={B} ctx={ctx} FAILED {type(e).__name__}: {e}")
                traceback.print_exc()
            ROWS.append(r); save()
            gc.collect(); torch.cuda.empty_cache()
        weights = None
        gc.collect(); torch.cuda.empty_cache()
        try:
            torch._dynamo.reset()
        except Exception:  # noqa: BLE001
            pass
    # ratios: peer / ours at the same (model, batch, context)
    ours = {(r["model"], r["batch"], r["context"]): r["ms"] for r in ROWS
            if r["system"] == "megakernel" and r.get("status") == "ok"}
    for r in ROWS:
        k = (r["model"], r["batch"], r["context"])
        if r.get("status") == "ok" and k in ours:
            r["ratio_vs_megakernel"] = r["ms"] / ours[k]   # > 1: the megakernel is faster
    save()
    print("\n==== bench_decode (ms/token, median) ====")
    print(f"{'model':13s} {'B':>3s} {'ctx':>5s} {'system':10s} {'ms':>8s} {'floor':>7s} {'%floor':>6s} {'peer/ours':>9s}")
    for r in ROWS:
        if r.get("status") != "ok":
            print(f"{r['model']:13s} {r['batch']:3d} {r['context']:5d} {r['system']:10s} {r['status'][:60]}")
            continue
        print(f"{r['model']:13s} {r['batch']:3d} {r['context']:5d} {r['system']:10s} {r['ms']:8.3f} {r['floor_ms']:7.3f} "
              f"{r['pct_of_floor']:6.0f} {r.get('ratio_vs_megakernel', float('nan')):9.2f}")
    print(f"wrote {OUT / 'bench_decode.json'}  total {time.time() - T0:.0f}s")


if __name__ == "__main__":
    main()
