"""Loading review (config.json entries left out or of the wrong type, checkpoints that do not match their config):
absent entries take transformers' defaults, bad ones are ConfigErrors / WeightErrors naming the entry or tensor and
what to do, never a bare TypeError / KeyError, and a checkpoint of another architecture is refused, not run."""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from mpk_runtime.models import PRESETS, ConfigError, ModelConfig, ReferenceModel, WeightError, load_config, \
    load_weights, random_weights, save_weights

from tests.models.test_loading_review import _DROP, _edit_config, _dir as _saved


def _dir(tmp_path, cfg, name="m", weights=None, shard_bytes=None, **edits):
    """A saved checkpoint of `cfg` (float32), its config.json then edited (_DROP removes an entry)."""
    d, cfg = _saved(tmp_path, name, cfg.replace(dtype="float32"), shard_bytes, weights)
    _edit_config(d, **edits)
    return d, cfg


# --- config.json entries left out: transformers' defaults ---------------------------------------------------------

def test_qwen3_config_without_head_dim_has_transformers_128_wide_heads(tmp_path):
    """Qwen3Config's head_dim defaults to 128, not hidden_size / num_attention_heads (qwen3-0.6b: 16 heads of 128 over
    1024); without head_dim in config.json the heads were taken hidden_size / heads wide and every q / k / v / o / norm
    tensor failed as a shape mismatch, where transformers loads and runs the checkpoint."""
    base = PRESETS["tiny-qwen3-d128"]
    assert base.hidden_size // base.num_heads != 128 == base.head_dim
    d, cfg = _dir(tmp_path, base, head_dim=_DROP)
    got = load_config(d)
    assert got.head_dim == 128 and got.replace(name=cfg.name) == cfg
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert hf.config.head_dim == 128
    ref = ReferenceModel(got, load_weights(d, got))
    toks = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(toks).logits
    out = ref.forward(toks, torch.zeros(1, dtype=torch.long), ref.new_cache(1, 16))
    assert ((out - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.parametrize("case", [
    # use_sliding_window without max_window_layers: transformers slides layers >= 28 only (none of 3): no cap (this
    # loader slid every layer and capped the context at the window)
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    # use_sliding_window without sliding_window: transformers' 4096-token window (this loader ran full attention past
    # it, another function than transformers')
    ("qwen2", {"use_sliding_window": True, "num_hidden_layers": 30, "max_position_embeddings": 32768}),
    ("qwen3", {"use_sliding_window": False, "max_position_embeddings": 32768}),
    ("mistral", {"sliding_window": 16, "max_position_embeddings": 32768}),
    ("mistral", {"sliding_window": None, "max_position_embeddings": 32768}),
    # no sliding_window entry: MistralConfig's default 4096 slides every layer (this loader ran full attention)
    ("mistral", {"max_position_embeddings": 32768}),
])
def test_sliding_window_defaults_are_transformers(case):
    """The context this loader serves is capped at the window exactly when transformers' config (its defaults for
    the entries config.json leaves out) has sliding-window layers."""
    transformers = pytest.importorskip("transformers")
    model_type, over = case
    preset = {"mistral": "tiny-llama", "qwen2": "tiny-qwen2", "qwen3": "tiny-qwen3"}[model_type]
    hf = PRESETS[preset].to_hf_config()
    for k in ("use_sliding_window", "sliding_window", "max_window_layers", "rope_scaling"):
        hf.pop(k, None)
    hf.update(over, model_type=model_type)
    t = transformers.AutoConfig.for_model(**hf)
    kinds = getattr(t, "layer_types", None) or ["sliding_attention" if t.sliding_window else "full_attention"] * \
        t.num_hidden_layers
    want = hf["max_position_embeddings"]
    if "sliding_attention" in kinds:
        want = min(want, t.sliding_window)
    assert ModelConfig.from_hf_config(hf).max_position_embeddings == want


def test_swish_is_silu():
    """hidden_act "swish" (transformers' ACT2FN: SiLU, as "silu") was refused as an unsupported activation."""
    hf = PRESETS["tiny-llama"].to_hf_config()
    assert ModelConfig.from_hf_config(dict(hf, hidden_act="swish")) == ModelConfig.from_hf_config(hf)
    with pytest.raises(ConfigError, match="gelu"):
        ModelConfig.from_hf_config(dict(hf, hidden_act="gelu"))
    act = pytest.importorskip("transformers.activations").ACT2FN
    x = torch.randn(64)
    assert torch.equal(act["swish"](x), F.silu(x))


# --- config.json entries of the wrong type: a ConfigError naming the entry ----------------------------------------

L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}


@pytest.mark.parametrize("preset, edits, word", [
    # (a TypeError from hidden_size // num_attention_heads)
    ("tiny-llama", {"hidden_size": "128", "head_dim": _DROP}, "hidden_size"),
    ("tiny-llama", {"hidden_size": None, "head_dim": _DROP}, "hidden_size"),
    # (a TypeError from int(None))
    ("tiny-qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": None}, "max_window_layers"),
    # (refused as "layer kinds ['_', 'a', 'e', ...]": the string's letters)
    ("tiny-qwen3", {"layer_types": "full_attention"}, "layer_types.*must be a list"),
    # (read as a top-level entry: "config.json has no 'low_freq_factor' entry")
    ("tiny-llama", {"rope_scaling": {k: v for k, v in L3.items() if k != "low_freq_factor"}},
     "rope_scaling.*llama3.*low_freq_factor"),
    ("tiny-llama", {"rope_scaling": {k: v for k, v in L3.items() if k != "original_max_position_embeddings"}},
     "rope_scaling.*original_max_position_embeddings"),
])
def test_wrong_or_missing_entries_are_config_errors_naming_them(tmp_path, preset, edits, word):
    d, _ = _dir(tmp_path, PRESETS[preset], **edits)
    with pytest.raises(ConfigError, match=word):
        load_config(d)
    hf = json.load(open(os.path.join(d, "config.json")))
    with pytest.raises(ConfigError, match=word):   # (from_hf_config itself: a KeyError before)
        ModelConfig.from_hf_config(hf)


