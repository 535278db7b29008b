"""Loading real Hugging Face checkpoints (config.json + safetensors): what a user's directory can hold, checked
against safetensors itself and, where installed, transformers (session 70 loading review)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from mpk_runtime.models import PRESETS, ConfigError, ReferenceModel, WeightError, load_config, \
    load_weights, random_weights, save_weights
from mpk_runtime.models.reference import rope_inv_freq


def _dir(tmp_path, name="m", cfg=None, shard_bytes=None, weights=None):
    cfg = cfg or PRESETS["tiny-llama"].replace(dtype="float32")
    d = tmp_path / name
    save_weights(str(d), cfg, weights or random_weights(cfg, seed=3),
                 **({"shard_bytes": shard_bytes} if shard_bytes else {}))
    return str(d), cfg


def _edit_config(d, **changes):
    p = os.path.join(d, "config.json")
    hf = json.load(open(p))
    for k, v in changes.items():
        if v is _DROP:
            hf.pop(k, None)
        else:
            hf[k] = v
    json.dump(hf, open(p, "w"))


_DROP = object()


def _hf_logits(d, toks):
    transformers = pytest.importorskip("transformers")
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(toks).logits


def _our_logits(d, toks):
    cfg = load_config(d).replace(dtype="float32")
    ref = ReferenceModel(cfg, load_weights(d, cfg))
    return ref.forward(toks, torch.zeros(toks.shape[0], dtype=torch.long), ref.new_cache(toks.shape[0], 64))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# --- sharded / multi-file directories -----------------------------------------------------------------------

def test_broken_index_or_shard_is_a_weight_error(tmp_path):
    """A malformed index (bad JSON, no weight_map), an index naming a tensor its shard lacks, or a truncated shard
    escaped as JSONDecodeError / KeyError / SafetensorError instead of a WeightError that names the file."""
    d, cfg = _dir(tmp_path, shard_bytes=200_000)
    ip = os.path.join(d, "model.safetensors.index.json")
    good = json.load(open(ip))
    open(ip, "w").write("{bad")
    with pytest.raises(WeightError, match="index.json"):
        load_weights(d, cfg)
    json.dump({"metadata": {}}, open(ip, "w"))
    with pytest.raises(WeightError, match="weight_map"):
        load_weights(d, cfg)
    wm = dict(good["weight_map"])
    other = next(f for f in sorted(set(wm.values())) if f != wm["model.norm.weight"])
    json.dump({"weight_map": dict(wm, **{"model.norm.weight": other})}, open(ip, "w"))
    with pytest.raises(WeightError, match=f"model.norm.weight.*{other}"):
        load_weights(d, cfg)
    json.dump(good, open(ip, "w"))
    shard = os.path.join(d, wm["model.norm.weight"])
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[:len(data) // 2])
    with pytest.raises(WeightError, match=os.path.basename(shard)):
        load_weights(d, cfg)


def test_model_safetensors_wins_over_an_index_as_in_transformers(tmp_path):
    """transformers loads model.safetensors when a directory holds it and an index; this loader took the index, so a
    stale index (its shards gone, or other values) failed or loaded other weights than transformers."""
    d, cfg = _dir(tmp_path)
    json.dump({"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}},
              open(os.path.join(d, "model.safetensors.index.json"), "w"))
    want = load_file(os.path.join(d, "model.safetensors"))
    got = load_weights(d, cfg)
    assert got.keys() <= want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_a_tensor_in_two_files_is_refused(tmp_path):
    """Without an index or model.safetensors every *.safetensors file was read and a tensor held by two files
    silently came from whichever sorted last."""
    d, cfg = _dir(tmp_path)
    w = load_file(os.path.join(d, "model.safetensors"))
    os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "a.safetensors"))
    save_file({"model.norm.weight": w["model.norm.weight"] * 2}, os.path.join(d, "b.safetensors"))
    with pytest.raises(WeightError, match="model.norm.weight.*a.safetensors.*b.safetensors"):
        load_weights(d, cfg)


# --- tied embeddings ------------------------------------------------------------------------------------------

def test_tied_config_with_a_different_lm_head_is_refused(tmp_path):
    """tie_word_embeddings true with a different lm_head.weight in the checkpoint: transformers (5.x) keeps the
    checkpoint's lm_head (and warns to set tie_word_embeddings false); this loader silently used embed_tokens."""
    cfg = PRESETS["tiny-llama"].replace(dtype="float32")        # tied
    w = random_weights(cfg.replace(tie_word_embeddings=False), seed=3)
    d, _ = _dir(tmp_path, cfg=cfg, weights=w)
    with pytest.raises(WeightError, match="tie_word_embeddings"):
        load_weights(d, cfg)
    # the same lm_head as the embedding (some exports write both): loads, logits as transformers'
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
    d2, _ = _dir(tmp_path, "same", cfg=cfg, weights=w)
    toks = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    assert _rel(_our_logits(d2, toks), _hf_logits(d2, toks)) < 1e-5


