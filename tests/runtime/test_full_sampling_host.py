"""The full-vocabulary draw of one host row (runtime/full_sampling.py draw_row, session 73) against FullRows' torch
form, which it must equal token for token: per-thread buffers, the uniforms in Python integers, one masked copy a
nucleus round, the zero-exp entries skipped, ranked rows' candidates from candidate_pool's blocks. Also the pieces on
their own, bitwise: _exp_ against torch.exp, and the fact it rests on (torch's fp32 exp is 0 below EXP_ZERO_BELOW)."""
import random

import numpy as np
import pytest
import torch

from mpk_runtime.runtime import full_sampling as fs
from mpk_runtime.runtime.device_sampling import DeviceSampling
from mpk_runtime.runtime.full_sampling import FullRows, draw_row


def torch_form(x: torch.Tensor, T: float, k: int, p: float, seed: int, pos: int) -> int:
    out = torch.full((1,), -7, dtype=torch.int64)
    FullRows([DeviceSampling(T, k, p, seed, full=True)], "cpu", x.numel()).draw(
        x[None], torch.tensor([pos]), out, impl="torch")
    return int(out[0])


def rows(rng: random.Random, V: int):
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    x = torch.randn(V, generator=g) * rng.choice([0.5, 2.0, 8.0, 30.0])
    yield x
    yield torch.round(x)                                           # ties everywhere
    y = x.clone()
    y[torch.rand(V, generator=g) < 0.9] = float("-inf")           # min_p's / a grammar's mask
    yield y
    yield torch.full((V,), rng.choice([0.0, -0.0, 3.0]))           # one tie
    z = x.clone()
    z[rng.randrange(V)] = float("nan")
    yield z                                                        # a bad row: -1 in both


@pytest.mark.parametrize("mode", ["vocab", "nucleus", "ranked"])
def test_draw_row_draws_the_torch_forms_token(mode):
    rng = random.Random({"vocab": 1, "nucleus": 2, "ranked": 3}[mode])
    n = 0
    for trial in range(40):
        V = rng.choice([2, 65, 300, 4096, 5003, 30011])
        for x in rows(rng, V):
            T = rng.choice([1.0001e-5, 0.02, 0.25, 0.7, 1.0, 3.0, 1e4])
            k = rng.choice([0, V, V + 9]) if mode != "ranked" else rng.choice([1, 65, 100, 500, V - 1])
            p = 1.0 if mode == "vocab" else rng.choice([0.999, 0.95, 0.7, 0.3, 0.01, 1e-9])
            if mode == "ranked":
                p = rng.choice([1.0, p])
            if not 0 < k < V and mode == "ranked":
                continue
            for pos in (rng.randrange(1 << 31), rng.randrange(100)):
                seed = rng.randrange(-(1 << 63), 1 << 64)
                assert draw_row(x, T, k, p, seed, pos) == torch_form(x, T, k, p, seed, pos), (trial, V, T, k, p)
                n += 1
    assert n > 300


def test_exp_equals_torch_exp_bitwise():
    g = torch.Generator().manual_seed(0)
    specials = torch.tensor([0.0, -0.0, -1e-45, -87.3, -88.0, -103.9, -103.97, -104.0, -104.00001, -104.01,
                             -109.99, -110.0, -110.01, -200.0, -3.4e38, float("-inf")])
    for scale, nan in ((1.0, False), (30.0, False), (60.0, False), (120.0, False), (1e4, False), (1e4, True)):
        for n in (1, 7, 15, 1000, 152064):
            f = -(torch.rand(n, generator=g) * scale)
            f[:min(n, specials.numel())] = specials[:n]
            if nan:
                f[n // 2] = float("nan")
            f = f[torch.randperm(n, generator=g)][None]
            want = torch.exp(f)
            got = f.clone()
            fs._exp_(got)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (scale, n)


def test_torch_exp_is_zero_below_the_cut():
    """What _exp_ rests on: every fp32 below EXP_ZERO_BELOW (sampled: 4M values, the edges, -inf) exps to +0.0; and
    between it and -104 (every fp32 there) where the cut is -104."""
    g = torch.Generator().manual_seed(1)
    cut = fs.EXP_ZERO_BELOW
    below = np.nextafter(np.float32(cut), np.float32(-np.inf))
    y = torch.cat([torch.tensor([float(below), cut - 1e-4, -1e3, -3.4028235e38, float("-inf")]),
                   cut - torch.rand(2_000_000, generator=g) * 20,
                   cut - torch.rand(2_000_000, generator=g).pow(8) * 3e38])
    assert torch.equal(torch.exp(y).view(torch.int32), torch.zeros_like(y).view(torch.int32))
    zc = fs._exp_zero_cut()
    assert zc in (float(below), float(np.nextafter(np.float32(-104.0), np.float32(-np.inf))))
    span = torch.from_numpy(np.arange(np.float32(-104.0).view(np.int32) + 1, np.float32(cut).view(np.int32) + 1,
                                      dtype=np.int32).view(np.float32))   # every fp32 in (-110, -104) and -110
    assert float(span.max()) < -104.0 and float(span.min()) == cut and span.numel() > 700_000
    if zc > cut:
        assert bool((torch.exp(span) == 0).all())
    assert float(torch.exp(torch.tensor(-104.0))) >= 0.0


def test_ranked_candidates_are_the_torch_forms():
    """Without a tie at the K-th place the K come from the blocks; with one, torch.topk picks as candidates() does."""
    rng = random.Random(4)
    for trial in range(200):
        V = rng.choice([700, 4096, 5003, 20000])
        K = rng.choice([65, 100, 300, V // 9])
        x = torch.randn(V, generator=torch.Generator().manual_seed(trial))
        if trial % 2:
            x = torch.round(x * 3)   # (ties at the edge: the torch.topk way)
        want = fs._RankedRows([(0, DeviceSampling(1.0, K, 1.0, 0, full=True))], "cpu").candidates(x[None])
        got = fs._ranked_candidates(x, K)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (trial, V, K)


def test_host_buffers_are_per_thread_and_per_vocabulary():
    import threading
    x1, x2 = torch.randn(5000), torch.randn(7000)
    want = [torch_form(x, 0.9, 0, 0.8, s, s) for x in (x1, x2) for s in range(20)]
    got = {}

    def run(i):
        got[i] = [draw_row(x, 0.9, 0, 0.8, s, s) for x in (x1, x2) for s in range(20)]
    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(got[i] == want for i in range(4))
