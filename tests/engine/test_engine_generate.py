"""LLM.generate / stream against the reference model's own greedy loop, and continuous batching."""
import threading

import pytest
import torch

from mpk_runtime.engine import LLM, LLMEngine, SamplingParams
from mpk_runtime.engine.async_engine import EngineLoop
from mpk_runtime.engine.tokenizer import LazyTokenizer
from mpk_runtime.runtime.executor import InProcessExecutor

PROMPTS = [[1, 2, 3, 4, 5], [7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [100, 200, 300]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama"])
def test_generate_greedy_matches_reference(model, ref_greedy):
    with LLM(model, dtype="float32", max_seq_len=64, max_batch=4) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == ref_greedy(model, p, 12)
        assert o.prompt_token_ids == p
        assert o.finish_reason == "length" and o.finished
        assert o.metrics.time_to_first_token > 0 and o.metrics.per_token_latency > 0
        assert o.text is None  # presets have no tokenizer


def test_seed_changes_weights(ref_greedy):
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=64, seed=3) as llm:
        out = llm.generate([PROMPTS[0]], GREEDY)[0].token_ids
    assert out == ref_greedy("tiny-qwen3", PROMPTS[0], 12, seed=3)
    assert out != ref_greedy("tiny-qwen3", PROMPTS[0], 12, seed=0)


def _engine(**kw):
    llm = LLM("tiny-qwen3", dtype="float32", **{"max_seq_len": 64, "max_batch": 4, **kw})
    return llm, llm.engine


def _run_to_end(engine, finished, arrivals=None):
    """Step until all done; `arrivals` maps step index -> prompts to add before that step."""
    step = 0
    arrivals = dict(arrivals or {})
    batch_sizes = []
    while engine.has_unfinished() or arrivals:
        for p in arrivals.pop(step, []):
            engine.add_request(p, GREEDY, request_id=str(p))
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
        batch_sizes.append(engine.stats["last_batch_size"])
        step += 1
    return batch_sizes


def test_continuous_batching_staggered_arrivals(ref_greedy):
    llm, engine = _engine()
    finished = {}
    # request 0 alone, then 1 joins mid-decode, 2 and 3 join later while others leave
    sizes = _run_to_end(engine, finished, {0: [PROMPTS[0]], 3: [PROMPTS[1]], 5: [PROMPTS[2], PROMPTS[3]]})
    for p in PROMPTS:
        assert finished[str(p)].token_ids == ref_greedy("tiny-qwen3", p, 12)
    assert max(sizes) >= 3 and sizes[0] == 1  # requests really shared steps
    assert engine.allocator.num_free == engine.allocator.num_pages  # every page came back
    assert llm.executor.workers[0].runner.num_cached() == 0  # and every cache was freed
    llm.shutdown()


def test_chunked_prefill_matches_reference(ref_greedy):
    llm, engine = _engine(max_num_batched_tokens=4)  # the 13-token prompt takes 4 prefill steps
    finished = {}
    _run_to_end(engine, finished, {0: [PROMPTS[2]], 1: [PROMPTS[0]]})
    assert finished[str(PROMPTS[2])].token_ids == ref_greedy("tiny-qwen3", PROMPTS[2], 12)
    assert finished[str(PROMPTS[0])].token_ids == ref_greedy("tiny-qwen3", PROMPTS[0], 12)
    llm.shutdown()


@pytest.mark.parametrize("kv_allocation", ["reserve", "lazy"])
def test_admission_control_queues_when_pages_run_out(ref_greedy, kv_allocation):
    # page_size 4, 10 pages. reserve: each request takes ceil((len+12-1)/4) = 4 pages, so at most 2 run at once
    # and none is preempted. lazy: one page at admission (3 prompt tokens), so all 8 slots fill, then pages run out
    # and the newest are preempted (the reference backend keeps K/V per sequence: a preempted one is freed on the
    # worker and computed again from its first token)
    llm, engine = _engine(page_size=4, num_pages=10, max_batch=8, kv_allocation=kv_allocation)
    prompts = [[i, i + 1, i + 2] for i in range(1, 60, 7)]  # 9 requests
    for p in prompts:
        engine.add_request(p, GREEDY, request_id=str(p))
    finished, max_running, saw_queue = {}, 0, False
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
        max_running = max(max_running, len(engine.scheduler.running))
        saw_queue |= bool(engine.scheduler.waiting) and bool(engine.scheduler.running)
        assert engine.allocator.num_free + sum(len(r.block_table) for r in engine.scheduler.running) == 10
    if kv_allocation == "reserve":
        assert saw_queue and max_running == 2 and engine.stats["preemptions"] == 0
    else:
        assert saw_queue and max_running == 8 and engine.stats["preemptions"] > 0
        assert engine.stats["recomputed_tokens"] > 0
    for p in prompts:
        assert finished[str(p)].token_ids == ref_greedy("tiny-qwen3", p, 12)
    assert engine.allocator.num_free == 10
    llm.shutdown()


def test_stream_deltas_add_up_to_generate():
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=64) as llm:
        want = {str(i): o.token_ids for i, o in enumerate(llm.generate(PROMPTS[:2], GREEDY))}
        got: dict[str, list[int]] = {}
        ends = []
        outs = list(llm.stream(PROMPTS[:2], GREEDY))
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.delta_token_ids)
            assert o.token_ids == got[o.request_id]
            if o.finished:
                ends.append(o.request_id)
        assert sorted(got.values()) == sorted(want.values())
        assert len(ends) == 2 and len(outs) == 24


