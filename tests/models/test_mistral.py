"""Mistral checkpoints (model_type "mistral": the Llama architecture) against Hugging Face transformers' own
MistralForCausalLM on the same weights, and the sliding-window rule (a window in every layer is served with a context
of at most the window, where full attention is exact). Skips without transformers."""
import json
import logging

import pytest
import torch

from mpk_runtime import LLM, SamplingParams
from mpk_runtime.models import ConfigError, ModelConfig, ReferenceModel, load_config, load_weights

transformers = pytest.importorskip("transformers")


def _mistral_dir(tmp_path, **over):
    hf_cfg = transformers.MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=128, rope_theta=1e6, rms_norm_eps=1e-5,
                                        tie_word_embeddings=False, **over)
    torch.manual_seed(3)
    hf = transformers.MistralForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():   # norms away from 1, so a missed norm weight shows
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(str(tmp_path))
    return hf


def test_mistral_logits_and_greedy_tokens_match_hf(tmp_path):
    hf = _mistral_dir(tmp_path, sliding_window=None)
    cfg = load_config(str(tmp_path)).replace(dtype="float32")
    assert cfg.family == "llama" and cfg.max_position_embeddings == 128 and cfg.rope_theta == 1e6
    ref = ReferenceModel(cfg, load_weights(str(tmp_path), cfg))
    toks = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(toks).logits
    got = ref.forward(toks, torch.zeros(2, dtype=torch.long), ref.new_cache(2, 32))
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    # the engine on the megakernel's CPU twin decodes HF's greedy tokens
    prompt = toks[0, :8]
    with torch.no_grad():
        hf_out = hf.generate(prompt[None], max_new_tokens=12, do_sample=False)[0, 8:].tolist()
    llm = LLM(str(tmp_path), backend="pyvm", dtype="float32", max_seq_len=64)
    out = llm.generate([prompt.tolist()], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out[0].token_ids == hf_out


def test_a_window_in_every_layer_caps_the_context_and_is_exact_within_it(tmp_path, caplog):
    hf = _mistral_dir(tmp_path, sliding_window=16)
    with caplog.at_level(logging.WARNING):
        cfg = load_config(str(tmp_path)).replace(dtype="float32")
    assert cfg.max_position_embeddings == 16 and "sliding-window" in caplog.text
    ref = ReferenceModel(cfg, load_weights(str(tmp_path), cfg))
    toks = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(toks).logits   # HF applies its window; within 16 positions it masks nothing
    got = ref.forward(toks, torch.zeros(1, dtype=torch.long), ref.new_cache(1, 16))
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(str(tmp_path), backend="torch", dtype="float32", max_seq_len=32)


def test_window_rules_of_the_config(tmp_path):
    base = json.loads(json.dumps(ModelConfig.from_name("tiny-llama").to_hf_config()))
    base.update(model_type="mistral", max_position_embeddings=64)
    assert ModelConfig.from_hf_config(dict(base, sliding_window=None)).max_position_embeddings == 64
    assert ModelConfig.from_hf_config(dict(base, sliding_window=4096)).max_position_embeddings == 64   # >= context
    assert ModelConfig.from_hf_config(dict(base, sliding_window=32)).max_position_embeddings == 32
    n = base["num_hidden_layers"]
    mixed = ["sliding_attention"] + ["full_attention"] * (n - 1)   # some layers only: the same cap
    assert ModelConfig.from_hf_config(dict(base, sliding_window=32, layer_types=mixed)).max_position_embeddings == 32
    with pytest.raises(ConfigError, match="no sliding_window"):
        ModelConfig.from_hf_config(dict(base, sliding_window=None, layer_types=mixed))
