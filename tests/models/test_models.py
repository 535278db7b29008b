import json
import os

import pytest
import torch

from mpk_runtime.models import (ConfigError, ModelConfig, PRESETS, ReferenceModel, WeightError, load_config,
                                load_weights, random_weights, save_weights, weight_shapes)

REQUIRED = ["llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b",
            "qwen3-32b", "tiny-llama", "tiny-qwen3"]


@pytest.mark.parametrize("name", REQUIRED)
def test_presets_exist_and_roundtrip(name):
    cfg = ModelConfig.from_name(name)
    assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg
    assert ModelConfig.from_hf_config(cfg.to_hf_config(), name=cfg.name) == cfg


def test_param_counts_match_published_sizes():
    # total parameters, from the published model cards (within 2%)
    for name, billions in [("llama-3.2-1b", 1.24), ("llama-3.1-8b", 8.03), ("qwen3-8b", 8.19), ("qwen3-32b", 32.8),
                           ("llama-3.1-70b", 70.6), ("qwen3-0.6b", 0.596)]:
        n = ModelConfig.from_name(name).num_params() / 1e9
        assert abs(n - billions) / billions < 0.02, (name, n)


def test_unknown_model_lists_presets():
    with pytest.raises(ConfigError, match="known presets: .*qwen3-8b"):
        ModelConfig.from_name("llama-9")


def test_a_misspelt_preset_is_named():
    with pytest.raises(ConfigError, match="did you mean 'tiny-llama'"):
        ModelConfig.from_name("tiny-lama")
    with pytest.raises(ConfigError) as e:   # nothing close: no guess
        ModelConfig.from_name("gpt2")
    assert "did you mean" not in str(e.value)


def test_invalid_configs_say_what_is_wrong():
    base = PRESETS["tiny-llama"]
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        base.replace(num_kv_heads=3)
    with pytest.raises(ConfigError, match="positive"):
        base.replace(hidden_size=0)
    with pytest.raises(ConfigError, match="not supported"):
        ModelConfig.from_hf_config({"model_type": "gemma2"})


def test_save_load_sharded_directory(tmp_path):
    cfg = PRESETS["tiny-qwen3"].replace(dtype="float32")
    w = random_weights(cfg, seed=7)
    save_weights(str(tmp_path), cfg, w, shard_bytes=200_000)
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert load_config(str(tmp_path)).replace(name=cfg.name) == cfg
    w2 = load_weights(str(tmp_path), cfg)
    assert set(w2) == set(weight_shapes(cfg))
    assert all(torch.equal(w[k], w2[k]) for k in w)
    # a slice is read straight from the file
    part = load_weights(str(tmp_path), cfg, slicer=lambda n, s: (slice(0, 32), slice(None)) if n.endswith("q_proj.weight") else None)
    assert torch.equal(part["model.layers.0.self_attn.q_proj.weight"], w["model.layers.0.self_attn.q_proj.weight"][:32])


def test_missing_weights_error(tmp_path):
    cfg = PRESETS["tiny-llama"].replace(dtype="float32")
    w = random_weights(cfg)
    del w["model.layers.1.mlp.up_proj.weight"]
    save_weights(str(tmp_path), cfg, w)
    with pytest.raises(WeightError, match="missing"):
        load_weights(str(tmp_path), cfg)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    with pytest.raises(WeightError, match="no \\*.safetensors"):
        load_weights(str(empty), cfg)


def test_reference_incremental_decode_equals_full_forward():
    cfg = PRESETS["tiny-qwen3"].replace(dtype="float32")
    m = ReferenceModel(cfg, random_weights(cfg, seed=2))
    toks = torch.randint(0, cfg.vocab_size, (2, 12))
    full = m.forward(toks, torch.zeros(2, dtype=torch.long), m.new_cache(2, 16))
    cache = m.new_cache(2, 16)
    m.forward(toks[:, :7], torch.zeros(2, dtype=torch.long), cache)
    steps = [m.forward(toks[:, i:i + 1], torch.full((2,), i), cache)[:, 0] for i in range(7, 12)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 7:], rtol=1e-5, atol=1e-4)
