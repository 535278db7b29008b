"""Worker / InProcessExecutor / reference runner contracts, and engine recovery from a failed step."""
import pytest
import torch

from mpk_runtime.engine import LLM, RequestFailedError, SamplingParams
from mpk_runtime.runtime.base import SeqChunk, known_backends, make_runner
from mpk_runtime.runtime.executor import InProcessExecutor, WorkerError, WorkerTimeout


def test_reference_backend_registered():
    assert "reference" in known_backends()


def test_reference_runner_validates_block_tables():
    r = make_runner("reference", model="tiny-qwen3", dtype="float32", max_seq_len=32, page_size=4, max_batch=2)
    assert r.kv_spec().num_pages == 16
    with pytest.raises(ValueError, match="block table"):
        r.step([SeqChunk(seq_id=0, token_ids=[1, 2, 3, 4, 5], start_pos=0, block_table=[0])])
    with pytest.raises(ValueError, match="block table"):
        r.step([SeqChunk(seq_id=0, token_ids=[1], start_pos=0, block_table=[99])])
    with pytest.raises(ValueError, match="no cache"):
        r.step([SeqChunk(seq_id=5, token_ids=[1], start_pos=3, block_table=[0])])
    out = r.step([SeqChunk(0, [1, 2, 3], 0, [0]), SeqChunk(1, [4], 0, [1])])
    assert out.shape == (2, 640) and out.dtype == torch.float32 and r.num_cached() == 2
    r.free(0)
    assert r.num_cached() == 1


def test_reference_runner_world_size_error():
    with pytest.raises(ValueError, match="world_size=2"):
        make_runner("reference", model="tiny-qwen3", rank=0, world_size=2)


def test_collective_rpc_rank_order_and_errors():
    ex = InProcessExecutor(2)
    try:
        ex.collective_rpc("init_comm_only", (ex.group,))
        assert [h["rank"] for h in ex.collective_rpc("health")] == [0, 1]
        assert ex.collective_rpc("check_comm") == [2.0, 2.0]  # ThreadGroup all-reduce across the threads
        with pytest.raises(WorkerError, match="rank 0.*init_model"):
            ex.collective_rpc("init_model", ("reference", None), {"model": "tiny-qwen3"})
        ex.collective_rpc("inject_fault", ("hang", 2.0))
        with pytest.raises(WorkerTimeout, match="rank 0"):
            ex.collective_rpc("execute", ([],), timeout=0.3)
    finally:
        ex.shutdown()


def test_engine_fails_inflight_and_recovers_after_worker_exception():
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=64) as llm:
        good = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5))[0].token_ids
        llm.executor.collective_rpc("inject_fault", ("raise",))
        with pytest.raises(RequestFailedError, match="injected fault"):
            llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5))
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages
        assert llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5))[0].token_ids == good


def test_mpk_runtime_and_cluster_import_without_ray():
    import subprocess
    import sys
    code = ("import sys; import mpk_runtime.engine, mpk_runtime.runtime.executor, cluster; "
            "assert 'ray' not in sys.modules, 'ray was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=__file__.rsplit("/tests/", 1)[0])


def test_async_engine_reports_a_failed_step_before_the_workers_are_rebuilt():
    """A failed step's requests get their error at once, not after the executor's rebuild (a Ray replica's takes
    seconds to tens of seconds): the loop hands them over through LLMEngine.on_failed_outputs before recover()."""
    import threading

    from mpk_runtime.engine.async_engine import EngineLoop
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=64) as llm:
        rebuilding, release = threading.Event(), threading.Event()

        def slow_recover():
            rebuilding.set()
            assert release.wait(30)
            return True
        llm.executor.recover = slow_recover
        loop = EngineLoop(llm.engine, name="t", health_interval=None)
        try:
            llm.executor.collective_rpc("inject_fault", ("raise",))
            got, done = {}, threading.Event()

            def cb(out):
                if out.finished:
                    got["out"] = out
                    done.set()
            loop.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=5), cb)
            assert done.wait(20) and rebuilding.is_set() and not release.is_set()
            assert got["out"].finish_reason == "error" and "injected fault" in got["out"].error
            release.set()
            good, again = {}, threading.Event()
            loop.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=5),
                        lambda o: (good.update(out=o), again.set()) if o.finished else None)
            assert again.wait(20) and good["out"].finish_reason != "error"
            assert llm.engine.stats["recoveries"] == 1
        finally:
            release.set()
            loop.shutdown()


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_rank_failure_is_reported_at_once_naming_the_rank_and_the_engine_goes_on(rank):
    """In-process TP=2: a rank that raises must not leave its peer blocked in the group barrier until the comm
    timeout (60 s), nor leave the barrier broken so that every later step fails."""
    import time
    with LLM("tiny-llama", backend="torch", tp=2, dtype="float32", max_seq_len=64) as llm:
        sp = SamplingParams(temperature=0, max_tokens=5)
        good = llm.generate([[1, 2, 3]], sp)[0].token_ids
        llm.executor.workers[rank].inject_fault("raise")
        t0 = time.monotonic()
        with pytest.raises(RequestFailedError, match=f"rank {rank} failed in 'execute'.*injected fault on rank {rank}"):
            llm.generate([[1, 2, 3]], sp)
        assert time.monotonic() - t0 < 10
        assert llm.engine.dead is None
        assert llm.generate([[1, 2, 3]], sp)[0].token_ids == good


def test_tp2_hung_rank_is_the_one_named():
    with LLM("tiny-llama", backend="torch", tp=2, dtype="float32", max_seq_len=64, step_timeout=1.0) as llm:
        sp = SamplingParams(temperature=0, max_tokens=5)
        good = llm.generate([[1, 2, 3]], sp)[0].token_ids
        llm.executor.workers[1].inject_fault("hang", 2.0)
        with pytest.raises(RequestFailedError, match="rank 1 did not finish 'execute'"):
            llm.generate([[1, 2, 3]], sp)
        assert llm.generate([[1, 2, 3]], sp)[0].token_ids == good   # it came back: the group works again
