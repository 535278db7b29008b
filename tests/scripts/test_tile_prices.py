"""scripts/tile_prices.py: a traced step's linear tiles grouped by shape beside the simulator's durations."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from tile_prices import tile_groups  # noqa: E402

from mpk_runtime.ir import build_graph  # noqa: E402
from mpk_runtime.models import PRESETS  # noqa: E402
from mpk_runtime.planner import HardwareProfile, simulate  # noqa: E402
from mpk_runtime.tasks import Tiling, build_task_graphs  # noqa: E402


def _tg(batch):
    g = build_graph(PRESETS["tiny-llama"], batch=batch, context_len=16)
    return build_task_graphs([g], Tiling(num_sms=8))[0]


def test_a_simulated_step_is_short_by_nothing_and_a_slower_one_by_its_extra_a_pass():
    """The simulator's own schedule, read back as a trace, matches itself (0 short a pass) in every group; with
    every traced tile 2 us a pass longer, each group is short by exactly 2 us a pass; groups follow tile shape."""
    tg = _tg(32)
    prof = HardwareProfile.load("h200_v42").for_batch(32)
    ev = simulate([tg], prof, steps=1, record=True).to_chrome_trace([tg])
    rows = tile_groups(ev, tg, prof)
    assert rows and sum(r["tasks"] for r in rows) == sum(t.kind == "linear" for t in tg.tasks)
    assert {r["op"] for r in rows} >= {"o_proj", "gate_up", "down", "lm_head"}
    assert all(r["short_per_pass_us"] == pytest.approx(0, abs=1e-9) for r in rows)
    assert any(r["tc_rows"] > 0 for r in rows)   # batch 32: Tensor Core tiles
    from mpk_runtime.planner.simulate import linear_passes
    for e in ev:
        t = tg.tasks[e["args"]["task"]]
        if t.kind == "linear":
            e["dur"] += 2.0 * linear_passes(t)[1]
    assert all(r["short_per_pass_us"] == pytest.approx(2.0) for r in tile_groups(ev, tg, prof))
