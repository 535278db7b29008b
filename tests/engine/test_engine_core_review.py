"""Engine core review: each test failed before the fix it names."""
import pytest

from mpk_runtime.engine import LLM, InvalidRequestError, RequestFailedError, SamplingParams
from mpk_runtime.engine.errors import UnknownModelError


def _clean(e):
    a = e.allocator
    assert not e.scheduler.running and not e.scheduler.waiting and e._inflight is None and not e._requests
    assert a.num_free == a.num_pages and not a._used


def test_a_failure_at_the_first_pipelined_bursts_launch_fails_its_requests_and_recovers(ref_greedy):
    # bursts.py _step_many: the first burst's launch (async_bursts: Worker.execute(defer=True)) ran outside the
    # step's failure handling: the worker's error escaped step() (generate raised WorkerError, not
    # RequestFailedError) and nothing was failed or recovered
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=64, max_batch=2, decode_steps=4,
             async_bursts=True) as llm:
        e = llm.engine
        e.add_request([3, 1, 4, 1, 5], sp, request_id="a")
        e.step()                                    # the prompt: the next step is a burst
        assert e.scheduler.running[0].decoding
        llm.executor.collective_rpc("inject_fault", ("raise",))
        outs = e.step()
        assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "error")]
        _clean(e)
        assert e.dead is None
        again = llm.generate([[9, 2, 6]], sp, use_tqdm=False)[0]
    assert again.token_ids == ref_greedy("tiny-llama", [9, 2, 6], 12)


def test_generated_request_ids_step_around_a_callers_own():
    # engine.py add_request: a generated id (the request's number) could equal an id a caller chose earlier, and the
    # request without an id was then refused as "already in use"
    llm = LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=64, max_batch=8)
    e = llm.engine
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    taken = [e.add_request([1, 2], p, request_id=str(i + 4)) for i in range(4)]   # (numbers 0-3 taken by them)
    mine = [e.add_request([3, 4], p) for _ in range(3)]
    assert len(set(taken + mine)) == 7 and not set(mine) & set(taken)
    while e.has_unfinished():
        e.step()
    _clean(e)
    llm.shutdown()


def test_sampling_params_n_is_checked():
    """vLLM's SamplingParams takes n (completions per prompt); ours answered SamplingParams(n=2) with a bare
    "unexpected keyword argument" TypeError. Since session 75 LLM runs n (tests/engine/test_n_completions.py);
    n outside [1, MAX_N] is an InvalidRequestError naming it."""
    assert SamplingParams(n=1) == SamplingParams()
    assert SamplingParams(n=64).n == 64
    for n in (0, 65, "2", True, 2.0):
        with pytest.raises(InvalidRequestError, match=r"n must be an int in \[1, 64\]"):
            SamplingParams(n=n)


def test_llm_names_a_file_or_a_missing_directory_as_such(tmp_path):
    """LLM(path) refused any name that is neither a directory nor a preset as "unknown model ... not a preset", so
    a typo in a directory path or a path to config.json itself read like a bad preset name; load_config's own error
    says which it is."""
    f = tmp_path / "config.json"
    f.write_text("{}")
    with pytest.raises(UnknownModelError, match="is a file; pass the model directory"):
        LLM(str(f), backend="reference")
    with pytest.raises(UnknownModelError, match="no such directory"):
        LLM(str(tmp_path / "missing"), backend="reference")
    with pytest.raises(UnknownModelError, match="known presets: .*tiny-llama"):
        LLM("tiny-lama", backend="reference")