# --- config.json values ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value", [
    ("max_position_embeddings", None), ("max_position_embeddings", "lots"), ("rms_norm_eps", None),
    ("rms_norm_eps", "small"), ("num_hidden_layers", None), ("rope_theta", "big"), ("rope_theta", [1]),
    ("rope_scaling", {"rope_type": "llama3", "factor": None, "low_freq_factor": 1, "high_freq_factor": 4,
                      "original_max_position_embeddings": 64}),
    ("sliding_window", "wide"),
])
def test_null_or_wrong_type_values_are_config_errors(tmp_path, key, value):
    """null or non-numeric values in config.json raised a bare TypeError / ValueError from int() / float() that did
    not say which entry of config.json was wrong."""
    d, _ = _dir(tmp_path)
    _edit_config(d, **{key: value}, **({"model_type": "mistral"} if key == "sliding_window" else {}))
    with pytest.raises(ConfigError, match={"rope_scaling": "factor", "num_hidden_layers": "num_layers"}.get(key, key)):
        load_config(d)


def test_tie_word_embeddings_must_be_a_bool(tmp_path):
    """tie_word_embeddings "false" (a string) read as True: a model with its own lm_head ran with the embedding as
    its LM head."""
    d, _ = _dir(tmp_path)
    _edit_config(d, tie_word_embeddings="false")
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        load_config(d)
    _edit_config(d, tie_word_embeddings=None)   # null: the families' default (False), as transformers
    assert load_config(d).tie_word_embeddings is False


def test_rope_scaling_that_is_not_an_object_is_refused(tmp_path):
    """rope_scaling given as a string or list was silently ignored: the model ran unscaled RoPE."""
    d, _ = _dir(tmp_path)
    for v in ("llama3", [8.0]):
        _edit_config(d, rope_scaling=v)
        with pytest.raises(ConfigError, match="rope_scaling"):
            load_config(d)


def test_zero_kv_heads_is_refused(tmp_path):
    """num_key_value_heads 0 silently became num_attention_heads (multi-head attention)."""
    d, _ = _dir(tmp_path)
    _edit_config(d, num_key_value_heads=0)
    with pytest.raises(ConfigError, match="num_kv_heads"):
        load_config(d)
    _edit_config(d, num_key_value_heads=_DROP)   # absent: one KV head per q head, as transformers
    assert load_config(d).num_kv_heads == load_config(d).num_heads


@pytest.mark.parametrize("family, cls", [("llama", "LlamaConfig"), ("qwen3", "Qwen3Config"),
                                         ("qwen2", "Qwen2Config"), ("mistral", "MistralConfig")])
