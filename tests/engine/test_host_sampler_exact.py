"""The host sampler's fast draw (engine/sampling.py sample(), session 73: candidate blocks, per-thread buffers, numpy
for the candidates' fp32 arithmetic, fewer vocabulary passes) draws exactly the token of the formulation it replaced
(session 72): the device samplers' own definitions run on the row - tasks/ops/argmax.py sample_logits (the graph's
top-C draw, an order key for every entry) for 1 <= top_k <= 64, runtime/full_sampling.py FullRows' torch form
otherwise. Any token that differs fails; rows with ties, +-0.0, -inf, a single finite entry, constant rows, tiny and
huge temperatures, every top_k / top_p / min_p regime; the bad rows (NaN, +-inf) fail in both."""
import math
import random

import pytest
import torch

from mpk_runtime.engine.sampling import SamplingParams, sample
from mpk_runtime.ir.sampling import SAMPLE_CANDIDATES, seed_to_int64
from mpk_runtime.runtime.device_sampling import DeviceSampling
from mpk_runtime.runtime.full_sampling import FullRows
from mpk_runtime.tasks.ops.argmax import sample_logits


def reference_sample(logits: torch.Tensor, params: SamplingParams, seed: int, pos: int):
    """sample() as session 72 wrote it, its top-C draw by sample_logits (which its sample_row was checked equal to):
    the token, or "error" where it raised."""
    if params.greedy:
        raise AssertionError("sampled params only")
    x = logits.float().reshape(1, -1)
    top = x.max()
    if bool(torch.isnan(x).any()) or not bool(torch.isfinite(top)):
        return "error"
    T = float(params.temperature)
    if params.min_p > 0:
        x = x.masked_fill(x < top + T * math.log(params.min_p), float("-inf"))
    if 1 <= params.top_k <= SAMPLE_CANDIDATES:
        tok = int(sample_logits(x, [T], [params.top_k], [float(params.top_p)], [seed_to_int64(seed)], [pos],
                                SAMPLE_CANDIDATES)[0])
    else:
        out = torch.full((1,), -1, dtype=torch.int64)
        FullRows([DeviceSampling(T, max(0, params.top_k), float(params.top_p), seed, full=True)], x.device,
                 x.shape[1]).draw(x, torch.tensor([pos], dtype=torch.int64), out, impl="torch")
        tok = int(out[0])
    return tok if 0 <= tok < x.shape[1] else "error"


def fast_sample(logits, params, seed, pos):
    try:
        return sample(logits, params, seed, pos)
    except ValueError:
        return "error"


