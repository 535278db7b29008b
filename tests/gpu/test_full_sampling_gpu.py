"""GPU: the full-vocabulary draw (runtime/full_sampling.py) on CUDA tensors draws the CPU's tokens for the same logits
(vocabularies of 151936 and 128256 tokens, every kind of row); through LLM on the megakernel runner, top_k 0 / top_p /
top_k > 64 requests are drawn on the device with no logits copy, bursts of decode steps give the single steps' tokens
(one megakernel), and every drawn token is the definition's draw from the reference model's logits, teacher-forced,
wherever that draw is not within bf16's reach of a boundary (tests/engine/test_full_sampling_engine.py's TOL)."""
import pytest
import torch

from tests.gpu.marks import GPU, KERNEL
from tests.engine.test_full_sampling_engine import assert_near_reference

pytestmark = GPU


def _rows():
    from mpk_runtime.runtime.device_sampling import DeviceSampling
    return [DeviceSampling(1.0, 0, 1.0, 5, full=True), DeviceSampling(0.7, 0, 0.9, 6, full=True),
            DeviceSampling(1.3, 100, 0.95, 7, full=True), DeviceSampling(0.6, 1000, 1.0, 8, full=True),
            DeviceSampling(1.0, 0, 0.95, 9, full=True), DeviceSampling(1.0, 0, 0.2, 10, full=True)]


@pytest.mark.parametrize("vocab", [151936, 128256])
def test_cuda_draws_equal_cpu_draws(vocab):
    from mpk_runtime.runtime.full_sampling import FullRows
    rows = _rows()
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(0)) * 4
    logits[5] = (logits[5] * 2).round() / 2          # ties
    cpu, gpu = FullRows(rows, "cpu", vocab), FullRows(rows, "cuda", vocab)
    lg = logits.cuda()
    for p in range(0, 2000, 37):
        pos = torch.full((len(rows),), p, dtype=torch.int64)
        a = torch.zeros(len(rows), dtype=torch.int64)
        b = torch.zeros(len(rows), dtype=torch.int64, device="cuda")
        cpu.draw(logits, pos, a, impl="torch")
        gpu.draw(lg, pos.cuda(), b)   # the Triton kernels
        assert a.tolist() == b.cpu().tolist(), p


def test_draw_graphs_replay_the_eager_draw():
    """runtime/draw_graphs.py on the GPU: a step's draw replayed as a CUDA graph over logits and positions rewritten
    in place (a decode step's buffers) gives FullRows' eager tokens at every step, for row sets that change (padding
    3 -> 4, a nucleus and not, ranked rows beside); one capture per (padded rows, nucleus), replays after."""
    from mpk_runtime.runtime.device_sampling import DeviceSampling
    from mpk_runtime.runtime.draw_graphs import DrawGraphs
    from mpk_runtime.runtime.full_sampling import FullRows
    V, B = 128256, 8
    logits = torch.zeros(B, V, device="cuda")
    pos = torch.zeros(B, dtype=torch.int64, device="cuda")
    out = torch.zeros(B, dtype=torch.int64, device="cuda")
    plain = [DeviceSampling(1.0, 0, 1.0, 50 + i, full=True) for i in range(B)]
    sets = [_rows(), plain[:3], plain[3:6] + [None], _rows()[:2] + [None, _rows()[4]], plain]
    dg = DrawGraphs()
    g = torch.Generator(device="cuda").manual_seed(3)
    for rows in sets:
        fr = FullRows(rows, "cuda", V)
        n = len(rows)
        for step in range(5):
            logits.copy_(torch.randn(B, V, device="cuda", generator=g) * 4)
            pos.copy_(torch.arange(B, device="cuda") * 31 + step * 7)
            out.fill_(-7)
            dg.draw(fr, logits[:n], pos[:n], out[:n], graph=True)
            want = torch.full((n,), -7, dtype=torch.int64, device="cuda")
            fr.draw(logits[:n], pos[:n], want)
            assert out[:n].tolist() == want.tolist(), (rows, step)
    # (m, nucleus): (4, T) [_rows: 4 vocab rows], (4, F) [3 plain], (4, F) reloaded, (4, T) [3 vocab], (8, F)
    assert dg.captures == 3 and dg.replays == 5 * 5 - 3


@KERNEL[-1]
@pytest.mark.parametrize("plan", [None, "auto"])
def test_llm_full_rows_on_the_megakernel(plan):
    from mpk_runtime import LLM, SamplingParams
    from mpk_runtime.models import ReferenceModel, get_weights, load_config
    from mpk_runtime.runtime.device_sampling import DeviceSampling
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    ps = [SamplingParams(max_tokens=10, temperature=1.0, seed=31, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=32, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=1.1, top_k=200, seed=33, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)]
    got = {}
    for k in (1, 4):
        llm = LLM("tiny-llama", backend="megakernel", max_batch=4, max_seq_len=128, decode_steps=k,
                  plan=plan)
        try:
            assert llm.engine.full_sampling
            got[k] = [o.token_ids for o in llm.generate(prompts, ps, use_tqdm=False)]
            assert (llm.engine.stats["multi_steps"] > 0) == (k > 1)
            assert llm.engine.stats["logits_bytes"] == 0     # no row's logits went to the host
        finally:
            llm.shutdown()
    if plan is None:
        assert got[1] == got[4]
    cfg = load_config("tiny-llama")
    # the runner's bf16 weights (drawn on the GPU), in fp32: the reference differs only by its fp32 arithmetic
    w = get_weights("tiny-llama", cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    ref = ReferenceModel(cfg, {k: v.float().cpu() for k, v in w.items()})
    checked = 0
    # the vocabulary-order rows (plain, nucleus); the top_k=200 row's order of near-equal logits differs between bf16
    # and fp32 (a 512-token flat vocabulary), so it is checked by test_cuda_draws_equal_cpu_draws and the bursts
    for prompt, p, toks in zip(prompts[:2], ps[:2], got[4][:2]):
        assert len(toks) == 10
        ds = DeviceSampling(p.temperature, max(p.top_k, 0), p.top_p, p.seed, full=True)
        checked += assert_near_reference(ref, prompt, toks, ds)
    assert checked >= 6   # of 20: not vacuous
