"""Every data file the packages read at run time ships in the wheel: pyproject's package-data covers each non-Python
file under the packages (session 27 found the planner's profiles missing from a built wheel, so an installed, not
editable, mpk-runtime could not load its default profile)."""
from __future__ import annotations

import fnmatch
import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {"__pycache__"}


def _data_files(pkg: str) -> list[str]:
    out = []
    for d, dirs, files in os.walk(os.path.join(ROOT, pkg)):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS]
        for f in files:
            if not f.endswith((".py", ".pyc")):
                out.append(os.path.relpath(os.path.join(d, f), os.path.join(ROOT, pkg)).replace(os.sep, "/"))
    return out


def test_package_data_covers_every_data_file():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        cfg = tomllib.load(f)["tool"]["setuptools"]
    data = cfg.get("package-data", {})
    assert "mpk_runtime" in data and "planner/profiles/*.json" in data["mpk_runtime"]
    missing = []
    for pkg in ("mpk_runtime", "cluster", "device_kernels"):
        pats = data.get(pkg, [])
        for rel in _data_files(pkg):
            if not any(fnmatch.fnmatch(rel, p) or (p.startswith("**/") and fnmatch.fnmatch(rel, p[3:]))
                       for p in pats):
                missing.append(f"{pkg}/{rel}")
    assert not missing, f"not in pyproject's [tool.setuptools.package-data]: {missing}"
