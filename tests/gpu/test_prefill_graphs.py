"""GPU: ConventionalPrefill replays CUDA graphs (one per (sequences, tokens) bucket and key cap) and gives the
same logits and tokens as its eager run, and the pure-torch reference's logits to bf16 tolerance, over steps whose
chunk sets differ (new lengths, new block tables, a second key cap); also with the layers' activations sharing
storage (share_activations) (skips without a CUDA GPU)."""
import random

import pytest
import torch

from tests.gpu.marks import GPU

pytestmark = GPU

PS, MAXLEN = 16, 256


def _steps(cfg, width):
    rng = random.Random(0)
    out = []
    for s, (n, lo, hi) in enumerate([(3, 4, 24), (5, 4, 24), (3, 4, 24), (2, 20, 60), (4, 4, 30)]):
        chunks = []
        for i in range(n):
            L = rng.randint(lo, hi)
            table = [1 + (s * 8 + i) % 8 * width + j for j in range(width)]
            chunks.append(([rng.randrange(cfg.vocab_size) for _ in range(L)], 0, table, None))
        out.append(chunks)
    return out


@pytest.mark.parametrize("packed", ["1024", "0"])
@pytest.mark.parametrize("model,share", [("tiny-llama", False), ("tiny-qwen3", False), ("tiny-qwen3", True)])
def test_prefill_graph_replays_equal_eager_and_reference(model, share, packed, monkeypatch):
    """packed "1024": each step's fresh prompts as one packed graph; "0": grouped by length, left-padded."""
    monkeypatch.setenv("MPK_PREFILL_PACKED_ROWS", packed)
    from mpk_runtime.models import ReferenceModel, load_config, random_weights
    from mpk_runtime.runtime.conventional_prefill import ConventionalPrefill
    from mpk_runtime.runtime.memory import KVStore
    cfg = load_config(model)
    dev = torch.device("cuda")
    w = {k: v.to(dev, torch.bfloat16) for k, v in random_weights(cfg, seed=3).items()}
    width = -(-MAXLEN // PS)
    runs = {}
    for capture in (False, True):
        kv = KVStore(cfg.num_layers, 8 * width + 1, PS, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, device=dev,
                     poison=False)
        pre = ConventionalPrefill(cfg, w, kv, max_seq_len=MAXLEN, page_size=PS, dtype="bfloat16", device=dev,
                                  capture=capture, share_activations=share)
        runs[capture] = [pre.run_many(chunks) for chunks in _steps(cfg, width)]
        if capture:
            assert pre.capture and pre.captures >= 2 and pre.replays == pre.graph_runs, (pre.captures, pre.replays)
            assert pre.packed_runs == (5 if packed != "0" else 0)
        else:
            assert pre.captures == 0 and pre.replays == 0
    ref = ReferenceModel(cfg, w)
    for s, chunks in enumerate(_steps(cfg, width)):
        (le, te), (lg, tg) = runs[False][s], runs[True][s]
        assert torch.equal(le, lg) and te == tg, f"step {s}: graph replay differs from the eager run"
        for i, (toks, *_rest) in enumerate(chunks):
            want = ref.forward(torch.tensor([toks], device=dev), torch.zeros(1, dtype=torch.long, device=dev),
                               ref.new_cache(1, MAXLEN))[0, -1].float().cpu()
            err = ((lg[i] - want).abs().max() / want.abs().max()).item()
            assert err < 3e-2, f"step {s} chunk {i}: relative error {err} vs the reference"


def test_warm_captures_short_prompt_buckets_ahead():
    """warm() captures the (sequences, tokens) buckets of short prompts up front: a step of such prompts then
    replays without capturing, and gives the logits of an unwarmed run."""
    from mpk_runtime.models import load_config, random_weights
    from mpk_runtime.runtime.conventional_prefill import ConventionalPrefill
    from mpk_runtime.runtime.memory import KVStore
    cfg = load_config("tiny-llama")
    dev = torch.device("cuda")
    w = {k: v.to(dev, torch.bfloat16) for k, v in random_weights(cfg, seed=3).items()}
    width = -(-MAXLEN // PS)
    chunks = [([(7 * i + j) % cfg.vocab_size for j in range(4 + 3 * i)], 0, [1 + i * width + j for j in range(width)],
               None) for i in range(3)]                      # 3 prompts of 4-10 tokens: bucket (4 seqs, 16 tokens)
    out = {}
    for warm in (False, True):
        kv = KVStore(cfg.num_layers, 8 * width + 1, PS, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, device=dev,
                     poison=False)
        pre = ConventionalPrefill(cfg, w, kv, max_seq_len=MAXLEN, page_size=PS, dtype="bfloat16", device=dev)
        if warm:
            n = pre.warm(max_batch=4, max_tokens=32)
            assert n == 12 == pre.captures, n               # sequences 1, 2, 4 x tokens 16, 32, padded and packed
        before = pre.captures
        out[warm] = pre.run_many(chunks)
        assert pre.replays == pre.graph_runs == 1
        assert (pre.captures == before) if warm else (pre.captures == before + 1)
    assert torch.equal(out[False][0], out[True][0]) and out[False][1] == out[True][1]
