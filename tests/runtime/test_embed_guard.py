"""A token id outside the embedding table reads a valid row (the last one), on every path that gathers the table.

Such an id reaches the embed only through the device's own feedback: a row whose logits hold NaN / inf draws
PAD_INDEX (ir/sampling.py step 6), and within a launch of several steps, or a burst of decode steps, that token is
the next step's input before the host sees it (the engine then fails that one request). Until session 75 the
megakernel read table + PAD_INDEX * H (a fault that ends the CUDA context, every request with it) and torch's
index_select asserted on the device: one request's NaN took the whole engine down. -1 (the full-vocabulary draw's
mark) reads row 0, as before."""
import pytest
import torch

from mpk_runtime.ir.sampling import PAD_INDEX
from mpk_runtime.models import PRESETS, random_weights
from mpk_runtime.runtime.pyvm_runner import TPGroup, shard_weights
from mpk_runtime.tasks import Tiling


def _group(tp=1):
    cfg = PRESETS["tiny-llama"].replace(dtype="float32")
    w = random_weights(cfg, seed=5, dtype="float32")
    return cfg, TPGroup(cfg, [shard_weights(cfg, w, tp, r) for r in range(tp)], num_pages=9, page_size=4,
                        max_seq_len=32, tiling=Tiling(num_sms=4, linear_cols=16, allreduce_cols=16), attn_splits=2)


@pytest.mark.parametrize("backend", ["pyvm", "torch"])
@pytest.mark.parametrize("tp", [1, 2])
def test_out_of_range_token_reads_the_last_row(backend, tp):
    cfg, _ = _group(tp)
    V = cfg.vocab_size
    got = {}
    for tok in (PAD_INDEX, V, V - 1, -1, 0):
        _, grp = _group(tp)   # (a fresh cache each: the step writes its K / V at position 0)
        got[tok] = grp.decode([tok], [0], [list(range(1, 9))], backend=backend)[0]
        assert torch.isfinite(got[tok]).all()
    assert torch.equal(got[PAD_INDEX], got[V - 1]) and torch.equal(got[V], got[V - 1])
    assert torch.equal(got[-1], got[0]) and not torch.equal(got[0], got[V - 1])
