"""The shell scripts a GPU session runs parse (bash -n), and gpu_pending.sh refuses a mode it does not know without
touching a GPU (a typo must not cost device time)."""
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "scripts").glob("*.sh")))
def test_script_parses(script):
    r = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_gpu_pending_refuses_an_unknown_mode(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_pending.sh"), "no-such-mode"], capture_output=True,
                       text=True, cwd=ROOT, env={"OUT": str(tmp_path / "out"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "unknown mode no-such-mode" in r.stdout + r.stderr


def test_gpu_pending_attn_sets_select_nothing_when_asked_for_nothing(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_pending.sh"), "attn"], capture_output=True, text=True,
                       cwd=ROOT, env={"OUT": str(tmp_path / "out"), "ATTN_SETS": "none", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "pytest" not in r.stdout and "done" in r.stdout
