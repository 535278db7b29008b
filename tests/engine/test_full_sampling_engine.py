"""Requests the graph's top-64 sampler cannot follow (top_k 0, top_k > 64) drawn on the device from the whole
vocabulary (DeviceSampling.full): through LLM on the CPU runners, in bursts and single steps, against the reference
model's logits and an independent definition of the draw (tests/runtime/test_full_sampling.ref_draw)."""
import pytest
import torch

from mpk_runtime.engine import LLM, InvalidRequestError, SamplingParams
from mpk_runtime.engine.sampling import check_device_sampling, device_sampling_for
from mpk_runtime.runtime.device_sampling import DeviceSampling
from tests.runtime.test_full_sampling import ref_draw

PROMPTS = [[1, 2, 3], [5, 4], [7, 7, 7, 7], [9]]
PARAMS = [SamplingParams(temperature=1.0, max_tokens=9, seed=21, ignore_eos=True),                 # top_k 0: plain
          SamplingParams(temperature=0.8, top_p=0.9, max_tokens=9, seed=22, ignore_eos=True),      # nucleus
          SamplingParams(temperature=1.2, top_k=100, top_p=0.95, max_tokens=9, seed=23, ignore_eos=True),  # k > 64
          SamplingParams(temperature=0, max_tokens=9)]                                              # greedy beside


def expected(ref, prompt: list[int], out: list[int], p: SamplingParams) -> list[int]:
    """The tokens the definition draws from the reference model's logits along `out` (teacher-forced)."""
    seq = torch.tensor([prompt + out[:-1]])
    logits = ref.forward(seq, torch.zeros(1, dtype=torch.long), ref.new_cache(1, seq.shape[1]))[0]
    if p.greedy:
        return [int(logits[len(prompt) - 1 + s].argmax()) for s in range(len(out))]
    ds = DeviceSampling(p.temperature, max(p.top_k, 0), p.top_p, p.seed, full=True)
    return [ref_draw(logits[q].tolist(), ds, q)[0] for q in range(len(prompt) - 1, len(prompt) - 1 + len(out))]


TOL = 1e-4   # bf16 against fp32 logits: decisions closer than this to a boundary (relative mass) may go either
#              way (a 512-token flat vocabulary: a token is ~2e-3 wide)


def assert_near_reference(ref, prompt: list[int], out: list[int], s: DeviceSampling) -> int:
    """Each token of `out` (drawn by a bf16 model) is the definition's draw from the fp32 reference's logits,
    teacher-forced, wherever that draw's margin exceeds TOL; returns how many tokens were checked."""
    seq = torch.tensor([prompt + out[:-1]])
    lg = ref.forward(seq, torch.zeros(1, dtype=torch.long), ref.new_cache(1, seq.shape[1]))[0]
    checked = 0
    for j, tok in enumerate(out):
        q = len(prompt) - 1 + j
        want, margin = ref_draw(lg[q].tolist(), s, q)
        if margin > TOL:
            assert tok == want, (prompt, j, tok, want, margin)
            checked += 1
    return checked


def _generate(backend="pyvm", tp=1, k=4, dmode="auto", **kw):
    with LLM("tiny-llama", backend=backend, tp=tp, dtype="float32", max_seq_len=64, max_batch=4, decode_steps=k,
             device_sampling=dmode, **kw) as m:
        outs = m.generate(PROMPTS, PARAMS, use_tqdm=False)
        return [o.token_ids for o in outs], dict(m.engine.stats)


@pytest.fixture(scope="module")
def pyvm_bursts():
    return _generate()


def test_full_rows_follow_the_reference_in_bursts(pyvm_bursts, ref_models):
    toks, stats = pyvm_bursts
    ref = ref_models("tiny-llama")
    for prompt, out, p in zip(PROMPTS, toks, PARAMS):
        assert len(out) == 9 and out == expected(ref, prompt, out, p)
    # the full rows did not keep the batch at one step a call: after the prompts' step, 8 decode steps in 2 calls
    assert stats["multi_steps"] == 2 and stats["device_steps_in_multi"] == 8
    assert (stats["sampled_full"], stats["sampled_graph"], stats["sampled_host"]) == (3, 1, 0)


def test_single_steps_plans_and_backends_draw_the_same_tokens(pyvm_bursts):
    toks = pyvm_bursts[0]
    assert _generate(k=1)[0] == toks
    assert _generate("torch", k=1)[0] == toks
    assert _generate("pyvm", plan="auto", plan_buckets=(1, 2, 4))[0] == toks


def test_tp2_draws_from_the_gathered_vocabulary(ref_models):
    """TP=2 ranks (threads) draw from the gathered logits of both vocabulary halves: the reference's tokens."""
    toks, _ = _generate("pyvm", tp=2)
    ref = ref_models("tiny-llama")
    for prompt, out, p in zip(PROMPTS, toks, PARAMS):
        assert out == expected(ref, prompt, out, p)


