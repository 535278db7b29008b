"""The full-vocabulary sampler (runtime/full_sampling.py) against an independent pure-Python reference of its
definition (the host sampler's distribution: temperature, top-k, top-p, renormalised; inverse CDF at uniform53)."""
import itertools
import math
import os
import random

import pytest
import torch

from mpk_runtime.ir.sampling import uniform53 as uniform53_ref
from mpk_runtime.runtime.device_sampling import DeviceSampling, draw_full, fill_sampling
from mpk_runtime.runtime.full_sampling import FullRows, uniform53
from mpk_runtime.runtime.triton_support import triton


def ref_draw(logits: list[float], s: DeviceSampling, u: float) -> int:
    """Python floats, one row: the token the definition draws at uniform u."""
    x = (torch.tensor(logits, dtype=torch.float32) / torch.tensor(s.temperature, dtype=torch.float32)).tolist()
    if not all(math.isfinite(v) for v in x):
        return -1
    V = len(x)
    if s.top_k == 0 and s.top_p >= 1.0:
        cand = list(range(V))          # vocabulary order
        top = max(x)
    else:
        k = s.top_k if 0 < s.top_k < V else V
        cand = sorted(range(V), key=lambda i: (-logits[i], i))[:k]   # (logit desc, index asc)
        top = x[cand[0]]
    e = [math.exp(x[i] - top) for i in cand]
    cum, c = [], 0.0
    for v in e:
        c += v
        cum.append(c)
    m = len(cand)
    if not (s.top_k == 0 and s.top_p >= 1.0):
        m = sum(1 for j in range(len(cand)) if j == 0 or cum[j] - e[j] < s.top_p * cum[-1])
    mass = cum[m - 1]
    r = min(u * mass, math.nextafter(mass, 0.0))
    j = next(j for j in range(m) if cum[j] > r)
    return cand[j]


def cdf_interval(logits: list[float], s: DeviceSampling, token: int) -> tuple[float, float] | None:
    """[lo, hi): the uniforms u for which the definition draws `token` from these logits (None: never drawn). For
    checks against a reference whose logits are close to the drawing model's but not equal (bf16 vs fp32)."""
    x = (torch.tensor(logits, dtype=torch.float32) / torch.tensor(s.temperature, dtype=torch.float32)).tolist()
    V = len(x)
    plain = s.top_k == 0 and s.top_p >= 1.0
    k = V if plain or not 0 < s.top_k < V else s.top_k
    cand = list(range(V)) if plain else sorted(range(V), key=lambda i: (-logits[i], i))[:k]
    top = max(x[i] for i in cand)
    e = [math.exp(x[i] - top) for i in cand]
    cum = [sum(e[:j + 1]) for j in range(len(e))] if len(e) < 2000 else list(itertools.accumulate(e))
    m = len(cand) if plain else sum(1 for j in range(len(cand)) if j == 0 or cum[j] - e[j] < s.top_p * cum[-1])
    if token not in cand[:m]:
        return None
    j = cand.index(token)
    return (cum[j] - e[j]) / cum[m - 1], cum[j] / cum[m - 1]


def test_uniform53_matches_the_python_reference_bitwise():
    rnd = random.Random(0)
    seeds = [rnd.getrandbits(64) - (1 << 63) for _ in range(500)] + [0, -1, (1 << 63) - 1, -(1 << 63)]
    pos = [rnd.randrange(0, 1 << 31) for _ in seeds[:-4]] + [0, 1, (1 << 31) - 1, 7]
    got = uniform53(torch.tensor(seeds), torch.tensor(pos)).tolist()
    assert got == [uniform53_ref(s, p) for s, p in zip(seeds, pos)]
    assert all(0.0 <= u < 1.0 for u in got) and len(set(got)) == len(got)


