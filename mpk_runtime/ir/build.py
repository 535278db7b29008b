"""Build the Graph of one step for one TP rank from a ModelConfig.

Op sequence per layer (the fused units the megakernel runs; TP>1 adds the all-reduces):
    qkv_rope   RMSNorm + Q/K/V projections (+ Qwen2 biases) + (Qwen3) q/k-norm + RoPE + KV append -> q
    attention  causal GQA attention over the paged cache, split-KV partials + merge          -> attn
    linear     o_proj (+ residual when tp == 1; else pushes partial sums to every rank)      -> h | h_part
    allreduce  (tp > 1) sum of the ranks' partials + residual                               -> h
    linear     RMSNorm + gate/up projections + SiLU(gate) * up                               -> act
    linear     down_proj (+ residual | push partials)  [+ allreduce]                         -> x
then: linear (final RMSNorm + LM head, vocab-parallel) -> logits, argmax (distributed) -> next token.
"""
from __future__ import annotations

import numbers

from ..envflags import env_flag, env_removed

from ..models.config import ModelConfig
from ..models.weights import lm_head_name
from .graph import DTYPE_BYTES, Graph, Op, TensorSpec
from .sampling import SAMPLE_CANDIDATES, TENSORS as SAMPLE_TENSORS
from .shard import shard_for


