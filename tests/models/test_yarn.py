"""YaRN RoPE scaling (rope_type "yarn", Qwen3's long-context setting; and "linear" interpolation) against Hugging Face transformers on the same
weights: the frequencies (models/reference.py rope_inv_freq) and the attention factor, which this runtime takes in the
softmax scale (ModelConfig.attn_scale) instead of multiplying q and k. Skips without transformers."""
import math

import pytest
import torch

from mpk_runtime import LLM, SamplingParams
from mpk_runtime.models import ConfigError, ModelConfig, RopeScaling, ReferenceModel, load_config, load_weights, \
    random_weights, save_weights
from mpk_runtime.models.reference import rope_inv_freq

transformers = pytest.importorskip("transformers")

YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)
CONFIGS = [
    ModelConfig(name="yarn-qwen3", family="qwen3", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-6,
                rope_scaling=RopeScaling(**YARN), max_position_embeddings=64, tie_word_embeddings=True),
    ModelConfig(name="linear-llama", family="llama", vocab_size=300, hidden_size=64, intermediate_size=96,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4,
                rope_scaling=RopeScaling(rope_type="linear", factor=2.5), max_position_embeddings=64),
    ModelConfig(name="yarn-llama", family="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                num_heads=4, num_kv_heads=1, head_dim=16, rope_theta=1e4,
                rope_scaling=RopeScaling(**YARN, beta_fast=16.0, beta_slow=2.0, mscale=1.0, mscale_all_dim=0.5),
                max_position_embeddings=64),
]


def _hf_dir(cfg, tmp_path):
    cfg = cfg.replace(dtype="float32")
    save_weights(str(tmp_path), cfg, random_weights(cfg, seed=5))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    return cfg, hf


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_yarn_frequencies_and_attention_factor_are_transformers(cfg, tmp_path):
    _, hf = _hf_dir(cfg, tmp_path)
    rot = hf.model.rotary_emb
    assert torch.allclose(rope_inv_freq(cfg), rot.inv_freq.float(), rtol=1e-6, atol=0)
    assert math.isclose(cfg.rope_scaling.attention_factor(), rot.attention_scaling, rel_tol=1e-9)
    assert (cfg.rope_scaling.attention_factor() != 1.0) == (cfg.rope_scaling.rope_type == "yarn")
    # and the config round-trips through config.json
    assert load_config(str(tmp_path)).replace(name=cfg.name) == cfg.replace(dtype="float32")


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_yarn_logits_match_hf_past_the_original_context(cfg, tmp_path):
    cfg, hf = _hf_dir(cfg, tmp_path)
    ref = ReferenceModel(cfg, load_weights(str(tmp_path), cfg))
    toks = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))   # 3x the original 16
    with torch.no_grad():
        want = hf(toks).logits
    got = ref.forward(toks, torch.zeros(2, dtype=torch.long), ref.new_cache(2, 64))
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.parametrize("backend,tp", [("pyvm", 1), ("torch", 1), ("pyvm", 2)])
def test_the_engine_decodes_hfs_greedy_tokens_with_yarn(backend, tp, tmp_path):
    """Through the task graphs (pyvm: the megakernel's CPU twin; torch: the conventional ops), whose attention takes
    the graph's scale; tp=2: two ranks' shards): HF's greedy continuation past the original context."""
    cfg, hf = _hf_dir(CONFIGS[0], tmp_path)
    prompt = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf.generate(prompt[None], max_new_tokens=16, do_sample=False)[0, 20:].tolist()
    llm = LLM(str(tmp_path), backend=backend, tp=tp, dtype="float32", max_seq_len=64)
    try:
        out = llm.generate([prompt.tolist()], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    finally:
        llm.shutdown()
    assert out[0].token_ids == want


def test_yarn_from_a_qwen3_style_config_and_bad_rope_types():
    hf = ModelConfig.from_name("tiny-qwen3").to_hf_config()
    hf.update(max_position_embeddings=128, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32})
    cfg = ModelConfig.from_hf_config(hf)
    rs = cfg.rope_scaling
    assert rs.rope_type == "yarn" and rs.factor == 4.0 and rs.original_max_position_embeddings == 32
    assert math.isclose(rs.attention_factor(), 0.1 * math.log(4.0) + 1)
    assert cfg.max_position_embeddings == 128   # max(its own 128, 4 x 32)
    # Qwen3's model-card setting: max_position_embeddings stays the original; the context is factor x that
    hf32 = dict(hf, max_position_embeddings=32)
    assert ModelConfig.from_hf_config(hf32).max_position_embeddings == 128
    # no factor: the ratio of the contexts (transformers' rule)
    hf["rope_scaling"] = {"rope_type": "yarn", "original_max_position_embeddings": 32}
    assert ModelConfig.from_hf_config(hf).rope_scaling.factor == 4.0
    hf["rope_scaling"] = {"rope_type": "longrope", "factor": 4.0}
    with pytest.raises(ConfigError, match="longrope.*not supported"):
        ModelConfig.from_hf_config(hf)
    with pytest.raises(ConfigError, match="not supported"):
        RopeScaling(rope_type="dynamic")
