"""scripts/smi_join.py: the nvidia-smi trace cut into bench_decode's cells by their start times, against a trace and
a bench file written here (the windows and what counts as under load are checked sample by sample)."""
from __future__ import annotations

import datetime
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import smi_join  # noqa: E402

T0 = datetime.datetime(2026, 12, 4, 14, 0, 0)
HEAD = ("timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], temperature.gpu, "
        "clocks_event_reasons.active\n")


def _trace(tmp_path, samples) -> str:
    """samples: (seconds after T0, sm MHz, W, reasons); one csv line each, as nvidia-smi -lms writes them."""
    p = tmp_path / "smi.csv"
    lines = [HEAD] + [f"{(T0 + datetime.timedelta(seconds=t)).strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, {sm} MHz, "
                      f"3201 MHz, {w:.2f} W, {40 + t}, {r}\n" for t, sm, w, r in samples]
    lines.insert(3, "a line nvidia-smi broke off\n")
    p.write_text("".join(lines))
    return str(p)


def _bench(tmp_path) -> str:
    rows = [dict(model="m", system="megakernel", batch=1, context=512, t_s=0.0, ms=1.0, status="ok"),
            dict(model="m", system="planned", batch=8, context=512, t_s=10.0, ms=1.3, status="ok"),
            dict(model="m", system="gptfast", batch=8, context=512, t_s=20.0, status="skipped (time budget)")]
    p = tmp_path / "bench_decode.json"
    p.write_text(json.dumps(dict(meta=dict(t0_local=T0.isoformat()), rows=rows)))
    return str(p)


def test_cells_get_their_own_samples_under_load(tmp_path):
    trace = smi_join.read_trace(_trace(tmp_path, [
        (1, 1980, 90.0, "0x0000000000000000"),     # idle: not under load
        (2, 1980, 500.0, "0x0000000000000000"), (5, 1755, 690.0, "0x0000000000000004"),
        (11, 1830, 620.0, "0x0000000000000000"), (19, 1845, 640.5, "0x0000000000000000"),
        (25, 1980, 80.0, "0x0000000000000000")]))
    assert len(trace) == 6 and trace[1]["sm"] == 1980 and trace[2]["power"] == 690.0
    wins = smi_join.windows(json.load(open(_bench(tmp_path))))
    assert [w[0]["system"] for w in wins] == ["megakernel", "planned", "gptfast"]
    got = [smi_join.summarize([x for x in trace if lo <= x["t"] < hi], 150.0) for _, lo, hi in wins]
    assert got[0] == dict(n=3, n_load=2, sm_min=1755, sm_med=1867.5, sm_max=1980, power_max=690.0, temp_max=45,
                          reasons=["0x0000000000000004"])
    assert got[1]["n_load"] == 2 and got[1]["sm_min"] == 1830 and got[1]["sm_max"] == 1845 and got[1]["reasons"] == []
    assert got[2] == dict(n=1, n_load=0)


def test_the_cli_prints_a_line_a_cell_and_refuses_old_bench_files(tmp_path, capsys):
    tr = _trace(tmp_path, [(2, 1980, 500.0, "0x0000000000000000"), (12, 1800, 600.0, "0x0000000000000000")])
    assert smi_join.main([_bench(tmp_path), tr]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and "1980/ 1980/ 1980" in out[1] and "1800/ 1800/ 1800" in out[2] and "none under load" in out[3]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(dict(meta={}, rows=[])))
    assert smi_join.main([str(old), tr]) == 1 and "no meta.t0_local" in capsys.readouterr().out
    assert smi_join.main(["-", tr]) == 0 and '"sm_med": 1890.0' in capsys.readouterr().out
