"""User-level review of the offline API (LLM / SamplingParams) and the command line: odd but valid inputs work,
bad ones are refused up front with a message that names the field."""
import pytest

from mpk_runtime import LLM, InvalidRequestError, SamplingParams
from mpk_runtime.models import ModelConfig, random_weights


@pytest.mark.parametrize("seed", [None, 1.5, "0", True])
def test_llm_seed_not_an_int_is_refused_up_front(seed):
    # (was a WorkerError "rank 0 failed in 'init_model': TypeError: unsupported operand type(s) for *: 'NoneType'
    # and 'int'" / "manual_seed expected a long, but got float" from inside the runner; True ran as seed 1)
    with pytest.raises(InvalidRequestError, match="seed"):
        LLM("tiny-llama", seed=seed)


def test_llm_seed_any_int_works_as_sampling_params_seed_does():
    # (a seed past int64 was "ValueError: Overflow when unpacking long long" from torch's manual_seed; SamplingParams
    # takes any int seed, and so does the engine's request seed)
    llm = LLM("tiny-llama", backend="reference", dtype="float32", seed=2 ** 70, max_seq_len=32)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))[0]
    assert len(out.token_ids) == 2
    llm.shutdown()


def test_random_weights_seed_range_unchanged_where_it_worked():
    # folding a huge seed into manual_seed's range must not change the weights of the seeds that worked before
    cfg = ModelConfig.from_name("tiny-llama")
    for seed, head in ((7, [0.896760880947113, 0.8142960071563721, 1.1739141941070557]),
                       (-5, [1.120500087738037, 0.9654400944709778, 0.9213863611221313]),
                       (2 ** 40, [1.155074119567871, 1.064881682395935, 1.0027295351028442])):
        got = random_weights(cfg, seed=seed, dtype="float32")["model.norm.weight"][:3].tolist()
        assert got == pytest.approx(head, abs=0), seed
    big = random_weights(cfg, seed=2 ** 80, dtype="float32")["model.norm.weight"]
    assert big.isfinite().all()


@pytest.fixture
def broken_tokenizer_dir(demo_dir, tmp_path):
    import shutil
    d = tmp_path / "demo-broken-tokenizer"
    shutil.copytree(demo_dir, d)
    (d / "tokenizer.json").write_text("{not json")   # (a download cut short)
    return str(d)


def test_damaged_tokenizer_is_named_not_a_bare_json_error(broken_tokenizer_dir):
    # (was json.JSONDecodeError "Expecting property name enclosed in double quotes" from deep inside transformers,
    # for token-id prompts too, with nothing saying it was the tokenizer)
    from mpk_runtime import NoTokenizerError
    llm = LLM(broken_tokenizer_dir, backend="reference", dtype="float32", max_seq_len=32)
    for prompt in ("hello", [1, 2]):
        with pytest.raises(NoTokenizerError, match="tokenizer") as e:
            llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2))
        assert broken_tokenizer_dir in str(e.value) and "tokenizer=" in str(e.value)
    assert not llm.engine.has_unfinished()
    llm.shutdown()


def test_cli_damaged_tokenizer_exits_2_naming_it(broken_tokenizer_dir, capsys):
    from mpk_runtime.__main__ import main
    rc = main(["generate", "--model", broken_tokenizer_dir, "--backend", "reference", "--prompt-ids", "1,2",
               "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "tokenizer" in err and "Traceback" not in err


def test_llm_takes_a_pathlib_path_as_the_model_directory(demo_dir):
    # (a pathlib.Path of a model directory was UnknownModelError "model must be a preset name or a local model
    # directory, got PosixPath(...)", though LLM's tokenizer= takes one)
    import pathlib
    llm = LLM(pathlib.Path(demo_dir), backend="reference", dtype="float32", max_seq_len=32)
    by_str = LLM(demo_dir, backend="reference", dtype="float32", max_seq_len=32)
    sp = SamplingParams(temperature=0, max_tokens=3)
    a, b = llm.generate("hello world", sp)[0], by_str.generate("hello world", sp)[0]
    assert a.text is not None and (a.token_ids, a.text) == (b.token_ids, b.text)
    llm.shutdown()
    by_str.shutdown()


def test_max_seq_len_1_is_refused_at_creation():
    # (was accepted, and every request then failed with "shorten it to at most 0 tokens")
    with pytest.raises(InvalidRequestError, match="max_seq_len"):
        LLM("tiny-llama", backend="reference", max_seq_len=1)


@pytest.mark.parametrize("step_timeout", [0, -1, "30", float("nan"), True])
def test_bad_step_timeout_is_refused_up_front(step_timeout):
    # (was accepted, and every request then failed at its first step as RequestFailedError "the model workers
    # failed while running this request (WorkerTimeout: ... within -1 s) ... retry it": a runtime fault to retry)
    with pytest.raises(InvalidRequestError, match="step_timeout"):
        LLM("tiny-llama", backend="reference", step_timeout=step_timeout)


def test_step_timeout_positive_number_works():
    llm = LLM("tiny-llama", backend="reference", dtype="float32", max_seq_len=32, step_timeout=30)
    assert len(llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=2))[0].token_ids) == 2
    llm.shutdown()


@pytest.mark.parametrize("tokenizer", [5, object(), ["a"]])
def test_tokenizer_that_is_not_one_is_refused_up_front(tokenizer):
    # (was accepted; generate then failed with AttributeError "'int' object has no attribute 'eos_token_id'")
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        LLM("tiny-llama", backend="reference", tokenizer=tokenizer)


def test_numpy_token_ids_in_stop_token_ids_and_logit_bias():
    # (prompts and the scalar fields take numpy ints as the ints they stand for; stop_token_ids=list(np.array(ids)) and
    # a logit_bias built from numpy arrays were refused as "must be a list of non-negative ints, got [np.int64(1),
    # ...]")
    np = pytest.importorskip("numpy")
    sp = SamplingParams(stop_token_ids=list(np.array([1, 2])), logit_bias={np.int64(3): np.float32(1.5), 4: -2})
    assert sp.stop_token_ids == (1, 2) and all(type(t) is int for t in sp.stop_token_ids)
    assert sp.logit_bias == ((3, 1.5), (4, -2.0)) and all(type(k) is int and type(v) is float for k, v in sp.logit_bias)
    assert SamplingParams(stop_token_ids=[1, 2], logit_bias={3: 1.5, 4: -2}) == sp
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[np.int64(-1)])
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[np.bool_(True)])
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={np.int64(3): np.float32("nan")})


def test_outputs_read_as_vllms(tmp_path):
    """(session 74) Code written for vLLM reads `out.outputs[0].text` / `.token_ids` / `.finish_reason`: the same
    completion as the RequestOutput's own fields (cluster.Client's outputs are RequestOutputs too)."""
    from mpk_runtime.engine import CompletionOutput
    with LLM("tiny-qwen3", backend="reference", dtype="float32", max_seq_len=64) as llm:
        o = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, logprobs=1))[0]
    (c,) = o.outputs
    assert isinstance(c, CompletionOutput) and c.index == 0
    assert (c.token_ids, c.text, c.finish_reason, c.logprobs) == (o.token_ids, o.text, o.finish_reason, o.logprobs)
    assert len(c.token_ids) == 4 and c.finish_reason == "length" and len(c.logprobs) == 4
