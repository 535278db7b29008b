"""scripts/trace_phases.py on a synthetic trace: phases are first start to last end per op, averaged over layers;
busy share is task time over span x SMs; the byte floor comes from the graph's op bytes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_phases_from_a_synthetic_trace(tmp_path):
    ev = []
    for layer, t in ((0, 0.0), (1, 100.0)):     # gate_up: two tasks on two SMs per layer, phase 30 us
        ev += [{"name": "x", "cat": f"L{layer}.gate_up", "ph": "X", "ts": t, "dur": 20.0, "tid": 0,
                "args": {"step": 1}},
               {"name": "x", "cat": f"L{layer}.gate_up", "ph": "X", "ts": t + 10.0, "dur": 20.0, "tid": 1,
                "args": {"step": 1}}]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    out = subprocess.run([sys.executable, str(ROOT / "scripts/trace_phases.py"), str(p), "--model", "tiny-llama"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "130 us on 2 SMs, SMs busy 30.8%" in out          # 80 us of tasks / (130 us x 2 SMs)
    row = [l for l in out.splitlines() if l.startswith("gate_up")][0].split()
    assert row[1:4] == ["30.0", "2", "2"] and row[-1] == "30.8%"
