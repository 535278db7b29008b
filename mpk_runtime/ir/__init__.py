from .graph import Graph, Op, TensorSpec
from .build import build_graph
from .shard import Shard, shard_for, weight_slice, check_tp, valid_tps

__all__ = ["Graph", "Op", "TensorSpec", "build_graph", "Shard", "shard_for", "weight_slice", "check_tp", "valid_tps"]
