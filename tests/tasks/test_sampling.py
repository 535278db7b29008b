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
    from mpk_runtime.tasks.ops.argmax import sample_logits, sample_row
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
