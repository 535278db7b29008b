"""scripts/score_rows.py: stored validation rows re-planned and re-priced under a profile, fitting nothing."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROWS = ROOT / "bench/results/s39/val1024/val/c1024/planner_validation_rows.jsonl"


def _run(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "score_rows.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_session_39_rows_re_plan_under_the_default_profile():
    """Every measured plan of session 39's ctx 1024 rows is re-planned by today's search (a planner change that no
    longer rebuilds a stored plan shows here as a dropped row) and both points are scored."""
    r = _run("--rows", str(ROWS), "--procs", "1", "h200_v45")
    assert r.returncode == 0, r.stderr
    assert "14 of 14 rows re-planned" in r.stdout
    pts = [l for l in r.stdout.splitlines() if "spearman=" in l]
    assert len(pts) == 2 and all("ctx= 1024" in l and "B=  32" in l for l in pts)


def test_missing_rows_file_is_a_clear_error(tmp_path):
    r = _run("--rows", str(tmp_path / "nope.jsonl"), "h200_v45")
    assert r.returncode != 0 and "no such rows file" in r.stderr
