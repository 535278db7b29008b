"""GPU: a replica whose engine runs in a child process (engine/engine_process.py) with the megakernel backend gives
the same greedy tokens as the same LLM in process (the child owns the CUDA context; the parent never touches CUDA).
Skips without a CUDA GPU + nvcc."""
import threading

import pytest

from tests.gpu.marks import KERNEL

pytestmark = KERNEL

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17], [20, 21]]
KW = dict(backend="megakernel", max_batch=4, max_seq_len=128)


def test_engine_process_megakernel_same_tokens_as_in_process():
    from mpk_runtime.engine import LLM, SamplingParams
    from mpk_runtime.engine.engine_process import EngineProcess
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM("tiny-llama", **KW) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    proc = EngineProcess("tiny-llama", name="gpu", health_interval=None, **KW)
    try:
        done, got = threading.Semaphore(0), {}

        def cb(o):
            if o.finished:
                got[o.request_id] = o
                done.release()
        rids = [proc.submit(p, sp, cb, stream=False) for p in PROMPTS]
        for _ in PROMPTS:
            assert done.acquire(timeout=300)
        assert [got[r].token_ids for r in rids] == want
        assert all(got[r].finish_reason == "length" for r in rids)
        assert proc.stats()["dead"] is None
    finally:
        proc.shutdown()
