"""The GPU runner's plan machinery (runtime/megakernel_plans.py), run on the CPU twin: PlannedDecoder picks the
bucket of each step's row count, writes the step's inputs in place (inactive padding rows), and every plan family
gives the reference model's logits; ConventionalPrefill gives the reference prefill logits; the key-length cap of a
captured step covers the longest sequence."""
import pytest
import torch

from mpk_runtime.ir.shard import shard_for
from mpk_runtime.models import PRESETS, ReferenceModel, random_weights
from mpk_runtime.planner import plan_book
from mpk_runtime.runtime.megakernel_plans import ConventionalPrefill, PlannedDecoder, kv_cap
from mpk_runtime.runtime.memory import KVStore

PS, MAXLEN = 4, 32


def _setup(name):
    cfg = PRESETS[name].replace(dtype="float32")
    w = random_weights(cfg, seed=3)
    kv = KVStore(cfg.num_layers, 40, PS, shard_for(cfg, 1, 0).n_kv, cfg.head_dim, torch.float32, poison=False)
    return cfg, w, kv


def test_kv_cap():
    assert kv_cap(1, 4096) == 256 and kv_cap(256, 4096) == 256 and kv_cap(257, 4096) == 512
    assert kv_cap(3000, 2048) == 2048


@pytest.mark.parametrize("family", ["mono", "attn-conv", "conventional"])
def test_planned_decoder_matches_reference(family):
    cfg, w, kv = _setup("tiny-qwen3")
    book = plan_book(cfg, 1, (2, 4), context=16, families=(family,))
    dec = PlannedDecoder(cfg, w, kv, book, max_seq_len=MAXLEN, page_size=PS, num_sms=4, dtype="float32",
                         device=torch.device("cpu"), backend="pyvm")
    pre = ConventionalPrefill(cfg, w, kv, max_seq_len=MAXLEN, page_size=PS, dtype="float32",
                              device=torch.device("cpu"))
    ref = ReferenceModel(cfg, w)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(4)]
    caches, toks, lens = [], [], []
    for i, p in enumerate(prompts):
        c = ref.new_cache(1, MAXLEN)
        want = ref.forward(torch.tensor([p]), torch.zeros(1, dtype=torch.long), c)[0, -1]
        got, tok = pre.run(p, 0, tables[i])
        assert ((got - want).abs().max() / want.abs().max()) < 1e-5
        assert tok == int(want.argmax())
        caches.append(c)
        toks.append(tok)
        lens.append(len(p))
    # steps of 4, 1 and 3 live rows (buckets 4, 2, 4): rows past n are padding
    for rows in ([0, 1, 2, 3], [2], [3, 0, 1]):
        lg, nxt = dec.decode([toks[i] for i in rows], [lens[i] for i in rows], [tables[i] for i in rows])
        assert lg.shape[0] == len(rows)
        for j, i in enumerate(rows):
            want = ref.forward(torch.tensor([[toks[i]]]), torch.tensor([lens[i]]), caches[i])[0, 0]
            assert ((lg[j] - want).abs().max() / want.abs().max()) < 1e-5, (family, rows, i)
            assert int(nxt[j]) == int(want.argmax())
            toks[i], lens[i] = int(nxt[j]), lens[i] + 1
    assert set(dec.used) == {2, 4} and set(dec.used.values()) == {family}
    with pytest.raises(ValueError, match="largest bucket"):
        dec.decode([1] * 5, [1] * 5, [tables[0]] * 5)


def test_gpu_runner_plans_refused_at_tp2():
    from mpk_runtime.engine.llm import LLM
    with pytest.raises(Exception, match="world size 1"):
        LLM("tiny-llama", backend="megakernel", tp=2, max_batch=2, plan="auto")