def test_routing_by_runner_support_and_mode():
    k0 = SamplingParams(temperature=1.0, seed=3)
    k65 = SamplingParams(temperature=1.0, top_k=65, seed=3)
    k8 = SamplingParams(temperature=1.0, top_k=8, seed=3)
    lp = SamplingParams(temperature=1.0, logprobs=2)
    assert device_sampling_for(k0, "auto", 3, full=True) == DeviceSampling(1.0, 0, 1.0, 3, full=True)
    assert device_sampling_for(k65, "on", 3, full=True) == DeviceSampling(1.0, 65, 1.0, 3, full=True)
    assert device_sampling_for(k8, "auto", 3, full=True) == DeviceSampling(1.0, 8, 1.0, 3)   # the graph's sampler
    assert device_sampling_for(k0, "auto", 3, full=False) is None                            # host
    assert device_sampling_for(k0, "on", 3, full=False) == DeviceSampling(1.0, 0, 1.0, 3)    # the top-64 cap
    assert device_sampling_for(lp, "auto", 3, full=True) is None                             # logprobs: host
    assert device_sampling_for(k0, "off", 3, full=True) is None
    check_device_sampling(k65, "on", full=True)
    with pytest.raises(InvalidRequestError, match="top_k=65"):
        check_device_sampling(k65, "on", full=False)


def test_runner_without_the_full_draw_samples_such_requests_on_the_host(monkeypatch, ref_models):
    from mpk_runtime.runtime.pyvm_runner import TorchRunner
    monkeypatch.setattr(TorchRunner, "samples_full_on_device", False)
    with LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=64, max_batch=4, decode_steps=4) as m:
        assert not m.engine.full_sampling
        m.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)
        assert m.engine.stats["multi_steps"] == 0 and m.engine.stats["logits_bytes"] > 0   # host-sampled
        assert m.engine.stats["sampled_host"] == 1 and m.engine.stats["sampled_full"] == 0
    with LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=64, max_batch=2,
             device_sampling="on") as m:
        with pytest.raises(InvalidRequestError, match="top_k"):
            m.generate([[1, 2]], SamplingParams(temperature=1.0, top_k=65, max_tokens=2))


@pytest.mark.parametrize("family,dtype", [("mono", "float32"), ("conventional", "float32"),
                                          ("conventional", "bfloat16")])   # bf16: the LM head's fp32 copy is optional
def test_planned_decoder_full_rows_read_fresh_logits(family, dtype):
    """PlannedDecoder (the GPU runner's plan path; here its CPU twin) with full rows beside greedy ones: the step runs
    the all-greedy graph variant but still writes the fp32 logits the draw reads (a conventional LM head may skip them
    in greedy steps): bursts equal single steps, and every token is the definition's draw from the reference model
    (bf16: wherever the reference's draw is not within TOL of a boundary, ref_draw's margin)."""
    from mpk_runtime.ir.shard import shard_for
    from mpk_runtime.models import PRESETS, ReferenceModel, random_weights
    from mpk_runtime.planner import plan_book
    from mpk_runtime.runtime.conventional_prefill import ConventionalPrefill
    from mpk_runtime.runtime.megakernel_plans import PlannedDecoder
    from mpk_runtime.runtime.memory import KVStore
    cfg = PRESETS["tiny-llama"].replace(dtype=dtype)
    w = random_weights(cfg, seed=3)
    ref = ReferenceModel(cfg, {k: v.float() for k, v in w.items()})
    book = plan_book(cfg, 1, (2, 4), context=16, families=(family,))
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(3)]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    samp = [DeviceSampling(0.9, 0, 1.0, 41, full=True), DeviceSampling(0.0, 0, 1.0, 0),
            DeviceSampling(0.7, 0, 0.9, 42, full=True)]
    results, checked = [], 0
    for multi in (False, True):
        kv = KVStore(cfg.num_layers, 40, 4, shard_for(cfg, 1, 0).n_kv, cfg.head_dim, getattr(torch, dtype),
                     poison=False)
        dec = PlannedDecoder(cfg, w, kv, book, max_seq_len=32, page_size=4, num_sms=4, dtype=dtype,
                             device=torch.device("cpu"), backend="pyvm")
        pre = ConventionalPrefill(cfg, w, kv, max_seq_len=32, page_size=4, dtype=dtype, device=torch.device("cpu"))
        toks = [pre.run(p, 0, tables[i], samp[i])[1] for i, p in enumerate(prompts)]
        pos = [len(p) for p in prompts]
        rows = [[t] for t in toks]
        if multi:
            for r, more in zip(rows, dec.decode_steps(toks, pos, tables, samp, 5).tolist()):
                r += more
        else:
            for _ in range(5):
                _, nxt = dec.decode(toks, pos, tables, samp, want_logits=False)
                toks, pos = [int(t) for t in nxt], [p + 1 for p in pos]
                for r, t in zip(rows, toks):
                    r.append(t)
        results.append(rows)
    assert results[0] == results[1]
    for prompt, s, out in zip(prompts, samp, results[1]):
        if dtype == "float32":
            p = SamplingParams(temperature=s.temperature, top_p=s.top_p, seed=s.seed, max_tokens=6)
            assert out == expected(ref, prompt, out, p)
            continue
        if not s.full:   # (bf16 greedy rows against the reference: tests/gpu, with a tie tolerance)
            continue
        checked += assert_near_reference(ref, prompt, out, s)
    if dtype != "float32":
        assert checked >= 6   # of 12 sampled tokens: the check is not vacuous
