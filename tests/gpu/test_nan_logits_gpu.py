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
