"""A model directory's generation_config.json sets the sampling defaults of a request that leaves them out, as vLLM's
generation_config="auto" does (session 76, from the API audit): LLM.generate(prompts) with no SamplingParams sampled
at temperature 1 / top_p 1 and 16 tokens whatever the model's maker recommends, where vLLM samples Qwen3 at 0.6 /
0.95 / top_k 20. "vllm" turns it off; a bad file is a clear error naming the file and the way round."""
import json
import os

import pytest

from mpk_runtime.engine import LLM, InvalidRequestError, SamplingParams
from mpk_runtime.engine.generation_config import sampling_defaults


def _write(d, cfg):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        f.write(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(d)


def test_the_files_sampling_fields_and_only_those_the_model_set(tmp_path):
    qwen3 = {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2, 3], "pad_token_id": 2, "temperature": 0.6,
             "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}
    assert sampling_defaults(_write(tmp_path / "q", qwen3)) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    # Hugging Face's own defaults are not the maker's recommendation (transformers' to_diff_dict drops them)
    hf = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0, "min_p": None}
    assert sampling_defaults(_write(tmp_path / "hf", hf)) == {}
    more = {"temperature": 0, "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 7, "do_sample": False}
    assert sampling_defaults(_write(tmp_path / "m", more)) == {"temperature": 0, "min_p": 0.05,
                                                               "repetition_penalty": 1.1, "max_tokens": 7}
    # none: a preset, a directory without the file, "vllm" / None
    assert sampling_defaults("tiny-llama") == {}
    os.makedirs(tmp_path / "empty")
    assert sampling_defaults(str(tmp_path / "empty")) == {}
    assert sampling_defaults(str(tmp_path / "q"), "vllm") == {} and sampling_defaults(str(tmp_path / "q"), None) == {}
    # another directory's file, for any model
    assert sampling_defaults("tiny-llama", str(tmp_path / "q")) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert sampling_defaults("tiny-llama", tmp_path / "q")["top_k"] == 20


@pytest.mark.parametrize("cfg, mode, words", [
    ("{not json", "auto", ["generation_config.json", "JSON", "'vllm'"]),
    ([1, 2], "auto", ["not a JSON object"]),
    ({"top_p": 2.0}, "auto", ["generation_config.json", "top_p", "'vllm'"]),
    ({"temperature": "0.6"}, "auto", ["temperature"]),
    ({"temperature": 0.6}, "hf", ["'hf'", "no generation_config.json"]),
    ({"temperature": 0.6}, 3, ["generation_config must be"]),
])
def test_a_bad_file_or_mode_is_a_clear_error(tmp_path, cfg, mode, words):
    d = _write(tmp_path / "m", cfg)
    with pytest.raises(InvalidRequestError) as e:
        sampling_defaults(d, mode)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from mpk_runtime.engine.demo_model import save_demo_model
    d = save_demo_model(str(tmp_path_factory.mktemp("gc") / "demo"))
    return _write(d, {"temperature": 0.0, "max_new_tokens": 5, "top_k": 20})


def test_generate_without_params_takes_the_models_defaults(model_dir):
    prompts = [[5, 6, 7], "hello there"]
    with LLM(model_dir, backend="torch", dtype="float32") as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5, top_k=20)
        got = llm.generate(prompts, use_tqdm=False)
        want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, top_k=20), use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert all(len(o.token_ids) == 5 or o.finish_reason == "stop" for o in got)
        # explicit params are the caller's: the defaults do not reach into them
        assert len(llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                                use_tqdm=False)[0].token_ids) == 2
        chat = llm.chat([{"role": "user", "content": "hello"}], use_tqdm=False)[0]
        assert chat.token_ids == llm.chat([{"role": "user", "content": "hello"}],
                                          SamplingParams(temperature=0, max_tokens=5, top_k=20),
                                          use_tqdm=False)[0].token_ids
        assert [o.outputs[0].token_ids for o in llm.stream(prompts[:1])][-1] == got[0].token_ids
    with LLM(model_dir, backend="torch", dtype="float32", generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_a_bad_generation_config_fails_the_llm_before_any_worker(tmp_path):
    d = _write(tmp_path / "bad", {"top_p": 0})
    with pytest.raises(InvalidRequestError, match=r"top_p.*generation_config='vllm'"):
        LLM("tiny-llama", backend="torch", generation_config=d)
