from .profile import HardwareProfile
from .plan import Plan, Segment
from .simulate import SimResult, simulate
from .search import candidates, choose

__all__ = ["HardwareProfile", "Plan", "Segment", "SimResult", "simulate", "candidates", "choose"]
