from .graph import Event, Region, Task, TaskGraph
from .tiling import Tiling
from .build import build_task_graphs, decompose
from .check import GraphCheckError, check_task_graphs

__all__ = ["Event", "Region", "Task", "TaskGraph", "Tiling", "build_task_graphs", "decompose",
           "GraphCheckError", "check_task_graphs"]
