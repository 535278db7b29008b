"""The peers of scripts/bench_decode.py (and scripts/validate_planner.py): a gpt-fast-style torch.compile decoder
(tp=1, or Megatron-sharded with NCCL all-reduces at tp>1) and HF transformers + StaticCache + torch.compile.
Each returns a row dict (ms per step, median; compile time); the caller runs them side by side with the
megakernel in one process/run.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------- gpt-fast-style peer
class NcclComm:
    """The peer's collectives: torch.distributed._functional_collectives (traceable by torch.compile, NCCL)."""

    def __init__(self, tp: int):
        self.group = list(range(tp))

    def all_reduce(self, x):
        import torch.distributed._functional_collectives as funcol
        return funcol.all_reduce(x, "sum", self.group)

    def all_gather(self, x):   # along dim 0, rank order
        import torch.distributed._functional_collectives as funcol
        return funcol.all_gather_tensor(x, 0, self.group)


class GptFast(torch.nn.Module):
    """peer_baseline_tp.py's decoder with a batch dimension (all sequences at the same position).

    tp > 1: rank `rank`'s shard, gpt-fast `apply_tp` style with the project's split (ir.shard.shard_for: q heads,
    KV heads (replicated when fewer than ranks), MLP width, vocabulary): column-parallel fused q/k/v and gate/up,
    row-parallel o_proj and down followed by comm.all_reduce, a vocab-parallel LM head whose per-rank
    (max logit, index) pairs are comm.all_gather'ed and reduced (ties -> lowest index, as torch.argmax). The
    weights are the full seeded tensors generated in the same order for every tp (one layer at a time on
    `device`) and sliced, so every tp computes the same function."""

    def __init__(self, cfg, B, max_ctx, *, tp=1, rank=0, comm=None, device="cuda", dtype=torch.bfloat16,
                 seed=1234):
        super().__init__()
        from mpk_runtime.ir.shard import shard_for
        D, L, H, KV, hd, I, V = (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                 cfg.intermediate_size, cfg.vocab_size)
        sh = shard_for(cfg, tp, rank)
        if tp > 1 and comm is None:
            raise ValueError("tp > 1 needs a comm (all_reduce, all_gather)")
        self.tp, self.comm, self.vocab0 = tp, comm, sh.vocab[0]
        self.h, self.kv, self.hd, self.qk_norm, self.eps = sh.n_q, sh.n_kv, hd, cfg.qk_norm, cfg.rms_norm_eps
        g = torch.Generator(device=device).manual_seed(seed)
        r = lambda *s: (torch.randn(*s, device=device, generator=g) * 0.02).to(dtype)  # noqa: E731
        one = lambda n: torch.ones(n, device=device, dtype=dtype)  # noqa: E731
        (q0, q1), (k0, k1), (i0, i1), (v0, v1) = sh.q_heads, sh.kv_heads, sh.inter, sh.vocab
        self.emb = r(V, D)                                  # replicated: gathered, B rows per step
        lm = self.emb if cfg.tie_word_embeddings else r(V, D)
        self.lm = lm[v0:v1]                                 # vocab-parallel LM head (a view when tp == 1)
        self.norm = one(D)
        self.layers = []
        for _ in range(L):
            kc = torch.randn(B, KV, max_ctx, hd, device=device, generator=g).to(dtype)
            vc = torch.randn(B, KV, max_ctx, hd, device=device, generator=g).to(dtype)
            wqkv, wo, w13, w2 = r((H + 2 * KV) * hd, D), r(D, H * hd), r(2 * I, D), r(D, I)
            if tp > 1:
                wq, wk, wv = wqkv.split([H * hd, KV * hd, KV * hd])
                wqkv = torch.cat([wq[q0 * hd:q1 * hd], wk[k0 * hd:k1 * hd], wv[k0 * hd:k1 * hd]])
                wo = wo[:, q0 * hd:q1 * hd].contiguous()
                w13 = torch.cat([w13[i0:i1], w13[I + i0:I + i1]])
                w2 = w2[:, i0:i1].contiguous()
                kc, vc = kc[:, k0:k1].contiguous(), vc[:, k0:k1].contiguous()
            bqkv = None
            if cfg.qkv_bias:   # (Qwen2) the projections' biases, sliced as the weights' rows
                bqkv = r((H + 2 * KV) * hd)
                if tp > 1:
                    bq, bk, bv = bqkv.split([H * hd, KV * hd, KV * hd])
                    bqkv = torch.cat([bq[q0 * hd:q1 * hd], bk[k0 * hd:k1 * hd], bv[k0 * hd:k1 * hd]])
            self.layers.append(dict(wqkv=wqkv, bqkv=bqkv, wo=wo, w13=w13, w2=w2, n1=one(D), n2=one(D), qn=one(hd),
                                    kn=one(hd), kc=kc, vc=vc))
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
        f = torch.outer(torch.arange(max_ctx, device=device).float(), inv)
        self.cos, self.sin = f.cos(), f.sin()

    def weight_bytes(self) -> int:
        """Weights streamed per step by this rank (the gathered embedding table excluded)."""
        keys = ("wqkv", "bqkv", "wo", "w13", "w2", "n1", "n2") + (("qn", "kn") if self.qk_norm else ())
        n = sum(lyr[k].numel() * lyr[k].element_size() for lyr in self.layers for k in keys if lyr[k] is not None)
        return n + (self.norm.numel() + self.lm.numel()) * self.lm.element_size()

    def rope(self, x, pos):
        c, s = self.cos[pos].view(1, 1, 1, -1), self.sin[pos].view(1, 1, 1, -1)
        x1, x2 = x[..., ::2].float(), x[..., 1::2].float()
        return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2).to(x.dtype)

    def _ar(self, x):
        return x if self.tp == 1 else self.comm.all_reduce(x)

    def logits(self, tok, pos, mask):
        """(B, 1, this rank's vocabulary slice) logits; updates the KV caches at `pos`."""
        B = tok.shape[0]
        x = self.emb[tok]                                  # (B, 1, D)
        for lyr in self.layers:
            h = F.rms_norm(x, (x.shape[-1],), lyr["n1"], self.eps)
            q, k, v = F.linear(h, lyr["wqkv"], lyr["bqkv"]).split([self.h * self.hd, self.kv * self.hd, self.kv * self.hd], -1)
            q, k = q.view(B, 1, self.h, self.hd), k.view(B, 1, self.kv, self.hd)
            if self.qk_norm:
                q, k = F.rms_norm(q, (self.hd,), lyr["qn"], self.eps), F.rms_norm(k, (self.hd,), lyr["kn"], self.eps)
            q, k = self.rope(q, pos).transpose(1, 2), self.rope(k, pos).transpose(1, 2)
            v = v.view(B, 1, self.kv, self.hd).transpose(1, 2)
            lyr["kc"].index_copy_(2, pos, k)
            lyr["vc"].index_copy_(2, pos, v)
            o = F.scaled_dot_product_attention(q, lyr["kc"], lyr["vc"], attn_mask=mask, enable_gqa=True)
            x = x + self._ar(F.linear(o.transpose(1, 2).reshape(B, 1, -1), lyr["wo"]))
            h = F.rms_norm(x, (x.shape[-1],), lyr["n2"], self.eps)
            gte, up = F.linear(h, lyr["w13"]).chunk(2, -1)
            x = x + self._ar(F.linear(F.silu(gte) * up, lyr["w2"]))
        x = F.rms_norm(x, (x.shape[-1],), self.norm, self.eps)
        return F.linear(x, self.lm)

    def forward(self, tok, pos, mask):
        lg = self.logits(tok, pos, mask)                   # (B, 1, V / tp)
        if self.tp == 1:
            return lg.argmax(-1)
        i = lg.argmax(-1, keepdim=True)                    # (B, 1, 1)
        pair = torch.cat([lg.gather(-1, i).float(), (i + self.vocab0).float()], -1)   # exact: V < 2^24
        allp = self.comm.all_gather(pair).view(self.tp, *pair.shape)                  # (tp, B, 1, 2)
        best = allp[..., 0].argmax(0, keepdim=True)        # first max -> lowest rank -> lowest index
        return allp[..., 1].gather(0, best).squeeze(0).long()


