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


def test_decode_positions_cycle_on_the_peers_cache():
    """The HF peer's timed steps cycle over positions ctx .. ctx + AHEAD - 1 on a cache of ctx + AHEAD keys
    (bench_hf). transformers >= 5 writes at its own running count, not at cache_position: without hf_seek the
    (AHEAD + 1)-th step wrote past the cache (session 70: a device-side assert on the GPU, an IndexError here).
    With it, a step at ctx after many cycles reads the same cache as the first step at ctx did."""
    from _peers import AHEAD, hf_decode_step
    from transformers import LlamaConfig, StaticCache
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=64)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    B, ctx = 2, 13
    cache = StaticCache(config=cfg, max_batch_size=B, max_cache_len=ctx + AHEAD, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        tok0 = hf_prefill(m, cache, torch.randint(0, 97, (B, ctx))).argmax(-1)
        first = hf_decode_step(m, cache, tok0, ctx)
        tok = first.argmax(-1)
        for i in range(1, 3 * AHEAD + 1):
            tok = hf_decode_step(m, cache, tok, ctx + i % AHEAD).argmax(-1)
        again = hf_decode_step(m, cache, tok0, ctx)
    torch.testing.assert_close(again, first, rtol=1e-5, atol=1e-5)
