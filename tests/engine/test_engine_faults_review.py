"""Concurrency and fault paths of the engine as a user drives them: several threads calling one LLM (generate,
stream, both at once) must each get the outputs a lone call gets, and leave no request or KV page behind."""
import threading

import pytest

from mpk_runtime.engine import LLM, SamplingParams

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]


def _params():
    return [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=7, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]


def _in_threads(fns, timeout=60):
    """Run each fn in a thread of its own, started together; their results (an exception is re-raised here)."""
    res, errs = [None] * len(fns), []
    go = threading.Barrier(len(fns))

    def run(i):
        go.wait()
        try:
            res[i] = fns[i]()
        except BaseException as e:   # noqa: BLE001 - re-raised below
            errs.append(e)
    ths = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout)
    assert not any(t.is_alive() for t in ths), "a call hung"
    if errs:
        raise errs[0]
    return res


def _drained(llm):
    e = llm.engine
    for _ in range(3):   # (a burst may still be in flight after the last output: async_bursts)
        if e.has_unfinished():
            e.step()
    assert not e.has_unfinished() and not e._requests and not llm._inboxes
    assert e.allocator.num_free == e.allocator.num_pages


@pytest.mark.parametrize("kw", [dict(), dict(decode_steps=1)], ids=["async_bursts", "one_step"])
def test_generate_and_stream_from_several_threads(kw):
    """Two threads calling generate() stepped the one engine at once: a step failed inside (SeqChunk.token_ids is
    empty, IndexError) or a call lost its outputs. Calls from several threads take turns at the engine now."""
    with LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=32, max_batch=4, num_pages=8, page_size=4,
             **kw) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, _params(), use_tqdm=False)]

        def gen():
            return [o.token_ids for o in llm.generate(PROMPTS, _params(), use_tqdm=False)]

        def stream():
            rids, got = [], {}
            for o in llm.stream(PROMPTS, _params()):
                if o.request_id not in got:
                    rids.append(o.request_id)
                got.setdefault(o.request_id, []).extend(o.delta_token_ids)
                if o.finished:
                    assert got[o.request_id] == o.token_ids
            return [got[r] for r in sorted(rids, key=int)]

        for got in _in_threads([gen, gen, stream, stream]):
            assert got == want
        _drained(llm)


def test_a_stream_broken_off_in_one_thread_while_another_generates():
    """A thread that stops reading its stream half-way (closing it aborts its requests) while other threads'
    generate() calls run under page pressure (lazy pages, preemptions): theirs equal a lone call's, nothing is left."""
    with LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=32, max_batch=4, num_pages=8, page_size=4,
             ) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, _params(), use_tqdm=False)]
        long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

        def gen():
            return [o.token_ids for o in llm.generate(PROMPTS, _params(), use_tqdm=False)]

        def broken():
            it = llm.stream([[1, 2, 3], [4, 5, 6, 7]], long)
            seen = [next(it) for _ in range(3)]
            it.close()
            return seen

        got = _in_threads([gen, broken, gen])
        assert got[0] == got[2] == want
        assert not any(o.finished for o in got[1])
        assert llm.engine.stats["preemptions"] > 0
        _drained(llm)
