"""Scheduling / KV-page review: each test failed before the fix it names."""
from mpk_runtime.engine import LLM, SamplingParams


def test_a_failed_steps_sequences_are_freed_on_workers_that_were_kept():
    # recovery.py _on_failure: when executor.recover() kept the workers (InProcessExecutor: they keep their models
    # and any per-sequence state), the failed requests' state on them was never freed (free() ran only on the path
    # where recover() returned False): the reference runner kept a whole max_seq_len K/V cache per failed request
    with LLM("tiny-llama", backend="reference", device_sampling="off", max_seq_len=32, max_batch=2) as llm:
        e, runner = llm.engine, llm.executor.workers[0].runner
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        e.add_request([3, 1, 4], sp)
        e.add_request([1, 5, 9, 2], sp)
        e.step()
        assert runner.num_cached() == 2
        llm.executor.collective_rpc("inject_fault", ("raise",))
        outs = e.step()
        assert [o.finish_reason for o in outs] == ["error", "error"] and e.dead is None
        assert e.stats["recoveries"] == 1
        assert runner.num_cached() == 0
        assert llm.generate([[2, 7]], sp, use_tqdm=False)[0].finish_reason == "length"
        assert runner.num_cached() == 0
