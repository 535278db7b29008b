"""GPU, one card: the TP=2 megakernel's device protocol with both ranks on this GPU (runtime/loopback.py,
scripts/gpu_check_tp_loopback.py): half the SMs each, their pushes and remote signals through this GPU's memory.
Greedy tokens against the one-rank kernel (identical under tp_invariant 2; at a near-tie only under 1), the ranks
agreeing on every token, and a rank whose peer never launches timing out as KernelTimeout."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.gpu.marks import KERNEL

pytestmark = KERNEL
ROOT = Path(__file__).resolve().parents[2]


def test_tp2_ranks_on_one_gpu_match_tp1_and_a_missing_peer_times_out(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_check_tp_loopback.py"), "--models",
                        "tiny-llama,tiny-qwen3", "--steps", "24"], env=env, capture_output=True, text=True,
                       timeout=600)
    res = json.loads((tmp_path / "gpu_check_tp_loopback.json").read_text())
    checks = [r for r in res if "tokens_identical" in r]
    assert len(checks) == 8 and all(r["ok"] for r in checks), p.stdout[-4000:]
    assert all(r["tokens_identical"] for r in checks if r["tp_invariant"] == 2), checks
    assert all(r["tp_cross_rank_signals"] > 0 for r in checks), checks
    st = [r for r in res if "stall_test" in r]
    assert st and st[0]["stall_test"] == "KernelTimeout" and st[0]["ok"], st
    assert p.returncode == 0, p.stdout[-4000:]
