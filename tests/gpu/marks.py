"""The marks every GPU test module takes: `pytestmark = GPU` (a CUDA GPU), or `KERNEL` (also nvcc, to build the
megakernel); on the CPU CI they skip."""
import pytest
import torch

from mpk_runtime.codegen import nvcc

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
KERNEL = GPU + [pytest.mark.skipif(nvcc.find_nvcc() is None, reason="needs nvcc to build the kernel")]
