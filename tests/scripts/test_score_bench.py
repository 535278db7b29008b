"""scripts/score_bench.py: the planner's step predictions against bench_decode's measured rows."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import score_bench  # noqa: E402


def _bench(tmp_path):
    d = {"meta": {}, "rows": [
        {"model": "tiny-llama", "batch": 1, "context": 64, "system": "megakernel", "ms": 0.5, "status": "ok"},
        {"model": "tiny-llama", "batch": 32, "context": 64, "system": "planned", "plan": "attn-mk", "ms": 2.0,
         "predicted_ms": 2.5, "status": "ok"},
        {"model": "tiny-llama", "batch": 32, "context": 64, "system": "gptfast", "ms": 1.0, "status": "ok"},
        {"model": "tiny-llama", "batch": 128, "context": 64, "system": "planned", "plan": "attn-mk",
         "status": "skipped (time budget)"}]}
    p = tmp_path / "bench_decode.json"
    p.write_text(json.dumps(d))
    return str(p)


def test_recorded_predictions_are_scored_and_rows_without_one_left_out(tmp_path, capsys):
    rows = score_bench.rows_of(_bench(tmp_path))
    assert [(r["system"], r["batch"]) for r in rows] == [("megakernel", 1), ("planned", 32)]   # ours, measured
    s = score_bench.score(rows)
    assert len(s) == 1 and s[0]["plan"] == "attn-mk" and abs(s[0]["err"] - 0.25) < 1e-12
    sys.argv = ["score_bench.py", _bench(tmp_path)]
    assert score_bench.main() == 0
    assert "1 rows, step MAPE 25.0%" in capsys.readouterr().out


def test_repricing_uses_the_plan_that_ran_and_the_one_megakernel_as_mono(tmp_path):
    from mpk_runtime.models import PRESETS
    from mpk_runtime.planner import candidates
    rows = score_bench.rows_of(_bench(tmp_path))
    s = score_bench.score(rows, score_bench.repricer(None))
    assert [r["plan"] for r in s] == ["mono", "attn-mk"]
    want = candidates(PRESETS["tiny-llama"], batch=32, context=64, families=("attn-mk",))[0].predicted_us / 1e3
    assert s[1]["predicted_ms"] == want and s[1]["ms"] == 2.0
