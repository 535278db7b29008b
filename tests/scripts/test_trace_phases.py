"""scripts/trace_phases.py on a synthetic trace: phases are first start to last end per op, averaged over layers;
busy share is task time over span x SMs; the byte floor comes from the graph's op bytes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_a_simulated_step_reads_like_a_measured_one(tmp_path):
    """SimResult.to_chrome_trace writes the kernel trace's format (name = kind, cat = op, args step), so
    trace_phases sets a simulated step beside a traced one: every op of the graph has its phase, and each phase is
    the simulator's first start to last end of that op's tasks."""
    sys.path.insert(0, str(ROOT))
    from mpk_runtime.ir import build_graph
    from mpk_runtime.models import PRESETS
    from mpk_runtime.planner import HardwareProfile, simulate
    from mpk_runtime.tasks import Tiling, build_task_graphs
    g = build_graph(PRESETS["tiny-llama"], batch=1, context_len=16)
    tg = build_task_graphs([g], Tiling(num_sms=8))[0]
    r = simulate([tg], HardwareProfile.load("h200_v41"), steps=1, record=True)
    ev = r.to_chrome_trace([tg])
    assert {e["cat"] for e in ev} == {t.op for t in tg.tasks} and {e["name"] for e in ev} == {t.kind for t in tg.tasks}
    p = tmp_path / "sim.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    out = subprocess.run([sys.executable, str(ROOT / "scripts/trace_phases.py"), str(p), "--model", "tiny-llama",
                          "--context", "16"], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    span = [e for e in ev if e["cat"] == "L0.gate_up"]
    want = max(e["ts"] + e["dur"] for e in span) - min(e["ts"] for e in span)
    rows = {l.split()[0]: l.split() for l in out.splitlines()[2:]}
    assert {"gate_up", "down", "o_proj", "attention", "qkv_rope", "lm_head"} <= set(rows)
    layers = [o for o in {t.op for t in tg.tasks} if o.endswith(".gate_up")]
    mean = sum(max(e["ts"] + e["dur"] for e in ev if e["cat"] == o) - min(e["ts"] for e in ev if e["cat"] == o)
               for o in layers) / len(layers)
    assert float(rows["gate_up"][1]) == pytest.approx(mean, abs=0.051) and want > 0


def test_attention_view_finds_the_merging_split(tmp_path):
    """--attn: per split the median duration and end after the layer's last qkv task; per group the last partial
    (the merger under the fold) against the second-to-last, and which split was last. Two layers, one group, three
    splits; split 2 ends last in both (duration 9 from qkv end + 1), split 1 second (5 + 1)."""
    ev = []
    for layer, t in ((0, 0.0), (1, 100.0)):
        ev.append({"name": "qkv_rope", "cat": f"L{layer}.qkv_rope", "ph": "X", "ts": t, "dur": 10.0, "tid": 0,
                   "args": {"step": 1, "label": "rank0/task0[qkv_rope]"}})
        for sp, d in ((0, 3.0), (1, 5.0), (2, 9.0)):
            ev.append({"name": "attn_partial", "cat": f"L{layer}.attention", "ph": "X", "ts": t + 11.0, "dur": d,
                       "tid": 1 + sp, "args": {"step": 1, "label": f"rank0/task9[attn_partial L{layer}.attention b=0 "
                                                                   f"g=0 split={sp}]"}})
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    out = subprocess.run([sys.executable, str(ROOT / "scripts/trace_phases.py"), str(p), "--attn"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    rows = {int(line.split()[0]): line.split() for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert rows[2][1:] == ["2", "9.00", "10.00"] and rows[0][1:] == ["2", "3.00", "4.00"]
    assert "groups 2: last partial ends 10.00 (its duration 9.00), second-to-last 6.00" in out
    assert "last split: 2 100%" in out
