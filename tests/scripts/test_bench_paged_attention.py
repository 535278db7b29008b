"""scripts/bench_paged_attention.py's summary (the sweep itself needs a GPU): the TUNED entries it prints parse as
paged_shapes.TUNED entries and name the best shape of each point; the ranking counts only measured points."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import bench_paged_attention as bpa  # noqa: E402
from mpk_runtime.runtime.paged_attention import PagedAttnConfig  # noqa: E402


def _row(model, B, keys, bn, tgt, st, us, ahead=False):
    return dict(model=model, B=B, keys=keys, block_n=bn, target=tgt, warps=4, stages=st, idx_ahead=ahead, us=us)


def test_summary_prints_tuned_entries_and_ranks_shapes():
    rows = [_row("m", 8, 512, 64, 264, 2, 10.0), _row("m", 8, 512, 128, 1056, 3, 8.0),
            _row("m", 32, 4096, 64, 264, 2, 100.0), _row("m", 32, 4096, 64, 528, 3, 90.0, ahead=True),
            _row("other", 1, 512, 64, 264, 2, 5.0)]   # a point with no best (never summarised)
    best = [rows[1], rows[3]]
    lines = bpa.summary(rows, best, {"m": (64, 8)})
    entries = {}
    for ln in lines[1:3]:
        exec("entries.update({" + ln.split("#")[0].strip().rstrip(",") + "})",
             {"PagedAttnConfig": PagedAttnConfig, "entries": entries})
    assert entries == {(64, 64, 512): PagedAttnConfig(128, 1056, 4, 3),
                       (64, 256, 4096): PagedAttnConfig(64, 528, 4, 3, idx_ahead=True)}
    ranked = lines[3:]
    assert len(ranked) == 3 and "within 3% of best at 1 of 1 points" in ranked[0]
    assert any("block 64 target 264 warps 4 stages 2 idx_ahead False: within 3% of best at 0 of 2 points" in r
               for r in ranked)


def test_a_point_launches_as_the_decode_step_does():
    """--cap serving (the default): a point of L keys is a row of L + 1 keys under the engine's power-of-two cap
    (what a decode step at context L launches, and what config_for and the splits see); tight: L keys under L."""
    assert bpa.launch_point(4096, "serving") == (4097, 8192)
    assert bpa.launch_point(512, "serving") == (513, 1024)
    assert bpa.launch_point(100, "serving") == (101, 256)
    assert bpa.launch_point(4096, "tight") == (4096, 4096)
