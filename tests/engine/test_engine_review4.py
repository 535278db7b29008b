"""Review 4 of the offline API as a vLLM user sees it (LLM.generate / stream, SamplingParams), against the reference
model's own greedy loop computed in the test."""
import pytest

from mpk_runtime.engine import LLM, SamplingParams
from tests.engine.test_engine_stop_logprobs import _SpaceTokenizer

PROMPT = [3, 1, 4, 1, 5]
OTHER = [7, 8, 9]


def _text(ids):
    return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=64, max_batch=8, tokenizer=_SpaceTokenizer()) as m:
        yield m


# --- calls that overlap: each call's outputs reach that call ------------------------------------------------------

def test_generate_while_a_stream_is_open(llm, ref_greedy):
    """generate() took every finished output as its own: with a stream() of the same LLM not yet exhausted, the
    stream's request finishing first made generate() return early with KeyError, and the stream then ended without
    its final output."""
    want_s, want_g = ref_greedy("tiny-qwen3", PROMPT, 3), ref_greedy("tiny-qwen3", OTHER, 6)
    it = llm.stream([PROMPT], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    first = next(it)
    g = llm.generate([OTHER], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert g[0].token_ids == want_g and g[0].finish_reason == "length"
    parts = [first] + list(it)
    assert parts[-1].finished and parts[-1].token_ids == want_s and parts[-1].finish_reason == "length"
    assert [t for p in parts for t in p.delta_token_ids] == want_s      # no update lost while generate() ran
    assert "".join(p.delta_text for p in parts) == _text(want_s)
    assert not llm.engine.has_unfinished()


def test_two_interleaved_streams_each_see_every_update(llm, ref_greedy):
    """Each stream() stepped the engine and dropped the other's updates: zip-style consumption lost deltas."""
    want_a, want_b = ref_greedy("tiny-qwen3", PROMPT, 4), ref_greedy("tiny-qwen3", OTHER, 7)
    a = llm.stream([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    b = llm.stream([OTHER], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    got_a, got_b = [], []
    for x, y in zip(a, b):
        got_a.append(x)
        got_b.append(y)
    got_a += list(a)
    got_b += list(b)
    for got, want in ((got_a, want_a), (got_b, want_b)):
        assert got[-1].finished and got[-1].token_ids == want
        assert [t for p in got for t in p.delta_token_ids] == want
        assert "".join(p.delta_text for p in got) == _text(want)
        assert [p.finished for p in got].count(True) == 1
    assert not llm.engine.has_unfinished()


# --- stop tokens and text -------------------------------------------------------------------------------------------

def test_a_stop_tokens_text_is_not_in_the_output_text(llm, ref_greedy):
    """vLLM: a request ended by one of its stop_token_ids keeps the token in token_ids but not its text in `text`
    (unless include_stop_str_in_output), as a stop string's text is cut. Here the token's text was in the text."""
    full = ref_greedy("tiny-qwen3", PROMPT, 12)
    stop = full[3]
    j = full.index(stop)
    sp = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop], ignore_eos=True)
    o = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    assert o.finish_reason == "stop" and o.token_ids == full[:j + 1]
    assert o.text == _text(full[:j])
    parts = list(llm.stream([PROMPT], sp))
    assert "".join(p.delta_text for p in parts) == _text(full[:j]) and parts[-1].text == _text(full[:j])
    o = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop], ignore_eos=True,
                                              include_stop_str_in_output=True), use_tqdm=False)[0]
    assert o.token_ids == full[:j + 1] and o.text == _text(full[:j + 1])


# --- min_tokens and stop strings ------------------------------------------------------------------------------------

def _vllm_min_tokens_stop(full, stop, min_tokens):
    """vLLM's rule, step by step over the greedy tokens: text produced by the first min_tokens tokens is not searched
    for stop strings (an occurrence must end in text of a later token)."""
    floor = len(_text(full[:min_tokens]))
    for k in range(min_tokens + 1, len(full) + 1):
        t = _text(full[:k])
        i = t.find(stop, max(0, floor - len(stop) + 1))
        if i >= 0:
            return full[:k], t[:i], "stop"
    return full, _text(full), "length"


@pytest.mark.parametrize("min_tokens", [3, 6])
def test_min_tokens_holds_off_stop_strings_too(llm, ref_greedy, min_tokens):
    """min_tokens guarantees that many tokens: a stop string in the first tokens' text ended the request at once
    (vLLM ignores stop strings in text of the first min_tokens tokens, as it does EOS and stop_token_ids)."""
    full = ref_greedy("tiny-qwen3", PROMPT, 12)
    stop = str(full[0])                       # in the first token's text: ends the request at token 1 without it
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop=stop, ignore_eos=True),
                         use_tqdm=False)[0]
    assert plain.token_ids == full[:1] and plain.text == "" and plain.finish_reason == "stop"
    ids, text, reason = _vllm_min_tokens_stop(full, stop, min_tokens)
    o = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop=stop, ignore_eos=True,
                                              min_tokens=min_tokens), use_tqdm=False)[0]
    assert len(o.token_ids) >= min_tokens
    assert (o.token_ids, o.text, o.finish_reason) == (ids, text, reason)


# --- prompts ---------------------------------------------------------------------------------------------------------

def test_token_ids_as_numpy_integers(llm, ref_greedy):
    """list(np.array(ids)) holds np.int64s: refused ("each prompt must be a str or a list of int token ids; got
    np.int64(3)") though SamplingParams takes numpy scalars; now taken as the ints they stand for, mixed with text."""
    np = pytest.importorskip("numpy")
    want = ref_greedy("tiny-qwen3", PROMPT, 5)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([list(np.array(PROMPT)), _text(PROMPT), tuple(np.array(PROMPT, dtype=np.int32))], sp,
                        use_tqdm=False)
    assert [o.token_ids for o in outs] == [want] * 3
    assert all(o.prompt_token_ids == PROMPT and all(type(t) is int for t in o.prompt_token_ids) for o in outs)
    o = llm.generate(list(np.array(PROMPT)), sp, use_tqdm=False)   # one prompt of numpy ints
    assert len(o) == 1 and o[0].token_ids == want
    from mpk_runtime.engine import InvalidRequestError
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, True, 2]], sp, use_tqdm=False)            # (bools stay refused)