# The peers' decode positions cycle over ctx .. ctx + AHEAD - 1 and their static caches hold ctx + AHEAD keys: their
# attention reads every key of the cache (a mask, not a length), so a cache sized for all their warm-up, timed and
# queued steps (ctx + 94 for gpt-fast, ctx + 46 for HF) read up to 94 keys a row more than this runtime's cells (ctx
# .. ctx + 8: 8 steps a launch from ctx): +8% bytes a step at llama-3.2-1b B=128 ctx 512.
AHEAD = 8


def _warm_count(step_s: float, tp: int) -> int:
    """Untimed steps after the compile's: ~WARM_S of them at tp == 1, as the megakernel and the planned cells get (a
    clock-ramped GPU, not one idle through the compile); at tp > 1 none (every rank must run as many steps)."""
    from _bench_common import WARM_S
    return 0 if tp > 1 else max(2, min(1000, int(WARM_S / max(step_s, 1e-5))))


def bench_gptfast(cfg, B, ctx, steps=40, warm=6, tp=1, rank=0, comm=None):
    max_ctx = ctx + AHEAD
    t = time.time()
    m = GptFast(cfg, B, max_ctx, tp=tp, rank=rank, comm=comm)
    wbytes = m.weight_bytes()
    step = torch.compile(m.forward, mode="reduce-overhead", fullgraph=True)
    tok = torch.zeros(B, 1, dtype=torch.long, device="cuda")
    ar = torch.arange(max_ctx, device="cuda")
    ts = []
    with torch.no_grad():
        i, extra = 0, None
        while i < warm + (extra or 0) + steps:
            p = ctx + i % AHEAD
            pos = torch.tensor([p], device="cuda")
            mask = (ar <= p).view(1, 1, 1, max_ctx)
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            torch.compiler.cudagraph_mark_step_begin()
            e0.record(); tok = step(tok, pos, mask).clone(); e1.record()
            e1.synchronize()
            if i == warm - 1:
                compile_s = time.time() - t
                extra = _warm_count(e0.elapsed_time(e1) / 1e3, tp)
            if extra is not None and i >= warm + extra:
                ts.append(e0.elapsed_time(e1))
            i += 1
        # the same steps queued back to back (inputs made on the GPU, no host sync in the loop)
        pos_all = torch.arange(max_ctx, device="cuda")
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        for i in range(steps):
            pos = pos_all[ctx + i % AHEAD:ctx + i % AHEAD + 1].clone()
            mask = (ar <= pos).view(1, 1, 1, max_ctx)
            torch.compiler.cudagraph_mark_step_begin()
            tok = step(tok, pos, mask).clone()
        e1.record(); e1.synchronize()
        pipelined = e0.elapsed_time(e1) / steps
    ts.sort()
    del m, step
    return dict(system="gptfast" if tp == 1 else f"gptfast_tp{tp}", ms=ts[len(ts) // 2], ms_min=ts[0],
                ms_pipelined=pipelined, compile_s=round(compile_s, 1), weight_bytes_rank=wbytes,
                cache_keys=max_ctx, warm_steps=warm + extra,
                timing=f"each step timed alone (CUDA events, synchronised), median of {steps}; ms_pipelined: "
                       f"{steps} steps queued back to back / {steps}; positions ctx .. ctx + {AHEAD - 1} over a "
                       f"cache of ctx + {AHEAD} keys; {warm + extra} untimed steps first")


# ------------------------------------------------------------------------------------------------ HF peer
def hf_prefill(m, cache, ids, max_tokens=65536):
    """Fill an HF StaticCache with the prompt `ids` (B, ctx); returns the last position's logits (B, 1, vocab).
    Only the last position's logits are computed: all of them (B x ctx x vocab) ran out of memory at llama B=128
    ctx 4096 (134 GB in bf16; session 14 / 16 tables). The prompt goes in chunks of at most `max_tokens` tokens over
    the batch: whole, qwen3-8b B=128 ctx 4096's MLP activations (12 GiB a tensor) ran out of memory beside its 77 GB
    static cache (session 25). The caller times only the decode steps after it."""
    B, ctx = ids.shape
    chunk = max(1, min(ctx, max_tokens // B))
    for c0 in range(0, ctx, chunk):
        c1 = min(ctx, c0 + chunk)
        out = m(input_ids=ids[:, c0:c1], past_key_values=cache, cache_position=torch.arange(c0, c1, device=ids.device),
                use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1:]
        del out
    return logits


def hf_model(cfg, max_positions: int, device="cuda", dtype=torch.bfloat16):
    """An HF transformers model of cfg's shape (random weights: the peers are timed, not compared) and its config."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
    common = dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
                  tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=max_positions,
                  rope_theta=cfg.rope_theta)
    hcfg = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[cfg.family](**common)
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(hcfg, torch_dtype=dtype)
    return m.eval(), hcfg


def hf_seek(cache, pos: int) -> None:
    """Set an HF StaticCache's write position to `pos` before a decode step. transformers >= 5 (StaticLayer) writes a
    step's keys at its own running count (`cumulative_length`, a static-address tensor the compiled graph reads), not at
    the `cache_position` passed, so the peer's positions cycling over ctx .. ctx + AHEAD - 1 ran past the cache of
    ctx + AHEAD keys after AHEAD steps (session 70: a device-side assert at the first HF cell). Older versions take
    cache_position and have no count: nothing to do. A device-side fill, outside the timed events."""
    for layer in getattr(cache, "layers", None) or ():
        n = getattr(layer, "cumulative_length", None)
        if isinstance(n, torch.Tensor):
            n.fill_(pos)


def hf_decode_step(fwd, cache, tok, pos: int):
    """One HF decode step at position `pos` (B, 1 token ids in, B, 1 argmax ids out) on the StaticCache."""
    hf_seek(cache, pos)
    cp = torch.tensor([pos], device=tok.device)
    return fwd(input_ids=tok, past_key_values=cache, cache_position=cp, use_cache=True).logits[:, -1:]


class _HostEvent:
    """A CUDA event's record / synchronize / elapsed_time (ms) on the host clock: the peers' timing loops on the CPU
    (tests with tiny models); on a GPU they use CUDA events."""

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


def _events(device: str):
    return (torch.cuda.Event(True), torch.cuda.Event(True)) if torch.device(device).type == "cuda" else \
        (_HostEvent(), _HostEvent())


def bench_hf(cfg, B, ctx, steps=32, warm=6, device="cuda", compile_kw=None):
    """ms per HF decode step: each step timed alone (ms, median) and the same steps queued back to back
    (ms_pipelined), as bench_gptfast. Before, HF had only the first, so its ratio against ours (8 steps a
    launch, or graph replays back to back) counted HF's per-step host work and ours not: the handicap session 69
    removed for gpt-fast. compile_kw: torch.compile's arguments (the tests: backend="eager" on the CPU)."""
    from transformers import StaticCache
    t = time.time()
    m, hcfg = hf_model(cfg, ctx + AHEAD, device=device)
    cache = StaticCache(config=hcfg, max_batch_size=B, max_cache_len=ctx + AHEAD, device=device,
                        dtype=torch.bfloat16)
    fwd = torch.compile(m.forward, **(compile_kw or dict(mode="reduce-overhead", fullgraph=True)))
    ts = []
    with torch.no_grad():
        ids = torch.randint(0, cfg.vocab_size, (B, ctx), device=device)
        tok = hf_prefill(m, cache, ids).argmax(-1)
        i, extra = 0, None
        while i < warm + (extra or 0) + steps:
            # the position's host-to-device copy (a stream sync) and the cache's seek before e0, as gpt-fast's pos:
            # not the step's time
            p = ctx + i % AHEAD
            hf_seek(cache, p)
            cp = torch.tensor([p], device=device)
            e0, e1 = _events(device)
            torch.compiler.cudagraph_mark_step_begin()
            e0.record()
            o = fwd(input_ids=tok, past_key_values=cache, cache_position=cp, use_cache=True)
            tok = o.logits[:, -1:].argmax(-1)
            e1.record(); e1.synchronize()
            if i == warm - 1:
                compile_s = time.time() - t
                extra = _warm_count(e0.elapsed_time(e1) / 1e3, 1)
            if extra is not None and i >= warm + extra:
                ts.append(e0.elapsed_time(e1))
            i += 1
        # the same steps queued back to back: positions sliced from a device tensor and the seek a device-side fill,
        # no host sync in the loop (as gpt-fast's)
        pos_all = torch.arange(ctx + AHEAD, device=device)
        e0, e1 = _events(device)
        e0.record()
        for i in range(steps):
            p = ctx + i % AHEAD
            hf_seek(cache, p)
            cp = pos_all[p:p + 1].clone()
            torch.compiler.cudagraph_mark_step_begin()
            o = fwd(input_ids=tok, past_key_values=cache, cache_position=cp, use_cache=True)
            tok = o.logits[:, -1:].argmax(-1)
        e1.record(); e1.synchronize()
        pipelined = e0.elapsed_time(e1) / steps
    ts.sort()
    del m, cache, fwd
    return dict(system="hf", ms=ts[len(ts) // 2], ms_min=ts[0], ms_pipelined=pipelined, compile_s=round(compile_s, 1),
                cache_keys=ctx + AHEAD, warm_steps=warm + extra,
                timing=f"each step timed alone (CUDA events, synchronised), median of {steps}; ms_pipelined: "
                       f"{steps} steps queued back to back / {steps}; positions ctx .. ctx + {AHEAD - 1} over a "
                       f"cache of ctx + {AHEAD} keys; {warm + extra} untimed steps first")
