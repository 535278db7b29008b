"""scripts/ab_table.py: the A/B table of bench_decode / validate_planner result files."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import ab_table  # noqa: E402


def test_rows_of_both_formats_pair_up_and_show_changes(tmp_path, capsys):
    a = {"meta": {}, "rows": [
        {"model": "m", "batch": 1, "context": 512, "system": "megakernel", "ms": 2.0, "status": "ok"},
        {"model": "m", "batch": 32, "context": 512, "system": "planned", "plan": "attn-mk", "ms": 4.0, "status": "ok"},
        {"model": "m", "batch": 8, "context": 512, "system": "hf", "status": "skipped (time budget)"}]}
    b = {"meta": {}, "rows": [
        {"model": "m", "batch": 1, "context": 512, "system": "megakernel", "ms": 1.5, "status": "ok"},
        {"model": "m", "batch": 32, "context": 512, "system": "planned", "plan": "attn-mk", "ms": 4.4, "status": "ok"}]}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    v = tmp_path / "v.jsonl"
    v.write_text(json.dumps({"model": "m", "batch": 1, "context": 512, "plan": "mono", "measured_us": 1800.0}) + "\n")
    lines = ab_table.table([("a", ab_table.load(str(tmp_path / "a.json"))), ("b", ab_table.load(str(tmp_path / "b.json"))),
                            ("v", ab_table.load(str(v)))])
    assert lines[0][-2:] == ["b vs a", "v vs a"]
    assert lines[1][4:] == ["2.000", "1.500", "1.800", "-25.0%", "-10.0%"]
    assert lines[2][3] == "attn-mk" and lines[2][-2] == "+10.0%"
    assert lines[3][4].startswith("skipped") and lines[3][-1] == "-"
    ab_table.main([f"a={tmp_path / 'a.json'}", f"b={tmp_path / 'b.json'}", "--md"])
    assert "| m | 1 | 512 | mono | 2.000 | 1.500 | -25.0% |" in capsys.readouterr().out


def test_kv_rates_between_two_contexts(tmp_path, capsys):
    """--kv-rates: extra K/V bytes of the longer context over the extra time (llama-3.2-1b: 16 layers, 8 KV heads of
    64: 32 KB per key per sequence across the layers)."""
    rows = [{"model": "llama-3.2-1b", "batch": 32, "context": c, "system": "planned", "plan": "attn-mk", "ms": t,
             "status": "ok"} for c, t in ((512, 2.0), (4096, 4.0))]
    rows.append({"model": "llama-3.2-1b", "batch": 8, "context": 512, "system": "megakernel", "ms": 1.5, "status": "ok"})
    (tmp_path / "a.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    lines = ab_table.kv_rates([("a", ab_table.load(str(tmp_path / "a.json")))])
    extra = 16 * 32 * 3584 * 8 * 64 * 2 * 2
    assert lines[1] == ["a", "llama-3.2-1b", "32", "attn-mk", "512 -> 4096", f"{extra / 1e9:.2f}",
                        f"{extra / 2e-3 / 1e12:.2f}"]
    assert len(lines) == 2   # the B=8 point has one context only
    ab_table.main([f"a={tmp_path / 'a.json'}", "--kv-rates"])
    assert "1.88" in capsys.readouterr().out
