"""Attention's wide passes in the planner: a head_dim <= 64 attention partial is priced under its own cost key
(attn_partial@w2, the per-flop cost of wide passes) where the packer would give it wide passes
(tasks/tiling.attn_wide), falling back to the narrow terms in a profile without the key; measured rows from before
wide passes are re-planned with them off (score._point)."""
import dataclasses

import pytest

from mpk_runtime.ir import build_graph
from mpk_runtime.models import PRESETS
from mpk_runtime.planner import HardwareProfile, simulate
from mpk_runtime.planner.score import _point
from mpk_runtime.planner.simulate import cost_key, task_tc_us
from mpk_runtime.tasks import Tiling, build_task_graphs


def _graphs(cfg, B=32, ctx=2048):
    return build_task_graphs([build_graph(cfg, batch=B, context_len=ctx, attn_splits=1)], Tiling(num_sms=132))


@pytest.mark.parametrize("model,env,key", [("llama-3.2-1b", "", "attn_partial@w2"),
                                           ("llama-3.2-1b", "0", "attn_partial"),
                                           ("qwen3-8b", "", "attn_partial")])   # head_dim 128: narrow passes
def test_cost_key_follows_the_packers_pass_width(monkeypatch, model, env, key):
    monkeypatch.setenv("MPK_ATT_WIDE", env)
    monkeypatch.delenv("MPK_NVCC_DEFINES", raising=False)
    tg = _graphs(PRESETS[model].replace(num_layers=1))
    att = next(t for t in tg[0].tasks if t.kind == "attn_partial")
    assert cost_key(att) == key


def test_wide_passes_are_priced_by_their_own_per_flop_cost(monkeypatch):
    monkeypatch.delenv("MPK_NVCC_DEFINES", raising=False)
    monkeypatch.delenv("MPK_ATT_WIDE", raising=False)
    prof = HardwareProfile.load("h200_v32").for_batch(32)
    narrow_cost = prof.flop_us("attn_partial")
    assert 0 < prof.flop_us("attn_partial@w2") < narrow_cost
    no_key = dataclasses.replace(prof, flop_us_by_kind={k: v for k, v in prof.flop_us_by_kind.items()
                                                        if k != "attn_partial@w2"})
    assert no_key.flop_us("attn_partial@w2") == narrow_cost          # unfitted: the narrow terms
    tg = _graphs(PRESETS["llama-3.2-1b"].replace(num_layers=1))
    att = next(t for t in tg[0].tasks if t.kind == "attn_partial")
    assert task_tc_us(att, prof) == pytest.approx(att.est_flops * prof.flop_us("attn_partial@w2"))
    wide = simulate(tg, prof).makespan_us
    assert wide < simulate(tg, no_key).makespan_us
    monkeypatch.setenv("MPK_ATT_WIDE", "0")
    assert simulate(tg, prof).makespan_us == pytest.approx(simulate(tg, no_key).makespan_us)


def test_rows_from_before_wide_passes_are_replanned_narrow():
    old = {"model": "llama-3.2-1b", "batch": 8, "context": 512, "tp": 1, "attn_splits": 2}
    new = dict(old, attn_wide_passes=True)
    assert dict(_point(old)[4]) == {"MPK_ATT_WIDE": "0"}
    assert dict(_point(new)[4]) == {}
    assert dict(_point(dict(new, env={"MPK_ATT_WIDE": "0"}))[4]) == {"MPK_ATT_WIDE": "0"}


def test_attention_chain_is_priced_per_flop_and_per_key():
    """h200_v33_cal: an attention partial's chain = flops x flop_us + keys (per KV group, times its groups) x key_us,
    under its cost key; a profile without key terms prices flops alone (as before). 128-wide heads (twice the flops
    per key) cost less than twice as much per key as 64-wide ones: the per-key part is the same per key."""
    prof = HardwareProfile.load("h200_v33_cal").for_batch(32)
    per_key = {}
    for model in ("llama-3.2-1b", "qwen3-8b"):
        tg = _graphs(PRESETS[model].replace(num_layers=1), B=32, ctx=2048)
        att = next(t for t in tg[0].tasks if t.kind == "attn_partial")
        k = cost_key(att)
        keys = att.params["keys"] * att.params.get("ng", 1)
        assert att.params["keys"] == 2049   # one split: every key of the context and the new one
        want = att.est_flops * prof.flop_us(k) + keys * prof.key_us(k)
        assert prof.key_us(k) > 0 and task_tc_us(att, prof) == pytest.approx(want)
        no_keys = dataclasses.replace(prof, key_us_by_kind={})
        assert task_tc_us(att, no_keys) == pytest.approx(att.est_flops * prof.flop_us(k))
        per_key[model] = want / keys
    assert per_key["llama-3.2-1b"] < per_key["qwen3-8b"] < 2 * per_key["llama-3.2-1b"]

