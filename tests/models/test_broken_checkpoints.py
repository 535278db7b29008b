"""Checkpoints that do not match what they claim: each is refused with an error that says what to fix, or (NaN
weights) fails its requests without wedging the engine. Found by a user audit (session 48)."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from mpk_runtime.engine import LLM, InvalidRequestError, RequestFailedError, SamplingParams
from mpk_runtime.models import PRESETS, ConfigError, WeightError, load_config, load_weights, random_weights, \
    save_weights


def _dir(tmp_path, name="m", cfg=None, mutate=None, shard_bytes=None):
    cfg = cfg or PRESETS["tiny-llama"].replace(dtype="float32")
    w = random_weights(cfg, seed=3)
    if mutate:
        mutate(w)
    d = tmp_path / name
    save_weights(str(d), cfg, w, **({"shard_bytes": shard_bytes} if shard_bytes else {}))
    return str(d), cfg


def test_missing_shard_named(tmp_path):
    d, cfg = _dir(tmp_path, shard_bytes=200_000)
    idx = json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]
    os.remove(os.path.join(d, sorted(set(idx.values()))[-1]))
    with pytest.raises(WeightError, match="download the missing shards"):
        load_weights(d, cfg)


def test_stray_layers_biases_and_integer_tensors_refused(tmp_path):
    d, cfg = _dir(tmp_path, "bias", mutate=lambda w: w.__setitem__(
        "model.layers.0.self_attn.q_proj.bias", torch.zeros(w["model.layers.0.self_attn.q_proj.weight"].shape[0])))
    with pytest.raises(WeightError, match="not part of config"):
        load_weights(d, cfg)
    cfg2 = PRESETS["tiny-llama"].replace(dtype="float32")
    d2, _ = _dir(tmp_path, "deeper", cfg=cfg2.replace(num_layers=cfg2.num_layers + 1))
    cfgj = json.load(open(os.path.join(d2, "config.json")))
    cfgj["num_hidden_layers"] = cfg2.num_layers   # config says fewer layers than the checkpoint holds
    json.dump(cfgj, open(os.path.join(d2, "config.json"), "w"))
    with pytest.raises(WeightError, match="layers"):
        load_weights(d2, load_config(d2))
    d3, _ = _dir(tmp_path, "int", mutate=lambda w: w.__setitem__(
        "model.norm.weight", w["model.norm.weight"].to(torch.int32)))
    with pytest.raises(WeightError, match="float tensor"):
        load_weights(d3, cfg)


def test_config_json_errors(tmp_path):
    d, _ = _dir(tmp_path)
    p = os.path.join(d, "config.json")
    good = json.load(open(p))
    open(p, "w").write("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(d)
    json.dump([good], open(p, "w"))
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(d)
    bad = dict(good)
    del bad["num_attention_heads"]
    json.dump(bad, open(p, "w"))
    with pytest.raises(ConfigError, match="num_attention_heads"):
        load_config(d)
    for heads in (0, -4, "8"):   # (0 divided hidden_size by zero: a ZeroDivisionError, not a ConfigError)
        json.dump(dict(good, num_attention_heads=heads, head_dim=None), open(p, "w"))
        with pytest.raises(ConfigError, match="num_heads must be a positive int"):
            load_config(d)


def test_sliding_window_layers_cap_the_context_or_are_refused():
    """Sliding layers are served with a context of at most the window (full attention is exact there); without a
    window size, or with layer kinds other than full / sliding attention, the config is refused."""
    hf = PRESETS["tiny-qwen3"].to_hf_config()
    from mpk_runtime.models import ModelConfig
    assert hf["max_position_embeddings"] > 8
    cfg = ModelConfig.from_hf_config(dict(hf, use_sliding_window=True, sliding_window=8, max_window_layers=1))
    assert cfg.max_position_embeddings == 8
    mixed = ["full_attention", "sliding_attention"]
    assert ModelConfig.from_hf_config(dict(hf, layer_types=mixed, sliding_window=8)).max_position_embeddings == 8
    big = hf["max_position_embeddings"]   # a window at least the context: nothing to cap
    assert ModelConfig.from_hf_config(dict(hf, layer_types=mixed, sliding_window=big)).max_position_embeddings == big
    with pytest.raises(ConfigError, match="no sliding_window"):
        ModelConfig.from_hf_config(dict(hf, layer_types=mixed))
    with pytest.raises(ConfigError, match="chunked_attention"):
        ModelConfig.from_hf_config(dict(hf, layer_types=["full_attention", "chunked_attention"]))
    # a YaRN extension does not lift the window's cap
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": big}
    assert ModelConfig.from_hf_config(dict(hf, layer_types=mixed, sliding_window=8,
                                           rope_scaling=yarn)).max_position_embeddings == 8
    ModelConfig.from_hf_config(dict(hf, use_sliding_window=False, sliding_window=8))   # off: fine
    ModelConfig.from_hf_config(dict(hf, layer_types=["full_attention"] * hf["num_hidden_layers"]))


@pytest.mark.parametrize("backend", ["reference", "torch", "pyvm"])
def test_nan_weights_fail_the_request_and_the_engine_stays_usable(tmp_path, backend):
    """Every sampler: greedy, the full-vocabulary draw, and the top-k (<= 64) draw inside the step's graph (until
    session 74 the last drew token 0 from NaN logits on the torch and pyvm backends, found by a user audit)."""
    d, _ = _dir(tmp_path, "nan", mutate=lambda w: w["model.norm.weight"].fill_(float("nan")))
    with LLM(d, backend=backend, dtype="float32", max_seq_len=64, max_batch=1) as llm:
        for sp in (SamplingParams(temperature=0.7, max_tokens=3), SamplingParams(temperature=0, max_tokens=3),
                   SamplingParams(temperature=1.0, top_k=5, max_tokens=3),
                   SamplingParams(temperature=0.5, top_k=64, top_p=0.9, seed=7, max_tokens=3)):
            with pytest.raises(RequestFailedError, match="NaN"):
                llm.generate([[1, 2, 3]], sp)
            assert not llm.engine.scheduler.running and llm.engine.allocator.num_free == llm.engine.allocator.num_pages


def test_nan_rows_drawn_on_the_device_fail_naming_nan_without_logits(tmp_path, monkeypatch):
    """The megakernel runner returns only the drawn tokens when no request reads logits (StepOutput(logits=None));
    a row its full-vocabulary draw could not draw comes back -1 (full_sampling), its in-graph draw PAD_INDEX. Both
    must fail the request naming NaN (the first GPU run of session 75 read -1 as "not drawn on the device" and
    failed with "the runner returned no logits"). Here the pyvm runner, its logits dropped as that runner does."""
    from mpk_runtime.runtime import pyvm_runner
    from mpk_runtime.runtime.device_sampling import StepOutput, host_logits_needed
    real = pyvm_runner.step_output

    def tokens_only(chunks, logits, tokens):
        out = real(chunks, logits, tokens)
        return StepOutput(None, out.tokens) if isinstance(out, StepOutput) and not host_logits_needed(chunks) else out
    monkeypatch.setattr(pyvm_runner, "step_output", tokens_only)
    d, _ = _dir(tmp_path, "nan", mutate=lambda w: w["model.norm.weight"].fill_(float("nan")))
    with LLM(d, backend="pyvm", dtype="float32", max_seq_len=64, max_batch=1) as llm:
        for sp in (SamplingParams(temperature=0.7, max_tokens=3), SamplingParams(temperature=0, max_tokens=3),
                   SamplingParams(temperature=1.0, top_k=5, max_tokens=3), SamplingParams(temperature=0.7, top_k=100)):
            with pytest.raises(RequestFailedError, match="NaN / inf logits") as e:
                llm.generate([[1, 2, 3]], sp)
            assert "no logits" not in str(e.value)
            assert not llm.engine.scheduler.running and llm.engine.allocator.num_free == llm.engine.allocator.num_pages
        assert llm.engine.stats["logits_bytes"] == 0   # (the tokens-only path was the one taken)


def test_eos_from_generation_config(tmp_path):
    d, cfg = _dir(tmp_path)
    with LLM(d, backend="reference", dtype="float32", max_seq_len=64) as llm:
        free = llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=8))[0].token_ids
    json.dump({"eos_token_id": [free[2], 10 ** 9]}, open(os.path.join(d, "generation_config.json"), "w"))
    with LLM(d, backend="reference", dtype="float32", max_seq_len=64) as llm:
        o = llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=8))[0]
        assert o.token_ids == free[:free.index(free[2]) + 1] and o.finish_reason == "stop"
        assert llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids == free


@pytest.mark.parametrize("kw, word", [({"max_seq_len": 10 ** 6}, "max_position_embeddings"),
                                      ({"max_seq_len": -5}, "max_seq_len"), ({"page_size": 0}, "page_size"),
                                      ({"max_batch": 0}, "max_batch"), ({"num_pages": 0}, "num_pages"),
                                      ({"max_seqlen": 64}, "unknown keyword")])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_bad_sizes_and_unknown_kwargs(backend, kw, word):
    with pytest.raises(InvalidRequestError, match=word):
        LLM("tiny-llama", backend=backend, dtype="float32", **kw)


def test_reference_defaults_to_fp32_on_cpu_like_the_other_cpu_backends():
    sp = SamplingParams(temperature=0, max_tokens=6)
    outs = []
    for be in ("reference", "pyvm"):
        with LLM("tiny-llama", backend=be, max_seq_len=64) as llm:
            outs.append(llm.generate([[1, 2, 3]], sp)[0].token_ids)
    assert outs[0] == outs[1]


def test_ignore_eos_must_be_bool():
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(ignore_eos="yes")
