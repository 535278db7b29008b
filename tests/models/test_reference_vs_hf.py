"""The reference forward against Hugging Face transformers on the same weights (skips without transformers).
On the GPU machine this also runs in bf16 on CUDA (scripts/gpu_hf_check.py reports the numbers)."""
import pytest
import torch

from mpk_runtime.models import ModelConfig, PRESETS, RopeScaling, ReferenceModel, load_weights, random_weights, save_weights

transformers = pytest.importorskip("transformers")

CONFIGS = [
    PRESETS["tiny-llama"],
    PRESETS["tiny-qwen3"],
    # not presets: odd sizes, MHA, untied llama, tied qwen3, llama3 rope scaling with small original context
    ModelConfig(name="odd-llama", family="llama", vocab_size=333, hidden_size=80, intermediate_size=200,
                num_layers=2, num_heads=5, num_kv_heads=5, head_dim=16, rope_theta=10000.0,
                rope_scaling=RopeScaling(4.0, 1.0, 4.0, 32), tie_word_embeddings=False),
    ModelConfig(name="odd-qwen3", family="qwen3", vocab_size=300, hidden_size=64, intermediate_size=96,
                num_layers=2, num_heads=6, num_kv_heads=2, head_dim=24, rope_theta=1e6, rms_norm_eps=1e-6,
                tie_word_embeddings=True),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_logits_match_hf(cfg, tmp_path):
    cfg = cfg.replace(dtype="float32")
    save_weights(str(tmp_path), cfg, random_weights(cfg, seed=11))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ref = ReferenceModel(cfg, load_weights(str(tmp_path), cfg))
    toks = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(toks).logits
    got = ref.forward(toks, torch.zeros(2, dtype=torch.long), ref.new_cache(2, 64))
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, err
    # and positions beyond the original context exercise llama3 rope scaling in decode
    cache = ref.new_cache(2, 64)
    ref.forward(toks[:, :39], torch.zeros(2, dtype=torch.long), cache)
    last = ref.forward(toks[:, 39:], torch.full((2,), 39), cache)
    assert ((last[:, 0] - want[:, 39]).abs().max() / want.abs().max()).item() < 1e-5