def random_row(rng: random.Random, V: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    kind = rng.randrange(10)
    x = torch.randn(V, generator=g) * rng.choice([0.2, 1.0, 3.0, 10.0, 40.0])
    if kind == 0:                                    # many ties
        x = torch.round(x * 2) / 2
    elif kind == 1:                                  # +-0.0 among them
        x[torch.randint(0, V, (V // 3 + 1,), generator=g)] = 0.0
        x[torch.randint(0, V, (V // 4 + 1,), generator=g)] = -0.0
        if rng.random() < 0.5:
            x = torch.minimum(x, torch.zeros(()))    # (zeros are the top: they tie at the candidates' edge)
    elif kind == 2:                                  # masked vocabulary
        x[torch.rand(V, generator=g) < rng.choice([0.5, 0.99, 1.0])] = float("-inf")
        x[rng.randrange(V)] = rng.choice([0.0, 3.5, -7.25])
    elif kind == 3:                                  # constant rows
        x = torch.full((V,), rng.choice([0.0, -0.0, 1.5, -2.0]))
    elif kind == 4:                                  # an LLM-like row: the bulk far below a few peaks
        x = x * 0 + torch.randn(V, generator=g) * 2.5
        x[torch.randint(0, V, (8,), generator=g)] += 25.0
    elif kind == 5:                                  # ties at the top
        x[torch.randint(0, V, (rng.choice([2, 63, 64, 65, 100, 101]),), generator=g)] = float(x.max()) + 1.0
    return x


def random_params(rng: random.Random, V: int, case: str) -> SamplingParams:
    T = rng.choice([1.0001e-5, 1e-3, 0.05, 0.3, 0.7, 1.0, 1.5, 4.0, 1e4])
    top_p = rng.choice([1.0, 1.0, 0.999, 0.95, 0.9, 0.5, 0.1, 1e-6])
    min_p = 0.0
    if case == "temperature":
        return SamplingParams(temperature=T, top_k=rng.choice([0, -1]))
    if case == "top_p":
        return SamplingParams(temperature=T, top_p=top_p)
    if case == "top_k<=64":
        k = rng.choice([2, 5, 20, 50, 63, 64])
    elif case == "top_k>64":
        k = rng.choice([65, 100, 200, 1000, V - 1, V, V + 3])
    else:   # min_p, with any of the others
        min_p = rng.choice([1e-4, 0.05, 0.3, 1.0])
        k = rng.choice([0, 0, 20, 64, 100, V + 1])
    return SamplingParams(temperature=T, top_k=k, top_p=top_p, min_p=min_p)


CASES = ["temperature", "top_p", "top_k<=64", "top_k>64", "min_p"]


@pytest.mark.parametrize("case", CASES)
def test_fast_sample_draws_the_reference_token(case):
    rng = random.Random(CASES.index(case))
    checked, errors = 0, 0
    for trial in range(300):
        V = rng.choice([3, 64, 65, 300, 1000, 4096, 5003, 20011])
        x = random_row(rng, V)
        p = random_params(rng, V, case)
        if p.greedy:
            continue
        seed, pos = rng.randrange(-(1 << 63), 1 << 64), rng.randrange(0, 1 << 31)
        want = reference_sample(x, p, seed, pos)
        assert fast_sample(x, p, seed, pos) == want, (case, trial, V, p, seed, pos)
        checked += 1
        errors += want == "error"
    assert checked >= 250 and errors < checked // 4


@pytest.mark.parametrize("case", CASES)
def test_fast_sample_at_a_real_vocabulary(case):
    """V = 152064 (Qwen's padded vocabulary): the candidate blocks at the size they were tuned for."""
    rng = random.Random(7 + len(case))
    for trial in range(6):
        x = random_row(rng, 152064)
        p = random_params(rng, 152064, case)
        if p.greedy:
            continue
        for pos in range(3):
            seed = rng.randrange(1 << 64)
            assert fast_sample(x, p, seed, pos) == reference_sample(x, p, seed, pos), (case, trial, p, pos)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_bad_rows_fail_as_before(bad):
    for V in (50, 4096):
        for params in (SamplingParams(temperature=0.8), SamplingParams(top_p=0.9), SamplingParams(top_k=20),
                       SamplingParams(top_k=100), SamplingParams(min_p=0.1), SamplingParams(min_p=0.1, top_k=5)):
            for where in (0, V // 2, V - 1):
                x = torch.randn(V)
                if bad == float("-inf"):
                    x[:] = bad   # (a single -inf is a fine row; all of them is not)
                else:
                    x[where] = bad
                assert reference_sample(x, params, 3, 4) == "error"
                with pytest.raises(ValueError, match="NaN / inf"):
                    sample(x, params, 3, 4)


def test_logits_are_not_changed_and_views_are_taken():
    x = torch.randn(2, 3000)
    keep = x.clone()
    row = x[:, ::1][1]
    for params in (SamplingParams(temperature=0.5, min_p=0.2), SamplingParams(top_k=30), SamplingParams(top_k=300),
                   SamplingParams(top_p=0.5)):
        assert sample(row, params, 11, 12) == reference_sample(row, params, 11, 12)
        strided = x.t()[:, 0]   # (a non-contiguous row)
        assert sample(strided, params, 11, 12) == reference_sample(strided.contiguous(), params, 11, 12)
        assert sample(x[0].double(), params, 1, 2) == reference_sample(x[0], params, 1, 2)
    assert torch.equal(x, keep)


def test_min_p_mask_is_masked_fill_bitwise():
    """min_p's mask by torch.threshold (the fp32 below the threshold kept out) against masked_fill(x < thr, -inf):
    entries equal to the threshold, +-0.0 thresholds and entries, denormal thresholds, -inf."""
    from mpk_runtime.engine.sampling import _min_p_mask
    g = torch.Generator().manual_seed(5)
    for trial in range(200):
        V = [7, 1000, 152064][trial % 3]
        x = torch.round(torch.randn(V, generator=g) * 8) / 4
        x[torch.randint(0, V, (V // 5 + 1,), generator=g)] = -0.0
        x[torch.randint(0, V, (V // 9 + 1,), generator=g)] = float("-inf")
        x[torch.randint(0, V, (3,), generator=g)] = torch.tensor([1e-45, -1e-45, 1.2e-38])
        thr = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.2e-38, float(x[trial % V]), 0.25 * (trial % 13 - 6),
                            float("-inf")][trial % 8])
        want = x.masked_fill(x < thr, float("-inf"))
        assert torch.equal(_min_p_mask(x, thr).view(torch.int32), want.view(torch.int32)), (trial, float(thr))
