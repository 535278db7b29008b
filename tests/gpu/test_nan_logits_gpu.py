"""GPU: NaN logits (a checkpoint whose final norm weight is NaN) fail every request on the megakernel backend,
whichever sampler draws it: greedy, the full-vocabulary draw, and the top-k (<= 64) draw inside the step's graph
(ir/sampling.py step 6: a best candidate that is not finite draws PAD_INDEX; until session 74 the device drew the
NaN-ranked candidate's token). The engine stays usable after each failure."""
import pytest

from tests.gpu.marks import KERNEL

pytestmark = KERNEL


@pytest.mark.parametrize("plan", ["auto", None], ids=["planned", "one-kernel"])
def test_nan_logits_fail_every_sampler_on_the_gpu(tmp_path, plan):
    from mpk_runtime.engine import LLM, RequestFailedError, SamplingParams
    from mpk_runtime.models import PRESETS, random_weights, save_weights
    cfg = PRESETS["tiny-llama"].replace(dtype="bfloat16")
    w = random_weights(cfg, seed=3)
    w["model.norm.weight"].fill_(float("nan"))
    d = tmp_path / "nan"
    save_weights(str(d), cfg, w)
    with LLM(str(d), backend="megakernel", max_seq_len=64, max_batch=2, plan=plan) as llm:
        for sp in (SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=0.7, max_tokens=3),
                   SamplingParams(temperature=1.0, top_k=5, max_tokens=3),
                   SamplingParams(temperature=0.5, top_k=64, top_p=0.9, seed=7, max_tokens=3)):
            with pytest.raises(RequestFailedError, match="NaN"):
                llm.generate([[1, 2, 3]], sp)
            assert not llm.engine.scheduler.running


@pytest.mark.parametrize("plan", ["auto", None], ids=["planned", "one-kernel"])
def test_a_token_outside_the_table_reads_its_nearest_row_on_the_gpu(plan):
    """The device feeds a NaN row's PAD_INDEX back as the next step's input (a multi-step launch, a burst) before
    the engine fails the request: the embed reads the table's last row (was an out-of-bounds read that ends the CUDA
    context, every request with it). tests/runtime/test_embed_guard.py on the CPU paths."""
    import torch

    from mpk_runtime.ir.sampling import PAD_INDEX
    from mpk_runtime.runtime.megakernel_runner import MegakernelRunner
    r = MegakernelRunner("tiny-llama", max_batch=2, max_seq_len=64, plan=plan)
    V = r.config.vocab_size
    got = {t: r._decode_rows([t], [0], [[1]], None)[0].float().cpu() for t in (V - 1, PAD_INDEX, V, 0, -1)}
    torch.cuda.synchronize()
    assert torch.isfinite(got[PAD_INDEX]).all()
    assert torch.equal(got[PAD_INDEX], got[V - 1]) and torch.equal(got[V], got[V - 1])
    assert torch.equal(got[-1], got[0])