def test_stream_stopped_early_aborts():
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=64) as llm:
        it = llm.stream([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40))
        next(it)
        it.close()
        assert not llm.engine.has_unfinished()
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages


def test_stop_token_ids(ref_greedy):
    full = ref_greedy("tiny-qwen3", PROMPTS[0], 12)
    stop = full[4]
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=64) as llm:
        o = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]))[0]
    assert o.token_ids == full[:full.index(stop) + 1] and o.finish_reason == "stop"


def test_max_tokens_none_runs_to_context():
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=20) as llm:
        o = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=None))[0]
    assert len(o.prompt_token_ids) + len(o.token_ids) == 20 and o.finish_reason == "length"


def test_text_prompts_with_tokenizer(demo_dir):
    with LLM(demo_dir, dtype="float32", max_seq_len=64) as llm:
        tok = llm.tokenizer
        o = llm.generate(["hello world", [5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        assert o[0].prompt_token_ids == tok.encode("hello world") and o[0].prompt == "hello world"
        for x in o:
            assert x.text == tok.decode(x.token_ids, skip_special_tokens=True)
        parts = list(llm.stream("hello world", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
        assert "".join(s.delta_text for s in parts) == o[0].text
        # every streamed snapshot, the first included, carries the tokenised prompt (as vLLM's RequestOutput)
        assert len(parts) > 1 and all(s.prompt_token_ids == o[0].prompt_token_ids for s in parts)
        loop, outs, done = EngineLoop(llm.engine, health_interval=None), [], threading.Event()
        try:
            loop.submit(o[0].prompt_token_ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        lambda x: (outs.append(x), x.finished and done.set()), prompt="hello world")
            assert done.wait(30)
        finally:
            loop.shutdown()
        assert len(outs) > 1 and all(x.prompt_token_ids == o[0].prompt_token_ids for x in outs)


class _StubTokenizer:
    """Just enough tokenizer for the engine: an EOS id and decode."""
    def __init__(self, eos):
        self.eos_token_id = eos

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 600 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_eos_stops_unless_ignored(ref_greedy):
    full = ref_greedy("tiny-qwen3", PROMPTS[0], 12)
    eos = full[5]
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=64, tokenizer=_StubTokenizer(eos)) as llm:
        o = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12))[0]
        assert o.token_ids == full[:full.index(eos) + 1] and o.finish_reason == "stop"
        assert o.text == " ".join(map(str, o.token_ids[:-1]))   # the EOS's own text left out, as vLLM does
        o = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, include_stop_str_in_output=True))[0]
        assert o.text == " ".join(map(str, o.token_ids)) and o.token_ids[-1] == eos
        o = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        assert o.token_ids == full and o.finish_reason == "length"


def test_engine_over_explicit_executor(ref_greedy):
    ex = InProcessExecutor(1)
    ex.init_workers("reference", model="tiny-qwen3", dtype="float32", max_seq_len=64)
    spec = ex.collective_rpc("kv_spec")[0]
    eng = LLMEngine(ex, spec, vocab_size=640, tokenizer=LazyTokenizer(None))
    eng.add_request(PROMPTS[1], GREEDY, request_id="a")
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].token_ids == ref_greedy("tiny-qwen3", PROMPTS[1], 12)
    ex.shutdown()


@pytest.mark.parametrize("backend, tp", [("torch", 1), ("pyvm", 1), ("torch", 2)])
def test_paged_backends_through_engine(backend, tp, ref_greedy):
    """The engine drives backends that honour its block tables; staggered arrivals still match the oracle."""
    llm = LLM("tiny-qwen3", backend=backend, tp=tp, dtype="float32", max_seq_len=64, max_batch=4, page_size=8)
    finished = {}
    _run_to_end(llm.engine, finished, {0: [PROMPTS[0]], 2: [PROMPTS[2]], 4: [PROMPTS[1], PROMPTS[3]]})
    for p in PROMPTS:
        assert finished[str(p)].token_ids == ref_greedy("tiny-qwen3", p, 12)
    llm.shutdown()
