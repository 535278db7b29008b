import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
# under TRITON_INTERPRET=1 every conventional decode step may run Triton kernels (the paged attention is the default
# where Triton is installed): the interpreter's patch for numpy >= 2.4, for all tests (a no-op otherwise)
from tests.runtime import triton_interp  # noqa: E402,F401


def _gpus() -> int:
    try:
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def pytest_collection_modifyitems(config, items):
    n = _gpus()
    for item in items:
        if "gpu" in item.keywords and n < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)"))
        if "gpu2" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))


@pytest.fixture(autouse=True)
def _torch_threads():
    torch.set_num_threads(1)  # tiny tensors: OpenMP threads only add overhead (and oversubscribe 2 cores)
    yield
