"""Codegen: the host/device contract (layout), the generated header, and the cached nvcc driver."""
from .header import HEADER_NAME, generate_header
from .layout import CONSTANTS, KERNEL_NAME, OP_ARGS, PARAMS, STATUS, TASK_HEADER, TASK_WORDS, arg_index
from .nvcc import BuildResult, CompileError, build, cache_dir, find_nvcc

__all__ = ["HEADER_NAME", "generate_header", "CONSTANTS", "KERNEL_NAME", "OP_ARGS", "PARAMS", "STATUS",
           "TASK_HEADER", "TASK_WORDS", "arg_index", "BuildResult", "CompileError", "build", "cache_dir",
           "find_nvcc"]
