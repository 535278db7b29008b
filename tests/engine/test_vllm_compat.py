"""Code written against vLLM's LLM runs here where the meaning is the same (session 75): its prompt dicts
(TextPrompt / TokensPrompt), its names for tp / max_seq_len / max_batch, get_tokenizer(); anything else it passes is
refused naming it, not dropped."""
import pytest

from mpk_runtime import LLM, SamplingParams
from mpk_runtime.engine import InvalidRequestError

SP = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from mpk_runtime.engine.demo_model import save_demo_model
    return save_demo_model(str(tmp_path_factory.mktemp("demo") / "tiny-qwen3-demo"))


def test_prompt_dicts_are_the_prompts_they_hold(demo):
    with LLM(demo, dtype="float32", max_seq_len=64) as llm:
        want = llm.generate(["hello world", [1, 2, 3]], SP)
        got = llm.generate([{"prompt": "hello world"}, {"prompt_token_ids": [1, 2, 3]}], SP)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert got[0].prompt == "hello world" and got[1].prompt_token_ids == [1, 2, 3]
        assert llm.generate({"prompt_token_ids": [1, 2, 3]}, SP)[0].token_ids == want[1].token_ids
        assert [o.token_ids for o in llm.stream({"prompt": "hello world"}, SP) if o.finished] == [want[0].token_ids]
        assert llm.get_tokenizer() is llm.tokenizer
        for bad, word in (({"prompt": "x", "multi_modal_data": {}}, "multi_modal_data"),
                          ({"prompt": "x", "prompt_token_ids": [1]}, "exactly one"), ({}, "exactly one"),
                          ({"prompt": [1, 2]}, "must be a string"), ({"prompt_token_ids": "1 2"}, "list of int"),
                          ([{"prompt": "a"}, {"text": "b"}], "text")):
            with pytest.raises(InvalidRequestError, match=word):
                llm.generate(bad, SP)
        assert not llm.engine.has_unfinished()


def test_vllm_keyword_names():
    a = LLM("tiny-qwen3", max_model_len=48, max_num_seqs=3, tensor_parallel_size=2, backend="pyvm", dtype="float32")
    try:
        assert a.engine.kv_spec.max_seq_len == 48 and a.engine.kv_spec.max_batch == 3 and a.executor.world_size == 2
        b = LLM("tiny-qwen3", max_seq_len=48, max_batch=3, tp=2, backend="pyvm", dtype="float32")
        try:
            assert a.generate([[5, 6, 7]], SP)[0].token_ids == b.generate([[5, 6, 7]], SP)[0].token_ids
        finally:
            b.shutdown()
    finally:
        a.shutdown()
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size.*is tp here"):
        LLM("tiny-qwen3", tp=2, tensor_parallel_size=4)
    with pytest.raises(InvalidRequestError, match="gpu_memory_utilization"):   # (not ours: refused, not dropped)
        LLM("tiny-qwen3", gpu_memory_utilization=0.9)
