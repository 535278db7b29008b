"""SPMDExecutor: every rank runs the same engine in lockstep over its own worker; the result equals the
in-process executor's (here ranks are threads sharing a ThreadGroup; on GPUs they are processes)."""
import threading

from mpk_runtime import LLM, SamplingParams
from mpk_runtime.runtime.comm import ThreadGroup
from mpk_runtime.runtime.executor import SPMDExecutor

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
KW = dict(max_batch=4, max_seq_len=64, dtype="float32")


import pytest


@pytest.mark.parametrize("bursts", [{"decode_steps": 1}, {"decode_steps": 4, "async_bursts": True}],
                         ids=["steps", "pipelined"])
def test_spmd_ranks_agree_with_inprocess(bursts):
    """Also with pipelined bursts (engine/bursts.py): every rank's engine launches its next burst before reading the
    last one (Worker.execute(defer=True) / collect run locally), in lockstep."""
    sp = SamplingParams(max_tokens=6 if bursts["decode_steps"] == 1 else 21, temperature=0.0)
    want = [o.token_ids for o in LLM("tiny-qwen3", backend="torch", tp=2, **KW).generate(PROMPTS, sp, use_tqdm=False)]
    group = ThreadGroup(2, timeout=60)
    got: list = [None, None]
    errs: list = []
    pipelined = [0, 0]

    def rank(r):
        try:
            llm = LLM("tiny-qwen3", backend="torch", tp=2, executor=SPMDExecutor(r, 2, comm_spec=group), **KW,
                      **bursts)
            got[r] = [o.token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
            pipelined[r] = llm.engine.stats["async_bursts"]
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
    assert all(len(t) == sp.max_tokens for t in want)
    assert (pipelined[0] >= 2 and pipelined[0] == pipelined[1]) if bursts["decode_steps"] > 1 else pipelined == [0, 0]


def test_tp_invariant_reaches_the_graphs():
    """LLM(..., tp_invariant=2) reaches every rank's graphs: TP=1 reduces o_proj/down in 2 K segments, TP=2 in 1."""
    for tp, kseg in ((1, 2), (2, 1)):
        llm = LLM("tiny-llama", backend="pyvm", tp=tp, max_batch=2, max_seq_len=32, tp_invariant=2)
        grp = llm.executor.workers[0].runner.group
        ops = {op.name: op for op in grp.graphs("decode", 1, 1)[0].ops}
        assert ops["L0.o_proj"].attrs["k_segments"] == kseg and ops["L1.down"].attrs["k_segments"] == kseg
        assert "k_segments" not in ops["L0.gate_up"].attrs
        llm.shutdown()