def build_graph(cfg: ModelConfig, *, mode: str = "decode", batch: int = 1, tokens_per_seq: int | None = None,
                context_len: int = 512, max_seq_len: int | None = None, tp: int = 1, rank: int = 0,
                dtype: str | None = None, attn_splits: int = 1, tp_invariant: int = 1,
                allreduce_ll: bool | None = None) -> Graph:
    """tp_invariant: R = the TP degree whose reduction order every degree dividing it reproduces. Row-parallel
    projections (o_proj, down) then sum K in R/tp segments, each reduced like one rank of a TP=R group, combined
    in fp32 in rank order, so TP=1 and TP=R give bit-identical activations (default 1: one segment).
    allreduce_ll (tp > 1; default $MPK_AR_LL, "1" = on): the all-reduce's partials travel as (fp32, step flag)
    pairs, one 8-byte word each, and the reduce tiles poll the flags instead of waiting on the producers' events
    (tasks/ops/allreduce.py); same sums, bit for bit."""
    env_removed("MPK_MLP_FUSE", "the down projection inside the gate_up tiles: a batch-1 MLP block "
                "(scripts/bench_mlp.py) fused +1.66 / +3.97 us a layer, with the in-place down share it ran +5.0 / "
                "+18.1, at llama-3.2-1b / qwen3-8b against two phases; removed in session 38", allowed=("0",))
    if mode not in ("decode", "prefill"):
        raise ValueError(f"mode must be 'decode' or 'prefill', got {mode!r}")
    T = 1 if mode == "decode" else (tokens_per_seq or context_len)
    if mode == "decode" and tokens_per_seq not in (None, 1):
        raise ValueError("decode graphs have tokens_per_seq == 1")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if context_len < 0:
        raise ValueError(f"context_len must be >= 0 (the keys already in each sequence), got {context_len}")
    check_tp_invariant(cfg, tp, tp_invariant)
    kseg = tp_invariant // tp if tp_invariant > 1 else 1
    if allreduce_ll is None:
        allreduce_ll = env_flag("MPK_AR_LL")
    ll = bool(allreduce_ll) and tp > 1
    max_seq_len = max_seq_len or max(context_len + T, 1)
    if context_len + (T if mode == "prefill" else 1) > max_seq_len:
        raise ValueError(f"context_len {context_len} (+ new tokens) exceeds max_seq_len {max_seq_len}")
    dt = dtype or cfg.dtype
    eb = DTYPE_BYTES[dt]
    sh = shard_for(cfg, tp, rank)
    H, D, I = cfg.hidden_size, cfg.head_dim, sh.n_inter
    nq, nkv, V = sh.n_q, sh.n_kv, sh.n_vocab
    B, M = batch, batch * T
    tensors: dict[str, TensorSpec] = {}
    ops: list[Op] = []

    def t(name, shape, kind, dtype_=dt, **attrs) -> str:
        tensors[name] = TensorSpec(name, tuple(int(s) for s in shape), dtype_, kind, attrs)
        return name

    def w(name, shape) -> str:
        return t(name, shape, "weight")

    def add(name, kind, inputs, outputs, attrs, nbytes, flops):
        ops.append(Op(name, kind, list(inputs), list(outputs), attrs, int(nbytes), int(flops)))

    tok = t("tokens", (M,), "io", "int64")
    emb = w("model.embed_tokens.weight", (cfg.vocab_size, H))
    x = t("x.embed", (M, H), "act")
    add("embed", "embed", [tok, emb], [x], {"tokens": tok, "table": emb, "out": x},
        M * H * eb * 2 + M * 8, 0)

    # KV positions read per sequence for cost estimates: decode reads context_len + 1 keys; prefill of a chunk
    # starting at context_len reads on average context_len + T/2.
    kv_read = context_len + (1 if mode == "decode" else T / 2)
    splits = attn_splits
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        ln1 = w(p + "input_layernorm.weight", (H,))
        wq, wk, wv = w(p + "self_attn.q_proj.weight", (nq * D, H)), w(p + "self_attn.k_proj.weight", (nkv * D, H)), \
            w(p + "self_attn.v_proj.weight", (nkv * D, H))
        bq, bk, bv = (w(p + "self_attn.q_proj.bias", (nq * D,)), w(p + "self_attn.k_proj.bias", (nkv * D,)),
                      w(p + "self_attn.v_proj.bias", (nkv * D,))) if cfg.qkv_bias else (None, None, None)
        qn = w(p + "self_attn.q_norm.weight", (D,)) if cfg.qk_norm else None
        kn = w(p + "self_attn.k_norm.weight", (D,)) if cfg.qk_norm else None
        kc = t(f"L{i}.k_cache", (B, nkv, max_seq_len, D), "kv", layer=i)
        vc = t(f"L{i}.v_cache", (B, nkv, max_seq_len, D), "kv", layer=i)
        q = t(f"L{i}.q", (M, nq * D), "act")
        n_qkv = (nq + 2 * nkv) * D
        # Qwen3: the q and k heads' projections before their per-head RMSNorm (bf16, q heads then k heads), so
        # a normed head's rows can stream on several SMs and one finishing task normalises the whole head
        # (tasks/ops/qkv_rope.py); whole-op (conventional) execution never touches it
        raw = t(f"L{i}.qk_raw", (M, (nq + nkv) * D), "act") if cfg.qk_norm else None
        # decode: the step's k and v rows (k heads, then v heads), where a conventional qkv_rope leaves them for
        # the attention megakernel to append (ir/defer.py, MPK_KV_DEFER); unused otherwise
        kvn = t(f"L{i}.kv_new", (M, 2 * nkv * D), "act") if mode == "decode" else None
        add(f"L{i}.qkv_rope", "qkv_rope", [x, ln1, wq, wk, wv] + [n for n in (bq, bk, bv, qn, kn) if n],
            [q, kc, vc] + [raw] * bool(raw),
            {"layer": i, "x": x, "norm": ln1, "wq": wq, "wk": wk, "wv": wv, "bq": bq, "bk": bk, "bv": bv,
             "q_norm": qn, "k_norm": kn,
             "q": q, "k_cache": kc, "v_cache": vc, "eps": cfg.rms_norm_eps, "n_q": nq, "n_kv": nkv,
             "q_head0": sh.q_heads[0], "kv_head0": sh.kv_heads[0], "qk_raw": raw, "kv_new": kvn},
            n_qkv * H * eb + M * H * eb + M * n_qkv * eb, 2 * M * n_qkv * H)

        attn = t(f"L{i}.attn", (M, nq * D), "act")
        part = t(f"L{i}.attn_part", (M, nq, splits, D), "act", dtype_="float32")
        lse = t(f"L{i}.attn_lse", (M, nq, splits), "act", dtype_="float32")
        add(f"L{i}.attention", "attention", [q, kc, vc], [part, lse, attn],
            {"layer": i, "q": q, "k_cache": kc, "v_cache": vc, "part": part, "lse": lse, "out": attn,
             "n_q": nq, "n_kv": nkv, "splits": splits, "scale": cfg.attn_scale, "kv_new": kvn},
            B * kv_read * nkv * D * eb * 2 + 2 * M * nq * D * eb, 4 * M * nq * D * kv_read)

        x = _proj(t, w, add, cfg, tp, f"L{i}.o_proj", x_in=attn, residual=x, wnames=[p + "self_attn.o_proj.weight"],
                  K=nq * D, N=H, M=M, eb=eb, prenorm=None, kseg=kseg, ll=ll)
        ln2 = w(p + "post_attention_layernorm.weight", (H,))
        wg, wu = w(p + "mlp.gate_proj.weight", (I, H)), w(p + "mlp.up_proj.weight", (I, H))
        act = t(f"L{i}.act", (M, I), "act")
        add(f"L{i}.gate_up", "linear", [x, ln2, wg, wu], [act],
            {"x": x, "weights": [wg, wu], "norm": ln2, "eps": cfg.rms_norm_eps, "epilogue": "silu_mul",
             "residual": None, "out": act, "push": False, "row_select": None},
            2 * I * H * eb + M * H * eb + M * I * eb, 2 * M * 2 * I * H)
        x = _proj(t, w, add, cfg, tp, f"L{i}.down", x_in=act, residual=x, wnames=[p + "mlp.down_proj.weight"],
                  K=I, N=H, M=M, eb=eb, prenorm=None, kseg=kseg, ll=ll)

    # Final norm + LM head on the last token of each sequence (decode: every row).
    lnf = w("model.norm.weight", (H,))
    head = lm_head_name(cfg)
    if head not in tensors:  # tied: the replicated embedding table; the LM head reads this rank's vocab rows
        w(head, (V, H))
    logits = t("logits", (B, V), "io", "float32", vocab0=sh.vocab[0])
    row_sel = None if T == 1 else {"offset": T - 1, "stride": T}
    add("lm_head", "linear", [x, lnf, head], [logits],
        {"x": x, "weights": [head], "norm": lnf, "eps": cfg.rms_norm_eps, "epilogue": "none", "residual": None,
         "out": logits, "push": False, "row_select": row_sel,
         "weight_row0": sh.vocab[0] if cfg.tie_word_embeddings else 0},
        V * H * eb + B * H * eb + B * V * 4, 2 * B * V * H)
    # argmax = the sampler (ir/sampling.py): per-row params in io tensors the runner fills (zeros = greedy);
    # each rank's vocabulary is cut into S equal slices, and the top-C candidates (value, index) of slice s go into
    # slot rank * S + s of every rank's buffer (several SMs share the scan of a rank's logits)
    # S is the same on every rank (slot rank * S + s is addressed in every rank's buffer): the smallest rank's choice,
    # which divides every rank's vocabulary too (powers of two), also when the vocabulary splits unevenly
    S = min(argmax_slices(shard_for(cfg, tp, r).n_vocab) for r in range(tp))
    amax = t("argmax.part", (tp * S, B, SAMPLE_CANDIDATES, 2), "sym", "float32")
    nxt = t("next_tokens", (B,), "io", "int64")
    sp = [t(n, (B,), "io", "int64" if n in ("sample.top_k", "sample.seed") else "float32") for n in SAMPLE_TENSORS]
    add("argmax", "argmax", [logits, *sp], [amax, nxt],
        {"logits": logits, "part": amax, "out": nxt, "vocab0": sh.vocab[0], "world": tp, "slices": S,
         "feeds_next_step": mode == "decode", "temperature": sp[0], "top_k": sp[1], "top_p": sp[2],
         "seed": sp[3]},
        B * V * 4 + B * 8, B * V)
    return Graph(cfg, mode, B, T, context_len, max_seq_len, tp, rank, tensors, ops, tp_invariant)


