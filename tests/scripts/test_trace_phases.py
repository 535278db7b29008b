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


def test_merge_chain_from_stage_stamps(tmp_path):
    """--merge: a stage-stamp file's folded partials, grouped by (layer, b, g); the merger is the partial whose
    ticket (stamp 6) came last; its chunk / ticket / merge / signal steps and its signal's lag behind the others'
    last signal, medians over groups (ns in the file, us printed). Rows from before the ticket stamp, and partials
    that are not folded (no ticket stamp), are left out."""
    K = 12

    def row(i, layer, b, sp, start, rows_written, ticket, merged, signals):
        st = [0] * K
        st[4], st[6], st[K - 2], st[K - 1] = rows_written, ticket, merged, signals
        return [i, "attn_partial", f"L{layer}.attention", i, start, signals + 100, st,
                f"rank0/task{i}[attn_partial L{layer}.attention b={b} g=0 split={sp}]"]
    rows = []
    for layer in (0, 1):   # two groups: split 1 takes the last ticket and merges (merge 3 us, signal 0.5 us)
        t = layer * 100_000
        rows.append(row(10 * layer, layer, 0, 0, t, t + 5000, t + 5400, t + 5500, t + 5600))
        rows.append(row(10 * layer + 1, layer, 0, 1, t, t + 6000, t + 7000, t + 10000, t + 10500))
    rows.append([99, "attn_partial", "L2.attention", 9, 0, 1, [0] * K, "rank0/task99[attn_partial L2.attention b=0 g=0 "
                 "split=0]"])   # not folded: no stamps
    rows.append([98, "linear", "L0.o_proj", 3, 0, 1, [0] * K, "rank0/task98[linear L0.o_proj]"])
    p = tmp_path / "stages.json.gz"
    import gzip
    with gzip.open(p, "wt") as f:
        json.dump({"stage_words": K, "step": 1, "rows": rows}, f)
    out = subprocess.run([sys.executable, str(ROOT / "scripts/trace_phases.py"), str(p), "--merge"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    got = {line.rsplit(None, 5)[0].strip(): float(line.split()[-5])
           for line in out.splitlines() if " us (median" in line}
    assert "folded groups: 2, partials a group: 2" in out
    assert got == {"chunk (start -> rows written)": 6.0, "ticket (rows written -> ticket)": 1.0,
                   "merge (ticket -> merged)": 3.0, "signal (merged -> signals issued)": 0.5,
                   "lag behind the others' last signal": 4.9, "others: ticket (rows written -> ticket)": 0.4}
