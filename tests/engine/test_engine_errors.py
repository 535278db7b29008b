"""Bad inputs raise typed errors (ValueError subclasses) that say what to do, before anything is queued."""
import pytest

from mpk_runtime.engine import (LLM, InvalidRequestError, NoTokenizerError, PromptTooLongError, SamplingParams,
                                UnknownModelError)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=32, page_size=4, num_pages=16) as m:
        yield m


def test_unknown_model():
    with pytest.raises(UnknownModelError, match="tiny-qwen3"):  # the message lists the presets
        LLM("no-such-model")


def test_unknown_backend_lists_known():
    with pytest.raises(ValueError, match="reference"):
        LLM("tiny-qwen3", backend="nope", dtype="float32")


def test_reference_backend_refuses_tp2():
    with pytest.raises(Exception, match="tp=1"):
        LLM("tiny-qwen3", tp=2, dtype="float32")


def test_unknown_executor_hint(monkeypatch):
    from mpk_runtime.runtime import executor
    monkeypatch.delitem(executor._EXECUTORS, "ray", raising=False)  # as if `cluster` was never imported
    with pytest.raises(ValueError, match="import cluster"):
        LLM("tiny-qwen3", executor="ray", dtype="float32")


def test_prompt_too_long_nothing_queued(llm):
    # (the advice names the flag too: the server and jobs users create no LLM themselves)
    with pytest.raises(PromptTooLongError, match=r"max_seq_len \(--max-seq-len for the server and the jobs\)"):
        llm.generate([[1, 2], list(range(40))], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()  # the good prompt was not queued either


def test_request_larger_than_cache(llm):
    # 16 pages * 4 tokens = 64 > max_seq_len here, so shrink the cache instead
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=32, page_size=4, num_pages=3) as small:
        with pytest.raises(PromptTooLongError, match=r"pages.*--num-pages"):
            small.generate([[1, 2, 3]], SamplingParams(max_tokens=20))
        assert small.generate([[1, 2, 3]], SamplingParams(max_tokens=5))[0].token_ids


def test_text_without_tokenizer(llm):
    with pytest.raises(NoTokenizerError, match="token ids"):
        llm.generate(["hello"])


@pytest.mark.parametrize("prompts", [[], [[]], [[1, -3]], [[1, 100000]], [[1.5]], 42, [["a", 1]]])
def test_bad_prompts(llm, prompts):
    with pytest.raises(InvalidRequestError):
        llm.generate(prompts, SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()


def test_bad_params_type_and_count(llm):
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        llm.generate([[1]], {"temperature": 0})
    with pytest.raises(InvalidRequestError, match="one per prompt"):
        llm.generate([[1], [2]], [SamplingParams(), SamplingParams(), SamplingParams()])
    with pytest.raises(InvalidRequestError, match="vocab"):
        llm.generate([[1]], SamplingParams(stop_token_ids=[10 ** 6]))


def test_typed_errors_are_value_errors():
    for cls in (InvalidRequestError, PromptTooLongError, NoTokenizerError, UnknownModelError):
        assert issubclass(cls, ValueError)


def test_cli_bad_flags_are_messages(capsys):
    from mpk_runtime.__main__ import main
    for argv, word in ((["plan", "--model", "tiny-llama", "--sms", "0"], "--sms"),
                       (["plan", "--model", "tiny-llama", "--classify"], "--search"),
                       (["generate", "--model", "tiny-llama", "--prompt-ids", "1,x"], "--prompt-ids")):
        assert main(argv) == 2
        assert word in capsys.readouterr().err


def test_cli_stop_token_ids_and_pages(capsys):
    from mpk_runtime.__main__ import main
    import json as _json
    base = ["generate", "--model", "tiny-llama", "--prompt-ids", "1,2", "--backend", "torch", "--max-tokens", "8"]
    assert main(base) == 0
    free = _json.loads(capsys.readouterr().out.splitlines()[0])["token_ids"]
    assert main(base + ["--stop-token-ids", str(free[3]), "--page-size", "8", "--num-pages", "4"]) == 0
    got = _json.loads(capsys.readouterr().out.splitlines()[0])
    assert got["token_ids"] == free[:free.index(free[3]) + 1] and got["finish_reason"] == "stop"


@pytest.mark.parametrize("model,tp", [("tiny-llama", 3), ("tiny-qwen3", 8)])
def test_a_tp_the_model_cannot_take_is_refused_before_any_executor_starts(model, tp, monkeypatch):
    """With executor='ray' the placement group (tp bundles) came first: on a machine without tp slots the user
    waited placement_timeout (60 s) for a resources error instead of the model's 'cannot be split' message."""
    import mpk_runtime.engine.llm as llm_mod

    def no_executor(*a, **k):
        raise AssertionError("an executor was created for a tp the model cannot take")
    monkeypatch.setattr(llm_mod, "make_executor", no_executor)
    with pytest.raises(InvalidRequestError, match=f"cannot be split {tp} ways"):
        llm_mod.LLM(model, backend="torch", tp=tp, executor="ray")


def test_a_shut_down_llm_refuses_new_requests_saying_so():
    """generate after shutdown (or after its with-block) failed each request as "the model workers failed while
    running this request ... retry it": nothing to retry, the workers were stopped on purpose."""
    from mpk_runtime.engine import ShutDownError
    with LLM("tiny-llama", backend="pyvm") as llm:
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids
    with pytest.raises(ShutDownError, match="create a new LLM"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ShutDownError):
        next(llm.stream([[1, 2, 3]], SamplingParams(max_tokens=2)))
    llm.shutdown()   # again: harmless
