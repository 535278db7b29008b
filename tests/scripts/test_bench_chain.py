"""scripts/bench_stream.py --chain's layer plan (the GPU run itself needs a GPU): each op's bytes a CTA cover the op's
bf16 weights split over the CTAs, in 1 KiB units (bulk copies move multiples of 16 bytes), in the layer's order; and the
kernel it launches is in the device source CI compiles."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_stream  # noqa: E402

from mpk_runtime.models.config import load_config  # noqa: E402


@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen3-8b"])
def test_chain_plan_covers_each_op(model):
    c = load_config(model)
    ops = bench_stream.chain_plan([model], 132)[model]
    assert [o for o, _ in ops] == ["qkv", "o_proj", "gate_up", "down"]
    want = {"qkv": (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * c.hidden_size,
            "o_proj": c.hidden_size * c.num_heads * c.head_dim,
            "gate_up": 2 * c.intermediate_size * c.hidden_size, "down": c.hidden_size * c.intermediate_size}
    for op, per_cta in ops:
        assert per_cta % 1024 == 0
        assert 132 * per_cta >= 2 * want[op] > 132 * (per_cta - 1024)


def test_chain_kernel_is_in_the_compiled_source():
    src = (ROOT / "device_kernels" / "bench_stream.cu").read_text()
    assert 'extern "C" __global__ void __launch_bounds__(THREADS, 1)\n    mpk_bench_chain(' in src
