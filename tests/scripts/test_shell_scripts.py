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


def test_gpu_pending_smi_trace_falls_back_and_stops(tmp_path):
    """smi_start / smi_stop (gpu_pending.sh): a driver whose nvidia-smi does not know clocks_event_reasons gets the
    trace without that field, the sampler runs in the background, and smi_stop ends it (a fake nvidia-smi here)."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/bash\n"
                    "case \"$*\" in *clocks_event_reasons*) echo 'Field is not a valid field to query.'; exit 2;; esac\n"
                    "echo \"header for $1\"\n"
                    "case \"$*\" in *-lms*) while true; do echo sample; sleep 0.05; done;; esac\n")
    fake.chmod(0o755)
    trace = tmp_path / "t.csv"
    body = (ROOT / "scripts" / "gpu_pending.sh").read_text()
    funcs = body[body.index("smi_start() {"):body.index("\n", body.index("smi_stop() {")) + 1]
    r = subprocess.run(["bash", "-c", funcs + f'smi_start "{trace}"; sleep 0.5; smi_stop; sleep 0.2; wc -l < "{trace}"; '
                        f'sleep 0.3; wc -l < "{trace}"'], capture_output=True, text=True,
                       env={"PATH": f"{fake.parent}:/usr/bin:/bin"})
    n1, n2 = (int(x) for x in r.stdout.split())
    lines = trace.read_text().splitlines()
    assert r.returncode == 0 and lines[0] == ("header for --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,"
                                              "temperature.gpu")
    assert lines[1] == "sample" and n1 >= 3 and n2 == n1   # sampled while running, nothing after smi_stop
