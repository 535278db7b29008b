"""TUNED's launch shapes against the points they were measured at, and the planner profile's record of the shape
each paged-attention curve point ran under (paged_shapes.lookup_keys, curve_shapes, stale_curve_points).

Session 44 found three shapes adopted from step A/Bs at ctx 512 (sessions 42-44) that the ctx-512 step never ran: a
step at context C runs under the engine's cap (the power of two above C + 1: 1024 at ctx 512), and config_for looked
TUNED up at the cap, where the 1024-key point answered. The first test pins every A/B'd point to the shape adopted
from it, under the cap LLM.generate runs, so that cannot happen again unnoticed."""
from __future__ import annotations

import pytest

from mpk_runtime.planner.profile import HardwareProfile
from mpk_runtime.runtime import paged_attention as pa
from mpk_runtime.runtime.megakernel_plans import kv_cap

MAX = 1 << 17


def _at(D, B, nkv, ctx):
    return pa.config_for(D, B, nkv, kv_cap(ctx + 1, MAX))


# (head dim, batch, KV heads, context) -> the TUNED point whose shape a step A/B at that point adopted
MEASURED = {
    (64, 8, 8, 512): (64, 64, 512),        # s43 p8: llama-3.2-1b B=8 ctx 512, 1270 -> 1254 us
    (64, 32, 8, 512): (64, 256, 512),      # s43 p32s: llama B=32 ctx 512, 1477 -> 1438
    (64, 32, 8, 4096): (64, 256, 4096),    # s43 p32: llama B=32 ctx 4096, 2504 -> 2352
    (64, 32, 8, 1024): (64, 256, 1024),    # s39 psh_l: llama B=32 ctx 1024, 1883 -> 1668 (its cap 2048 since s39)
    (128, 8, 8, 512): (128, 64, 512),      # s44 pq8: qwen3-8b B=8 ctx 512, 5564 -> 5454
    (128, 32, 8, 512): (128, 256, 512),    # s44 pq32: qwen3-8b B=32 ctx 512, 6124 -> 5950
    (128, 32, 8, 1024): (128, 256, 1024),  # s39 psh_q: qwen3-8b B=32 ctx 1024, 7961 -> 7019
    (128, 128, 8, 512): (128, 1024, 512),  # s42: qwen3-8b B=128 ctx 512 keeps its shape (8939 against 9456)
}


@pytest.mark.parametrize("pt", sorted(MEASURED))
def test_each_measured_point_runs_its_adopted_shape(monkeypatch, pt):
    monkeypatch.delenv("MPK_PAGED_SHAPE", raising=False)
    assert _at(*pt) == pa.TUNED[MEASURED[pt]]


def test_lookup_keys_takes_a_power_of_two_cap_at_its_shortest_row():
    assert [pa.lookup_keys(c) for c in (256, 1024, 2048, 8192)] == [129, 513, 1025, 4097]
    assert pa.lookup_keys(4097) == 4097 and pa.lookup_keys(3000) == 3000   # a tight cap: as is
    # ctx 512 and ctx 511 share the cap 1024 and so the shape; ctx 1024 (cap 2048) takes the 1024-key point
    assert _at(64, 32, 8, 512) == _at(64, 32, 8, 700) != _at(64, 32, 8, 1024)


@pytest.mark.parametrize("name", ["h200_v49", "h200_v50", "h200_v51"])
def test_profiles_record_a_shape_for_every_paged_point(name):
    prof = HardwareProfile.load(name)
    paged = {k: v for k, v in prof.conv_attn_us_by_shape.items() if k.endswith("@paged")}
    assert paged and set(paged) == set(prof.conv_attn_shape_by_shape)
    for k, pts in paged.items():
        rec = prof.conv_attn_shape_by_shape[k]
        assert [(b, n) for b, n, _ in pts] == [(b, n) for b, n, _ in rec]
        assert all(lbl.endswith(("i32", "i64")) and len(lbl.split(",")) in (5, 6) for _, _, lbl in rec)
    assert pa.parse_curve_key("8x128x4@paged") == (8, 128, 4) and pa.parse_curve_key("8x128x4") is None


def test_stale_points_are_the_ones_a_changed_shape_moves(monkeypatch):
    monkeypatch.delenv("MPK_PAGED_SHAPE", raising=False)
    monkeypatch.delenv("MPK_PAGED_TABLE", raising=False)
    cap = lambda k: kv_cap(k, MAX)  # noqa: E731
    grid = {"8x64x4@paged": [[b, k, 1.0] for b in (1, 8, 32, 128) for k in (257, 513, 1025, 4097, 8193)],
            "8x128x4@paged": [[b, k, 1.0] for b in (8, 32) for k in (513, 4097)]}
    rec = pa.curve_shapes(grid, cap)
    assert pa.stale_curve_points(rec, cap) == []
    # llama's B=32 4096-key shape replaced: exactly llama B=32's 4097-key point goes stale (cap 8192; the 8193-key
    # point, cap 16384, has had its own entry since session 56)
    monkeypatch.setitem(pa.TUNED, (64, 256, 4096), pa.PagedAttnConfig(64, 264, 8, 2))
    st = pa.stale_curve_points(rec, cap)
    assert [(k, b, n) for k, b, n, _, _ in st] == [("8x64x4@paged", 32, 4097)]
    assert st[0][3] == "128,264,4,3,i32" and st[0][4] == "64,264,8,2,i32"
    # the table type is part of the label: forcing int64 makes every int32 point stale
    monkeypatch.undo()
    monkeypatch.setenv("MPK_PAGED_TABLE", "i64")
    st = pa.stale_curve_points(rec, cap)
    assert {(k, b, n) for k, b, n, _, _ in st} == {(k, b, n) for k, pts in rec.items() for b, n, lbl in pts
                                                   if lbl.endswith("i32")}


def test_plan_cli_notes_stale_curve_points(capsys):
    from mpk_runtime.__main__ import _note_stale_curves
    from mpk_runtime.models import load_config
    prof = HardwareProfile.load("h200_v49")
    _note_stale_curves(prof, load_config("qwen3-8b"), 1)   # v49 ran before session 44's qwen3-8b 512-key shapes
    out = capsys.readouterr().out
    assert "8x128x4@paged" in out and "scripts/gpu_run.sh cattn" in out
    _note_stale_curves(HardwareProfile.load("h200_v48"), load_config("qwen3-8b"), 1)   # no record before v49
    assert "does not record" in capsys.readouterr().out
