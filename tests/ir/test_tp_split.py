"""TP degrees that do not split a model (ir/shard.py check_tp), and the graph's weights against the model's real
tensors for presets and for odd, non-preset shapes (6 heads on 3 KV heads of 96, an MLP width not a multiple of 128,
an odd vocabulary, tied embeddings), at tp=1 and per rank of every tp the model splits into."""
import math

import numpy as np
import pytest
import torch

from mpk_runtime.ir import build_graph, check_tp, shard_for, weight_slice
from mpk_runtime.ir.graph import DTYPE_BYTES
from mpk_runtime.ir.shard import valid_tps
from mpk_runtime.models import ConfigError, ModelConfig
from mpk_runtime.models.weights import weight_shapes


def _odd(family="llama", tie=False, inter=960, vocab=1001):
    return ModelConfig(name=f"odd-{family}", family=family, vocab_size=vocab, hidden_size=576,
                       intermediate_size=inter, num_layers=2, num_heads=6, num_kv_heads=3, head_dim=96,
                       tie_word_embeddings=tie)


@pytest.mark.parametrize("cfg,tp,names,valid", [
    (_odd(), 2, ["num_kv_heads=3 is not divisible by tp=2"], "1, 3, 6"),
    (_odd(), 4, ["num_heads=6 is not divisible by tp=4", "tp=4 is not a multiple of num_kv_heads=3"], "1, 3, 6"),
    (_odd(inter=1000), 3, ["intermediate_size=1000 is not divisible by tp=3"], "1"),
    (_odd(vocab=5), 6, ["vocab_size=5 split in blocks of 1 leaves rank 5 no LM head rows"], "1, 3"),
    (ModelConfig.from_name("llama-3.2-1b"), 3, ["num_heads=32", "num_kv_heads=8", "intermediate_size=8192"],
     "1, 2, 4, 8, 16, 32"),
])
def test_a_tp_that_does_not_split_the_model_names_why_and_the_valid_ones(cfg, tp, names, valid):
    """The refusal named what does not divide but not what would: "Choose a tp that divides the head counts and the
    MLP width" left the user to work out, e.g., that 6 heads on 3 KV heads with an MLP of 960 split 1, 3 or 6 ways."""
    with pytest.raises(ConfigError, match=f"cannot be split {tp} ways") as e:
        check_tp(cfg, tp)
    msg = str(e.value)
    for n in names:
        assert n in msg
    assert msg.endswith(f"valid tp for this model: {valid}.")
    assert valid_tps(cfg) == [int(v) for v in valid.split(", ")]
    for t in valid_tps(cfg):
        check_tp(cfg, t)


@pytest.mark.parametrize("tp", [2.0, "2", True, 0, -2, None])
def test_a_tp_that_is_not_a_positive_integer_is_refused(tp):
    """tp=2.0 passed check_tp (2.0 divides the heads) and gave shards with float head ranges: build_graph then died
    in range() and weight slicing in torch ("slice indices must be integers"), far from the cause; a tp that did
    not divide read "cannot be split 2.0 ways". (0 and -2 were refused before too, worded "tp must be >= 1".)"""
    cfg = ModelConfig.from_name("tiny-llama")
    with pytest.raises(ConfigError, match=f"tp must be an integer >= 1, got {tp!r}"):
        check_tp(cfg, tp)
    check_tp(cfg, np.int64(2))     # an integer of another type is one


def _real_bytes(cfg, tp, rank):
    """Bytes of the model's tensors (models/weights.weight_shapes) that rank `rank` holds (weight_slice)."""
    sh = shard_for(cfg, tp, rank)
    n = 0
    for name, shape in weight_shapes(cfg).items():
        sl = weight_slice(cfg, sh, name, shape)
        n += math.prod(torch.empty(shape, device="meta")[sl].shape if sl is not None else shape)
    return n * DTYPE_BYTES[cfg.dtype]


CONFIGS = [ModelConfig.from_name(n).replace(num_layers=2) for n in
           ("llama-3.2-1b", "qwen3-8b", "tiny-qwen2", "tiny-llama")] + \
          [_odd(f, tie) for f in ("llama", "qwen2", "qwen3") for tie in (False, True)] + \
          [_odd("qwen3", inter=1000), _odd("qwen2", vocab=65537)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.name}-tie{int(c.tie_word_embeddings)}-I{c.intermediate_size}")
def test_graph_weights_are_the_models_tensors_on_every_rank(cfg):
    """Each weight of the graph is a model tensor with the shape rank r holds, and the graph's weight bytes are the
    model's (tp=1) or the rank's share (every valid tp, every rank: replicated norms / embeddings / KV heads in
    full on each), also for shapes no preset has."""
    names = set(weight_shapes(cfg))
    assert build_graph(cfg).weight_bytes() == _real_bytes(cfg, 1, 0) == cfg.num_params() * DTYPE_BYTES[cfg.dtype]
    for tp in valid_tps(cfg):
        if tp > 8:
            break
        for r in range(tp):
            g = build_graph(cfg, batch=3, context_len=40, tp=tp, rank=r)
            sh = shard_for(cfg, tp, r)
            ws = {n: t for n, t in g.tensors.items() if t.kind == "weight"}
            assert set(ws) == names, (tp, r, set(ws) ^ names)
            for n, t in ws.items():
                sl = weight_slice(cfg, sh, n, weight_shapes(cfg)[n])
                want = tuple(torch.empty(weight_shapes(cfg)[n], device="meta")[sl].shape) if sl is not None \
                    else weight_shapes(cfg)[n]
                assert t.shape == want, (tp, r, n)
            assert g.weight_bytes() == _real_bytes(cfg, tp, r), (tp, r)


@pytest.mark.parametrize("cfg", [_odd("qwen3"), _odd("llama", tie=True)], ids=lambda c: c.name)
def test_odd_shapes_split_their_work_across_ranks(cfg):
    """6 q heads on 3 KV heads of 96, MLP 960 (not a multiple of 128), vocabulary 1001 (uneven): at tp=3 the ranks'
    linear flops and streamed weight bytes add up to tp=1's, and at tp=6 (KV heads replicated two ranks each) only
    the k / v projections are counted twice."""
    one = build_graph(cfg, batch=2, context_len=64)

    def per_kind(g, what):
        out = {}
        for o in g.ops:
            key = o.name.split(".", 1)[-1] if o.name.startswith("L") else o.name
            out[key] = out.get(key, 0) + getattr(o, what)
        return out

    B, H, D = 2, cfg.hidden_size, cfg.head_dim
    for tp in (3, 6):
        ranks = [build_graph(cfg, batch=2, context_len=64, tp=tp, rank=r) for r in range(tp)]
        f1, ft = per_kind(one, "flops"), [per_kind(g, "flops") for g in ranks]
        for k in ("o_proj", "gate_up", "down", "lm_head", "attention"):
            assert sum(f[k] for f in ft) == f1[k], (tp, k)
        extra_kv = (tp // cfg.num_kv_heads - 1) * cfg.num_kv_heads if tp > cfg.num_kv_heads else 0
        assert sum(f["qkv_rope"] for f in ft) == f1["qkv_rope"] + cfg.num_layers * 2 * B * 2 * extra_kv * D * H
        assert sum(g.tensors["logits"].shape[1] for g in ranks) == cfg.vocab_size
        for r, g in enumerate(ranks):
            assert g.op("L0.gate_up").bytes >= 2 * (cfg.intermediate_size // tp) * H * 2
            assert g.tensors["L0.act"].shape == (B, cfg.intermediate_size // tp)
            assert g.op("L0.attention").attrs["n_q"] == cfg.num_heads // tp
