"""scripts/_peers.py hf_prefill: the HF peer's prompt, fed to its StaticCache in chunks, leaves the same cache and
last logits as the whole prompt at once (tiny Llama / Qwen3 configs on the CPU)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
transformers = pytest.importorskip("transformers")

from _peers import hf_prefill  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_chunked_prefill_matches_the_whole_prompt(family):
    from transformers import LlamaConfig, Qwen3Config, StaticCache
    cls = LlamaConfig if family == "llama" else Qwen3Config
    cfg = cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=97, max_position_embeddings=64)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    B, ctx = 3, 21
    ids = torch.randint(0, 97, (B, ctx))
    res = []
    for max_tokens in (10 ** 6, 2 * B, 5 * B):   # whole; chunks of 2; chunks of 5 (the last one short)
        cache = StaticCache(config=cfg, max_batch_size=B, max_cache_len=32, device="cpu", dtype=torch.float32)
        with torch.no_grad():
            logits = hf_prefill(m, cache, ids, max_tokens=max_tokens)
            nxt = m(input_ids=logits.argmax(-1), past_key_values=cache, cache_position=torch.tensor([ctx]),
                    use_cache=True).logits   # one decode step reads the whole cache the prefill left
        res.append((logits, nxt))
    assert res[0][0].shape == (B, 1, 97)
    for logits, nxt in res[1:]:
        torch.testing.assert_close(logits, res[0][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(nxt, res[0][1], rtol=1e-4, atol=1e-4)
