"""Qwen2 / Qwen2.5 checkpoints (model_type "qwen2": the Llama architecture with biases on the q, k and v
projections) against Hugging Face transformers' own Qwen2ForCausalLM on the same weights: logits, and the greedy
tokens of the engine on pyvm (tp 1 and 2) and torch; the config rules for biases. Skips without transformers."""
import json

import pytest
import torch

from mpk_runtime import LLM, SamplingParams
from mpk_runtime.ir.shard import shard_for, weight_slice
from mpk_runtime.models import ConfigError, ModelConfig, ReferenceModel, load_config, load_weights, random_weights
from mpk_runtime.models.weights import weight_shapes

transformers = pytest.importorskip("transformers")


def _qwen2_dir(tmp_path, tie=False):
    hf_cfg = transformers.Qwen2Config(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                                      rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tie,
                                      use_sliding_window=False)
    torch.manual_seed(4)
    hf = transformers.Qwen2ForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():   # transformers starts biases at zero: large ones here, so a dropped or misplaced bias shows
        for n, p in hf.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in n:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(str(tmp_path))
    return hf


def test_qwen2_logits_and_greedy_tokens_match_hf(tmp_path):
    hf = _qwen2_dir(tmp_path)
    cfg = load_config(str(tmp_path)).replace(dtype="float32")
    assert cfg.family == "qwen2" and cfg.qkv_bias and not cfg.qk_norm
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    w = load_weights(str(tmp_path), cfg)
    assert w["model.layers.1.self_attn.k_proj.bias"].abs().max() > 0.5
    ref = ReferenceModel(cfg, w)
    toks = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(toks).logits
    got = ref.forward(toks, torch.zeros(2, dtype=torch.long), ref.new_cache(2, 32))
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    # without the biases the model is another function: the comparison above sees them
    nob = ReferenceModel(cfg, {k: (v * 0 if k.endswith(".bias") else v) for k, v in w.items()})
    off = nob.forward(toks, torch.zeros(2, dtype=torch.long), nob.new_cache(2, 32))
    assert ((off - want).abs().max() / want.abs().max()).item() > 1e-2
    prompt = toks[0, :8]
    with torch.no_grad():
        hf_out = hf.generate(prompt[None], max_new_tokens=12, do_sample=False)[0, 8:].tolist()
    for backend, tp in (("pyvm", 1), ("pyvm", 2), ("torch", 1)):
        llm = LLM(str(tmp_path), backend=backend, dtype="float32", max_seq_len=64, tp=tp)
        out = llm.generate([prompt.tolist()], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert out[0].token_ids == hf_out, (backend, tp)


def test_tied_qwen2_preset_shapes_round_trip_through_hf(tmp_path):
    """A Qwen2.5 preset's config.json is transformers' Qwen2 config of the same shape (tied embeddings, GQA 7)."""
    cfg = ModelConfig.from_name("qwen2.5-0.5b")
    hc = cfg.to_hf_config()
    assert hc["architectures"] == ["Qwen2ForCausalLM"] and hc["model_type"] == "qwen2"
    assert ModelConfig.from_hf_config(json.loads(json.dumps(hc)), name=cfg.name) == cfg
    conf = transformers.Qwen2Config(**{k: v for k, v in hc.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        m = transformers.Qwen2ForCausalLM(conf)
    ours = weight_shapes(cfg)
    theirs = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert ours == theirs
    assert cfg.num_params() == sum(p.numel() for p in m.parameters())   # (~494M: Qwen2.5-0.5B's count)


def test_bias_rules_of_the_config():
    base = ModelConfig.from_name("tiny-llama").to_hf_config()
    with pytest.raises(ConfigError, match="attention_bias.*o_proj"):   # a Llama attention_bias biases o_proj too
        ModelConfig.from_hf_config(dict(base, attention_bias=True))
    with pytest.raises(ConfigError, match="mlp_bias"):
        ModelConfig.from_hf_config(dict(base, mlp_bias=True))
    q2 = ModelConfig.from_name("tiny-qwen2").to_hf_config()
    assert ModelConfig.from_hf_config(dict(q2, attention_bias=True)).qkv_bias   # Qwen2's own flag changes nothing
    with pytest.raises(ConfigError, match="mlp_bias"):
        ModelConfig.from_hf_config(dict(q2, mlp_bias=True))


def test_bias_rows_follow_their_heads_across_tp_ranks():
    cfg = ModelConfig.from_name("tiny-qwen2")
    w = random_weights(cfg, seed=2, dtype="float32")
    D = cfg.head_dim
    for name, heads in (("q_proj", "q_heads"), ("k_proj", "kv_heads"), ("v_proj", "kv_heads")):
        full_b, full_w = w[f"model.layers.0.self_attn.{name}.bias"], w[f"model.layers.0.self_attn.{name}.weight"]
        parts = []
        for r in range(2):
            sh = shard_for(cfg, 2, r)
            b = full_b[weight_slice(cfg, sh, f"model.layers.0.self_attn.{name}.bias", tuple(full_b.shape))]
            rows = full_w[weight_slice(cfg, sh, f"model.layers.0.self_attn.{name}.weight", tuple(full_w.shape))]
            h0, h1 = getattr(sh, heads)
            assert b.shape == (rows.shape[0],) == ((h1 - h0) * D,)
            parts.append(b)
        assert torch.equal(torch.cat(parts), full_b)


def test_a_missing_bias_file_is_named(tmp_path):
    _qwen2_dir(tmp_path)
    from safetensors.torch import load_file, save_file
    f = next(tmp_path.glob("*.safetensors"))
    sd = load_file(str(f))
    del sd["model.layers.0.self_attn.v_proj.bias"]
    save_file(sd, str(f), metadata={"format": "pt"})
    cfg = load_config(str(tmp_path))
    with pytest.raises(ValueError, match="v_proj.bias"):
        load_weights(str(tmp_path), cfg)


def test_the_published_qwen25_7b_config_is_the_preset():
    """Qwen2.5-7B-Instruct's config.json as published (sliding_window set, use_sliding_window false: full attention
    in every layer, no cap) reads as the qwen2.5-7b preset."""
    hf = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
          "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
          "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
          "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
          "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
          "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064}
    assert ModelConfig.from_hf_config(hf, name="qwen2.5-7b") == ModelConfig.from_name("qwen2.5-7b")
