"""The head-major KV layout (KVStore layout "hnd", MPK_KV_LAYOUT=hnd): a head's rows of a page are one contiguous
block, every executor indexes the cache through the same (page, slot, head, D) view, and a decode gives the same
logits, tokens and cache contents, bit for bit, as the token-major default - pyvm (the megakernel's twin, whose
task kernels index the view) and the torch executor (the conventional path: flat slots become (page, slot) pairs)."""
import pytest
import torch

from mpk_runtime.models import PRESETS
from mpk_runtime.runtime.memory import KVStore, kv_layout_default

from tests.runtime.test_pyvm import ODD, STEPS, setup


def test_hnd_pages_are_head_blocks():
    kv = KVStore(2, 5, 4, 3, 8, torch.float32, poison=False, layout="hnd")
    k = kv.k[1]
    assert k.shape == (6, 4, 3, 8)                           # indexed (page, slot, head, D) like "nhd"
    k.copy_(torch.arange(k.numel(), dtype=torch.float32).view(k.shape))
    base = k.permute(0, 2, 1, 3)                              # the storage: (page, head, slot, D)
    assert base.is_contiguous() and not k.is_contiguous()
    flat = base.reshape(-1)
    blk = (2 * 3 + 1) * 4 * 8                                 # page 2, head 1: one block of page_size x D
    assert torch.equal(flat[blk:blk + 32].view(4, 8), k[2, :, 1])
    nhd = KVStore(2, 5, 4, 3, 8, torch.float32, poison=False, layout="nhd")
    assert nhd.k[0].is_contiguous() and nhd.layout == "nhd"


def test_layout_switch_checked(monkeypatch):
    monkeypatch.setenv("MPK_KV_LAYOUT", "hnd")
    assert kv_layout_default() == "hnd" and KVStore(1, 2, 4, 1, 8, torch.float32).layout == "hnd"
    monkeypatch.setenv("MPK_KV_LAYOUT", "")
    assert kv_layout_default() == "nhd"
    monkeypatch.setenv("MPK_KV_LAYOUT", "khd")
    with pytest.raises(ValueError, match="MPK_KV_LAYOUT='khd'"):
        KVStore(1, 2, 4, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="KV layout 'x'"):
        KVStore(1, 2, 4, 1, 8, torch.float32, layout="x")


def _run(monkeypatch, layout, cfg, tp, batch, backend):
    monkeypatch.setenv("MPK_KV_LAYOUT", layout)
    grp, lens, tables, ref_logits, toks = setup(cfg, tp, batch, num_sms=5)
    assert all(kv.layout == layout for kv in grp.kv)
    out = []
    for s in range(STEPS):
        lg = grp.decode(toks[s].tolist(), [n + s for n in lens], tables, backend=backend)
        err = ((lg - ref_logits[s]).abs().max() / ref_logits[s].abs().max()).item()
        assert err <= 1e-5, f"{layout} {backend} step {s}: relative error {err}"
        out.append(lg)
    caches = [torch.stack([c.contiguous() for c in kv.k + kv.v]) for kv in grp.kv]
    return torch.stack(out), caches


@pytest.mark.parametrize("cfg,tp,batch,backend", [
    (PRESETS["tiny-llama"], 1, 4, "pyvm"), (PRESETS["tiny-qwen3"], 2, 3, "pyvm"), (ODD, 1, 4, "pyvm"),
    (PRESETS["tiny-llama"], 1, 4, "torch"), (PRESETS["tiny-qwen3"], 2, 3, "torch")])
def test_hnd_decode_equals_nhd(monkeypatch, cfg, tp, batch, backend):
    a, ca = _run(monkeypatch, "nhd", cfg, tp, batch, backend)
    b, cb = _run(monkeypatch, "hnd", cfg, tp, batch, backend)
    assert torch.equal(a, b)
    for x, y in zip(ca, cb):   # the same values in every written slot (unwritten: the same NaN poison)
        assert torch.equal(torch.nan_to_num(x, nan=7.0), torch.nan_to_num(y, nan=7.0))


@pytest.mark.parametrize("backend", ["pyvm", "torch"])
def test_engine_generates_the_same_tokens_with_head_major_pages(monkeypatch, backend):
    """The whole engine (prefill through the conventional path, decode through the backend, continuous batching
    over pages the allocator hands out) with MPK_KV_LAYOUT=hnd: the same greedy tokens as the default layout."""
    from mpk_runtime.engine import LLM, SamplingParams
    prompts = [[1, 2, 3, 4, 5], [7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [100, 200, 300]]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for layout in ("nhd", "hnd"):
        monkeypatch.setenv("MPK_KV_LAYOUT", layout)
        with LLM("tiny-qwen3", backend=backend, dtype="float32", max_seq_len=64, max_batch=4) as llm:
            outs[layout] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert outs["hnd"] == outs["nhd"] and all(len(t) == 10 for t in outs["hnd"])
