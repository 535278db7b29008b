"""A seeded request draws the same tokens wherever it is sampled: the host sampler draws as the device samplers do
(engine/sampling.py sample(): the same token for the same logits, seed and position). Asking for logprobs moves a
request from the device's draw to the host's, and its text changed with it (two random streams); the reference
backend (host only) drew other tokens than pyvm for the same seed."""
import pytest

from mpk_runtime import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 7], [300, 2, 9]]
KINDS = [dict(temperature=0.9, top_k=20, top_p=0.9),          # the graph's top-C sampler on the device
         dict(temperature=1.2),                                # the full-vocabulary sampler (or the host)
         dict(temperature=0.7, top_k=200, top_p=0.8)]          # top_k past the graph's 64


def _params(kind, seed, **kw):
    return SamplingParams(max_tokens=12, seed=seed, **kind, **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_do_not_change_a_seeded_requests_tokens(kind):
    with LLM("tiny-qwen3", backend="pyvm", dtype="float32", max_seq_len=64) as llm:
        plain = llm.generate(PROMPTS, [_params(kind, s) for s in (3, 4)], use_tqdm=False)
        st = dict(llm.engine.stats)
        lp = llm.generate(PROMPTS, [_params(kind, s, logprobs=2) for s in (3, 4)], use_tqdm=False)
        assert llm.engine.stats["sampled_host"] - st["sampled_host"] == 2   # (the logprobs rows were the host's)
    assert [o.token_ids for o in lp] == [o.token_ids for o in plain]
    assert len({tuple(o.token_ids) for o in plain}) == 2 and all(len(o.logprobs) == 12 for o in lp)


@pytest.mark.parametrize("kind", KINDS)
def test_the_reference_backend_draws_what_pyvm_draws(kind):
    """fp32 tiny model: the two backends' logits agree to rounding, so the same seed gives the same tokens."""
    outs = []
    for backend in ("reference", "pyvm"):
        with LLM("tiny-qwen3", backend=backend, dtype="float32", max_seq_len=64) as llm:
            outs.append([o.token_ids for o in llm.generate(PROMPTS, [_params(kind, s) for s in (3, 4)],
                                                           use_tqdm=False)])
    assert outs[0] == outs[1]
