"""logit_bias is applied before the penalties, as vLLM applies it (v1 Sampler: min_tokens / logit_bias logits
processors, then repetition / frequency / presence penalties): with a multiplicative repetition penalty the order
changes the logits, and so the tokens a user porting from vLLM gets."""
import torch

from mpk_runtime.engine.sampling import SamplingParams, process_logits


def test_logit_bias_then_repetition_penalty():
    x = torch.tensor([1.0, -2.0, 0.5, 0.0])
    p = SamplingParams(logit_bias={0: 3.0, 1: 3.0}, repetition_penalty=2.0)
    y = process_logits(x, p, output_ids=[0], prompt_ids=[1])
    # vLLM: (1 + 3) / 2 = 2 for token 0 (seen, positive after the bias); (-2 + 3) / 2 = 0.5 for token 1 (the bias
    # made it positive: divided, not multiplied); the unseen tokens keep their logits
    assert y.tolist() == [2.0, 0.5, 0.5, 0.0]


def test_bias_decides_the_greedy_token_as_vllm_would():
    # token 0: logit 2, biased +2 -> 4, seen, / 4 -> 1.0 ; token 1: logit 1.5, unseen -> 1.5: vLLM picks token 1
    # (penalty first would give 2 / 4 + 2 = 2.5 for token 0 and pick it)
    from mpk_runtime.engine.sampling import sample
    x = torch.tensor([2.0, 1.5, -1.0])
    p = SamplingParams(temperature=0, logit_bias={0: 2.0}, repetition_penalty=4.0)
    assert sample(process_logits(x, p, output_ids=[0], prompt_ids=[2]), p, 0, 3) == 1


def test_additive_penalties_and_min_tokens_unchanged():
    x = torch.zeros(6)
    p = SamplingParams(logit_bias={2: 1.5, 4: -3, 5: 100}, presence_penalty=1.0, frequency_penalty=0.5,
                       min_tokens=3, stop_token_ids=[5])
    y = process_logits(x, p, [2, 2], [], ())
    assert y[:5].tolist() == [0, 0, 1.5 - 1.0 - 1.0, 0, -3] and y[5] == float("-inf")


def test_vllms_detokenizer_switches_at_their_defaults_are_accepted():
    """SamplingParams(skip_special_tokens=True) (vLLM code passes it) was a TypeError; the value this runtime does not
    implement is an InvalidRequestError that names it."""
    import pytest

    from mpk_runtime.engine import InvalidRequestError
    assert SamplingParams(skip_special_tokens=True, spaces_between_special_tokens=True) == SamplingParams()
    for kw in ({"skip_special_tokens": False}, {"spaces_between_special_tokens": False}):
        with pytest.raises(InvalidRequestError, match=f"{next(iter(kw))}=False is not implemented"):
            SamplingParams(**kw)