PARAMS = [DeviceSampling(1.0, 0, 1.0, 5, full=True),      # plain: temperature only
          DeviceSampling(0.7, 0, 0.9, 6, full=True),      # nucleus over the whole vocabulary (sorted)
          DeviceSampling(1.3, 100, 0.95, 7, full=True),   # top-k above the graph sampler's 64
          DeviceSampling(0.5, 500, 1.0, 8, full=True),    # top-k above the vocabulary
          DeviceSampling(2.0, 65, 0.3, 9, full=True)]


@pytest.mark.parametrize("quantised", [False, True])
@pytest.mark.parametrize("rows", [PARAMS, [PARAMS[2], PARAMS[4], DeviceSampling(3.0, 200, 1.0, 10, full=True)]],
                         ids=["sorted", "topk"])   # a group's candidates: the whole vocabulary sorted, or top-200
def test_draws_equal_the_reference_row_by_row(quantised, rows):
    """Every (row, position) draws the reference's token; quantised logits have many ties: (value desc, index asc)."""
    g = torch.Generator().manual_seed(1)
    V = 300
    logits = torch.randn(len(rows), V, generator=g) * 3
    if quantised:
        logits = (logits * 2).round() / 2
    fr = FullRows(rows, "cpu")
    for p in range(0, 400, 7):
        pos = torch.full((len(rows),), p, dtype=torch.int64)
        out = torch.full((len(rows),), -7, dtype=torch.int64)
        fr.draw(logits, pos, out)
        ref = [ref_draw(logits[i].tolist(), s, uniform53_ref(s.seed, p)) for i, s in enumerate(rows)]
        assert out.tolist() == ref, p


def test_frequencies_follow_the_distribution():
    """20000 positions of one row: token frequencies within 4 sigma of the renormalised top-k / top-p softmax."""
    V = 40
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2)) * 2
    for s in (DeviceSampling(0.8, 0, 1.0, 1, full=True), DeviceSampling(1.2, 0, 0.8, 2, full=True),
              DeviceSampling(1.0, 12, 0.9, 3, full=True)):
        N = 20000
        fr = FullRows([s] * N, "cpu")
        out = torch.empty(N, dtype=torch.int64)
        fr.draw(logits.expand(N, V), torch.arange(N), out, impl="torch")   # (20000 rows: too many to interpret)
        freq = torch.bincount(out, minlength=V).double() / N
        x = logits[0].double() / s.temperature
        vals, idx = torch.sort(x, descending=True)
        k = s.top_k or V
        p = torch.softmax(vals[:k], -1)
        keep = max(1, int(((torch.cumsum(p, -1) - p) < s.top_p).sum()))
        want = torch.zeros(V, dtype=torch.float64)
        want[idx[:keep]] = p[:keep] / p[:keep].sum()
        sigma = (want * (1 - want) / N).sqrt()
        assert bool(((freq - want).abs() <= 4 * sigma + 1e-12).all()), s
        assert float(freq[want == 0].sum()) == 0.0


def test_rows_do_not_depend_on_their_batch_and_bad_rows_fail_alone():
    V = 200
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3))
    logits[2, 17] = float("nan")
    logits[4, 3] = float("inf")
    rows = [PARAMS[i % len(PARAMS)] for i in range(6)]
    pos = torch.arange(10, 16)
    out = torch.zeros(6, dtype=torch.int64)
    FullRows(rows, "cpu").draw(logits, pos, out)
    for i in range(6):
        alone = torch.zeros(1, dtype=torch.int64)
        FullRows([rows[i]], "cpu").draw(logits[i:i + 1], pos[i:i + 1], alone)
        assert int(alone) == int(out[i])
    assert out[2] == -1 and out[4] == -1 and bool((out[[0, 1, 3, 5]] >= 0).all())


