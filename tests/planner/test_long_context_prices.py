"""The default profile at long contexts against what the GPUs measured in session 56 (bench/results/s56): the one
megakernel's step at llama-3.2-1b B=8 and 32k / 131k keys (run 3, an H200: the profile's card) priced within 10%
(h200_v52 priced it 11% / 15% low: its attention's cost a key was the fair share of HBM, the kernel's is ~20% more),
and the plan chosen there the one measured faster (run 5's validate_planner rows, an H100: conventional at both;
v52 chose mono at 131k, 2.6% slower). Prices only: no GPU."""
import json
from pathlib import Path

import pytest

from mpk_runtime.models import load_config
from mpk_runtime.planner import candidates
from mpk_runtime.planner.profile import DEFAULT_PROFILE, HardwareProfile
from mpk_runtime.planner.score import load_rows

ROOT = Path(__file__).resolve().parents[2]
S56 = ROOT / "bench/results/s56"


@pytest.mark.parametrize("context", [32768, 131072])
def test_default_profile_prices_and_chooses_at_long_contexts(context, monkeypatch):
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "1")   # the paged attention, as the GPU runs measured
    bench = json.loads((S56 / "run3_h200_long_b8_bench_decode.json").read_text())
    assert "H200" in bench["meta"]["machine"]
    mono_ms = next(r["ms"] for r in bench["rows"] if r["system"] == "megakernel" and r["context"] == context)
    rows = load_rows(str(S56 / f"run5_val_c{context}_rows.jsonl"))
    faster = min(rows, key=lambda r: r["measured_us"])["plan"]
    plans = candidates(load_config("llama-3.2-1b"), batch=8, context=context, prof=HardwareProfile.load(DEFAULT_PROFILE),
                       families=("conventional", "mono"))
    price = {p.name: p.predicted_us for p in plans}
    assert abs(price["mono"] / (1e3 * mono_ms) - 1) <= 0.10, (price, mono_ms)
    assert plans[0].name == faster == "conventional", (price, rows)
