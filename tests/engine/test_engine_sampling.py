"""Host-side sampling: reproducible with a seed, respects top-k / top-p, greedy at temperature 0."""
import pytest
import torch

from mpk_runtime.engine import LLM, InvalidRequestError, SamplingParams
from mpk_runtime.engine.sampling import sample

PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=64, max_batch=8) as m:
        yield m


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=10, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPT], sp)[0].token_ids
    # same seed, now sharing the batch with other sampled requests
    others = [SamplingParams(temperature=1.0, max_tokens=10, seed=s) for s in range(3)]
    mixed = llm.generate([[9, 9], PROMPT, [8], [7, 7, 7]], [others[0], sp, others[1], others[2]])
    assert mixed[1].token_ids == alone
    assert llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=10, seed=99))[0].token_ids != alone


def test_unseeded_sampling_reproducible_from_engine_seed():
    sp = SamplingParams(temperature=1.0, max_tokens=8)
    runs = []
    for _ in range(2):
        with LLM("tiny-qwen3", dtype="float32", max_seq_len=64, seed=5) as m:
            runs.append([o.token_ids for o in m.generate([PROMPT, PROMPT], sp)])
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]  # two requests get different streams


def test_top_k_1_and_tiny_top_p_equal_greedy(llm, ref_models):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10))[0].token_ids
    ref = ref_models("tiny-qwen3").generate_greedy(torch.tensor([PROMPT]), 10)[0].tolist()
    assert greedy == ref
    assert llm.generate([PROMPT], SamplingParams(temperature=2.0, top_k=1, max_tokens=10, seed=7))[0].token_ids == ref
    assert llm.generate([PROMPT], SamplingParams(temperature=2.0, top_p=1e-6, max_tokens=10, seed=7))[0].token_ids == ref
    # temperatures below SAMPLING_EPS are greedy (1e-39 overflowed logits / T to inf and NaN'd the softmax)
    for t in (1e-39, 1e-6):
        assert llm.generate([PROMPT], SamplingParams(temperature=t, max_tokens=10))[0].token_ids == ref
    # any int seed (its low 64 bits, as the device sampler takes it)
    sp = SamplingParams(temperature=1.0, max_tokens=4, seed=2 ** 64 + 3)
    assert llm.generate([PROMPT], sp)[0].token_ids == \
        llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=4, seed=3))[0].token_ids


def test_top_k_tokens_come_from_the_top_k(llm, ref_models):
    """Every sampled token is among the k most likely under the reference model given the prefix so far."""
    model = ref_models("tiny-qwen3")
    k = 3
    outs = llm.generate([PROMPT] * 4, [SamplingParams(temperature=3.0, top_k=k, max_tokens=8, seed=s)
                                       for s in range(4)])
    for o in outs:
        seq = list(PROMPT)
        for t in o.token_ids:
            cache = model.new_cache(1, 64)
            logits = model.forward(torch.tensor([seq]), torch.zeros(1, dtype=torch.long), cache)[0, -1]
            assert t in torch.topk(logits, k).indices.tolist()
            seq.append(t)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # and it is really sampling


def test_sample_distribution_unit():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    counts = torch.zeros(4)
    for pos in range(2000):   # (the draws of one seed at successive positions)
        counts[sample(logits, SamplingParams(temperature=1.0, top_p=0.7), 0, pos)] += 1
    # top_p=0.7 keeps {0, 1} (0.5 < 0.7, 0.8 >= 0.7): renormalised 5/8, 3/8
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / 2000 - 0.625) < 0.05
    counts.zero_()
    for pos in range(2000):
        counts[sample(logits, SamplingParams(temperature=1.0, top_k=3), 0, pos)] += 1
    assert counts[3] == 0 and counts[2] > 0


@pytest.mark.parametrize("kw, word", [
    (dict(temperature=-1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-2), "top_k"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(seed="x"), "seed"),
])
def test_sampling_params_validation(kw, word):
    with pytest.raises(InvalidRequestError, match=word) as e:
        SamplingParams(**kw)
    assert isinstance(e.value, ValueError)


def test_sampling_params_none_means_no_stops():
    """stop_token_ids=None / stop=None (vLLM's defaults, the OpenAI API's null) are no stops, not an error."""
    sp = SamplingParams(stop_token_ids=None, stop=None)
    assert sp.stop_token_ids == () and sp.stop == () and sp == SamplingParams()
    assert SamplingParams.from_dict({"stop_token_ids": None, "stop": None}).stop_token_ids == ()
    assert SamplingParams(stop="\n").stop == ("\n",) and SamplingParams(stop_token_ids=[3]).stop_token_ids == (3,)


def test_sampling_params_from_dict_rejects_unknown():
    assert SamplingParams.from_dict({"temperature": 0, "max_tokens": 3}).max_tokens == 3
    with pytest.raises(InvalidRequestError, match="allowed"):
        SamplingParams.from_dict({"temprature": 0})


def _exact_distribution(logits, temperature, top_k, top_p):
    """The sampling distribution by definition, with a full sort (the reference for sample())."""
    x = logits.double() / temperature
    order = torch.argsort(x, descending=True, stable=True)
    if top_k:
        order = order[:top_k]
    p = torch.softmax(x[order], -1)
    keep = int(((torch.cumsum(p, -1) - p) < top_p).sum())
    out = torch.zeros_like(x)
    out[order[:keep]] = p[:keep] / p[:keep].sum()
    return out


@pytest.mark.parametrize("V,kw", [(12, dict(temperature=1.3, top_p=0.8)), (12, dict(temperature=0.9, top_k=5, top_p=0.85)),
                                  (12, dict(temperature=1.0)), (12, dict(temperature=0.6, top_k=4)),
                                  (150, dict(temperature=1.1, top_k=90, top_p=0.9)),   # top_k past the graph's 64
                                  (3000, dict(temperature=1.0, top_p=0.9))])   # (a nucleus of > 1024 tokens)
def test_sample_matches_the_exact_distribution(V, kw):
    """sample() (the device samplers' draws on the host: the graph's for top_k <= 64, the full-vocabulary one
    otherwise) against the distribution computed by definition with a full sort: every draw inside its support,
    frequencies within a few standard errors, over the draws of successive positions."""
    torch.manual_seed(V)
    logits = torch.randn(V) * (2.0 if V < 1000 else 0.3)
    sp = SamplingParams(**kw)
    want = _exact_distribution(logits, sp.temperature, sp.top_k, sp.top_p)
    n = 12000 if V < 1000 else 3000
    counts = torch.bincount(torch.tensor([sample(logits, sp, 1, pos) for pos in range(n)]), minlength=V).double()
    assert bool((counts[want == 0] == 0).all())                     # never outside the support
    if V < 1000:
        se = torch.sqrt(want * (1 - want) / n)
        assert bool(((counts / n - want).abs() <= 5 * se + 1e-9).all()), (counts / n, want)
    else:
        assert int((want > 0).sum()) > 1024 and int((counts > 0).sum()) > 1024


def test_sample_reproducible_per_seed_and_position():
    logits = torch.randn(5000)
    sp = SamplingParams(temperature=0.8, top_p=0.95)
    runs = [[sample(logits, sp, seed, pos) for pos in range(20)] for seed in (9, 9, 10)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
