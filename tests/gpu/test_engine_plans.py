"""GPU: the planner's plans in the megakernel runner. Every plan family of a tiny model, prefilled through the
conventional path and decoded through PlannedDecoder (CUDA-graph replays, a key-cap re-capture), stays within
bf16 tolerance of the pure-torch reference, teacher-forced (scripts/gpu_check_plans.py forced()); and
LLM(backend="megakernel", plan="auto") generates through its plans (skips without a CUDA GPU + nvcc)."""
from types import SimpleNamespace

import pytest

from tests.gpu.marks import KERNEL

pytestmark = KERNEL


def _script():
    import importlib.util
    import pathlib
    spec = importlib.util.spec_from_file_location("gpu_check_plans",
                                                  pathlib.Path(__file__).parents[2] / "scripts/gpu_check_plans.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


@pytest.mark.parametrize("family", ["mono", "mega2", "attn-conv", "attn-mk", "conventional"])
def test_plan_families_match_reference(family):
    from mpk_runtime.models.config import load_config
    from mpk_runtime.planner import plan_book
    book = plan_book(load_config("tiny-qwen3"), 1, (2, 4), context=256, families=(family,))
    r = _script().forced("tiny-qwen3", book, 3, 250, 10)
    assert r["plan"] == family and r["captures"] == 2 and r["ok"], r


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama"])
def test_attn_mk_plans_with_deferred_kv_appends_match_reference(model, monkeypatch):
    """MPK_KV_DEFER=1 (ir/defer.py): the attention megakernels append the k / v rows the conventional q/k tail left
    in kv_new (CUDA-graph replays, a key-cap re-capture: the next steps read what the deferred appends wrote)."""
    from mpk_runtime.models.config import load_config
    from mpk_runtime.planner import plan_book
    monkeypatch.setenv("MPK_KV_DEFER", "1")
    book = plan_book(load_config(model), 1, (2, 4), context=256, families=("attn-mk",))
    r = _script().forced(model, book, 3, 250, 10)
    assert r["plan"] == "attn-mk" and r["captures"] == 2 and r["ok"], r


def assert_follows_reference(model: str, prompts, outs, rel: float = 3e-2) -> None:
    """Each greedy token the engine generated is the pure-torch reference's argmax at that position, teacher-forced on
    the engine's own tokens (fp32 over the same bf16 weights, drawn on the GPU with the engine's seed 0), or within
    2 x `rel` of the top logit's magnitude of it (forced()'s logit tolerance: bf16 rounding differs per plan, so a near
    tie may go either way; a wrong token, bucket or page table lands far below the top)."""
    import torch

    from mpk_runtime.models import ReferenceModel, get_weights, load_config
    cfg = load_config(model)
    w = get_weights(model, cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    ref = ReferenceModel(cfg.replace(dtype="float32"), {k: v.float() for k, v in w.items()})
    for p, o in zip(prompts, outs):
        seq = torch.tensor([list(p) + list(o.token_ids)], device="cuda")
        with torch.no_grad():
            lg = ref.forward(seq, torch.zeros(1, dtype=torch.long, device="cuda"), ref.new_cache(1, seq.shape[1]))[0]
        for t, tok in enumerate(o.token_ids):
            row = lg[len(p) - 1 + t].float()
            gap = float(row.max() - row[tok])
            assert gap <= 2 * rel * float(row.abs().max()), (p, t, tok, int(row.argmax()), gap)


def test_llm_plan_auto_generates_through_plans():
    from mpk_runtime import LLM, SamplingParams
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    llm = LLM("tiny-llama", backend="megakernel", max_batch=4, max_seq_len=128, plan="auto")
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert [len(o.token_ids) for o in outs] == [6] * 4
        assert llm.executor.collective_rpc("health")[0]["plans_used"]
    finally:
        llm.shutdown()
    assert_follows_reference("tiny-llama", prompts, outs)


def test_greedy_and_sampled_steps_replay_their_own_graphs():
    """Greedy rows draw the same tokens whether a sampled row shares their batch or not, a seeded sampled row draws
    the same tokens twice, every device draw is the contract's sampler (tasks/ops/argmax.py) applied to the logits
    the plan computed in that step, and the captures per bucket are what each plan needs: a plan with a
    conventional argmax keeps one graph per variant (greedy steps skip the sampler's ~250 kernels; sampled steps run
    the argmax as a megakernel), a one-megakernel plan one for both. (Session 13 added it; session 14's first GPU
    run found the second variant's warm-up replaying the first one's graph. Session 15: draws are compared with the
    sampler on each plan's own logits, not across plans - the conventional plan's logits differ from the
    megakernel's in the last bf16 bits, which flips a sampled draw now and then: scripts/gpu_check_sampling.py.)"""
    from mpk_runtime import LLM, SamplingParams
    from mpk_runtime.ir.sampling import SAMPLE_CANDIDATES, seed_to_int64
    from mpk_runtime.models.config import load_config
    from mpk_runtime.planner import plan_book
    from mpk_runtime.tasks.ops.argmax import sample_logits
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    g = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    s = SamplingParams(max_tokens=6, temperature=0.9, top_k=20, seed=7, ignore_eos=True)
    # (since session 56 the runner captures each bucket's logits-unread greedy and sampled graphs at start-up; this
    # test reads every step's logits, the other two variants of a plan whose argmax is conventional)
    for family, captures in (("mono", 1), ("conventional", 4), ("attn-mk", 4)):
        book = plan_book(load_config("tiny-llama"), 1, (4,), context=128, families=(family,))
        # decode_steps=1: the test records every decode() call (bursts go through decode_steps)
        llm = LLM("tiny-llama", backend="megakernel", max_batch=4, max_seq_len=128, plan=book, decode_steps=1)
        try:
            planned = llm.executor.workers[0].runner.planned
            seen = []
            decode = planned.decode

            def recording(toks, pos, tables, sampling=None, want_logits=True):
                lg, nxt = decode(toks, pos, tables, sampling, True)
                seen.append((lg, nxt, list(pos), list(sampling or [None] * len(toks))))
                return (lg if want_logits else None), nxt
            planned.decode = recording
            greedy = [o.token_ids for o in llm.generate(prompts, g, use_tqdm=False)]
            mixed = [o.token_ids for o in llm.generate(prompts, [g, g, g, s], use_tqdm=False)]
            again = [o.token_ids for o in llm.generate(prompts, [g, g, g, s], use_tqdm=False)]
            assert mixed[:3] == greedy[:3] and again == mixed, family
            assert_follows_reference("tiny-llama", prompts, [SimpleNamespace(token_ids=t) for t in greedy])
            assert [bk.captures for bk in planned._buckets.values()] == [captures], family
            draws = 0
            for lg, nxt, pos, rows in seen:
                for b, r in enumerate(rows):
                    if r is None or r.temperature <= 0:
                        continue
                    ref = sample_logits(lg[b:b + 1], [r.temperature], [r.top_k], [r.top_p], [seed_to_int64(r.seed)], [pos[b]],
                                        SAMPLE_CANDIDATES)
                    assert int(nxt[b]) == int(ref[0]), (family, pos[b], int(nxt[b]), int(ref[0]))
                    draws += 1
            assert draws >= 8, (family, draws)   # two generates x the decode steps of the sampled row
        finally:
            llm.shutdown()


def test_llm_megakernel_default_max_seq_len():
    """LLM(backend="megakernel") with no max_seq_len (LLM passes None; the runner's default is 512) was passed
    through as None and crashed before session 48: it must build the same engine as max_seq_len=512 and generate the
    same greedy tokens."""
    from mpk_runtime import LLM, SamplingParams
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got, used = [], []
    for kw in ({}, {"max_seq_len": 512}, {"plan": None}):   # (no plan named: planned, executor.default_plan)
        llm = LLM("tiny-llama", backend="megakernel", **kw)
        try:
            assert llm.engine.kv_spec.max_seq_len == 512
            got.append(llm.generate([[1, 2, 3], [4, 5]], sp, use_tqdm=False))
            used.append(llm.executor.collective_rpc("health")[0].get("plans_used"))
        finally:
            llm.shutdown()
    assert [o.token_ids for o in got[0]] == [o.token_ids for o in got[1]]
    assert all(len(o.token_ids) == 8 for o in got[0] + got[2])
    assert used[0] and not used[2]   # the planned buckets by default; plan=None: the one megakernel
    for g in (got[0], got[2]):
        assert_follows_reference("tiny-llama", [[1, 2, 3], [4, 5]], g)


def test_logprobs_and_penalties_through_the_megakernel():
    """Requests with logprobs or penalties are sampled on the host from the step's logits while greedy rows of the
    same batch keep the device sampler: the greedy rows' tokens do not change, the logprobs are the reference's
    log-softmax within bf16 tolerance, and a penalized row follows the reference with the penalty applied."""
    import torch

    from mpk_runtime import LLM, SamplingParams
    from mpk_runtime.models import ReferenceModel, get_weights, load_config
    prompts = [[1, 2, 3], [4, 5]]
    g = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    lp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    pen = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, frequency_penalty=2.0, logprobs=0)
    llm = LLM("tiny-llama", backend="megakernel", max_batch=4, max_seq_len=128, plan="auto")
    try:
        greedy = llm.generate(prompts, g, use_tqdm=False)
        mixed = llm.generate(prompts, [g, lp], use_tqdm=False)
        pens = llm.generate([prompts[0]], pen, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert mixed[0].token_ids == greedy[0].token_ids and mixed[0].logprobs is None
    assert_follows_reference("tiny-llama", prompts, [greedy[0], mixed[1]])
    cfg = load_config("tiny-llama")
    w = get_weights("tiny-llama", cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    ref = ReferenceModel(cfg.replace(dtype="float32"), {k: v.float() for k, v in w.items()})

    def logits(seq):
        t = torch.tensor([seq], device="cuda")
        with torch.no_grad():
            return ref.forward(t, torch.zeros(1, dtype=torch.long, device="cuda"), ref.new_cache(1, t.shape[1]))[0]
    seq = prompts[1] + mixed[1].token_ids
    want = torch.log_softmax(logits(seq).float(), -1)
    for t, (tok, d) in enumerate(zip(mixed[1].token_ids, mixed[1].logprobs)):
        row = want[len(prompts[1]) - 1 + t]
        assert next(iter(d)) == tok and len(d) in (3, 4)
        for k, v in d.items():
            assert abs(v - float(row[k])) <= 5e-2 * max(1.0, abs(float(row[k]))), (t, k, v, float(row[k]))
    seq = prompts[0] + pens.token_ids
    lg = logits(seq)
    for t, tok in enumerate(pens.token_ids):   # the penalized argmax, teacher-forced, with bf16's tolerance
        out = pens.token_ids[:t]
        row = lg[len(prompts[0]) - 1 + t].float().clone()
        for u in set(out):
            row[u] -= 2.0 * out.count(u)
        gap = float(row.max() - row[tok])
        assert gap <= 6e-2 * float(row.abs().max()), (t, tok, int(row.argmax()), gap)


@pytest.mark.parametrize("plan", [None, "auto"])
def test_decode_steps_feed_tokens_back_on_the_device(plan):
    """LLM(decode_steps=4): bursts of decode steps with the drawn tokens fed back on the device (the one megakernel
    launched per step, or a plan's graphs replayed back to back). The one megakernel runs the same kernel and inputs
    either way, so its tokens (greedy and seeded top-k) equal decode_steps=1's; a plan's burst may capture a larger
    key cap, so its greedy tokens are checked against the reference with the tie tolerance."""
    from mpk_runtime import LLM, SamplingParams
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    g = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    s = SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=7, ignore_eos=True)
    got = {}
    for k in (1, 4):
        llm = LLM("tiny-llama", backend="megakernel", max_batch=4, max_seq_len=128, decode_steps=k,
                  plan=plan)
        try:
            got[k] = llm.generate(prompts, [g, s, g, s], use_tqdm=False)
            assert (llm.engine.stats["multi_steps"] > 0) == (k > 1)
        finally:
            llm.shutdown()
    assert all(len(o.token_ids) == 10 for o in got[4])
    greedy = [got[4][0], got[4][2]]
    assert_follows_reference("tiny-llama", [prompts[0], prompts[2]], greedy)
    if plan is None:
        assert [o.token_ids for o in got[1]] == [o.token_ids for o in got[4]]


@pytest.mark.parametrize("warm", [True, False])
def test_decode_graphs_captured_at_start_up(warm, monkeypatch):
    """The runner captures every plan bucket's step graph when it starts (PlannedDecoder.warm): greedy and sampled,
    logits unread, at the smallest key cap; steps of those batch sizes then capture nothing (session 56: lazily, a
    prefill step carrying 5 decode rows captured bucket 8 for 1.3 s inside 128 requests' time to first token).
    MPK_DECODE_WARMUP=0 leaves every capture to the first step that needs it."""
    from mpk_runtime import LLM, SamplingParams
    from mpk_runtime.models.config import load_config
    from mpk_runtime.planner import plan_book
    monkeypatch.setenv("MPK_DECODE_WARMUP", "1" if warm else "0")
    book = plan_book(load_config("tiny-llama"), 1, (1, 4, 8), context=128, families=("conventional",))
    llm = LLM("tiny-llama", backend="megakernel", max_batch=4, max_seq_len=128, plan=book)
    try:
        planned = llm.executor.workers[0].runner.planned
        at_start = {b: bk.captures for b, bk in planned._buckets.items()}
        assert at_start == ({1: 2, 4: 2} if warm else {}), at_start   # (bucket 8 is above max_batch: not built)
        prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
        g = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        s = SamplingParams(max_tokens=5, temperature=0.8, top_k=10, seed=3, ignore_eos=True)
        outs = llm.generate(prompts, g, use_tqdm=False)
        llm.generate(prompts[:1], g, use_tqdm=False)
        llm.generate(prompts, [g, g, s], use_tqdm=False)
        after = {b: bk.captures for b, bk in planned._buckets.items()}
        if warm:
            assert after == at_start, (at_start, after)
        else:
            assert set(after) == {1, 4} and after[4] == 2, after   # (captured lazily: the same graphs, later)
        assert_follows_reference("tiny-llama", prompts, outs)
    finally:
        llm.shutdown()


def test_batch1_split_builds_follow_each_requests_key_cap():
    """A batch-1 request past 512 keys (tiny-llama: cap 1024) runs 16 attention splits (PlannedDecoder.splits_at);
    a short request after it runs the plan's 8 again, on the build kept aside since the first short one (no rebuild,
    no capture: session 56, 16 splits at 512 keys was ~2% slower a token at llama-3.2-1b), and both follow the
    reference."""
    import random

    from mpk_runtime import LLM, SamplingParams
    rng = random.Random(5)
    short, long_ = [3, 1, 4, 1, 5], [rng.randrange(1, 200) for _ in range(600)]
    g = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM("tiny-llama", backend="megakernel", max_batch=1, max_seq_len=1024, plan="auto")
    try:
        planned = llm.executor.workers[0].runner.planned
        outs = [llm.generate([short], g, use_tqdm=False)[0]]
        b8 = planned._buckets[1]
        outs.append(llm.generate([long_], g, use_tqdm=False)[0])
        b16 = planned._buckets[1]
        assert (b8.splits, b16.splits) == (8, 16), (b8.splits, b16.splits)
        captures = b16.captures
        outs.append(llm.generate([short], g, use_tqdm=False)[0])
        assert planned._buckets[1] is b8 and b8.captures == captures   # (the batch's count, nothing new captured)
        assert_follows_reference("tiny-llama", [short, long_, short], outs)
        assert outs[2].token_ids == outs[0].token_ids
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", ["mono", "conventional"])
def test_yarn_scaled_model_matches_reference(family, tmp_path):
    """A YaRN-scaled Qwen3 (rope_type yarn, factor 4 over an original context of 64; decoded at positions 250-260):
    the frequencies and the attention factor (ModelConfig.attn_scale, the graph's softmax scale) through the one
    megakernel and the conventional plan, against the reference (which tests/models/test_yarn.py checks against HF)."""
    import json
    from mpk_runtime.models import RopeScaling
    from mpk_runtime.models.config import load_config
    from mpk_runtime.planner import plan_book
    cfg = load_config("tiny-qwen3").replace(max_position_embeddings=512, rope_scaling=RopeScaling(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=64))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    assert load_config(str(tmp_path)).attn_scale != cfg.head_dim ** -0.5
    book = plan_book(load_config(str(tmp_path)), 1, (2, 4), context=256, families=(family,))
    r = _script().forced(str(tmp_path), book, 3, 250, 10)
    assert r["plan"] == family and r["ok"], r


@pytest.mark.parametrize("family", ["mono", "attn-mk", "conventional"])
def test_qwen2_biases_through_each_plan_family(family):
    """Qwen2's q / k / v biases (tiny-qwen2: GQA 3, tied embeddings) through the one megakernel's qkv_rope tasks, the
    attention megakernels' deferred appends of rows the conventional projections biased, and the conventional plan,
    against the reference (which tests/models/test_qwen2.py checks against HF's Qwen2ForCausalLM)."""
    from mpk_runtime.models.config import load_config
    from mpk_runtime.planner import plan_book
    book = plan_book(load_config("tiny-qwen2"), 1, (2, 4), context=256, families=(family,))
    r = _script().forced("tiny-qwen2", book, 3, 250, 10)
    assert r["plan"] == family and r["ok"], r
