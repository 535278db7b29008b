"""Per-kind megakernel task costs from traced steps: the simulator's `task_fixed_us_by_kind`,
`stream_eff_by_kind` and `flop_us_by_kind`.

A traced task's duration (globaltimer after its waits to after its signals, Megakernel.chrome_trace) is fitted per
task kind (Tensor Core linear / qkv_rope tiles apart: simulate.cost_key) as  duration = fixed + bytes * s_b + flops * s_f  by least squares over every traced task of that kind
(both batch regimes and every model given: flops separate the regimes); s_b against the fair-share rate when all
SMs stream gives the streaming efficiency. A negative slope is dropped and the fit redone without it, so the model
stays physical. Used on the GPU by scripts/profile_hw.py (its own traced steps) and offline by
scripts/refit_from_traces.py (traces stored under bench/results). Pure Python.
"""
from __future__ import annotations

import re

from .simulate import cost_key

_TASK_ID = re.compile(r"task(\d+)\[")


def med(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def lstsq(rows: list[list[float]], y: list[float]) -> list[float] | None:
    """Least squares of a few columns by the normal equations in Python floats (Gaussian elimination with partial
    pivoting): no LAPACK, so the same answer in every process (a fresh-clone CI run once got another answer from
    torch.linalg.lstsq for the same points). None when the columns are (nearly) linearly dependent."""
    n = len(rows[0])
    M = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * v for r, v in zip(rows, y))]
         for i in range(n)]
    scale = max(abs(M[i][i]) for i in range(n)) or 1.0
    for c in range(n):
        piv = max(range(c, n), key=lambda i: abs(M[i][c]))
        if abs(M[piv][c]) <= 1e-12 * scale:
            return None
        M[c], M[piv] = M[piv], M[c]
        for i in range(n):
            if i != c:
                f = M[i][c] / M[c][c]
                M[i] = [a - f * b for a, b in zip(M[i], M[c])]
    return [M[i][n] / M[i][i] for i in range(n)]


def task_points(events: list[dict], tg, step: int | None = None) -> dict[str, list[tuple[float, float, float]]]:
    """{cost key: [(est_bytes, est_flops, duration us), ...]} (simulate.cost_key: the kind, "<kind>@tc" for Tensor
    Core tiles, which the simulator prices apart) of one traced step (default: the last in `events`) of
    the task graph `tg` the trace was recorded from (task ids from the events' labels, "rank0/task17[...]")."""
    ev = [e for e in events if e.get("ph") == "X"]
    if not ev:
        raise ValueError("trace has no task events")
    s = max(e["args"]["step"] for e in ev) if step is None else step
    pts: dict[str, list[tuple[float, float, float]]] = {}
    for e in ev:
        if e["args"]["step"] != s:
            continue
        m = _TASK_ID.search(e["args"]["label"])
        if m is None:
            raise ValueError(f"trace event without a task id in its label: {e['args']['label']!r}")
        t = tg.tasks[int(m.group(1))]
        if t.kind != e["name"]:
            raise ValueError(f"trace does not match the task graph: task {t.id} is {t.kind}, traced as {e['name']} "
                             "(rebuild the graph with the traced model, batch, context and attention splits)")
        pts.setdefault(cost_key(t), []).append((float(t.est_bytes), float(t.est_flops), float(e["dur"])))
    return pts


def merge_points(*parts: dict) -> dict[str, list[tuple[float, float, float]]]:
    out: dict[str, list[tuple[float, float, float]]] = {}
    for p in parts:
        for k, v in p.items():
            out.setdefault(k, []).extend(v)
    return out


def fit_task_costs(pts: dict[str, list[tuple[float, float, float]]], fair_bytes_per_us: float
                   ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(fixed us, streaming efficiency, us per flop) per kind. fair_bytes_per_us: one SM's share of the HBM
    bandwidth when all SMs stream (profile.bw(num_sms) / num_sms / 1e6)."""
    fixed, eff, fl = {}, {}, {}
    for kind, xy in pts.items():
        ys = [y for _, _, y in xy]
        # Candidate models: intercept plus bytes and/or flops, each used only if it varies over the points; the
        # one with the smallest squared error among those with no negative slope wins; a later (richer) one must
        # beat it by more than rounding, so on a tie (collinear bytes and flops, as within one task kind) the
        # simpler one stays, bytes before flops. Deterministic whatever
        # the LAPACK build: the choice never rests on how a rank-deficient solve splits a slope.
        varies = [j for j in (0, 1) if len({p[j] for p in xy}) > 1]
        cands = [()] + [c for c in ((0,), (1,), (0, 1)) if all(j in varies for j in c)]   # simplest first
        best = None
        for c in cands:
            sol = lstsq([[1.0] + [p[j] / 1e6 for j in c] for p in xy], ys) if c else [med(ys)]
            if sol is None or any(v < 0 for v in sol[1:]):
                continue
            sse = sum((sol[0] + sum(v * p[j] / 1e6 for j, v in zip(c, sol[1:])) - y) ** 2 for p, y in zip(xy, ys))
            if best is None or sse < best[0] * (1 - 1e-9) - 1e-12:
                best = (sse, c, sol)
        _, c, sol = best
        c0 = sol[0]
        coef = {0: 0.0, 1: 0.0}
        coef.update(zip(c, sol[1:]))
        sb, sf = coef[0], coef[1]
        fixed[kind] = max(0.0, c0)
        eff[kind] = min(1.0, max(0.02, 1e6 / (fair_bytes_per_us * sb))) if sb > 0 else 1.0   # sb: us per MB
        fl[kind] = max(0.0, sf) / 1e6
    return fixed, eff, fl
