"""The full-vocabulary sampler (runtime/full_sampling.py) against an independent pure-Python reference of its
definition (inverse CDF at uniform53, rejection rounds for a vocab row's nucleus), and against the host sampler's
distribution (temperature, top-k, top-p, renormalised) by frequencies."""
import math
import os
import random

import pytest
import torch

from mpk_runtime.ir.sampling import uniform53 as uniform53_ref
from mpk_runtime.runtime.device_sampling import DeviceSampling, draw_full, fill_sampling
from mpk_runtime.runtime.full_sampling import FullRows, uniform53
from mpk_runtime.runtime.triton_support import triton


MAX_ROUNDS = 64


def _inverse_cdf(e: list[float], members: list[int], u: float) -> tuple[int, float]:
    """The first of `members` (indices into e, in order) whose running sum of e exceeds u * (their mass), and the
    distance of u * mass from that token's interval ends, relative to the mass."""
    cum, c = [], 0.0
    for i in members:
        c += e[i]
        cum.append(c)
    mass = cum[-1]
    r = min(u * mass, math.nextafter(mass, 0.0))
    j = next(j for j in range(len(cum)) if cum[j] > r)
    return members[j], min(r - (cum[j] - e[members[j]]), cum[j] - r) / mass


def ref_draw(logits: list[float], s: DeviceSampling, pos: int) -> tuple[int, float]:
    """Python floats, one row: (the token the definition draws (runtime/full_sampling.py's module doc), its margin:
    the smallest distance of any of the draw's decisions from its boundary, relative to the mass involved)."""
    x = (torch.tensor(logits, dtype=torch.float32) / torch.tensor(s.temperature, dtype=torch.float32)).tolist()
    if not all(math.isfinite(v) for v in x):
        return -1, 1.0
    V = len(x)
    rank = sorted(range(V), key=lambda i: (-logits[i], i))   # (logit desc, index asc)
    if 0 < s.top_k < V:   # ranked: candidates, the nucleus prefix, one inverse CDF in the ranking's order
        cand = rank[:s.top_k]
        e = [math.exp(x[i] - x[cand[0]]) for i in cand]
        total, before, m, margin = sum(e), 0.0, 0, 1.0
        for j, v in enumerate(e):
            if j and not before < s.top_p * total:
                break
            margin = min(margin, abs(before - s.top_p * total) / total) if j else margin
            before += v
            m += 1
        if m < len(e):
            margin = min(margin, abs(before - s.top_p * total) / total)
        j, mg = _inverse_cdf(e, list(range(m)), uniform53_ref(s.seed, pos))
        return cand[j], min(margin, mg)
    top = max(x)   # vocab: rounds of inverse CDF in vocabulary order, the nucleus by rejection
    e = [math.exp(v - top) for v in x]
    total = sum(e)
    place = {i: n for n, i in enumerate(rank)}
    members, margin = list(range(V)), 1.0
    for rnd in range(MAX_ROUNDS):
        tok, mg = _inverse_cdf(e, members, uniform53_ref(s.seed, pos, rnd))
        margin = min(margin, mg)
        if s.top_p >= 1.0:
            return tok, margin
        ahead = [i for i in range(V) if place[i] < place[tok]]
        before = sum(e[i] for i in ahead)
        margin = min(margin, abs(before - s.top_p * total) / total)
        if before < s.top_p * total or rnd == MAX_ROUNDS - 1:
            return tok, margin
        members = ahead
    raise AssertionError("unreachable")


def test_uniform53_matches_the_python_reference_bitwise():
    rnd = random.Random(0)
    seeds = [rnd.getrandbits(64) - (1 << 63) for _ in range(500)] + [0, -1, (1 << 63) - 1, -(1 << 63)]
    pos = [rnd.randrange(0, 1 << 31) for _ in seeds[:-4]] + [0, 1, (1 << 31) - 1, 7]
    for r in (0, 1, 5):
        got = uniform53(torch.tensor(seeds), torch.tensor(pos), r).tolist()
        assert got == [uniform53_ref(s, p, r) for s, p in zip(seeds, pos)]
        assert all(0.0 <= u < 1.0 for u in got) and len(set(got)) == len(got)
    assert uniform53_ref(3, 4, 1) != uniform53_ref(3, 4, 0)


PARAMS = [DeviceSampling(1.0, 0, 1.0, 5, full=True),      # vocab: temperature only
          DeviceSampling(0.7, 0, 0.9, 6, full=True),      # vocab: a nucleus (rejection rounds)
          DeviceSampling(1.3, 100, 0.95, 7, full=True),   # ranked: top-k above the graph sampler's 64
          DeviceSampling(0.5, 500, 1.0, 8, full=True),    # top-k above the vocabulary: a vocab row
          DeviceSampling(2.0, 65, 0.3, 9, full=True),
          DeviceSampling(1.0, 0, 0.2, 10, full=True)]     # a small nucleus: several rounds


