"""SamplingParams.n: LLM.generate / chat / stream run a prompt's n completions (vLLM's outputs[j]), each the one a
single request with seed + j gives when seeded; the engine itself takes one completion a request."""
import pytest

from mpk_runtime import LLM, SamplingParams
from mpk_runtime.engine import InvalidRequestError
from mpk_runtime.engine.sampling import completions

P = [[1, 2, 3], [7, 8]]


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", backend="reference", dtype="float32", max_seq_len=64, seed=3) as m:
        yield m


def test_seeded_n_equals_single_requests_seeded_seed_plus_j(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=6, seed=11, n=3, logprobs=1, ignore_eos=True)
    outs = llm.generate(P, sp)
    assert len(outs) == len(P)
    for p, o in zip(P, outs):
        assert [c.index for c in o.outputs] == [0, 1, 2]
        for j, c in enumerate(o.outputs):
            one = llm.generate([p], SamplingParams(temperature=1.0, max_tokens=6, seed=11 + j, logprobs=1,
                                                   ignore_eos=True))[0]
            assert (c.token_ids, c.finish_reason, c.logprobs) == (one.token_ids, one.finish_reason, one.logprobs)
        # the top-level fields are completion 0's; prompt tokens once
        assert o.token_ids == o.outputs[0].token_ids and o.prompt_token_ids == p and o.index == 0
        d = o.to_dict()
        assert [c["token_ids"] for c in d["completions"]] == [c.token_ids for c in o.outputs]
        assert len({tuple(c.token_ids) for c in o.outputs}) > 1   # (three seeds: not one sequence three times)


def test_unseeded_n_completions_differ_and_n1_is_unchanged(llm):
    o = llm.generate([P[0]], SamplingParams(temperature=1.0, max_tokens=8, n=4, ignore_eos=True))[0]
    assert len(o.outputs) == 4 and len({tuple(c.token_ids) for c in o.outputs}) > 1
    one = llm.generate([P[0]], SamplingParams(temperature=0, max_tokens=4))[0]
    assert one.completions is None and [c.index for c in one.outputs] == [0]
    greedy = llm.generate([P[0]], SamplingParams(temperature=0, max_tokens=4, n=2))[0]
    assert [c.token_ids for c in greedy.outputs] == [one.token_ids] * 2


def test_on_output_once_a_prompt_with_its_n_completions(llm):
    seen = []
    outs = llm.generate(P, SamplingParams(temperature=0.8, max_tokens=3, seed=1, n=2), use_tqdm=False,
                        on_output=lambda i, o: seen.append((i, len(o.outputs))))
    assert seen == [(0, 2), (1, 2)] and len(outs) == 2


def test_stream_tells_the_completions_apart_by_index(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=5, seed=21, n=2, ignore_eos=True)
    final = {}
    for o in llm.stream([P[0]], sp):
        if o.finished:
            final[o.index] = o.token_ids
    want = llm.generate([P[0]], sp)[0]
    assert final == {j: c.token_ids for j, c in enumerate(want.outputs)}


def test_params_per_prompt_with_different_n(llm):
    outs = llm.generate(P, [SamplingParams(temperature=0, max_tokens=2, n=3), SamplingParams(temperature=0,
                                                                                             max_tokens=2)])
    assert [len(o.outputs) for o in outs] == [3, 1]


def test_engine_request_is_one_completion(llm):
    with pytest.raises(InvalidRequestError, match="one completion.*LLM.generate"):
        llm.engine.add_request([1, 2], SamplingParams(n=2))
    assert not llm.engine.has_unfinished()
    assert [s.seed for s in completions(SamplingParams(seed=5, n=3))] == [5, 6, 7]
    assert all(s.n == 1 for s in completions(SamplingParams(n=3)))


def test_stream_names_each_snapshot_by_its_prompt(llm):
    """(session 75) LLM.stream's snapshots carried the engine's request ids, numbered across every call, so a caller
    of several prompts could not tell which prompt a snapshot was of. Now "i" / "i-j", as cluster.Client.stream."""
    prompts = [[4, 5, 6], [1, 2, 3], [4, 5, 6]]
    sp = [SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=1.0, max_tokens=4, seed=2, n=2,
                                                                       ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    final = {o.request_id: o.token_ids for o in llm.stream(prompts, sp) if o.finished}
    want = llm.generate(prompts, sp)
    assert final == {"0": want[0].token_ids, "1": want[1].outputs[0].token_ids, "1-1": want[1].outputs[1].token_ids,
                     "2": want[2].token_ids}
