"""scripts/validate_planner.py's rows record the graph switches as they resolved (set or default), so a later
re-plan (planner/score.py resimulate: a CPU refit, another session's defaults) prices each plan as it ran."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))


def test_rows_are_re_planned_as_they_ran_after_the_defaults_move(monkeypatch):
    import validate_planner as vp
    from mpk_runtime.models import PRESETS
    from mpk_runtime.planner import HardwareProfile, candidates
    from mpk_runtime.planner.score import resimulate
    for k in ("MPK_ATTN_QKNORM", "MPK_QKV_FLAT", "MPK_CONV_TRITON_ATTN", "MPK_PAGED_ROW_KEYS", "MPK_MEASURE_CAP",
              "MPK_PAGED_USED_SPLITS", "MPK_PAGED_APPEND", "MPK_PAGED_GRID", "MPK_PAGED_HEADS"):
        monkeypatch.delenv(k, raising=False)
    prof = HardwareProfile.load("h200_v41")
    cfg = PRESETS["qwen3-8b"]
    p = candidates(cfg, batch=1, context=512, prof=prof, families=("mono",))[0]
    row = vp.plan_row("qwen3-8b", 1, 512, 1, p, True, {"step_ms": [5.0, 5.1, 5.2], "seg_ms": [[5.0, 5.1]]}, 1.0)
    assert row["env"]["MPK_ATTN_QKNORM"] == "1" and row["env"]["MPK_QKV_FLAT"] == "1"
    assert row["env"]["MPK_CONV_TRITON_ATTN"] in ("0", "1") and row["measured_us"] == pytest.approx(5100.0)
    # what the conventional attention ran (sessions 39 and 40 moved these defaults): the walk, the key cap, the merge
    # and the appends
    assert row["env"]["MPK_PAGED_ROW_KEYS"] == "split" and row["env"]["MPK_MEASURE_CAP"] == "serving"
    assert row["env"]["MPK_PAGED_USED_SPLITS"] == "1" and row["env"]["MPK_PAGED_APPEND"] == "cache"
    assert row["env"]["MPK_PAGED_GRID"] == "row" and row["env"]["MPK_PAGED_HEADS"] == "one"
    monkeypatch.setenv("MPK_ATTN_QKNORM", "0")   # defaults as they were before sessions 32-33
    monkeypatch.setenv("MPK_QKV_FLAT", "0")
    old = candidates(cfg, batch=1, context=512, prof=prof, families=("mono",))[0]
    assert old.predicted_us != pytest.approx(p.predicted_us, rel=1e-4)   # the switches do change the plan's graph
    got = resimulate([row], prof, procs=1)[0]
    assert got["predicted_us"] == pytest.approx(p.predicted_us, rel=1e-9)
    monkeypatch.setenv("MPK_ATTN_QKNORM", "1")   # a row set explicitly keeps its value over the resolved one
    set_row = vp.plan_row("qwen3-8b", 1, 512, 1, old, True, {"step_ms": [5.0], "seg_ms": [[5.0]]}, 1.0)
    assert set_row["env"]["MPK_ATTN_QKNORM"] == "1" and set_row["env"]["MPK_QKV_FLAT"] == "0"
