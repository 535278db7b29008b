from .config import ConfigError, ModelConfig, PRESETS, RopeScaling, load_config
from .weights import WeightError, get_weights, load_weights, random_weights, save_weights, weight_shapes
from .reference import KVCache, ReferenceModel

__all__ = ["ConfigError", "ModelConfig", "PRESETS", "RopeScaling", "load_config", "WeightError", "get_weights",
           "load_weights", "random_weights", "save_weights", "weight_shapes", "KVCache", "ReferenceModel"]
