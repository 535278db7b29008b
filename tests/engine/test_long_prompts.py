"""Long prompts are prefilled in chunks of a bounded size by default (engine.DEFAULT_MAX_NUM_BATCHED_TOKENS): one
chunk of a whole 128k-token prompt made the conventional prefill's attention mask alone 128 GiB at llama-3.2-1b's
shape, so a prompt of the model's context failed for memory on an 80 GiB GPU."""
import pytest
import torch

from mpk_runtime.engine import LLM, InvalidRequestError, SamplingParams
from mpk_runtime.engine.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, step_token_budget
from mpk_runtime.models import PRESETS, random_weights, save_weights
from mpk_runtime.runtime.base import KVSpec


def _spec(max_seq_len, max_batch):
    return KVSpec(num_pages=8, page_size=16, max_batch=max_batch, max_seq_len=max_seq_len)


def test_default_step_budget_is_bounded_at_long_contexts():
    assert step_token_budget(None, _spec(512, 8)) == 4096      # short contexts too: many prompts a step, none cut
    assert step_token_budget(None, _spec(131072, 8)) == DEFAULT_MAX_NUM_BATCHED_TOKENS == 4096
    assert step_token_budget(None, _spec(131072, 8192)) == 8192                # never below a step's decode rows
    assert step_token_budget(100, _spec(131072, 8)) == 100                      # the caller's, as given


@pytest.mark.parametrize("bad", [0, -4, 1.5, True, "4096"])
def test_bad_step_budget_refused_before_any_worker_starts(bad):
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
        LLM("tiny-llama", backend="nonexistent-backend", max_num_batched_tokens=bad)


def test_a_prompt_longer_than_the_budget_prefills_in_chunks_and_matches_the_reference(tmp_path):
    """A 6000-token prompt at max_seq_len 6200 (a tiny llama whose context allows it): two prefill chunks (4096 +
    1904) by default, and the generated tokens equal the pure-torch reference's."""
    cfg = PRESETS["tiny-llama"].replace(dtype="float32", max_position_embeddings=8192)
    d = tmp_path / "long"
    save_weights(str(d), cfg, random_weights(cfg, seed=5))
    prompt = torch.randint(0, cfg.vocab_size, (6000,), generator=torch.Generator().manual_seed(0)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("torch", "reference"):
        with LLM(str(d), backend=backend, max_seq_len=6200, max_batch=2, dtype="float32") as llm:
            outs[backend] = llm.generate([prompt], sp, use_tqdm=False)[0].token_ids
            if backend == "torch":
                st = llm.engine.stats
                assert (st["prompt_chunks"], st["prefill_steps"]) == (2, 2), st
    assert outs["torch"] == outs["reference"]


def test_short_prompts_join_the_batch_in_one_step_at_a_short_context():
    """16 prompts of 9-14 tokens, max_seq_len 64, max_batch 16: the default budget (4096) admits all of them in the
    first step, none cut (min(max_seq_len, 4096) = 64 tokens a step let in ~5 and cut the next), and the tokens
    equal each prompt's alone."""
    prompts = [[(7 * i + j) % 200 + 1 for j in range(9 + i % 6)] for i in range(16)]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM("tiny-llama", backend="torch", max_seq_len=64, max_batch=16, dtype="float32") as llm:
        for p in prompts:
            llm.engine.add_request(p, sp)
        llm.engine.step()
        st = llm.engine.stats
        assert (st["prefill_steps"], st["prompt_chunks"], st["prompt_tokens"]) == (1, 16, sum(map(len, prompts)))
        while llm.engine.has_unfinished():
            llm.engine.step()
        together = llm.generate(prompts, sp, use_tqdm=False)
        alone = [llm.generate([p], sp, use_tqdm=False)[0].token_ids for p in prompts]
    assert [o.token_ids for o in together] == alone
