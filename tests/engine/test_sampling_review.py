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
