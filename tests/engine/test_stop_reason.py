"""vLLM's CompletionOutput.stop_reason (the stop string or stop token id that ended a completion; None for EOS and
any other ending) and cumulative_logprob (the sampled tokens' logprobs summed; None without logprobs), on
RequestOutput, its outputs[j], to_dict, the engine process's wire form, the HTTP server's choices and
cluster.Client's outputs (session 76, from the API audit: code ported from vLLM that read them failed with an
AttributeError)."""
import dataclasses
import math

import pytest

from mpk_runtime.engine import LLM, SamplingParams

KW = dict(backend="torch", dtype="float32", max_seq_len=64)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from mpk_runtime.engine.demo_model import save_demo_model
    d = save_demo_model(str(tmp_path_factory.mktemp("sr") / "demo"))
    with LLM(d, **KW) as llm:
        yield llm


def _greedy(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(temperature=0, ignore_eos=True, **kw), use_tqdm=False)[0]


def test_a_stop_token_is_the_stop_reason(llm):
    full = _greedy(llm, [5, 6, 7], max_tokens=8)
    tok = full.token_ids[3]
    first = full.token_ids.index(tok)   # (it may come earlier too)
    got = _greedy(llm, [5, 6, 7], max_tokens=8, stop_token_ids=[tok])
    assert got.finish_reason == "stop" and got.token_ids == full.token_ids[:first + 1]
    assert got.stop_reason == tok and got.outputs[0].stop_reason == tok and got.to_dict()["stop_reason"] == tok
    # an ending by length: None
    assert full.finish_reason == "length" and full.stop_reason is None and "stop_reason" not in full.to_dict()


def test_a_stop_string_is_the_stop_reason(llm):
    full = _greedy(llm, "hello world", max_tokens=12)
    text = full.text
    assert len(text) >= 4
    stop = text[2:4]
    got = _greedy(llm, "hello world", max_tokens=12, stop=["zzzq", stop])
    assert got.finish_reason == "stop" and got.stop_reason == stop and got.text == text[:text.index(stop)]


def test_cumulative_logprob_sums_the_sampled_tokens(llm):
    got = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.7, seed=1, max_tokens=6, logprobs=2,
                                                   ignore_eos=True), use_tqdm=False)[0]
    want = sum(lp[t] for lp, t in zip(got.logprobs, got.token_ids))
    assert math.isclose(got.outputs[0].cumulative_logprob, want) and got.cumulative_logprob < 0
    assert _greedy(llm, [5, 6, 7], max_tokens=3).outputs[0].cumulative_logprob is None


def test_n_completions_each_keep_their_own(llm):
    full = _greedy(llm, [5, 6, 7], max_tokens=8)
    tok = full.token_ids[2]
    outs = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, n=6,
                                                    stop_token_ids=[tok]), use_tqdm=False)[0].outputs
    for o in outs:
        assert o.stop_reason == (tok if o.finish_reason == "stop" else None), o


def test_the_engine_process_wire_carries_it(llm):
    from mpk_runtime.engine.process_wire import PendingRequest, pack_output
    o = dataclasses.replace(_greedy(llm, [5, 6], max_tokens=2), stop_reason="\n\n", finish_reason="stop")
    assert PendingRequest(None, o.prompt, o.prompt_token_ids).unpack(o.request_id, pack_output(o, {})) == o
