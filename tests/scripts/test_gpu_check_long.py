"""scripts/gpu_check_long.py on the CPU (--cpu: the pyvm twin for decode, the conventional prefill, the pure-torch
reference) so the script the GPU runs for long contexts does not rot: both reference paths (the reference's own
prefill, and its cache filled from our pages past --ref-prefill-max), the exact-key prefill, the engine rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_long_cpu_smoke(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), MPK_PREFILL_EXACT_KEYS="256")
    r = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_check_long.py"), "--cpu", "--models", "tiny-llama-g8",
                        "--lens", "300,700", "--chunk", "256", "--ref-chunk", "256", "--ref-prefill-max", "500",
                        "--steps", "3", "--max-tokens", "4"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check_long.json").read_text())
    assert [f["reference_prefill"] for f in res["forced"]] == [True, False]
    assert all(f["ok"] and f["decode_far_tokens"] == 0 for f in res["forced"])
    assert [e["prompt_len"] for e in res["engine"]] == [300, 700] and not res["errors"]
    assert all(e["tokens"] == 4 and "error" not in e for e in res["engine"])
