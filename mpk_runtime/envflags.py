"""Switches read from the environment: on/off ("1" on, "0" off) and small positive integers; unset or empty: the
switch's default; anything else an error naming the variable."""
from __future__ import annotations

import os


def env_flag(name: str, default: bool = False) -> bool:
    v = os.environ.get(name, "").strip()
    if v not in ("0", "1", ""):
        raise ValueError(f"{name}={v!r}: expected 1 (on) or 0 (off)")
    return default if v == "" else v == "1"


def env_int(name: str, default: int, lo: int = 1, hi: int = 64) -> int:
    v = os.environ.get(name, "").strip()
    if v == "":
        return default
    if not v.isdigit() or not lo <= int(v) <= hi:
        raise ValueError(f"{name}={v!r}: expected an integer from {lo} to {hi}")
    return int(v)
