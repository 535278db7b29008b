"""scripts/_plan_measure.py's key cap: "serving" (the engine's power-of-two cap, the default since session 39) or
"tight" (context + 1, MPK_MEASURE_CAP=tight, every measurement before), which must give the same step, only with the
rows shorter than the cap."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))


def test_key_cap_values(monkeypatch):
    from _plan_measure import key_cap
    from mpk_runtime.models import PRESETS
    cfg = PRESETS["llama-3.2-1b"]
    monkeypatch.setenv("MPK_MEASURE_CAP", "tight")
    assert key_cap(1024, cfg) == 1025 and key_cap(100, cfg) == 101
    for v in ("serving", ""):
        monkeypatch.setenv("MPK_MEASURE_CAP", v)
        assert key_cap(1024, cfg) == 2048 and key_cap(1023, cfg) == 1024 and key_cap(100, cfg) == 256
    monkeypatch.delenv("MPK_MEASURE_CAP")
    assert key_cap(1024, cfg) == 2048
    monkeypatch.setenv("MPK_MEASURE_CAP", "loose")
    with pytest.raises(ValueError, match="MPK_MEASURE_CAP='loose': expected one of serving, tight"):
        key_cap(1024, cfg)


def test_serving_cap_runs_the_same_step(monkeypatch):
    """tiny-llama, the conventional plan on the CPU (gather + SDPA: its mask covers the cap's extra keys, which the
    table names as the scratch page): the same logits, to bf16 rounding, at context 300 under a cap of 301 and of
    512."""
    from _plan_measure import Point, measure_plan
    from mpk_runtime.models import PRESETS
    from mpk_runtime.models.weights import random_weights
    from mpk_runtime.planner import candidates
    cfg = PRESETS["tiny-llama"]
    w = random_weights(cfg)
    logits = {}
    for mode in ("tight", "serving"):
        monkeypatch.setenv("MPK_MEASURE_CAP", mode)
        torch.manual_seed(0)   # the KV cache's random contents
        pt = Point(cfg, w, 2, 300, "cpu", 2)
        plan = candidates(cfg, batch=2, context=300, families=("conventional",))[0]
        measure_plan(plan, pt, 1, cpu=True)
        assert pt.ctx.kv_len_cap == {"tight": 301, "serving": 512}[mode]
        assert pt.tables.shape[1] * 16 >= pt.ctx.kv_len_cap
        logits[mode] = pt.mem.t("logits").clone()
    assert torch.isfinite(logits["tight"]).all()
    # bf16 attention over 301 or 512 keys (the extra ones masked) rounds its sums in another order: bf16-level
    torch.testing.assert_close(logits["serving"], logits["tight"], rtol=2e-2, atol=2e-2)
