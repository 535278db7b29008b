"""On/off switches read from the environment ("1" on, "0" off, unset or empty: the switch's default), with an error
naming the variable."""
from __future__ import annotations

import os


def env_flag(name: str, default: bool = False) -> bool:
    v = os.environ.get(name, "").strip()
    if v not in ("0", "1", ""):
        raise ValueError(f"{name}={v!r}: expected 1 (on) or 0 (off)")
    return default if v == "" else v == "1"
