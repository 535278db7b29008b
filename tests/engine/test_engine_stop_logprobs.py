"""Stop strings, logprobs and penalties, against the reference model run step by step in the test."""
import pytest
import torch

from mpk_runtime.engine import LLM, InvalidRequestError, NoTokenizerError, SamplingParams
from mpk_runtime.engine.stop_strings import held_back, visible_text

PROMPT = [3, 1, 4, 1, 5]


class _SpaceTokenizer:
    """Text = the token ids joined by spaces: every stop string's position is known from the token ids."""
    eos_token_id = None

    def encode(self, text, add_special_tokens=True):
        return [int(x) for x in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=64, max_batch=8, tokenizer=_SpaceTokenizer()) as m:
        yield m


def _ref_logits(ref, seq: list[int]) -> torch.Tensor:
    """The reference model's fp32 logits for the token after `seq` (the whole sequence again, no cache reuse)."""
    return ref.forward(torch.tensor([seq]), torch.zeros(1, dtype=torch.long), ref.new_cache(1, len(seq)))[0, -1]


def test_stop_string_cuts_text_and_keeps_tokens(llm, ref_greedy):
    full = ref_greedy("tiny-qwen3", PROMPT, 12)
    text = " ".join(map(str, full))
    stop = f" {full[4]} {full[5]}"          # ends inside the 6th token's text
    i = text.find(stop)
    o = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop=stop, ignore_eos=True))[0]
    assert o.finish_reason == "stop" and o.text == text[:i]
    assert o.token_ids == full[:len(o.token_ids)] and len(o.token_ids) == 6   # the tokens that completed it
    o = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop=[stop, "no-such"],
                                              include_stop_str_in_output=True, ignore_eos=True))[0]
    assert o.finish_reason == "stop" and o.text == text[:i + len(stop)]
    o = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop="no-such", ignore_eos=True))[0]
    assert o.finish_reason == "length" and o.text == text


def test_streamed_text_never_shows_a_stop_strings_start(llm, ref_greedy):
    full = ref_greedy("tiny-qwen3", PROMPT, 12)
    stop = f" {full[6]} {full[7]}"
    parts = list(llm.stream(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop=stop, ignore_eos=True)))
    final = parts[-1]
    assert final.finished and final.finish_reason == "stop"
    assert "".join(p.delta_text for p in parts) == final.text
    for p in parts:   # what was shown so far is always a prefix of the final text
        assert final.text.startswith(p.text)


def test_stop_string_helpers():
    assert held_back("abc x", ("x y",)) == 1 and held_back("abc x ", ("x y",)) == 2
    assert held_back("abc", ("x y",)) == 0
    assert visible_text("a stop b", ("stop",), False, False) == ("a ", True)
    assert visible_text("a sto", ("stop",), False, False) == ("a ", False)
    assert visible_text("a sto", ("stop",), False, True) == ("a sto", False)
    assert visible_text("x ab", ("b", "ab"), True, False) == ("x ab", True)   # earliest, then longest


def test_stop_strings_need_a_tokenizer():
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=32) as m:
        with pytest.raises(NoTokenizerError, match="stop_token_ids"):
            m.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, stop="x"))


@pytest.mark.parametrize("device_sampling", ["auto", "off"])
def test_logprobs_match_the_reference(ref_models, device_sampling):
    ref = ref_models("tiny-qwen3")
    with LLM("tiny-qwen3", backend="pyvm", dtype="float32", max_seq_len=64,
             device_sampling=device_sampling) as m:
        greedy = m.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
        o = m.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    assert greedy.logprobs is None and o.token_ids == greedy.token_ids
    assert len(o.logprobs) == 6
    seq = list(PROMPT)
    for tok, lp in zip(o.token_ids, o.logprobs):
        want = torch.log_softmax(_ref_logits(ref, seq), -1)
        top = torch.topk(want, 3).indices.tolist()
        assert next(iter(lp)) == tok                          # the sampled token first
        assert set(lp) == {tok, *top}                         # then the top 3 (greedy: tok is one of them)
        for t, v in lp.items():
            assert v == pytest.approx(float(want[t]), abs=1e-4)
        seq.append(tok)
    d = o.to_dict()["logprobs"]
    assert [row[0][0] for row in d] == o.token_ids


def test_sampled_logprobs_name_the_sampled_token(llm):
    o = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=7, max_tokens=8, logprobs=0, ignore_eos=True))[0]
    same = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[0]
    assert o.token_ids == same.token_ids                     # logprobs change nothing about the draw
    assert [list(lp) for lp in o.logprobs] == [[t] for t in o.token_ids]
    assert all(v <= 0 for lp in o.logprobs for v in lp.values())


def _penalized_greedy(ref, prompt, steps, presence=0.0, frequency=0.0, repetition=1.0):
    seq, out = list(prompt), []
    for _ in range(steps):
        x = _ref_logits(ref, seq).clone()
        for t in set(seq):
            if repetition != 1.0:
                x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
        for t in set(out):
            x[t] -= frequency * out.count(t) + presence
        tok = int(torch.argmax(x))
        out.append(tok)
        seq.append(tok)
    return out


@pytest.mark.parametrize("kw", [dict(frequency_penalty=2.0), dict(presence_penalty=2.0),
                                dict(repetition_penalty=4.0), dict(frequency_penalty=-0.5, repetition_penalty=0.5)])
def test_penalties_match_a_step_by_step_reference(llm, ref_models, kw):
    ref = ref_models("tiny-qwen3")
    steps = 16
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))[0].token_ids
    o = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, **kw))[0]
    want = _penalized_greedy(ref, PROMPT, steps, kw.get("presence_penalty", 0.0), kw.get("frequency_penalty", 0.0),
                             kw.get("repetition_penalty", 1.0))
    assert o.token_ids == want
    assert want != plain        # the penalty changed the continuation (else this test could not fail)


def test_host_only_fields_refused_when_everything_samples_on_device():
    with LLM("tiny-qwen3", backend="pyvm", dtype="float32", max_seq_len=32, device_sampling="on") as m:
        for kw in (dict(logprobs=1), dict(presence_penalty=0.5), dict(repetition_penalty=1.2)):
            with pytest.raises(InvalidRequestError, match="device_sampling='auto'"):
                m.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, **kw))


@pytest.mark.parametrize("kw,msg", [
    (dict(stop=""), "stop must be"), (dict(stop=["a", 3]), "stop must be"),
    (dict(logprobs=-1), "logprobs must be"), (dict(logprobs=21), "logprobs must be"), (dict(logprobs=True), "logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(include_stop_str_in_output=1), "include_stop_str"),
])
def test_bad_fields_are_named(kw, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        SamplingParams(**kw)


def test_cli_generate_logprobs_and_penalties(capsys, ref_models):
    import json

    from mpk_runtime.__main__ import main
    assert main(["generate", "--model", "tiny-llama", "--prompt-ids", "1,2,3", "--backend", "pyvm",
                 "--max-tokens", "3", "--logprobs", "1", "--repetition-penalty", "1.3", "--ignore-eos"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert [pos[0][0] for pos in row["logprobs"]] == row["token_ids"] and all(len(p) in (1, 2) for p in row["logprobs"])
    ref = ref_models("tiny-llama")
    logits = ref.forward(torch.tensor([[1, 2, 3]]), torch.zeros(1, dtype=torch.long), ref.new_cache(1, 3))[0, -1]
    assert row["logprobs"][0][0][1] == pytest.approx(float(torch.log_softmax(logits, -1)[row["token_ids"][0]]),
                                                     abs=1e-4)
