"""On-device sampling (ir/sampling.py): CPU semantics of argmax_partial / argmax_reduce, the RNG, exp2, the
device constants, the distribution drawn, greedy == argmax, and the engine routing (device vs host)."""
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mpk_runtime.ir import sampling as S
from mpk_runtime.tasks.graph import Task
from mpk_runtime.runtime import host_draw as H
from mpk_runtime.tasks.ops import argmax as A

ROOT = Path(__file__).resolve().parents[2]
C = S.SAMPLE_CANDIDATES


class FakeMem:
    def __init__(self, rank, tensors, syms):
        self.rank, self.tensors, self.syms, self.peers = rank, tensors, syms, [self]

    def t(self, name):
        return self.tensors[name]

    def sym(self, name, parity):
        return self.syms[name][parity]


def run_sampler(logits, temp, top_k=None, top_p=None, seed=None, pos=None, world=1, T=1, slices=1, per_task=1):
    """The argmax op over `world` vocab-parallel ranks (contiguous equal shards), each rank's vocabulary cut into
    `slices` slices and scanned by tasks of `per_task` slices, CPU semantics; (B,) tokens."""
    B, V = logits.shape
    z = lambda dt: torch.zeros(B, dtype=dt)  # noqa: E731
    temp = torch.as_tensor(temp, dtype=torch.float32).expand(B).clone()
    top_k = z(torch.int64) if top_k is None else torch.as_tensor(top_k, dtype=torch.int64).expand(B).clone()
    top_p = torch.ones(B) if top_p is None else torch.as_tensor(top_p, dtype=torch.float32).expand(B).clone()
    seed = z(torch.int64) if seed is None else torch.as_tensor(seed, dtype=torch.int64).expand(B).clone()
    pos = z(torch.int64) if pos is None else torch.as_tensor(pos, dtype=torch.int64).expand(B).clone()
    bounds = [V * r // world for r in range(world + 1)]
    mems = []
    for r in range(world):
        ts = {"logits": logits[:, bounds[r]:bounds[r + 1]].contiguous(), "next": z(torch.int64),
              "sample.temperature": temp, "sample.top_k": top_k, "sample.top_p": top_p, "sample.seed": seed}
        mems.append(FakeMem(r, ts, {"part": torch.full((2, world * slices, B, C, 2), float("nan"))}))
    for m in mems:
        m.peers = mems
    ctx = SimpleNamespace(parity=1, pos=pos, tokens_per_seq=T)
    sp = {"temperature": "sample.temperature", "top_k": "sample.top_k", "top_p": "sample.top_p",
          "seed": "sample.seed"}
    for r, m in enumerate(mems):
        vs = (bounds[r + 1] - bounds[r]) // slices
        assert vs * slices == bounds[r + 1] - bounds[r], "slices must divide every rank's vocabulary"
        for s0 in range(0, slices, per_task):
            A.execute_partial(Task(0, r, "argmax_partial", "argmax",
                                   {"logits": "logits", "part": "part", "vocab0": bounds[r],
                                    "temperature": sp["temperature"], "s0": s0, "nslices": per_task,
                                    "slice_len": vs, "slot0": r * slices + s0}, [], []), m, ctx)
    outs = []
    for r, m in enumerate(mems):
        A.execute_reduce(Task(1, r, "argmax_reduce", "argmax", {"part": "part", "out": "next", "world": world,
                                                                "slots": world * slices,
                                                                "feeds_next_step": False, **sp}, [], []), m, ctx)
        outs.append(m.t("next").clone())
    for o in outs[1:]:
        assert torch.equal(o, outs[0]), "ranks disagree on the token"
    return outs[0]


def reference_probs(logits, temperature, top_k, top_p):
    """The host sampler's distribution (engine/sampling.py) in float64."""
    x = logits.double() / temperature
    if 0 < top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sx, idx = torch.sort(x, descending=True)
        pr = torch.softmax(sx, -1)
        drop = (torch.cumsum(pr, -1) - pr) >= top_p
        x = x.clone()
        x[idx[drop]] = float("-inf")
    return torch.softmax(x, -1)


# --- constants and primitives -----------------------------------------------------------------------------------
def test_device_constants_match_python():
    src = "".join((ROOT / "device_kernels/ops" / f).read_text() for f in ("argmax.cuh", "sample_select.cuh"))
    for h in S.EXP2_POLY_HEX + (S.LOG2E_HEX,):
        assert re.search(re.escape(h) + "f", src), f"{h} missing from argmax.cuh"
    assert f"0x{S.HASH_M1:08x}u" in src and f"0x{S.HASH_M2:08x}u" in src and f"0x{S.POS_SALT:08x}u" in src
    assert f"{float(S.PAD_INDEX):.1f}f" in src
    from mpk_runtime.codegen import layout as L
    assert L.CONSTANTS["SAMPLE_C"] == C


def test_rng_matches_python_reference():
    g = torch.Generator().manual_seed(0)
    seeds = [0, 1, -1, 2 ** 63 - 1, -(2 ** 63), 123456789012345] + \
        torch.randint(-2 ** 62, 2 ** 62, (50,), generator=g).tolist()
    pos = [0, 1, 5, 1000, 2 ** 31 - 1, -1] + torch.randint(0, 10 ** 6, (50,), generator=g).tolist()
    st, pt = torch.tensor(seeds), torch.tensor(pos)
    u = A.uniform(st, pt)
    ref = [S.uniform_bits(s, p) * 2.0 ** -24 for s, p in zip(seeds, pos)]
    assert u.dtype == torch.float32 and u.tolist() == ref
    assert 0 <= min(ref) and max(ref) < 1


def test_exp2_single_rounded_ops_and_accuracy():
    t = torch.cat([torch.linspace(-130, 0, 20001), torch.tensor([-126.0, -125.9999, -0.0, float("nan"), -float("inf")])])
    got = A.exp2_neg(t.float())
    # the same ops, one numpy fp32 op at a time (no FMA anywhere)
    f32 = np.float32
    ref = []
    for x in t.float().numpy():
        if not x >= f32(-126):
            ref.append(0.0)
            continue
        n = np.floor(x)
        f = f32(x - n)
        p = f32(S.EXP2_POLY[6])
        for c in S.EXP2_POLY[5::-1]:
            p = f32(f32(p * f) + f32(c))
        ref.append(float(f32(p * np.ldexp(f32(1), int(n)))))
    assert got.tolist() == ref
    ok = t >= -126
    rel = (got[ok].double() / torch.exp2(t[ok].double()) - 1).abs().max()
    assert rel < 1e-6


# --- greedy ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3])
def test_greedy_is_argmax_with_lowest_index_ties(world):
    g = torch.Generator().manual_seed(world)
    x = torch.randint(0, 5, (16, 97), generator=g).float()   # many ties, also across rank boundaries
    x[3] = 7.0
    x[4, 50:] = float("inf")
    tok = run_sampler(x, 0.0, world=world)
    assert torch.equal(tok, x.argmax(-1))


def test_zero_params_mean_greedy():
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    assert torch.equal(run_sampler(x, 0.0, top_k=5, top_p=0.5, seed=9, world=2), x.argmax(-1))


# --- candidates and determinism ---------------------------------------------------------------------------------
def test_candidates_top_c_with_ties_lowest_index_and_padding():
    V = 200
    x = torch.full((1, V), -1.0)
    x[0, ::3] = 2.0                       # 67 ties at the top: candidates are the 64 lowest indices among them
    mem = FakeMem(0, {"logits": x, "sample.temperature": torch.ones(1)},
                  {"part": torch.zeros(2, 1, 1, C, 2)})
    A.execute_partial(Task(0, 0, "argmax_partial", "argmax", {"logits": "logits", "part": "part", "vocab0": 10,
                                                               "temperature": "sample.temperature"}, [], []),
                      mem, SimpleNamespace(parity=0))
    cand = mem.syms["part"][0, 0, 0]
    assert cand[:, 0].tolist() == [2.0] * C
    assert cand[:, 1].tolist() == [float(10 + 3 * i) for i in range(C)]
    small = torch.tensor([[0.5, -0.0, 0.0, float("-inf"), 3.0]])
    mem = FakeMem(0, {"logits": small, "sample.temperature": torch.ones(1)}, {"part": torch.zeros(2, 1, 1, C, 2)})
    A.execute_partial(Task(0, 0, "argmax_partial", "argmax", {"logits": "logits", "part": "part", "vocab0": 0,
                                                               "temperature": "sample.temperature"}, [], []),
                      mem, SimpleNamespace(parity=0))
    cand = mem.syms["part"][0, 0, 0]
    assert cand[:5, 1].tolist() == [4.0, 0.0, 2.0, 1.0, 3.0]      # +0.0 before -0.0 (key order)
    assert cand[5:, 1].eq(float(S.PAD_INDEX)).all() and cand[5:, 0].eq(float("-inf")).all()


def test_same_token_for_any_world_size_and_batch_neighbours():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 500, generator=g) * 3
    args = dict(temp=torch.rand(32, generator=g) + 0.2, top_k=torch.randint(0, C + 1, (32,), generator=g),
                top_p=torch.rand(32, generator=g) * 0.9 + 0.1, seed=torch.arange(32) * 7919, pos=torch.arange(32))
    toks = [run_sampler(x, world=w, **args) for w in (1, 2, 4)]
    assert torch.equal(toks[0], toks[1]) and torch.equal(toks[0], toks[2])
    # row 5 alone gives the same token as inside the batch
    one = run_sampler(x[5:6], **{k: v[5:6] for k, v in args.items()})
    assert int(one[0]) == int(toks[0][5])
    # the RNG counter is the last token's position: pos p with T tokens == pos p + T - 1 with one
    a = run_sampler(x[:4], 1.0, seed=11, pos=torch.tensor([3, 4, 5, 6]), T=3)
    b = run_sampler(x[:4], 1.0, seed=11, pos=torch.tensor([5, 6, 7, 8]), T=1)
    assert torch.equal(a, b)