def tp_invariant_problems(cfg: ModelConfig, tp: int, tp_invariant: int) -> list[str]:
    """Why `tp_invariant` cannot run `cfg` at `tp` (build_graph's argument), as sentences; [] when it can. Each
    row-parallel projection's K (a rank's q heads x head_dim for o_proj, its intermediate_size / tp for down) is
    reduced in tp_invariant / tp equal segments of whole 16-byte vectors (8 bf16 values; the device code's loads)."""
    if isinstance(tp_invariant, bool) or not isinstance(tp_invariant, numbers.Integral) or tp_invariant < 1 \
            or (tp_invariant > 1 and tp_invariant % tp):
        return [f"it must be 1 (off) or a multiple of tp={tp} (the TP degree whose reduction order every rank "
                "reproduces)"]
    kseg = tp_invariant // tp if tp_invariant > 1 else 1
    sh = shard_for(cfg, tp, 0)
    ks = ((f"o_proj's K (num_heads / tp x head_dim = {sh.n_q} x {cfg.head_dim})", sh.n_q * cfg.head_dim),
          (f"down's K (intermediate_size / tp = {cfg.intermediate_size} / {tp})", sh.n_inter))
    out = [f"{what} = {K} does not split into tp_invariant / tp = {kseg} segments of whole 16-byte vectors "
           f"(multiples of 8 values)" for what, K in ks if kseg > 1 and K % (8 * kseg)]
    if out:
        ok = [tp * k for k in range(2, 65) if all(K % (8 * k) == 0 for _, K in ks)]
        out.append(f"tp_invariant values that split both at tp={tp}: {', '.join(map(str, [1] + ok[:6]))}")
    return out


