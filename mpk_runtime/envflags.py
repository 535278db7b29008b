"""On/off switches read from the environment ("1" on, "0" or unset off), with an error naming the variable."""
from __future__ import annotations

import os


def env_flag(name: str) -> bool:
    v = os.environ.get(name, "0").strip()
    if v not in ("0", "1", ""):
        raise ValueError(f"{name}={v!r}: expected 1 (on) or 0 (off)")
    return v == "1"
