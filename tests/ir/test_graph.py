import pytest

from mpk_runtime.ir import Graph, build_graph, shard_for
from mpk_runtime.models import ConfigError, ModelConfig


@pytest.mark.parametrize("name,tp", [("qwen3-8b", 1), ("qwen3-8b", 2), ("llama-3.2-1b", 4), ("tiny-llama", 8)])
def test_json_roundtrip_and_bytes(name, tp):
    cfg = ModelConfig.from_name(name)
    g = build_graph(cfg, batch=4, context_len=512, tp=tp, rank=tp - 1)
    g2 = Graph.from_json(g.to_json())
    assert g2.to_json() == g.to_json()
    # every tensor an op names exists; every activation has exactly one producer (SSA)
    producers = {}
    for op in g.ops:
        for t in op.inputs + op.outputs:
            assert t in g.tensors
        for t in op.outputs:
            if g.tensors[t].kind == "act":
                assert t not in producers
                producers[t] = op.name


def test_weight_bytes_per_rank_split_evenly():
    cfg = ModelConfig.from_name("qwen3-8b")
    one = build_graph(cfg, tp=1).weight_bytes()
    # 8.19 B params in bf16
    assert abs(one / 2 - cfg.num_params()) / cfg.num_params() < 1e-9
    two = [build_graph(cfg, tp=2, rank=r).weight_bytes() for r in range(2)]
    emb = cfg.vocab_size * cfg.hidden_size * 2
    norms = 2 * (cfg.hidden_size * (2 * cfg.num_layers + 1) + 2 * cfg.head_dim * cfg.num_layers)
    # sharded weights halve; the embedding table and norms are replicated
    assert two[0] == two[1] == (one - emb - norms) // 2 + emb + norms


def test_decode_flops_and_kv_bytes_scale():
    cfg = ModelConfig.from_name("llama-3.2-1b")
    a = build_graph(cfg, batch=1, context_len=512)
    b = build_graph(cfg, batch=8, context_len=512)
    c = build_graph(cfg, batch=1, context_len=4096)
    lin = lambda g: sum(o.flops for o in g.ops if o.kind in ("linear", "qkv_rope"))
    assert lin(b) == 8 * lin(a)
    attn = lambda g: sum(o.bytes for o in g.ops if o.kind == "attention")
    assert 7 < attn(c) / attn(a) < 9


def test_prefill_graph_and_errors():
    cfg = ModelConfig.from_name("tiny-qwen3")
    g = build_graph(cfg, mode="prefill", batch=2, tokens_per_seq=16, context_len=0)
    assert g.rows == 32 and g.tensors["logits"].shape == (2, cfg.vocab_size)
    with pytest.raises(ValueError, match="mode"):
        build_graph(cfg, mode="train")
    with pytest.raises(ConfigError, match="cannot be split 3 ways"):
        build_graph(cfg, tp=3)


def test_gqa_replication_when_fewer_kv_heads_than_ranks():
    cfg = ModelConfig.from_name("qwen3-8b")  # 8 KV heads
    shards = [shard_for(cfg, 16, r) for r in range(16)]
    for s in shards:
        assert s.n_kv == 1
        # each rank's q heads all belong to the KV head it keeps
        assert {h // cfg.group_size for h in range(*s.q_heads)} == {s.kv_heads[0]}


@pytest.mark.parametrize("vocab,tp", [(65537, 2), (32001, 2), (128259, 4)])
def test_argmax_slices_agree_across_ranks_with_an_uneven_vocabulary(vocab, tp):
    """Slot rank * S + s is written into every rank's argmax buffer, so S must be the same on every rank; with an
    uneven vocabulary (65537 -> 32769 / 32768 at tp=2) each rank's own choice differed (1 vs 8) and a TP step
    crashed ("The expanded size of the tensor (0) must match the existing size (8)")."""
    cfg = ModelConfig.from_name("tiny-llama").replace(vocab_size=vocab)
    gs = [build_graph(cfg, batch=2, tp=tp, rank=r) for r in range(tp)]
    ops = [[o for o in g.ops if o.kind == "argmax"][0] for g in gs]
    S = {o.attrs["slices"] for o in ops}
    assert len(S) == 1
    assert {g.tensors[o.attrs["part"]].shape for g, o in zip(gs, ops)} == {(tp * S.pop(), 2, 64, 2)}
    for g, o in zip(gs, ops):
        assert g.tensors[o.attrs["logits"]].shape[1] % o.attrs["slices"] == 0


def test_tp2_generates_the_reference_tokens_with_an_uneven_vocabulary(tmp_path):
    from mpk_runtime import LLM, SamplingParams
    from mpk_runtime.models import random_weights, save_weights
    cfg = ModelConfig.from_name("tiny-llama").replace(vocab_size=65537, dtype="float32")
    save_weights(str(tmp_path), cfg, random_weights(cfg, seed=0, dtype="float32"))
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(str(tmp_path), backend="reference", dtype="float32", max_seq_len=32) as ref:
        want = [o.token_ids for o in ref.generate([[1, 2, 3], [4, 5]], sp)]
    with LLM(str(tmp_path), backend="torch", tp=2, dtype="float32", max_seq_len=32) as llm:
        assert [o.token_ids for o in llm.generate([[1, 2, 3], [4, 5]], sp)] == want
