"""Review of engine/sampling.py, checks.py, stop_strings.py and tokenizer.py: user-visible contract bugs."""
import pathlib

import pytest

from mpk_runtime import LLM, SamplingParams
from mpk_runtime.engine.tokenizer import LazyTokenizer


def test_tokenizer_given_as_a_pathlib_path_is_loaded_from_that_directory(demo_dir):
    """LLM(tokenizer=...) takes "a path, or a tokenizer object": a pathlib.Path was taken for a tokenizer object, and
    the first text prompt failed with AttributeError ('PosixPath' object has no attribute 'encode')."""
    lt = LazyTokenizer(pathlib.Path(demo_dir))
    assert lt.available and lt.get().encode("hello world") == LazyTokenizer(demo_dir).get().encode("hello world")
    llm = LLM("tiny-qwen3", tokenizer=pathlib.Path(demo_dir))
    a = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    b = LLM("tiny-qwen3", tokenizer=demo_dir).generate(["hello world"], SamplingParams(temperature=0, max_tokens=4,
                                                                                         ignore_eos=True))[0]
    assert a.token_ids == b.token_ids and a.text == b.text


def test_numpy_scalars_are_taken_as_the_numbers_they_stand_for():
    """np.float32(0.7) / np.int64(5) (what a value read from an array is) were refused with a message that named the
    value and said it must be a number; they are numbers. Booleans stay refused where an int is asked."""
    import numpy as np
    from mpk_runtime.engine.sampling import SamplingParams
    sp = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int64(5), max_tokens=np.int32(7),
                        seed=np.uint64(3), min_p=np.float16(0.25))
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.seed, sp.min_p) == (0.5, 0.9, 5, 7, 3, 0.25)
    assert type(sp.temperature) is float and type(sp.top_k) is int and type(sp.max_tokens) is int
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=np.bool_(True))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=np.float32("nan"))


def test_a_tokenizer_path_without_a_tokenizer_is_refused_up_front(tmp_path):
    """LLM(tokenizer=<a directory with no tokenizer files>, or a path that does not exist) went on with no tokenizer:
    text prompts then failed far from the cause. It is refused when the LLM is made, naming the path."""
    from mpk_runtime.engine.errors import InvalidRequestError
    for bad in (tmp_path, tmp_path / "missing", str(tmp_path / "missing")):
        with pytest.raises(InvalidRequestError, match="not a directory holding a tokenizer"):
            LLM("tiny-llama", tokenizer=bad)