def test_draw_full_overwrites_only_full_rows_of_a_memory():
    """fill_sampling keeps the full rows beside the sample.* tensors; draw_full writes next_tokens of those only, and
    refuses vocabulary shards."""
    from types import SimpleNamespace
    V = 64
    names = ("sample.temperature", "sample.top_k", "sample.top_p", "sample.seed", "next_tokens")
    tensors = {n: torch.zeros(4, dtype=torch.int64 if n in ("sample.top_k", "sample.seed", "next_tokens")
                              else torch.float32) for n in names}
    mem = SimpleNamespace(tensors=tensors, t=tensors.__getitem__,
                          graph=SimpleNamespace(config=SimpleNamespace(vocab_size=V)))
    rows = [None, DeviceSampling(0.9, 10, 1.0, 3), PARAMS[1], PARAMS[0]]
    fill_sampling(mem, rows)
    # the graph draws full rows greedily (cheapest; their token is drawn again)
    assert mem.t("sample.top_k").tolist() == [0, 10, 0, 0] and mem.t("sample.temperature")[2:].tolist() == [0, 0]
    mem.t("next_tokens").copy_(torch.tensor([-5, -6, -7, -8]))
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(4))
    draw_full(mem, logits, [3, 4, 5, 6])
    nt = mem.t("next_tokens").tolist()
    assert nt[:2] == [-5, -6]
    assert nt[2:] == [ref_draw(logits[i].tolist(), rows[i], uniform53_ref(rows[i].seed, 1 + i + 2)) for i in (2, 3)]
    with pytest.raises(ValueError, match="whole vocabulary"):
        draw_full(mem, logits[:, :32], [3, 4, 5, 6])
    fill_sampling(mem, [None, rows[1]])   # no full row: nothing drawn
    mem.t("next_tokens").fill_(-1)
    draw_full(mem, logits, [0, 0, 0, 0])
    assert mem.t("next_tokens").tolist() == [-1] * 4


def test_cdf_interval_holds_the_drawn_uniform():
    V = 120
    logits = torch.randn(len(PARAMS), V, generator=torch.Generator().manual_seed(5))
    for p in range(20):
        out = torch.zeros(len(PARAMS), dtype=torch.int64)
        FullRows(PARAMS, "cpu").draw(logits, torch.full((len(PARAMS),), p), out)
        for i, s in enumerate(PARAMS):
            lo, hi = cdf_interval(logits[i].tolist(), s, int(out[i]))
            assert lo - 1e-12 <= uniform53_ref(s.seed, p) < hi + 1e-12


@pytest.mark.skipif(triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernel on the CPU needs Triton and TRITON_INTERPRET=1 (scripts/test.sh)")
@pytest.mark.parametrize("rows", [PARAMS, PARAMS[:1], [PARAMS[2], PARAMS[4]]], ids=["mixed", "plain", "topk"])
def test_triton_kernel_draws_the_torch_tokens(rows):
    """The Triton kernel (_draw_kernel, interpreted) and the torch ops draw the same tokens; NaN rows give -1."""
    V = 3000
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(6)) * 3
    logits[0, :10] = (logits[0, :10] * 2).round() / 2
    fr = FullRows(rows, "cpu")
    for p in (0, 1, 99, 12345):
        pos = torch.full((len(rows),), p, dtype=torch.int64)
        a, b = torch.zeros(len(rows), dtype=torch.int64), torch.zeros(len(rows), dtype=torch.int64)
        fr.draw(logits, pos, a, impl="torch")
        fr.draw(logits, pos, b, impl="triton")
        assert a.tolist() == b.tolist(), p
    logits[-1, 5] = float("nan")
    b = torch.zeros(len(rows), dtype=torch.int64)
    fr.draw(logits, torch.zeros(len(rows), dtype=torch.int64), b, impl="triton")
    assert int(b[-1]) == -1


def test_device_sampling_full_validation():
    with pytest.raises(ValueError, match="top_k"):
        DeviceSampling(1.0, 65, 1.0, 0)
    with pytest.raises(ValueError, match="temperature > 0"):
        DeviceSampling(0.0, 0, 1.0, 0, full=True)
    assert DeviceSampling(1.0, 1000, 1.0, 0, full=True).top_k == 1000
