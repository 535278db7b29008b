"""The engine's per-step host shortcuts keep their meaning: token_slice == all_token_ids[a:b]; step(outputs=
"finished") reports exactly the finished requests of step(outputs="all"), with the same tokens; a request's
device sampling is decided once."""
import pytest

from mpk_runtime import LLM, SamplingParams
from mpk_runtime.engine.request import Request


def test_token_slice_matches_concatenation():
    r = Request("r", 0, None, [1, 2, 3, 4], SamplingParams(), None, 100, output_token_ids=[5, 6, 7])
    full = r.all_token_ids
    for a in range(len(full) + 1):
        for b in range(a, len(full) + 2):
            assert r.token_slice(a, b) == full[a:b], (a, b)


def test_step_outputs_finished_only():
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (3, 5, 4)]
    runs = {}
    for mode in ("all", "finished"):
        llm = LLM("tiny-llama", backend="reference", max_batch=3)
        for p, sp in zip(prompts, params):
            llm.engine.add_request(p, sp)
        seen, finished = 0, {}
        while llm.engine.has_unfinished():
            for o in llm.engine.step(outputs=mode):
                seen += 1
                if o.finished:
                    finished[o.request_id] = o.token_ids
        runs[mode] = (seen, finished)
        llm.shutdown()
    assert runs["all"][1] == runs["finished"][1] and len(runs["all"][1]) == 3
    assert runs["finished"][0] == 3 < runs["all"][0]
    with pytest.raises(ValueError, match="outputs"):
        LLM("tiny-llama", backend="reference").engine.step(outputs="some")


def test_device_sampling_decided_once():
    llm = LLM("tiny-llama", backend="pyvm", max_batch=2)
    rid = llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.7, top_k=20, seed=5))
    req = llm.engine._requests[rid]
    llm.engine.step()
    first = req.device_sampling
    assert first is not None and first[0] is not None and first[0].seed != 0
    llm.engine.step()
    assert req.device_sampling is first
    llm.shutdown()