def _draw(rows, logits, p, impl=None):
    out = torch.full((len(rows),), -7, dtype=torch.int64)
    FullRows(rows, "cpu", logits.shape[1]).draw(logits, torch.full((len(rows),), p, dtype=torch.int64), out, impl)
    return out.tolist()


@pytest.mark.parametrize("quantised", [False, True])
@pytest.mark.parametrize("rows", [PARAMS, [PARAMS[2], PARAMS[4], DeviceSampling(3.0, 200, 1.0, 10, full=True)]],
                         ids=["mixed", "ranked"])
def test_draws_equal_the_reference_row_by_row(quantised, rows):
    """Every (row, position) draws the reference's token; quantised logits have many ties: (logit desc, index asc)."""
    V = 300
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(1)) * 3
    if quantised:
        logits = (logits * 2).round() / 2
    for p in range(0, 400, 7):
        assert _draw(rows, logits, p) == [ref_draw(logits[i].tolist(), s, p)[0] for i, s in enumerate(rows)], p


def test_frequencies_follow_the_distribution():
    """20000 positions of one row: token frequencies within 4 sigma of the renormalised top-k / top-p softmax (the
    host sampler's definition, by a full sort here)."""
    V = 40
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2)) * 2
    for s in (DeviceSampling(0.8, 0, 1.0, 1, full=True), DeviceSampling(1.2, 0, 0.8, 2, full=True),
              DeviceSampling(1.0, 0, 0.1, 4, full=True), DeviceSampling(1.0, 12, 0.9, 3, full=True)):
        N = 20000
        out = torch.empty(N, dtype=torch.int64)
        FullRows([s] * N, "cpu", V).draw(logits.expand(N, V), torch.arange(N), out, impl="torch")   # (too many rows
        freq = torch.bincount(out, minlength=V).double() / N                                        # to interpret)
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
    FullRows(rows, "cpu", V).draw(logits, pos, out)
    for i in range(6):
        alone = torch.zeros(1, dtype=torch.int64)
        FullRows([rows[i]], "cpu", V).draw(logits[i:i + 1], pos[i:i + 1], alone)
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
    assert nt[2:] == [ref_draw(logits[i].tolist(), rows[i], 3 + i)[0] for i in (2, 3)]
    with pytest.raises(ValueError, match="whole vocabulary"):
        draw_full(mem, logits[:, :32], [3, 4, 5, 6])
    fill_sampling(mem, [None, rows[1]])   # no full row: nothing drawn
    mem.t("next_tokens").fill_(-1)
    draw_full(mem, logits, [0, 0, 0, 0])
    assert mem.t("next_tokens").tolist() == [-1] * 4


def test_margin_flags_near_boundary_decisions():
    """ref_draw's margin (what bf16-vs-fp32 checks rely on): small exactly when a nudge of the logits can change the
    token."""
    V = 50
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(7))
    changed = robust = 0
    for p in range(40):
        for i, s in enumerate(PARAMS):
            tok, margin = ref_draw(logits[i % 8].tolist(), s, p)
            nudged = (logits[i % 8] + 3e-3 * torch.randn(V, generator=torch.Generator().manual_seed(p))).tolist()
            if ref_draw(nudged, s, p)[0] != tok:
                changed += 1
                assert margin < 3e-3, (p, s)
            robust += margin > 3e-3
    assert changed >= 1 and robust > 0.6 * 40 * len(PARAMS)


@pytest.mark.skipif(triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernel on the CPU needs Triton and TRITON_INTERPRET=1 (scripts/test.sh)")
@pytest.mark.parametrize("rows", [PARAMS, PARAMS[:1], [PARAMS[2], PARAMS[4]]], ids=["mixed", "plain", "ranked"])
def test_triton_kernel_draws_the_torch_tokens(rows):
    """The Triton kernels (interpreted) and the torch ops draw the same tokens; NaN rows give -1."""
    V = 3000
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(6)) * 3
    logits[0, :10] = (logits[0, :10] * 2).round() / 2
    for p in (0, 1, 99, 12345):
        assert _draw(rows, logits, p, "torch") == _draw(rows, logits, p, "triton"), p
    logits[-1, 5] = float("nan")
    assert _draw(rows, logits, 0, "triton")[-1] == -1


