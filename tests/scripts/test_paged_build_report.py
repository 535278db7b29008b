"""scripts/paged_build_report.py: the paged attention's launch at a point, from offline sm_90 builds (Triton needed
for those; the argument check runs without it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "paged_build_report.py"


def _run(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600)


def test_an_unknown_heads_mode_is_refused_by_name():
    r = _run("--heads", "one,pairs")
    assert r.returncode != 0 and "unknown --heads pairs (one of one, group, all)" in r.stderr


def test_an_unknown_table_type_is_refused_by_name():
    r = _run("--tables", "auto,int32")
    assert r.returncode != 0 and "--tables auto,int32: each one of auto, i64, i32" in r.stderr


def test_the_launch_of_llama_b32_at_4097_keys(tmp_path):
    """One head a program: TUNED's 128-key shape for 264 programs (3 stages and int32 tables since session 43), 2
    splits, 512 programs, 4 CTAs an SM (128 registers at 4 warps); a group of 4: the same tile rows as 32 keys x 4
    heads, 5 splits, 320 programs, 512 contiguous bytes."""
    pytest.importorskip("triton", reason="needs Triton (pip install triton): it builds without a GPU")
    out = tmp_path / "r.json"
    r = _run("--models", "llama-3.2-1b", "--batches", "32", "--keys", "4097", "--heads", "one,group", "--out",
             str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    one, group = json.loads(out.read_text())["rows"]
    assert (one["splits"], one["programs"], one["tile_rows"], one["contiguous_bytes"]) == (2, 512, 128, 128)
    assert (group["splits"], group["programs"], group["tile_rows"], group["contiguous_bytes"]) == (5, 320, 128, 512)
    assert one["ctas_per_sm"] == 4 and one["spills"] == 0 and group["spills"] == 0
    assert group["heads_a_program"] == 4 and group["keys_a_step"] == 32


def test_qwen3_8b_tp2_b32_holds_a_cta_more_with_int64_tables(tmp_path):
    """Why TUNED names int64 tables at head dim 128's 4096-key points (session 43): one rank of qwen3-8b at TP=2, B=32
    (4 KV heads: 128 programs a split, the B=8 point's (64, 528, 4, 2) shape), builds 96 registers with int64 page
    tables (5 CTAs an SM: 640 programs in 0.97 waves) and 126 with int32 (4: 1.21 waves); measured +17..+25% on the
    op with int32 (bench/results/s43/cattn, cattn32). "auto" builds what the step reads: int64."""
    pytest.importorskip("triton", reason="needs Triton (pip install triton): it builds without a GPU")
    out = tmp_path / "r.json"
    r = _run("--models", "qwen3-8b", "--tp", "2", "--batches", "32", "--keys", "4097", "--heads", "one", "--tables",
             "auto,i32,i64", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    auto, i32, i64 = json.loads(out.read_text())["rows"]
    assert auto["tp"] == 2 and auto["programs"] == i32["programs"] == 640 and auto["table"] == "i64"
    assert (i64["ctas_per_sm"], i32["ctas_per_sm"]) == (5, 4) and auto["regs"] == i64["regs"] < i32["regs"]
    assert i64["waves"] < 1 < i32["waves"]

