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
    if not (v.isascii() and v.isdigit()) or not lo <= int(v) <= hi:   # ("²".isdigit(), and int() refuses it)
        raise ValueError(f"{name}={v!r}: expected an integer from {lo} to {hi}")
    return int(v)


def env_seconds(name: str, default: float) -> float:
    """A duration in seconds (> 0) named by the variable; unset or empty: `default`."""
    v = os.environ.get(name, "").strip()
    if v == "":
        return default
    try:
        t = float(v)
    except ValueError:
        t = float("nan")
    if not t > 0 or t == float("inf"):
        raise ValueError(f"{name}={v!r}: expected a positive number of seconds (unset: {default:g})")
    return t


def kernel_timeout_s(timeout_s: float | None = None) -> float:
    """How long a megakernel's task may spin on one event before the kernel gives up and reports it (a timeout
    names the task, runtime/base.py KernelTimeout): `timeout_s` where given, else $MPK_KERNEL_TIMEOUT_S, else 2 s.
    Raise it where every access is slow (compute-sanitizer) or a step is long enough to need it."""
    # the kernel reads it as int64 nanoseconds: inf or more than MAX_TIMEOUT_S overflowed in the launch parameters
    if timeout_s is None:
        t = env_seconds("MPK_KERNEL_TIMEOUT_S", 2.0)
        if t > MAX_TIMEOUT_S:
            raise ValueError(f"MPK_KERNEL_TIMEOUT_S={t:g}: expected a positive number of seconds up to {MAX_TIMEOUT_S:g}")
        return t
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s={timeout_s!r}: expected a positive number of seconds up to {MAX_TIMEOUT_S:g}")
    return float(timeout_s)


MAX_TIMEOUT_S = 1e9   # (int64 ns holds ~9.2e9 s)


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """One of `choices` named by the variable; unset or empty: `default`; anything else an error listing them."""
    v = os.environ.get(name, "").strip() or default
    if v not in choices:
        raise ValueError(f"{name}={v!r}: expected one of {', '.join(choices)} (unset: {default})")
    return v


def env_removed(name: str, why: str, allowed: tuple[str, ...] = ()) -> None:
    """A switch that was removed: set (non-empty and not one of `allowed`, the values that asked for what is now
    the only behaviour), a ValueError naming it and why, so an old script is told instead of silently ignored."""
    v = os.environ.get(name, "").strip()
    if v and v not in allowed:
        raise ValueError(f"{name}={v!r}: this option was removed ({why}); unset {name}")


NOT_SWITCHES = ("MPK_CACHE_DIR", "MPK_KERNEL_TIMEOUT_S", "MPK_PLAN_CACHE", "MPK_PREFILL_GRAPHS")


def switches() -> dict:
    """The MPK_* switches set in this process (attention grouping, build defines, conventional fusions, ...):
    what a measurement ran under, recorded with its results (validate_planner rows, bench_decode meta) so a later
    fit or comparison knows; paths and timeouts are not switches."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MPK_") and v and k not in NOT_SWITCHES}


def resolved_switches() -> dict:
    """switches() plus the values the task-graph and conventional-path switches resolved to, set or not: their
    defaults move between sessions (MPK_QKV_FLAT in 32, MPK_ATTN_QKNORM in 33) or depend on the machine
    (MPK_CONV_TRITON_ATTN: on where Triton is installed), so a result records the graph it ran and a later re-plan
    (planner/score.py resimulate), on any machine, plans it the same way."""
    from .ir.defer import conv_attn_appends, kv_defer   # (imported here: they read their switches from this module)
    from .ir.sampling import conv_bf16_argmax
    from .runtime.paged_attention import append_cache, grid_order, heads_mode, row_keys, table_choice, used_splits
    from .tasks.tiling import Tiling
    t = Tiling()
    flag = lambda v: "1" if v else "0"   # noqa: E731
    # the paged attention's walk (its default moved in session 39: cap -> split) does not change a plan, but it
    # changes what a conventional attention costs: recorded so rows say which kernel they measured
    return {"MPK_CONV_TRITON_ATTN": flag(conv_attn_appends()), "MPK_KV_DEFER": flag(kv_defer()),
            "MPK_QKV_FLAT": flag(t.qkv_flat), "MPK_ATTN_QKNORM": flag(t.attn_qk_norm),
            "MPK_ATTN_FOLD": flag(t.attn_fold_merge), "MPK_PAGED_ROW_KEYS": row_keys(),
            "MPK_PAGED_USED_SPLITS": flag(used_splits()), "MPK_PAGED_APPEND": "cache" if append_cache() else "regs",
            "MPK_PAGED_GRID": grid_order(), "MPK_PAGED_HEADS": heads_mode(), "MPK_PAGED_TABLE": table_choice(),
            "MPK_CONV_BF16_ARGMAX": flag(conv_bf16_argmax()), **switches()}
