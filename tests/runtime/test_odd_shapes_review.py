"""Odd (non-preset) model shapes through the user's entry point, `LLM(dir, backend=..., tp=...)` on a local Hugging
Face directory of seeded fp32 weights, against the reference backend run in the test: greedy tokens equal, the
sampled tokens' logprobs within fp32 tolerance; and the shapes a backend cannot run refused when it is made, with an
error naming the entry and what to do (not every request failing later, nor an assertion in the packer).

tests/tasks/test_odd_configs_review.py drives TPGroup directly (pyvm only); this file goes through the engine (the
prefill graphs, chunked prefill, paged KV allocation, on-device greedy bursts and host logprobs) on both CPU
backends, at tp 1, 2 and 4 where the shape divides."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mpk_runtime import LLM, SamplingParams
from mpk_runtime.engine.errors import InvalidRequestError
from mpk_runtime.ir.shard import valid_tps
from mpk_runtime.models import PRESETS, random_weights, save_weights
from tests.runtime.test_runtime_review import _fake_gpus

LLAMA, QWEN2, QWEN3 = PRESETS["tiny-llama"], PRESETS["tiny-qwen2"], PRESETS["tiny-qwen3"]
LP_TOL = 2e-5   # |logprob - reference's| of the top tokens (fp32; seen <= 2.4e-6 over every shape below)


def _model_dir(tmp_path_factory, name, cfg):
    cfg = cfg.replace(dtype="float32", name=name)
    d = tmp_path_factory.mktemp(name)
    save_weights(str(d), cfg, random_weights(cfg, seed=3, dtype="float32"))
    return str(d), cfg


def _prompts(cfg, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]


def _check_against_reference(path, cfg, prompts, tps, backends=("pyvm", "torch"), max_tokens=5, max_seq_len=64,
                             **kw):
    lp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)   # host: logits
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)          # device argmax, bursts
    with LLM(path, backend="reference", dtype="float32", max_seq_len=max_seq_len) as ref:
        want = ref.generate(prompts, lp)
    want_ids = [o.token_ids for o in want]
    for tp in tps:
        assert tp in valid_tps(cfg), (cfg.name, tp)
        for be in backends:
            with LLM(path, backend=be, tp=tp, dtype="float32", max_seq_len=max_seq_len, **kw) as llm:
                got = llm.generate(prompts, lp)
                got_dev = llm.generate(prompts, greedy)
            where = f"{cfg.name} {be} tp={tp}"
            assert [o.token_ids for o in got] == want_ids, where
            assert [o.token_ids for o in got_dev] == want_ids, where + " (device greedy)"
            err = max(abs(a[k] - b[k]) for og, ow in zip(got, want) for a, b in zip(og.logprobs, ow.logprobs)
                      for k in a if k in b)
            assert err <= LP_TOL, f"{where}: logprob error {err}"


# --- defects found in this review ----------------------------------------------------------------------------------

def test_tp_invariant_that_does_not_split_the_mlp_is_refused_when_the_llm_is_made(tmp_path_factory):
    """intermediate_size 1000 with tp_invariant=2 (down's K in 2 segments of 500: not whole 16-byte vectors): LLM()
    was made without complaint and then every request failed at its first step ("... does not split into 2 segments
    ...; it was not completed - retry it", which a retry never fixes). Now LLM() refuses it, naming the projection
    and the tp_invariant values that split; and a tp_invariant that is no multiple of tp likewise."""
    path, cfg = _model_dir(tmp_path_factory, "llama-i1000", LLAMA.replace(intermediate_size=1000))
    for be in ("pyvm", "torch"):
        with pytest.raises(InvalidRequestError, match=r"tp_invariant=2 cannot run .* down's K \(intermediate_size / tp "
                                                      r"= 1000 / 1\) = 1000 does not split into .* 2 segments"):
            LLM(path, backend=be, tp=1, tp_invariant=2, dtype="float32", max_seq_len=32)
        with pytest.raises(InvalidRequestError, match=r"tp_invariant=3 cannot run .* multiple of tp=2"):
            LLM(path, backend=be, tp=2, tp_invariant=3, dtype="float32", max_seq_len=32)
    # the ones that split still run, and match the reference
    _check_against_reference(path, cfg, _prompts(cfg, (5, 3)), tps=(2,), backends=("pyvm",), tp_invariant=2)


def test_megakernel_refuses_a_tp_whose_mlp_share_is_not_whole_16_byte_rows(monkeypatch):
    """intermediate_size 1000 splits 2 ways (pyvm / torch run it, above), but each megakernel rank's down projection
    then reduces over 500 values, not whole 16-byte rows: megakernel_shape_problems looked at the whole model only,
    so the runner went on (to an AssertionError `K % 8 == 0` in the packer on a GPU). Even the preset tiny-llama at
    tp=8 (352 / 8 = 44) did. Now it is refused when the runner is made, naming the entry, the tp the megakernel
    takes, and the backends that run it."""
    from mpk_runtime.runtime import megakernel_runner as mr
    from mpk_runtime.runtime.base import make_runner
    from mpk_runtime.runtime.packer import megakernel_shape_problems
    odd = dataclasses.replace(LLAMA, intermediate_size=1000)
    # the runner of rank 0 of a 2-GPU group (one process a rank: no thread comm), on faked GPUs
    _fake_gpus(monkeypatch, 2)
    monkeypatch.setattr(mr, "load_config", lambda m: odd)
    with pytest.raises(ValueError, match=r"backend 'megakernel' cannot run this model's shape: intermediate_size / tp "
                                         r"must be a multiple of 8 .* use backend 'torch'"):
        make_runner("megakernel", model="tiny-llama", world_size=2, rank=0, max_seq_len=32)

    assert megakernel_shape_problems(odd) == megakernel_shape_problems(odd, 1) == []
    p = megakernel_shape_problems(odd, 2)
    assert len(p) == 1 and "intermediate_size / tp must be a multiple of 8" in p[0] and "1000 / 2 = 500" in p[0]
    assert p[0].endswith("tp this model's megakernel splits into: 1)")
    assert megakernel_shape_problems(LLAMA, 4) == []
    assert "352 / 8 = 44" in megakernel_shape_problems(LLAMA, 8)[0]
    for name, cfg in PRESETS.items():   # every preset at tp <= 8 where its own intermediate share is whole rows
        for tp in valid_tps(cfg):
            if tp <= 8 and (cfg.intermediate_size // tp) % 8 == 0:
                assert megakernel_shape_problems(cfg, tp) == [], (name, tp)


# --- guard: odd shapes that match the reference through LLM (a sample of a wider probe, all of which matched) -----

ODD = [
    # (name, config, tps, extra LLM keywords)
    ("llama-hd64-H320-I1000-V1001", LLAMA.replace(head_dim=64, hidden_size=320, intermediate_size=1000,
                                                  vocab_size=1001), (1, 2, 4), {}),
    ("qwen3-hd256-1layer-untied", QWEN3.replace(head_dim=256, num_layers=1, tie_word_embeddings=False), (1, 4), {}),
    ("qwen3-gqa6-hd40-H480", QWEN3.replace(num_heads=12, num_kv_heads=2, head_dim=40, hidden_size=480), (2, 4), {}),
    ("qwen2-mqa-gqa6-V1002-page7-chunked", QWEN2.replace(num_kv_heads=1, vocab_size=1002), (1, 2),
     {"page_size": 7, "max_num_batched_tokens": 13}),
    ("llama-mha-V130-tied-1layer", LLAMA.replace(num_kv_heads=8, vocab_size=130, num_layers=1), (4,), {}),
]


@pytest.mark.parametrize("name,cfg,tps,kw", ODD, ids=[o[0] for o in ODD])
def test_odd_shapes_through_llm_match_the_reference(tmp_path_factory, name, cfg, tps, kw):
    path, cfg = _model_dir(tmp_path_factory, name, cfg)
    kw = {"page_size": 4, **kw}
    # different lengths in one batch; the longest crosses many pages (and chunks, where the chunk is small)
    _check_against_reference(path, cfg, _prompts(cfg, (5, 41, 1, 13)), tps, **kw)