# --- distribution ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature, top_k, top_p, world", [
    (1.0, 0, 1.0, 1),      # V <= C: plain softmax, exact
    (0.7, 10, 1.0, 2),     # top-k
    (1.3, 40, 0.8, 2),     # top-k then top-p
    (2.0, 0, 0.6, 3),      # top-p (V <= C: exact)
])
def test_sampled_frequencies_match_the_distribution(temperature, top_k, top_p, world):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(C - 4, generator=g) * 2
    N = 40000
    toks = run_sampler(logits.expand(N, -1).contiguous(), temperature, top_k, top_p,
                       seed=torch.randint(-2 ** 62, 2 ** 62, (N,), generator=g), pos=torch.randint(0, 4096, (N,),
                                                                                                 generator=g),
                       world=world)
    p = reference_probs(logits, temperature, top_k, top_p)
    freq = torch.bincount(toks, minlength=logits.numel()).double() / N
    assert freq[p == 0].sum() == 0, "drew a token outside the top-k / top-p set"
    tv = 0.5 * (freq - p).abs().sum().item()
    assert tv < 0.02, tv
    live = p > 0
    chi2 = (((freq[live] - p[live]) * N) ** 2 / (p[live] * N)).sum().item()
    dof = int(live.sum()) - 1
    assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, (chi2, dof)   # far beyond chance only if the law is wrong