@pytest.mark.skipif(triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernel on the CPU needs Triton and TRITON_INTERPRET=1 (scripts/test.sh)")
@pytest.mark.parametrize("chunk,rounds", [(256, 2), (128, 0), (512, 1)])
def test_split_rows_draw_the_torch_tokens(monkeypatch, chunk, rounds):
    """A vocab row split into chunks (full_sampling_triton: a chunk count that is not a power of two, a last chunk
    part full), nucleus rounds run split then carried on in one program (rounds=0: every rejected row goes there):
    the torch ops' tokens, position by position, and every path taken."""
    from mpk_runtime.runtime import full_sampling_triton as fst
    monkeypatch.setattr(fst, "CHUNK", chunk)
    monkeypatch.setattr(fst, "ROUNDS", rounds)
    V = 3000
    rows = PARAMS + [DeviceSampling(1.0, 0, 0.05, 11, full=True), DeviceSampling(0.8, 0, 0.5, 12, full=True)]
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(8)) * 3
    logits[1] = (logits[1] * 2).round() / 2   # ties: (logit desc, index asc)
    logits[0, 100:400] = float("-inf")
    fr = FullRows(rows, "cpu", V)
    most = 0
    for p in range(0, 60, 3):
        out = torch.full((len(rows),), -7, dtype=torch.int64)
        fr.draw(logits, torch.full((len(rows),), p, dtype=torch.int64), out, "triton")
        assert out.tolist() == _draw(rows, logits, p, "torch"), p
        most = max(most, int(fr.groups[0]._work.st[:, 2].max()))   # rounds drawn by a row
    assert fr.groups[0]._work.C == -(-V // chunk)
    assert most > rounds + 1   # some row was still undecided after the split rounds: the one-program loop ran


def test_device_sampling_full_validation():
    with pytest.raises(ValueError, match="top_k"):
        DeviceSampling(1.0, 65, 1.0, 0)
    with pytest.raises(ValueError, match="temperature > 0"):
        DeviceSampling(0.0, 0, 1.0, 0, full=True)
    assert DeviceSampling(1.0, 1000, 1.0, 0, full=True).top_k == 1000


@pytest.mark.skipif(triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernel on the CPU needs Triton and TRITON_INTERPRET=1 (scripts/test.sh)")
def test_padded_static_rows_draw_the_rows_tokens():
    """runtime/draw_graphs.py: vocab rows padded to a power of two by repeating the last one (3 -> 4, 5 -> 8) and
    reloaded when the step's rows change draw what FullRows draws of the rows as they are (the torch ops), every
    position; ranked rows beside them untouched; rows the group does not hold keep their slot."""
    from mpk_runtime.runtime.draw_graphs import DrawGraphs
    V = 3000
    sets = [PARAMS[:3] + [None],                                               # 2 vocab rows, 1 ranked (m = 2)
            [PARAMS[1], None, PARAMS[0], PARAMS[5], PARAMS[3]],                # 3 vocab rows, 1 ranked (m = 4)
            [DeviceSampling(1.0, 0, 1.0, 40 + i, full=True) for i in range(5)],   # 5 at top_p 1 (m = 8)
            [PARAMS[5], PARAMS[0], None, PARAMS[1], None]]                     # 3: m = 4's tensors, reloaded
    dg = DrawGraphs()
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(9)) * 3
    for rows in sets:
        fr = FullRows(rows, "cpu", V)
        for p in (0, 17, 301):
            pos = torch.arange(len(rows), dtype=torch.int64) + p
            want = torch.full((len(rows),), -7, dtype=torch.int64)
            fr.draw(logits[:len(rows)], pos, want, "torch")
            got = torch.full((len(rows),), -7, dtype=torch.int64)
            dg.draw(fr, logits[:len(rows)], pos, got, graph=True)   # (CPU: the padded launches, eagerly)
            assert got.tolist() == want.tolist(), (rows, p)
            assert [t for t, s in zip(got.tolist(), rows) if s is None] == [-7] * rows.count(None)
    assert sorted((k[0], k[2]) for k in dg._static) == [(2, True), (4, True), (8, False)]
    assert dg.captures == 0


def test_draw_full_without_draw_graphs_draws_the_rows_as_they_are(monkeypatch):
    """MPK_DRAW_GRAPHS=0: FullRows.draw itself (no DrawGraphs on the memory); the default keeps one on it where the
    Triton kernels run."""
    from types import SimpleNamespace
    from mpk_runtime.runtime.triton_support import runs_on
    V = 64
    names = ("sample.temperature", "sample.top_k", "sample.top_p", "sample.seed", "next_tokens")
    tensors = {n: torch.zeros(3, dtype=torch.int64 if n in ("sample.top_k", "sample.seed", "next_tokens")
                              else torch.float32) for n in names}
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    got = {}
    for env in ("0", "1"):
        monkeypatch.setenv("MPK_DRAW_GRAPHS", env)
        mem = SimpleNamespace(tensors=tensors, t=tensors.__getitem__,
                              graph=SimpleNamespace(config=SimpleNamespace(vocab_size=V)))
        fill_sampling(mem, [PARAMS[0], None, PARAMS[1]])
        draw_full(mem, logits, torch.tensor([5, 6, 7]), graph=True)
        got[env] = mem.t("next_tokens").tolist()
        assert hasattr(mem, "_draw_graphs") == (env == "1" and runs_on(logits))
    assert got["0"] == got["1"]
    assert got["0"][0::2] == [ref_draw(logits[i].tolist(), PARAMS[i // 2], 5 + i)[0] for i in (0, 2)]
