"""SPMDExecutor: every rank runs the same engine in lockstep over its own worker; the result equals the
in-process executor's (here ranks are threads sharing a ThreadGroup; on GPUs they are processes)."""
import threading

from mpk_runtime import LLM, SamplingParams
from mpk_runtime.runtime.comm import ThreadGroup
from mpk_runtime.runtime.executor import SPMDExecutor

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
KW = dict(max_batch=4, max_seq_len=64, dtype="float32")


def test_spmd_ranks_agree_with_inprocess():
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    want = [o.token_ids for o in LLM("tiny-qwen3", backend="torch", tp=2, **KW).generate(PROMPTS, sp, use_tqdm=False)]
    group = ThreadGroup(2, timeout=60)
    got: list = [None, None]
    errs: list = []

    def rank(r):
        try:
            llm = LLM("tiny-qwen3", backend="torch", tp=2, executor=SPMDExecutor(r, 2, comm_spec=group), **KW)
            got[r] = [o.token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
            llm.shutdown()
        except Exception as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errs, errs
    assert got[0] == got[1] == want
    assert all(len(t) == 6 for t in want)