def test_sequential_draws_of_one_seed_look_uniform():
    x = torch.zeros(1, 10)   # uniform over 10 tokens
    toks = torch.cat([run_sampler(x, 1.0, seed=42, pos=p) for p in range(3000)])
    freq = torch.bincount(toks, minlength=10).double() / 3000
    assert (freq - 0.1).abs().max() < 0.03


def test_top_k_zero_is_capped_at_c():
    """The documented approximation: top_k disabled samples from the top C tokens only."""
    V = 4 * C
    logits = torch.zeros(V)
    logits[torch.randperm(V, generator=torch.Generator().manual_seed(0))[:C]] = 0.5
    N = 5000
    toks = run_sampler(logits.expand(N, -1).contiguous(), 5.0, 0, 1.0, seed=torch.arange(N), world=2)
    assert set(toks.tolist()) <= set((logits == 0.5).nonzero()[:, 0].tolist())
    assert len(set(toks.tolist())) > C // 2


# --- engine routing ----------------------------------------------------------------------------------------------
def test_engine_validation_and_routing():
    from mpk_runtime.engine import InvalidRequestError, SamplingParams
    from mpk_runtime.engine.sampling import check_device_sampling, device_sampling_for
    big = SamplingParams(temperature=1.0, top_k=C + 1)
    check_device_sampling(big, "auto")
    with pytest.raises(InvalidRequestError, match=f"top_k={C + 1}.*top_k <= {C}.*device_sampling='auto'"):
        check_device_sampling(big, "on")
    assert device_sampling_for(big, "auto", 1) is None
    assert device_sampling_for(SamplingParams(temperature=1.0), "auto", 1) is None          # uncapped: host
    assert device_sampling_for(SamplingParams(temperature=1.0), "on", 1).top_k == 0          # capped: device
    assert device_sampling_for(SamplingParams(temperature=0.5, top_k=3, top_p=0.9), "off", 1) is None
    d = device_sampling_for(SamplingParams(temperature=0.5, top_k=3, top_p=0.9), "auto", 77)
    assert (d.temperature, d.top_k, d.top_p, d.seed) == (0.5, 3, 0.9, 77)
    assert device_sampling_for(SamplingParams(temperature=2.0, top_k=1), "auto", 5).temperature == 0.0


