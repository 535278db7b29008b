"""mpk-runtime: LLM decode as persistent megakernels, tensor-parallel through in-kernel NVSHMEM.

Importing this package needs only torch: CUDA, NVSHMEM and Ray are imported where they are used.
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "LLM": ("mpk_runtime.engine", "LLM"),
    "SamplingParams": ("mpk_runtime.engine", "SamplingParams"),
    "RequestOutput": ("mpk_runtime.engine", "RequestOutput"),
    "CompletionOutput": ("mpk_runtime.engine", "CompletionOutput"),
    "RequestMetrics": ("mpk_runtime.engine", "RequestMetrics"),
    "LLMEngine": ("mpk_runtime.engine", "LLMEngine"),
    "InvalidRequestError": ("mpk_runtime.engine", "InvalidRequestError"),
    "PromptTooLongError": ("mpk_runtime.engine", "PromptTooLongError"),
    "NoTokenizerError": ("mpk_runtime.engine", "NoTokenizerError"),
    "UnknownModelError": ("mpk_runtime.engine", "UnknownModelError"),
    "RequestFailedError": ("mpk_runtime.engine", "RequestFailedError"),
    "ShutDownError": ("mpk_runtime.engine", "ShutDownError"),
    "ServerOverloadedError": ("mpk_runtime.engine", "ServerOverloadedError"),
    "ModelConfig": ("mpk_runtime.models", "ModelConfig"),
    "build_graph": ("mpk_runtime.ir", "build_graph"),
    "build_task_graphs": ("mpk_runtime.tasks", "build_task_graphs"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'mpk_runtime' has no attribute {name!r}")


__all__ = list(_LAZY)
