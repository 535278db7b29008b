"""Device sampling through the engine: pyvm (task graphs, random interleavings, TP=2) and the conventional
executor ("torch") draw the same tokens for the same seeds; greedy equals the reference; host fallback."""
import pytest
import torch

from mpk_runtime.engine import LLM, InvalidRequestError, SamplingParams

PROMPTS = [[1, 2, 3], [5, 4], [7, 7, 7, 7], [9]]
PARAMS = [SamplingParams(temperature=0, max_tokens=6),                                  # greedy
          SamplingParams(temperature=0.9, top_k=64, max_tokens=6, seed=11, ignore_eos=True),   # temperature
          SamplingParams(temperature=1.5, top_k=8, max_tokens=6, seed=12, ignore_eos=True),    # top-k
          SamplingParams(temperature=1.0, top_k=50, top_p=0.7, max_tokens=6, seed=13, ignore_eos=True)]  # top-p


def _run(backend, tp, dmode="auto", **kw):
    with LLM("tiny-llama", backend=backend, tp=tp, dtype="float32", max_seq_len=64, max_batch=4,
             device_sampling=dmode, **kw) as m:
        return [o.token_ids for o in m.generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def pyvm_tp2():
    return _run("pyvm", 2, mode="random")   # seeded random interleavings of both ranks' SMs


def test_pyvm_and_conventional_draw_identical_tokens(pyvm_tp2):
    assert _run("torch", 2) == pyvm_tp2
    assert _run("pyvm", 1) == pyvm_tp2           # vocab-parallel merge == single rank
    assert len({tuple(t) for t in pyvm_tp2}) == 4


def test_greedy_row_equals_reference(pyvm_tp2, ref_models):
    ref = ref_models("tiny-llama").generate_greedy(torch.tensor([PROMPTS[0]]), 6)[0].tolist()
    assert pyvm_tp2[0] == ref


def test_device_and_host_draw_the_same_tokens():
    """The host sampler draws as the device does (same seed and position, same token; it drew from a
    torch.Generator of its own until session 72), so device_sampling on or off and a runner without a device
    sampler give one result."""
    host = _run("torch", 1, dmode="off")
    dev = _run("torch", 1, dmode="auto")
    assert host == dev and len({tuple(t) for t in host}) > 1   # (and they are not all one greedy row)
    ref_host = _run("reference", 1, dmode="auto")  # the reference runner has no device sampler: host
    assert ref_host == host


def test_on_mode_takes_every_top_k_where_the_runner_draws_the_whole_vocabulary():
    """(Runners without the full draw reject top_k > 64 in mode "on": test_full_sampling_engine.py.)"""
    with LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=32, max_batch=2, device_sampling="on") as m:
        assert m.engine.full_sampling
        for p in (SamplingParams(temperature=1.0, top_k=65, max_tokens=3, seed=1),
                  SamplingParams(temperature=1.0, max_tokens=3, seed=1)):
            assert len(m.generate([[1, 2]], p)[0].token_ids) == 3
    with pytest.raises(InvalidRequestError, match="device_sampling"):
        LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=32, device_sampling="maybe")