def test_absent_max_position_embeddings_is_the_families_default(tmp_path, family, cls):
    """Without max_position_embeddings the context was 8192 for every family, where transformers takes the family's
    default (2048 Llama, 32768 Qwen, 131072 Mistral); YaRN without original_max_position_embeddings then scaled
    from another context and its frequencies differed from transformers'."""
    transformers = pytest.importorskip("transformers")
    cfg = PRESETS["tiny-" + ("llama" if family == "mistral" else family)].replace(dtype="float32", rope_scaling=None)
    d, _ = _dir(tmp_path, cfg=cfg)
    # (Mistral without a sliding_window entry slides 4096, which caps the context: null here, no window)
    _edit_config(d, max_position_embeddings=_DROP, model_type=family,
                 **({"sliding_window": None} if family == "mistral" else {}))
    assert load_config(d).max_position_embeddings == getattr(transformers, cls)().max_position_embeddings
    _edit_config(d, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert torch.allclose(rope_inv_freq(load_config(d)), m.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)


def test_float64_config_loads_as_float32(tmp_path):
    """A float64 checkpoint (torch_dtype "float64") was refused by the config even though its F64 tensors load and
    cast; it now defaults to float32."""
    cfg = PRESETS["tiny-llama"].replace(dtype="float32")
    w = {k: v.double() for k, v in random_weights(cfg, seed=3).items()}
    d, _ = _dir(tmp_path, cfg=cfg, weights=w)
    _edit_config(d, torch_dtype="float64")
    c = load_config(d)
    assert c.dtype == "float32"
    got = load_weights(d, c)
    assert all(torch.equal(got[k], w[k].float()) for k in got)


# --- what the user points at ----------------------------------------------------------------------------------

def test_a_file_or_a_missing_path_is_named_as_such(tmp_path):
    """A path to config.json / model.safetensors, or a directory that does not exist, was reported as an unknown
    preset name; it now says the path is a file (pass its directory) or does not exist."""
    d, _ = _dir(tmp_path)
    with pytest.raises(ConfigError, match="is a file.*directory"):
        load_config(os.path.join(d, "config.json"))
    with pytest.raises(ConfigError, match="no such directory"):
        load_config(os.path.join(d, "nope"))
    with pytest.raises(ConfigError, match="tiny-llama"):   # a plain unknown name still lists the presets
        load_config("llama-4")


# --- good checkpoints written by transformers -----------------------------------------------------------------

@pytest.mark.parametrize("arch", ["Llama", "Qwen3", "Qwen2", "Mistral"])
def test_transformers_sharded_bf16_checkpoint_loads_exactly(tmp_path, arch):
    """A checkpoint written by transformers' save_pretrained (sharded, bf16, its own config.json) loads to exactly
    the tensors safetensors holds, cast, and gives transformers' logits (a regression check; passed already)."""
    transformers = pytest.importorskip("transformers")
    hc = getattr(transformers, arch + "Config")(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=arch == "Qwen2",
        **({"head_dim": 24} if arch == "Qwen3" else {}))
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(hc)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    m.to(torch.bfloat16).save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    wm = json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"]
    disk = {}
    for f in set(wm.values()):
        disk.update(load_file(str(tmp_path / f)))
    cfg = load_config(str(tmp_path))
    for dt in (torch.float32, torch.float16):
        got = load_weights(str(tmp_path), cfg, dtype=dt)
        assert all(torch.equal(got[k], disk[k].to(dt)) for k in got)
    toks = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    assert _rel(_our_logits(str(tmp_path), toks), _hf_logits(str(tmp_path), toks)) < 1e-5


def test_quantized_checkpoint_config_is_refused(tmp_path):
    """A quantized checkpoint (AWQ / GPTQ: quantization_config in config.json, qweight / scales tensors) loaded its
    config and then failed with "N tensors missing ... does the checkpoint match config", not saying why."""
    d, cfg = _dir(tmp_path)
    _edit_config(d, quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128})
    with pytest.raises(ConfigError, match="awq.*not supported"):
        load_config(d)
