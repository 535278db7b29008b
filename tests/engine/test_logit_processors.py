"""logit_bias, min_tokens and min_p (SamplingParams; sampling.process_logits / sample): host work like the penalties,
checked against the reference model's own logits and against their definitions."""
import math

import pytest
import torch

from mpk_runtime.engine import LLM, InvalidRequestError, SamplingParams
from mpk_runtime.engine.sampling import process_logits, sample

PROMPT = [5, 9, 2, 7, 11]


def _ref_logits(ref_models, prompt):
    m = ref_models("tiny-qwen3", 0)
    cache = m.new_cache(1, 64)
    return m.forward(torch.tensor([prompt]), torch.tensor([0]), cache)[0, -1].float()


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_logit_bias_against_the_reference_logits(ref_models, ref_greedy, backend):
    lg = _ref_logits(ref_models, PROMPT)
    t0 = int(lg.argmax())
    assert ref_greedy("tiny-qwen3", PROMPT, 1) == [t0]
    want = int((lg - 100 * torch.nn.functional.one_hot(torch.tensor(t0), lg.numel())).argmax())
    with LLM("tiny-qwen3", backend=backend, dtype="float32", max_seq_len=64) as llm:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logit_bias={t0: -100}),
                           use_tqdm=False)[0]
        assert out.token_ids == [want] and want != t0
        # +100 on one token: every draw takes it, greedy or sampled
        outs = llm.generate([PROMPT, PROMPT], [SamplingParams(temperature=0, max_tokens=6, logit_bias={7: 100},
                                                              ignore_eos=True),
                                               SamplingParams(temperature=1.0, seed=3, max_tokens=6,
                                                              logit_bias={7: 100}, ignore_eos=True)],
                            use_tqdm=False)
        assert [o.token_ids for o in outs] == [[7] * 6, [7] * 6]
        with pytest.raises(InvalidRequestError, match="logit_bias token ids"):
            llm.generate([PROMPT], SamplingParams(logit_bias={10 ** 6: 1.0}))
        st = llm.engine.stats
        assert st["sampled_host"] >= 3 or backend == "reference"


def test_min_tokens_holds_off_the_stop_tokens(ref_greedy):
    ref = ref_greedy("tiny-qwen3", PROMPT, 12)
    stop = ref[1]                       # the greedy run's second token
    with LLM("tiny-qwen3", backend="torch", dtype="float32", max_seq_len=64) as llm:
        plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]),
                             use_tqdm=False)[0]
        held = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop],
                                                     min_tokens=6), use_tqdm=False)[0]
    assert plain.token_ids == ref[:2] and plain.finish_reason == "stop"
    assert len(held.token_ids) >= 6 and stop not in held.token_ids[:6]
    assert held.token_ids[0] == ref[0] and held.token_ids[1] != stop


def test_process_logits_masks_ends_until_min_tokens():
    x = torch.zeros(10)
    p = SamplingParams(min_tokens=2, stop_token_ids=[3])
    y = process_logits(x, p, [1], [4], eos_ids={5})
    assert torch.isinf(y[[3, 5]]).all() and torch.isfinite(y[[0, 1, 2, 4, 6]]).all() and x.eq(0).all()
    assert torch.isfinite(process_logits(x, p, [1, 2], [4], eos_ids={5})).all()   # two generated: no mask
    y = process_logits(x, SamplingParams(min_tokens=2, ignore_eos=True), [], [], eos_ids={5})
    assert torch.isfinite(y).all()   # ignore_eos: EOS ends nothing, so nothing to hold off
    y = process_logits(x, SamplingParams(logit_bias={2: 1.5, 4: -3}, presence_penalty=1.0), [2], [], ())
    assert y.tolist() == [0, 0, 0.5, 0, -3, 0, 0, 0, 0, 0]   # the bias, then the penalty (additive: either order gives this)


def test_min_p_keeps_the_tokens_near_the_top():
    # probabilities proportional to 1, 0.6, 0.3, 0.1: min_p 0.5 keeps the first two, in ratio 1 : 0.6
    logits = torch.log(torch.tensor([1.0, 0.6, 0.3, 0.1]))
    p = SamplingParams(temperature=1.0, min_p=0.5)
    draws = [sample(logits, p, 0, pos) for pos in range(4000)]
    assert set(draws) == {0, 1}
    assert abs(draws.count(0) / 4000 - 1 / 1.6) < 0.03
    # after temperature: at T = 0.5 the probabilities go as squares (1, 0.36, 0.09, 0.01): min_p 0.3 keeps two
    p = SamplingParams(temperature=0.5, min_p=0.3)
    assert set(sample(logits, p, 1, pos) for pos in range(500)) == {0, 1}
    assert math.isclose(SamplingParams(min_p=1).min_p, 1.0)
    assert set(sample(logits, SamplingParams(min_p=1.0), 2, pos) for pos in range(50)) == {0}


def test_min_p_and_friends_are_host_work():
    with LLM("tiny-qwen3", backend="torch", dtype="float32", max_seq_len=64) as llm:
        llm.generate([PROMPT], SamplingParams(temperature=0.8, min_p=0.1, max_tokens=3), use_tqdm=False)
        assert llm.engine.stats["sampled_host"] == 1
        llm.generate([PROMPT], SamplingParams(temperature=0, min_p=0.1, max_tokens=3), use_tqdm=False)
        assert llm.engine.stats["sampled_host"] == 1   # greedy: min_p changes nothing, the device's argmax serves
    with LLM("tiny-qwen3", backend="torch", dtype="float32", max_seq_len=64, device_sampling="on") as llm:
        for sp in (SamplingParams(min_p=0.1), SamplingParams(logit_bias={1: 2.0}), SamplingParams(min_tokens=2)):
            with pytest.raises(InvalidRequestError, match="on the host"):
                llm.generate([PROMPT], sp)


@pytest.mark.parametrize("kw, word", [
    (dict(logit_bias={"a": 1}), "logit_bias"), (dict(logit_bias={1: 200}), "logit_bias"),
    (dict(logit_bias=[(3, 50.0), (3, 50.0)]), "each once"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(min_p=1.5), "min_p"), (dict(min_p="x"), "min_p")])
def test_bad_values_are_refused(kw, word):
    with pytest.raises(InvalidRequestError, match=word):
        SamplingParams(**kw)
