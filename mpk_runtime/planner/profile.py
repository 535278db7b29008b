"""A measured hardware profile: what the cost model prices tasks and kernels with.

Profiles are JSON files in `planner/profiles/` (written by `scripts/profile_hw.py` on the GPU machine), so the
planner runs, and is tested, on a CPU. Curves are piecewise linear in log-space between measured points.
"""
from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass, field

_DIR = os.path.join(os.path.dirname(__file__), "profiles")


def _curve(points: dict[str, float], x: float) -> float:
    """Interpolate a measured curve {x: y} at x (log-log between points, clamped at the ends)."""
    xs = sorted((float(k), float(v)) for k, v in points.items())
    keys = [k for k, _ in xs]
    if x <= keys[0]:
        return xs[0][1]
    if x >= keys[-1]:
        return xs[-1][1]
    i = bisect.bisect_right(keys, x)
    (x0, y0), (x1, y1) = xs[i - 1], xs[i]
    f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))


@dataclass
class HardwareProfile:
    name: str
    num_sms: int
    hbm_bw_by_sms: dict[str, float]
    tc_flops_per_s: float
    sync_us: float
    barrier_us: float
    task_fixed_us: float
    megakernel_launch_us: float
    graph_kernel_gap_us: float
    conv_kernel_us: float
    conv_bw_fraction: float
    remote_signal_us_by_bytes: dict[str, float]
    nccl_graph_allreduce_us_by_bytes: dict[str, float]
    wgmma_m: int = 64
    fp32_flops_per_s: float = 60e12
    task_fixed_us_by_kind: dict[str, float] = field(default_factory=dict)
    stream_eff_by_kind: dict[str, float] = field(default_factory=dict)   # achieved / fair-share streaming rate
    flop_us_by_kind: dict[str, float] = field(default_factory=dict)      # per-flop time not hidden under loads
    conv_fixed_us_by_kind: dict[str, float] = field(default_factory=dict)  # measured fixed cost per conventional op
    source: str = ""

    def bw(self, active_sms: int) -> float:
        """Aggregate streaming bandwidth (bytes/s) when `active_sms` SMs stream at once."""
        return _curve(self.hbm_bw_by_sms, max(1, active_sms))

    def per_sm_bw(self, active_sms: int) -> float:
        return self.bw(active_sms) / max(1, active_sms)

    def fixed_us(self, kind: str) -> float:
        return self.task_fixed_us_by_kind.get(kind, self.task_fixed_us)

    def stream_eff(self, kind: str) -> float:
        return self.stream_eff_by_kind.get(kind, 1.0)

    def flop_us(self, kind: str) -> float:
        return self.flop_us_by_kind.get(kind, 0.0)

    def remote_signal_us(self, nbytes: int) -> float:
        return _curve(self.remote_signal_us_by_bytes, max(64, nbytes))

    def nccl_allreduce_us(self, nbytes: int) -> float:
        return _curve(self.nccl_graph_allreduce_us_by_bytes, max(8192, nbytes))

    def tc_time_us(self, flops: float, m_rows: int, sms: int = 1) -> float:
        """Tensor Core time for `flops` on `sms` SMs; wgmma computes M=64 rows, so M < 64 wastes the rest."""
        eff = min(1.0, max(1, m_rows) / self.wgmma_m)
        return flops / (self.tc_flops_per_s * sms / self.num_sms * eff) * 1e6

    @classmethod
    def load(cls, name_or_path: str = "h200_measured") -> "HardwareProfile":
        path = name_or_path if os.path.exists(name_or_path) else os.path.join(_DIR, f"{name_or_path}.json")
        if not os.path.exists(path):
            known = sorted(f[:-5] for f in os.listdir(_DIR) if f.endswith(".json"))
            raise FileNotFoundError(f"no hardware profile {name_or_path!r}; known: {known}, or a JSON path "
                                    "written by scripts/profile_hw.py")
        with open(path) as f:
            d = json.load(f)
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def to_json(self) -> str:
        from dataclasses import asdict
        return json.dumps(asdict(self), indent=1)