# --- checkpoints that do not match their config ------------------------------------------------------------------

def test_untied_config_without_lm_head_says_to_tie(tmp_path):
    """A checkpoint without lm_head.weight whose config.json says tie_word_embeddings false (or leaves it out: false
    by default) was reported as "1 tensors missing ... is it a llama model with 2 layers?"; it now says to set
    tie_word_embeddings true if the model ties its LM head."""
    cfg = PRESETS["tiny-llama"]   # tied: no lm_head.weight saved
    d, _ = _dir(tmp_path, cfg, tie_word_embeddings=_DROP)
    untied = load_config(d)
    assert not untied.tie_word_embeddings
    with pytest.raises(WeightError, match="no lm_head.weight.*set tie_word_embeddings to true"):
        load_weights(d, untied)
    got = load_weights(d, untied.replace(tie_word_embeddings=True))   # as told: loads
    assert "lm_head.weight" not in got


def test_a_checkpoint_of_another_family_is_refused_not_run(tmp_path):
    """A Qwen3 checkpoint whose config.json says model_type llama loaded without its q / k norm weights (only biases
    and layers past the config's were checked) and ran as another function than the model."""
    d, _ = _dir(tmp_path, PRESETS["tiny-qwen3"], model_type="llama")
    with pytest.raises(WeightError, match="q_norm.*model_type llama.*no q / k norms"):
        load_weights(d, load_config(d))
    # older exports' rotary_emb.inv_freq buffers are not weights of another architecture: still load
    d2, cfg = _dir(tmp_path, PRESETS["tiny-llama"], name="inv")
    f = os.path.join(d2, "model.safetensors")
    sd = load_file(f)
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(cfg.head_dim // 2)
    save_file(sd, f, metadata={"format": "pt"})
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in load_weights(d2, cfg)


@pytest.mark.parametrize("name, rows, keys", [
    ("model.embed_tokens.weight", 500, "vocab_size, hidden_size"),
    ("model.layers.1.self_attn.k_proj.weight", 16, "num_key_value_heads, head_dim"),
    ("model.layers.0.mlp.up_proj.weight", 300, "intermediate_size"),
])
def test_shape_mismatch_names_the_config_entries(tmp_path, name, rows, keys):
    """A tensor of another shape than the config's was reported with both shapes only, not which config.json entries
    give that shape nor what to do."""
    cfg = PRESETS["tiny-llama"].replace(dtype="float32")
    w = random_weights(cfg, seed=3)
    w[name] = w[name][:rows].clone()
    d, _ = _dir(tmp_path, cfg, weights=w)
    with pytest.raises(WeightError, match=f"{name}.*\\({rows}, .*{keys}.*config.json published with it"):
        load_weights(d, cfg)


def test_index_with_a_null_file_name_is_a_weight_error(tmp_path):
    """An index whose weight_map gives a tensor null for its file escaped as a TypeError from os.path.join."""
    d, cfg = _dir(tmp_path, PRESETS["tiny-llama"], shard_bytes=200_000)
    ip = os.path.join(d, "model.safetensors.index.json")
    idx = json.load(open(ip))
    idx["weight_map"]["model.norm.weight"] = None
    json.dump(idx, open(ip, "w"))
    with pytest.raises(WeightError, match="index.json.*model.norm.weight.*download it again"):
        load_weights(d, cfg)
