"""`python -m mpk_runtime plan --search`: the candidates, best first, and a note when the conventional attention is
priced as the gather + SDPA path (no Triton here) rather than the paged kernel a GPU runs."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _plan(triton_attn: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPK_CONV_TRITON_ATTN=triton_attn)
    r = subprocess.run([sys.executable, "-m", "mpk_runtime", "plan", "--model", "tiny-llama", "--batch", "2",
                        "--context", "64", "--search", "--top", "3"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("flag,noted", [("0", True), ("1", False)])
def test_plan_search_says_how_conventional_attention_is_priced(flag, noted):
    out = _plan(flag)
    lines = [l for l in out.splitlines() if "predicted" in l and "segments" in l]
    assert len(lines) == 3
    us = [float(l.split("predicted")[1].split("us")[0]) for l in lines]
    assert us == sorted(us)   # best first
    assert ("priced as gather + SDPA" in out) is noted


@pytest.mark.parametrize("args,msg", [
    (["--context", "-5"], "context_len must be >= 0"),
    (["--context", "99999999"], "exceeds tiny-llama's max_position_embeddings"),
    (["--profile", "no-such-profile"], "no hardware profile 'no-such-profile'"),
    (["--batch", "0"], "batch must be >= 1")])
def test_plan_bad_input_is_one_clear_error(args, msg):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "mpk_runtime", "plan", "--model", "tiny-llama", "--search", *args],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr[-1000:]


def test_plan_search_at_tp2_names_what_the_engine_runs():
    """At tp > 1 the engine runs one-megakernel and conventional plans only (runtime/tp_buckets.py): where the best
    candidate is another family, the search says which plan the engine takes and how much slower it is predicted."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPK_CONV_TRITON_ATTN="0")
    r = subprocess.run([sys.executable, "-m", "mpk_runtime", "plan", "--model", "tiny-llama", "--tp", "2", "--batch",
                        "128", "--search", "--top", "3"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stdout.splitlines() if "predicted" in l and "segments" in l]
    best = lines[0].split()[0]
    note = [l for l in r.stdout.splitlines() if l.startswith("note: at tp > 1 the engine runs")]
    assert best not in ("mono", "mono-w2", "conventional") and len(note) == 1, r.stdout   # (attn-mk here)
    took = note[0].split("here ")[1].split(",")[0]
    assert took in ("mono", "mono-w2", "conventional") and "against the best" in note[0]
