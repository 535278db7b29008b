"""docs/switches.md is the list of environment switches and build defines: every MPK_* name the package reads (a
string literal in mpk_runtime/ or cluster/) and every removed build define is there, and the default planner profile
it names is the one the planner loads."""
import re
from pathlib import Path

from mpk_runtime.codegen import nvcc
from mpk_runtime.planner.profile import DEFAULT_PROFILE

ROOT = Path(__file__).resolve().parents[1]
SWITCHES = (ROOT / "docs" / "switches.md").read_text()


def _named(name: str, text: str) -> bool:   # as a word, or a -D define
    return re.search(rf"(?:\b|(?<=-D)){name}\b", text) is not None


def _literals() -> set[str]:
    names = set()
    for pkg in ("mpk_runtime", "cluster"):
        for p in (ROOT / pkg).rglob("*.py"):
            names |= set(re.findall(r"[\"'](MPK_[A-Z0-9_]+)[\"']", p.read_text()))
    return names


def test_every_switch_the_code_reads_is_documented():
    names = _literals()
    assert "MPK_KERNEL_TIMEOUT_S" in names and "MPK_PF_CUR_KB" in names   # (the scan finds what it should)
    missing = sorted(n for n in names if not _named(n, SWITCHES))
    assert not missing, f"docs/switches.md does not name {missing}"


def test_every_removed_define_is_in_the_removed_table():
    removed = SWITCHES[SWITCHES.index("## Removed"):]
    missing = sorted(n for n in nvcc.REMOVED_DEFINES if not _named(n, removed))
    assert not missing, f"docs/switches.md's Removed table does not name {missing}"


def test_the_documented_default_profile_is_the_planners():
    m = re.search(r"`MPK_PLANNER_PROFILE`[^\n]*default (h200_v\d+)", SWITCHES)
    assert m and m.group(1) == DEFAULT_PROFILE, (m and m.group(1), DEFAULT_PROFILE)
    line = re.search(r"`MPK_PLANNER_PROFILE`[^\n]*", SWITCHES).group(0)
    from mpk_runtime.planner.profile import PROFILE_BY_CARD
    assert all(name in line for card, name in PROFILE_BY_CARD.items() if name != DEFAULT_PROFILE), line