@pytest.mark.parametrize("world,slices,per_task", [(1, 4, 1), (1, 4, 4), (2, 4, 2), (2, 8, 1)])
def test_vocabulary_slices_draw_the_same_tokens(world, slices, per_task):
    """Cutting each rank's vocabulary into slices (several argmax_partial tasks, more candidate slots) draws the
    tokens one slot per rank draws: greedy with ties across slice borders, and sampled rows."""
    g = torch.Generator().manual_seed(5)
    B, V = 6, 64 * world * slices
    x = torch.randn(B, V, generator=g)
    x[0, 3] = x[0, V - 1] = x[0].max() + 1.0              # a tie across slices and ranks: lowest index wins
    x[1, :] = 0.25                                          # every logit equal
    x[2, V // 2 - 1] = x[2, V // 2] = x[2].max() + 2.0    # a tie at a slice border
    greedy = run_sampler(x, 0.0, world=world, slices=slices, per_task=per_task)
    assert torch.equal(greedy, x.argmax(-1)), (greedy, x.argmax(-1))
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.0, 0.9])
    kw = dict(top_k=torch.tensor([0, 5, 40, 64, 0, 3]), top_p=torch.tensor([1.0, 0.9, 0.5, 1.0, 1.0, 0.95]),
              seed=torch.arange(B) * 7919, pos=torch.arange(B) + 11)
    one = run_sampler(x, temp, world=world, **kw)
    cut = run_sampler(x, temp, world=world, slices=slices, per_task=per_task, **kw)
    assert torch.equal(one, cut), (one, cut)


