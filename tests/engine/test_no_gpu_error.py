"""Asking for the megakernel backend where no usable GPU is gives an error that says what to do (engine/llm.py turns
the runner's NoGPUError, a ValueError, into InvalidRequestError), not a torch internals message."""
import pytest
import torch

from mpk_runtime import LLM
from mpk_runtime.engine.errors import InvalidRequestError
from mpk_runtime.runtime import megakernel_runner as mr


def test_no_gpu_names_the_cpu_backends(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InvalidRequestError, match=r"needs an NVIDIA GPU.*backend='pyvm'"):
        LLM("tiny-qwen3", backend="megakernel")


def test_a_gpu_that_is_not_hopper_or_not_there_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (8, 0))
    with pytest.raises(mr.NoGPUError, match=r"sm_90a .* this GPU is sm_80"):
        mr.require_gpu("cuda")
    with pytest.raises(mr.NoGPUError, match=r"cuda:5.* 2 visible"):
        mr.require_gpu("cuda:5")
    with pytest.raises(mr.NoGPUError, match="runs on a CUDA device"):
        mr.require_gpu("cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    mr.require_gpu("cuda:1")   # an H100 / H200 passes


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_megakernel_refuses_dtypes_its_device_code_cannot_read(dtype):
    """The kernel reads bf16 weights only: another dtype is refused by name (before any GPU check), not run."""
    with pytest.raises(InvalidRequestError, match="bf16 weights.*backend 'torch'"):
        LLM("tiny-llama", backend="megakernel", dtype=dtype)
