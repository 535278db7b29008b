"""scripts/load_test.py end to end on CPU (in-process replica, a few requests): the JSON carries the per-step time
breakdown of the measured window (the warm-up request excluded), consistent with the run's own counts and wall."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _load_test(tmp_path, requests: int, max_tokens: int, *extra: str):
    """scripts/load_test.py on tiny-qwen3 (reference backend, max_batch 4): (its stdout, load_test.json)."""
    pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "load_test.py"), "--model", "tiny-qwen3",
                        "--backend", "reference", "--requests", str(requests), "--max-tokens", str(max_tokens),
                        "--max-batch", "4", *extra, "--out", str(tmp_path)],
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, json.loads((tmp_path / "load_test.json").read_text())


def test_load_test_writes_time_breakdown(tmp_path):
    out, d = _load_test(tmp_path, 6, 5, "--no-engine-process")   # (the replica in this process: its threads here)
    assert "where the time went:" in out and "execute ms/step:" in out
    assert d["succeeded"] == 6 and d["tokens"] == 30
    # the result file names what it ran on and with (benchmarks' results carry machine, date, commit)
    assert d["machine"].startswith("CPU (") and d["git_commit"] == os.environ.get("GIT_COMMIT", "unknown")
    assert d["max_tokens"] == 5 and d["max_seq_len"] == 256 and d["date"]
    assert d["graphs_in_window"] == {"replica-0": {}}   # the reference runner keeps no CUDA graphs
    assert d["rounds"] == 1 and d["earlier_rounds"] == []
    # 4 client processes by default; the engine's idle stretches placed in the window, the clients' responses inside it
    assert d["clients"] == 4 and set(d["idle_stretches_ms"]) == {"replica-0"}
    for a, dur in d["idle_stretches_ms"]["replica-0"]:
        assert 0 <= a and 0 < dur and a + dur <= d["wall_s"] * 1e3 + 1
    first, last = d["client_done_ms"]
    assert 0 < first <= last <= d["wall_s"] * 1e3 + 1
    # the threads that share the server's GIL, by name: the HTTP server's and the replica's engine loop ran in it
    cpu = d["thread_cpu_s"]
    assert cpu["mpk-http"] > 0 and cpu["mpk-replica-0"] > 0 and all(v >= 0 for v in cpu.values())
    assert "CPU seconds of the threads in the window" in out
    assert d["engine_events"] == {"preemptions": 0, "recomputed_tokens": 0, "prefix_cache_hit_tokens": 0,
                                  "requests_failed": 0}
    b = d["time_breakdown"]
    assert b["steps"] == d["engine_steps"] == b["prefill_steps"] + b["decode_steps"] >= 5
    assert b["prefill_steps"] >= 2  # 6 requests in batches of at most 4: at least two admissions
    ms = b["ms_per_step"]
    assert all(v >= 0 for v in ms.values())
    assert ms["schedule"] + ms["execute"] + ms["output"] + ms["free"] <= ms["step"] + 1e-2
    assert ms["step"] <= b["wall_ms_per_step"] and 0 < b["steps_share_of_wall"] <= 1
    assert b["execute_ms_per_step"]["worker"] > 0
    loop = b["loop_ms_per_step"]
    assert loop["step"] >= ms["step"] - 1e-2
    # idle can include time before the first request of the measured window (so "other" may dip below 0);
    # the busy phases cannot exceed the wall time
    assert loop["apply"] + loop["step"] + loop["deliver"] + loop["health"] <= b["wall_ms_per_step"] + 1e-2


def test_load_test_measures_the_last_round(tmp_path):
    """--rounds 2: the first load warms the server up and is reported apart; the numbers are the second round's."""
    out, d = _load_test(tmp_path, 3, 2, "--rounds", "2", "--clients", "2")
    assert "round 1:" in out and d["clients"] == 2
    assert d["rounds"] == 2 and d["succeeded"] == 3 and d["tokens"] == 6
    assert len(d["earlier_rounds"]) == 1 and d["earlier_rounds"][0]["tokens"] == 6
    assert d["earlier_rounds"][0]["errors"] == 0


def test_load_test_streams(tmp_path):
    """--stream: every request as server-sent events; the tokens counted from the chunks equal max_tokens a request
    (as the non-streaming usage counts them) and the time to first token is taken at the first chunk, inside the
    request's latency."""
    out, d = _load_test(tmp_path, 5, 4, "--stream", "--clients", "2")
    assert d["stream"] is True and d["succeeded"] == 5 and d["errors"] == 0 and d["tokens"] == 20
    assert 0 < d["ttft_p50_s"] <= d["ttft_p99_s"] <= d["latency_p99_s"]


@pytest.mark.parametrize("flag,word", [("--clients", "--clients must be >= 1"), ("--rounds", "--rounds must be >= 1")])
def test_load_test_refuses_bad_counts(flag, word):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "load_test.py"), flag, "0"],
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and word in r.stderr


def test_load_test_engine_process(tmp_path):
    """The default (--engine-process with the in-process executor): the same load through a replica whose engine
    runs in a child process; that child's threads are reported by name under the replica's, the HTTP thread under
    its own."""
    out, d = _load_test(tmp_path, 6, 5)
    assert d["engine_process"] is True and d["succeeded"] == 6 and d["tokens"] == 30
    cpu = d["thread_cpu_s"]
    assert cpu["mpk-http"] > 0 and cpu["replica-0/mpk-replica-0"] > 0 and "mpk-replica-0" not in cpu
    assert set(d["idle_stretches_ms"]) == {"replica-0"} and d["graphs_in_window"] == {"replica-0": {}}
    assert d["time_breakdown"]["steps"] == d["engine_steps"] >= 5