def check_tp_invariant(cfg: ModelConfig, tp: int, tp_invariant: int) -> None:
    """A ValueError naming what does not split when tp_invariant_problems finds anything (the CPU runners call it
    when they are made, so a bad tp_invariant is refused up front instead of failing every request's step)."""
    probs = tp_invariant_problems(cfg, tp, tp_invariant)
    if probs:
        raise ValueError(f"tp_invariant={tp_invariant!r} cannot run {cfg.name!r} at tp={tp}: " + "; ".join(probs))


def argmax_slices(v_local: int, most: int = 16, least_len: int = 4096) -> int:
    """Vocabulary slices per rank for the sampler: the largest power of two <= `most` that divides the rank's
    vocabulary into slices of >= `least_len` logits (1 for small vocabularies)."""
    s = most
    while s > 1 and (v_local % s or v_local // s < least_len):
        s //= 2
    return s


def _proj(t, w, add, cfg, tp, name, *, x_in, residual, wnames, K, N, M, eb, prenorm, kseg=1, ll=False):
    """A row-parallel projection back to the hidden size: fused residual at tp == 1, else push + allreduce.
    kseg: K is reduced in kseg equal segments (see build_graph's tp_invariant). ll: the partials as (fp32, flag)
    pairs in int64 words (see build_graph's allreduce_ll)."""
    if kseg > 1 and K % (8 * kseg):
        raise ValueError(f"{name}: K={K} does not split into {kseg} segments of whole 16-byte vectors; "
                         "use a tp_invariant that divides it")
    for wn in wnames:
        w(wn, (N, K))
    if tp == 1:
        out = t(f"{name}.out", (M, N), "act")
        add(name, "linear", [x_in, *wnames, residual], [out],
            {"x": x_in, "weights": wnames, "norm": prenorm, "eps": cfg.rms_norm_eps, "epilogue": "none",
             "residual": residual, "out": out, "push": False, "row_select": None, "k_segments": kseg},
            N * K * eb + M * K * eb + 2 * M * N * eb, 2 * M * N * K)
        return out
    pb = 8 if ll else 4
    part = t(f"{name}.part", (tp, M, N), "sym", "int64" if ll else "float32")
    add(name, "linear", [x_in, *wnames], [part],
        {"x": x_in, "weights": wnames, "norm": prenorm, "eps": cfg.rms_norm_eps, "epilogue": "none",
         "residual": None, "out": part, "push": True, "row_select": None, "k_segments": kseg, "ll": ll},
        N * K * eb + M * K * eb + tp * M * N * pb, 2 * M * N * K)
    out = t(f"{name}.out", (M, N), "act")
    add(f"{name}.allreduce", "allreduce", [part, residual], [out],
        {"part": part, "residual": residual, "out": out, "world": tp, "ll": ll},
        tp * M * N * pb + 2 * M * N * eb, tp * M * N)
    return out
