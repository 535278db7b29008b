"""scripts/bench_engine_overhead.py's profile_summary: kernel totals, the device's busy time as the union of kernel
intervals (overlaps counted once), and the idle gaps between them, from a Chrome trace."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_engine_overhead import profile_summary  # noqa: E402


def test_busy_time_is_the_union_of_kernel_intervals_and_gaps_are_what_lies_between():
    ev = [{"cat": "kernel", "ts": 100.0, "dur": 10.0, "name": "a"},
          {"cat": "kernel", "ts": 105.0, "dur": 10.0, "name": "b"},     # overlaps a: 100..115 busy
          {"cat": "kernel", "ts": 118.0, "dur": 2.0, "name": "a"},      # a 3 us gap
          {"cat": "cpu_op", "ts": 0.0, "dur": 500.0, "name": "aten::mm"},   # not a kernel
          {"cat": "kernel", "ts": 140.0, "dur": 5.0, "name": "c"}]      # a 20 us gap
    s = profile_summary({"traceEvents": ev})
    assert s["kernels"] == 4 and s["span_us"] == 45.0 and s["busy_us"] == 22.0
    assert abs(s["busy_share"] - 22 / 45) < 1e-12
    assert s["gaps_over_5us"] == 1 and s["gap_us_over_5us"] == 20.0 and s["largest_gaps_us"] == [3.0, 20.0]
    a = next(r for r in s["by_kernel"] if r["name"] == "a")
    assert a["count"] == 2 and a["total_us"] == 12.0 and s["by_kernel"][0]["name"] == "a"
    assert profile_summary({"traceEvents": ev[3:4]}) == {"kernels": 0}
