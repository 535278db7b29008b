"""scripts/_plan_measure.py segment_spans: a traced plan's megakernel segments, each as the window of its tasks on
the globaltimer (first start to last end) and the gap from the previous megakernel segment's last task, read from the
Megakernel trace buffers (start / end words per task; 0 = not reached)."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))


class _FakeMk:
    """The Megakernel surface segment_spans reads: trace_steps, trace_times() (steps, tasks, 2), chrome_trace()."""

    def __init__(self, spans, traced=1):
        self.trace_steps = traced
        self._t = torch.tensor([spans], dtype=torch.int64)

    def trace_times(self):
        return self._t

    def chrome_trace(self):
        return {"traceEvents": [{"ts": int(a), "dur": int(b - a)} for a, b in self._t[0].tolist() if a and b]}


class _FakeEx:
    def __init__(self, segments):
        self.segments = segments


def test_windows_and_gaps_of_the_megakernel_segments(tmp_path):
    from _plan_measure import segment_spans
    ex = _FakeEx([
        ("megakernel", _FakeMk([[1_000, 5_000], [2_000, 9_000], [0, 0]])),     # a task not reached: ignored
        ("conventional", object()),
        ("megakernel", _FakeMk([[30_000, 31_000], [29_500, 40_000]])),
        ("megakernel", _FakeMk([[50_000, 51_000]], traced=0)),                 # not traced: skipped
    ])
    spans = segment_spans(ex, str(tmp_path), "m_b1")
    assert [s["segment"] for s in spans] == [0, 2]
    assert spans[0]["tasks"] == 2 and spans[0]["span_us"] == pytest.approx(8.0) and spans[0]["gap_before_us"] is None
    assert spans[1]["span_us"] == pytest.approx(10.5) and spans[1]["gap_before_us"] == pytest.approx(20.5)
    with gzip.open(tmp_path / "m_b1_seg2.json.gz", "rt") as f:
        assert len(json.load(f)["traceEvents"]) == 2
    assert not (tmp_path / "m_b1_seg3.json.gz").exists()
    assert segment_spans(_FakeEx([("megakernel", _FakeMk([[0, 0]]))])) == []


def test_validate_planner_takes_the_trace_option():
    import subprocess
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "validate_planner.py"), "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--trace-plans" in out
