from .profile import HardwareProfile
from .plan import Plan, Segment
from .simulate import SimResult, simulate
from .search import candidates, choose
from .book import plan_book, pick_plan

__all__ = ["HardwareProfile", "Plan", "Segment", "SimResult", "simulate", "candidates", "choose", "plan_book", "pick_plan"]
