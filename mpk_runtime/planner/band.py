"""A profile's uncertainty band, measured: per batch regime, the interval of measured / predicted - 1 that held a given
share (default 90%) of the validated plans, written into the profile as `step_band`, so `Plan.band` says how far
a prediction has been seen to miss instead of a guessed +-12%.

    python -m mpk_runtime.planner.band --rows ROWS[,ROWS] --profile NAME [--test ROWS] [--out DIR] [--name NAME]
        [--resimulate]

Use rows the profile was not fit on (a later validation run, another context): in-sample rows give a band that is
too narrow. `--test` scores the band's coverage on further rows (e.g. a context absent from --rows).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import replace

from .fit import regime_of
from .profile import HardwareProfile
from .score import load_rows, reprice, resimulate, valid_rows

REGIMES = (1, 8, 32, 128)


def central(xs: list[float], share: float) -> tuple[float, float]:
    """The order-statistic interval that leaves out floor((1 - share) / 2 * n) values on each side, so it holds at
    least `share` of xs (interpolated quantiles would hold less at a few dozen rows)."""
    xs = sorted(xs)
    k = int((1.0 - share) / 2 * len(xs) + 1e-9)   # (1 - 0.9) / 2 is 0.04999...: 20 rows must leave one out
    return xs[k], xs[len(xs) - 1 - k]


def rel_errors(rows: list[dict], prof: HardwareProfile, regimes=REGIMES) -> dict[int, list[float]]:
    """measured / predicted - 1 of every measured plan, by regime. Predictions are re-priced under `prof` from the
    segments' recorded features (the simulated makespans of the code that measured them), not re-simulated."""
    out: dict[int, list[float]] = {b: [] for b in regimes}
    for r in reprice(valid_rows(rows), prof):
        out[int(regime_of(r["batch"], tuple((b, str(b)) for b in regimes)))].append(r["measured_us"] / r["predicted_us"] - 1.0)
    return out


def bands_of(errs: dict, share: float = 0.9, min_rows: int = 10) -> dict:
    """{regime: relative errors} -> {regime: (lo, hi)}: per regime with >= min_rows errors, the central interval
    holding `share` of them, rounded outwards to 1e-4."""
    out = {}
    for b, e in errs.items():
        if len(e) >= min_rows:
            lo, hi = central(e, share)
            out[b] = (math.floor(lo * 1e4) / 1e4, math.ceil(hi * 1e4) / 1e4)
    return out


def measure_bands(rows: list[dict], prof: HardwareProfile, regimes=REGIMES, share: float = 0.9,
                  min_rows: int = 10) -> dict[int, tuple[float, float]]:
    """Per regime with >= min_rows rows: the central interval holding `share` of the relative errors."""
    return bands_of(rel_errors(rows, prof, regimes), share, min_rows)


def with_bands(prof: HardwareProfile, bands: dict[int, tuple[float, float]]) -> HardwareProfile:
    regimes = {k: dict(v) for k, v in prof.regimes.items()}
    for b, band in bands.items():
        regimes.setdefault(str(b), {})["step_band"] = list(band)
    return replace(prof, regimes=regimes)


def coverage(rows: list[dict], prof: HardwareProfile, regimes=REGIMES) -> dict[int, tuple[int, int]]:
    """(rows whose measured step fell inside the profile's band, rows) by regime."""
    out = {}
    for b, errs in rel_errors(rows, prof, regimes).items():
        lo, hi = prof.for_batch(b).step_band
        out[b] = (sum(lo <= e <= hi for e in errs), len(errs))
    return out


def main() -> None:
    try:
        _main()
    except (OSError, ValueError) as e:   # a rows file or profile not there, or not readable: a message
        raise SystemExit(f"error: {e}") from None


def _main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", required=True, help="validation rows JSONL (or planner_validation.json), comma-separated")
    ap.add_argument("--profile", default=None, help="the profile to measure (default: the planner's default)")
    ap.add_argument("--test", default="", help="further rows to score the band's coverage on")
    ap.add_argument("--share", type=float, default=0.9, help="share of the rows the band must hold")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--name", default="", help="name of the written profile (default: the profile's own)")
    ap.add_argument("--resimulate", action="store_true", help="re-plan the rows under the profile first (score."
                    "resimulate): needed when the profile changes the simulator itself (e.g. tc_pass_us_by_rows), "
                    "since re-pricing alone reuses the measuring run's simulated makespans")
    a = ap.parse_args()
    if not 0.0 < a.share < 1.0:
        raise SystemExit(f"--share must be in (0, 1), got {a.share}")
    prof = HardwareProfile.load(a.profile)

    def rows_of(spec: str) -> list[dict]:
        got = load_rows(spec)
        return resimulate(valid_rows(got), prof) if a.resimulate else got
    rows = rows_of(a.rows)
    bands = measure_bands(rows, prof, share=a.share)
    if not bands:
        raise SystemExit("no regime has enough measured rows to measure a band (10 needed)")
    out = with_bands(replace(prof, name=a.name or prof.name), bands)
    report = {"profile": prof.name, "share": a.share, "bands": {str(b): v for b, v in bands.items()},
              "in_sample": {str(b): c for b, c in coverage(rows, out).items()}}
    if a.test:
        report["test"] = {str(b): c for b, c in coverage(rows_of(a.test), out).items()}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"{out.name}.json")
    with open(path, "w") as f:
        f.write(out.to_json())
    print(json.dumps(report, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
