"""LLM(decode_steps=k): several decode steps per engine step, the drawn tokens fed back by the runner. Tokens must
equal one step at a time (and the reference); stops inside a burst cut the output there; a waiting request or a
host-sampled row falls back to single steps."""
import pytest
import torch

from mpk_runtime.engine import LLM, InvalidRequestError, SamplingParams
from mpk_runtime.models import PRESETS, random_weights
from mpk_runtime.ir.shard import shard_for
from mpk_runtime.planner import plan_book
from mpk_runtime.runtime.conventional_prefill import ConventionalPrefill
from mpk_runtime.runtime.megakernel_plans import PlannedDecoder
from mpk_runtime.runtime.memory import KVStore

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3], [8, 9, 7, 9, 3, 2]]
GREEDY = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=11, ignore_eos=True)


@pytest.mark.parametrize("backend", ["pyvm", "torch"])
def test_bursts_equal_single_steps(backend, ref_greedy):
    outs = {}
    for k in (1, 4):
        with LLM("tiny-qwen3", backend=backend, dtype="float32", max_seq_len=64, max_batch=4, decode_steps=k) as m:
            outs[k] = [o.token_ids for o in m.generate(PROMPTS, [GREEDY, SAMPLED, GREEDY, SAMPLED])]
            stats = dict(m.engine.stats)
        if k == 4:   # 11 tokens: the prefill's, then bursts of 4, 4 and 2 (capped at max_tokens)
            assert stats["multi_steps"] == 3 and stats["device_steps_in_multi"] == 10
    assert outs[1] == outs[4]
    assert all(len(t) == 11 for t in outs[4])
    assert outs[4][0] == ref_greedy("tiny-qwen3", PROMPTS[0], 11)


class _StubTokenizer:
    def __init__(self, eos):
        self.eos_token_id = eos

    def encode(self, text, add_special_tokens=True):
        return [int(x) for x in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_bursts_at_tp2_in_process():
    sp = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    got = {}
    for k in (1, 3):
        with LLM("tiny-qwen3", backend="pyvm", tp=2, dtype="float32", max_seq_len=64, decode_steps=k) as m:
            got[k] = [o.token_ids for o in m.generate(PROMPTS[:2], sp, use_tqdm=False)]
            assert (m.engine.stats["multi_steps"] > 0) == (k > 1)
    assert got[1] == got[3]


def test_stops_inside_a_burst(ref_greedy):
    full = ref_greedy("tiny-qwen3", PROMPTS[0], 12)
    eos = full[5]
    stop = f" {full[8]}"
    with LLM("tiny-qwen3", backend="pyvm", dtype="float32", max_seq_len=64, decode_steps=4,
             tokenizer=_StubTokenizer(eos)) as m:
        o = m.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12))[0]
        assert o.token_ids == full[:full.index(eos) + 1] and o.finish_reason == "stop"
        o = m.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop))[0]
        text = " ".join(map(str, full))
        assert o.finish_reason == "stop" and o.text == text[:text.index(stop)]
        assert o.token_ids == full[:len(o.token_ids)]
        parts = list(m.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
        assert [t for p in parts for t in p.delta_token_ids] == full
        assert len(parts) < 12   # tokens arrive in bursts


def test_waiting_and_host_sampled_requests_take_single_steps(ref_greedy):
    with LLM("tiny-qwen3", backend="pyvm", dtype="float32", max_seq_len=64, max_batch=1, decode_steps=4) as m:
        outs = m.generate(PROMPTS[:2], GREEDY)   # the second waits for the first's slot
        assert [o.token_ids for o in outs] == [ref_greedy("tiny-qwen3", p, 11) for p in PROMPTS[:2]]
        s0 = m.engine.stats["multi_steps"]
        o = m.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1))[0]
        assert m.engine.stats["multi_steps"] == s0 and len(o.logprobs) == 6   # host-sampled: one step at a time


def test_decode_steps_refused_where_it_cannot_work():
    with pytest.raises(InvalidRequestError, match="does not sample on the device"):
        LLM("tiny-qwen3", backend="reference", dtype="float32", max_seq_len=32, decode_steps=2)
    with pytest.raises(InvalidRequestError, match="device_sampling='off'"):
        LLM("tiny-qwen3", backend="pyvm", dtype="float32", max_seq_len=32, decode_steps=2, device_sampling="off")
    for bad in (0, 65, 2.0, True):
        with pytest.raises(InvalidRequestError, match="decode_steps"):
            LLM("tiny-qwen3", dtype="float32", max_seq_len=32, decode_steps=bad)


@pytest.mark.parametrize("family", ["mono", "conventional"])
def test_planned_decoder_decode_steps_feed_back_on_device(family):
    """PlannedDecoder.decode_steps (the GPU runner's path; here its CPU twin) gives the tokens of as many single
    decode() calls with the tokens fed back, and the same seeded draws."""
    from mpk_runtime.runtime.device_sampling import DeviceSampling
    cfg = PRESETS["tiny-llama"].replace(dtype="float32")
    w = random_weights(cfg, seed=3)
    book = plan_book(cfg, 1, (2, 4), context=16, families=(family,))
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(3)]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    samp = [DeviceSampling(0.0, 0, 1.0, 0), DeviceSampling(0.9, 10, 0.95, 77), DeviceSampling(0.0, 0, 1.0, 0)]
    results = []
    for multi in (False, True):
        kv = KVStore(cfg.num_layers, 40, 4, shard_for(cfg, 1, 0).n_kv, cfg.head_dim, torch.float32, poison=False)
        dec = PlannedDecoder(cfg, w, kv, book, max_seq_len=32, page_size=4, num_sms=4, dtype="float32",
                             device=torch.device("cpu"), backend="pyvm")
        pre = ConventionalPrefill(cfg, w, kv, max_seq_len=32, page_size=4, dtype="float32", device=torch.device("cpu"))
        toks = [pre.run(p, 0, tables[i])[1] for i, p in enumerate(prompts)]
        pos = [len(p) for p in prompts]
        if multi:
            results.append(dec.decode_steps(toks, pos, tables, samp, 5).tolist())
        else:
            rows = [[] for _ in prompts]
            for _ in range(5):
                _, nxt = dec.decode(toks, pos, tables, samp, want_logits=False)
                toks = [int(t) for t in nxt]
                pos = [p + 1 for p in pos]
                for r, t in zip(rows, toks):
                    r.append(t)
            results.append(rows)
    assert results[0] == results[1]