def test_sample_row_draws_what_the_graphs_sampler_draws():
    """The host's one-row draw (a candidate search over the entries >= the C-th largest) against sample_logits
    (an order key for every entry, as the device): ties, +-0.0 logits, vocabularies smaller and larger than C."""
    import random
    from mpk_runtime.ir.sampling import seed_to_int64
    from mpk_runtime.runtime.host_draw import sample_row
    from mpk_runtime.tasks.ops.argmax import sample_logits
    rng = random.Random(0)
    torch.manual_seed(0)
    for trial in range(600):
        V = rng.choice([3, 64, 65, 1000])
        x = torch.randn(V)
        if trial % 3 == 0:
            x = torch.round(x * 2) / 2   # many equal values
        if trial % 5 == 0:
            x[torch.randint(0, V, (V // 3 + 1,))] = 0.0
            x[torch.randint(0, V, (V // 5 + 1,))] = -0.0
        T, k, p = rng.choice([0.5, 1.0, 1.7]), rng.choice([0, 1, 5, 30, 64]), rng.choice([1.0, 0.9, 0.5])
        seed, pos = seed_to_int64(rng.randrange(1 << 64)), rng.randrange(5000)
        want = int(sample_logits(x[None], [T], [k], [p], [seed], [pos], 64)[0])
        assert sample_row(x, T, k, p, seed, pos, 64) == want, (trial, V, T, k, p)


# --- the host's one-row draw (session 73: candidate blocks, numpy for the candidates' fp32 arithmetic) -------------
def _keys_top(x: torch.Tensor, n: int) -> list[int]:
    """The device's candidates of a row: the first n by (order key desc, index asc), from an order key for every
    entry (partial_candidates' ranking)."""
    order = A._rank_order(A.order_key(x), torch.arange(x.numel()))
    return torch.topk(order, n, sorted=True).indices.tolist()


def _zero_rows():
    """Rows whose n-th largest value is a zero, with -0.0 before +0.0 in vocabulary order (the candidates take the
    +0.0 first: a search by values alone would take the low-index -0.0)."""
    V = 4096
    for n_pos in (0, 1, 11, 63, 64, 300):
        x = torch.full((V,), -1.0)
        x[:1000] = -0.0
        x[V - n_pos:] = 0.0
        x[5:5 + n_pos % 7] = 2.0
        yield x
    x = torch.full((5003,), -0.0)
    x[4990:] = 0.0   # (+0.0 in the tail past the last whole block)
    yield x


def test_row_candidates_are_the_devices_top_c():
    rng = np.random.default_rng(3)
    rows = list(_zero_rows())
    for trial in range(300):
        V = int(rng.choice([3, 64, 65, 511, 512, 4096, 5003, 20011]))
        x = torch.from_numpy(rng.standard_normal(V).astype(np.float32) * float(rng.choice([0.1, 1, 30])))
        kind = trial % 6
        if kind == 1:
            x = torch.round(x * 2) / 2
        elif kind == 2:
            x[torch.from_numpy(rng.integers(0, V, V // 2))] = float("-inf")
        elif kind == 3:
            x = torch.full((V,), float(rng.choice([0.0, -0.0, 1.0])))
        elif kind == 4:
            x[torch.from_numpy(rng.integers(0, V, V // 3 + 1))] = 0.0
            x[torch.from_numpy(rng.integers(0, V, V // 3 + 1))] = -0.0
            x = torch.minimum(x, torch.zeros(()))
        rows.append(x)
    for x in rows:
        n = min(C, x.numel())
        assert H.row_candidates(x, C).tolist() == _keys_top(x, n), x[:8]


def test_candidate_pool_holds_every_entry_the_top_n_needs():
    """candidate_pool's promises: the pool's n-th largest value is the row's; every entry > t0 is in it; of the
    entries == t0, the n of lowest index are."""
    rng = np.random.default_rng(4)
    for trial in range(200):
        V, n = int(rng.choice([1000, 4099, 20000])), int(rng.choice([1, 20, 64, 100]))
        x = rng.standard_normal(V).astype(np.float32)
        if trial % 3 == 0:
            x = np.round(x * 2) / 2
        if trial % 5 == 0:
            x[:] = x[0]
        pool = H.candidate_pool(torch.from_numpy(x), n)
        if pool is None:
            assert V < 8 * n
            continue
        pv, pi, t0, top = pool
        assert top == x.max() and np.array_equal(pv, x[pi]) and (np.diff(pi) > 0).all()
        assert np.sort(pv)[-n] == np.sort(x)[-n]
        assert set(np.flatnonzero(x > t0)) <= set(pi.tolist())
        assert set(np.flatnonzero(x == t0)[:n]) <= set(pi.tolist())


def test_serial_prefix_is_the_devices_fp32_adds():
    rng = np.random.default_rng(5)
    for trial in range(300):
        e = (rng.random(C) ** rng.choice([1, 4, 30])).astype(np.float32) * np.float32(rng.choice([1, 1e-3, 1e30]))
        e[rng.integers(0, C, 5)] = 0
        c = torch.zeros(1, C + 1)
        cc, ee = c.unbind(1), torch.from_numpy(e)[None].unbind(1)
        for q in range(C):
            torch.add(cc[q], ee[q], out=cc[q + 1])
        assert np.array_equal(H.serial_prefix_f32(e).view(np.int32), c[0].numpy().view(np.int32))


def test_sample_candidates_draws_what_sample_rows_draws():
    """The numpy one-row twin against the torch rows (sample_rows), on merged candidate rows: near ties, candidates
    past the vocabulary (-inf, PAD_INDEX), tiny and huge temperatures, top_p at the fp32 edges of the prefix sums."""
    rng = np.random.default_rng(6)
    for trial in range(3000):
        n = int(rng.choice([1, 3, 40, C, C, C]))
        v = np.sort(rng.standard_normal(n).astype(np.float32) * np.float32(rng.choice([0.01, 1, 10, 100])))[::-1]
        if trial % 4 == 0:
            v = np.round(v * 4) / 4
        vals = np.full(C, -np.inf, dtype=np.float32)
        vals[:n] = v
        idx = np.full(C, S.PAD_INDEX, dtype=np.int64)
        idx[:n] = rng.permutation(100000)[:n]
        T = float(rng.choice([1.0001e-5, 0.01, 0.3, 1.0, 2.0, 1e4]))
        k = int(rng.choice([0, 1, 2, 5, 20, 63, 64, 70]))
        p = float(rng.choice([1.0, 0.9, 0.5, 0.1, 1e-7, int(rng.integers(1, C)) / C, 0.5 - 1e-9, 0.75 + 1e-9]))
        seed, pos = int(rng.integers(-(1 << 63), 1 << 63)), int(rng.integers(0, 1 << 31))
        want = int(A.sample_rows(torch.from_numpy(vals.copy())[None], torch.from_numpy(idx)[None],
                                 torch.tensor([T], dtype=torch.float32), torch.tensor([k]),
                                 torch.tensor([p], dtype=torch.float32), torch.tensor([seed]),
                                 torch.tensor([pos]))[0])
        assert H.sample_candidates(vals, idx, T, k, p, seed, pos) == want, (trial, n, T, k, p)


def test_sample_candidates_where_the_uniform_hits_a_prefix_sum():
    """Equal candidates, so c[j] = j, and seeds whose r = u * 64 is a whole number (u's 24 bits a multiple of
    2^18): the draw takes the token whose interval starts at r (c[j] <= r < c[j + 1]), in both forms."""
    vals = np.zeros(C, dtype=np.float32)
    idx = np.arange(1000, 1000 + C, dtype=np.int64)
    for seed, j in ((289150, 16), (334681, 22), (541522, 53)):
        assert S.uniform_bits(seed, 17) == j << 18
        want = int(A.sample_rows(torch.from_numpy(vals)[None], torch.from_numpy(idx)[None], torch.tensor([1.0]),
                                 torch.tensor([C]), torch.tensor([1.0]), torch.tensor([seed]), torch.tensor([17]))[0])
        assert want == 1000 + j
        assert H.sample_candidates(vals, idx, 1.0, C, 1.0, seed, 17) == want


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_row_whose_best_candidate_is_not_finite_draws_no_token(bad):
    """ir/sampling.py step 6: sample_rows (pyvm, the conventional executor) and sample_candidates (the host mirror)
    return PAD_INDEX for a row whose v_0 is NaN or +-inf, and draw the other rows as before."""
    C = 8
    vals = torch.tensor([[bad] + [-1.0 * j for j in range(1, C)], [2.0 - j for j in range(C)]], dtype=torch.float32)
    idx = torch.arange(2 * C, dtype=torch.int64).view(2, C) + 5
    args = (torch.tensor([1.0, 1.0]), torch.tensor([3, 3]), torch.tensor([1.0, 1.0]), torch.tensor([11, 11]),
            torch.tensor([4, 4]))
    got = A.sample_rows(vals, idx, *args)
    assert got[0].item() == S.PAD_INDEX and 5 + C <= got[1].item() < 5 + C + 3
    for r in range(2):
        assert H.sample_candidates(vals[r].numpy(), idx[r].numpy(), 1.0, 3, 1.0, 11, 4) == got[r].item()
