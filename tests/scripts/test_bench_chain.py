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
    assert [o for o, _, _ in ops] == ["qkv", "o_proj", "gate_up", "down"]
    assert [k for _, _, k in ops] == [c.hidden_size, c.num_heads * c.head_dim, c.hidden_size, c.intermediate_size]
    want = {"qkv": (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * c.hidden_size,
            "o_proj": c.hidden_size * c.num_heads * c.head_dim,
            "gate_up": 2 * c.intermediate_size * c.hidden_size, "down": c.hidden_size * c.intermediate_size}
    for op, per_cta, _ in ops:
        assert per_cta % 1024 == 0
        assert 132 * per_cta >= 2 * want[op] > 132 * (per_cta - 1024)


def test_chain_kernel_is_in_the_compiled_source():
    src = (ROOT / "device_kernels" / "bench_stream.cu").read_text()
    assert 'extern "C" __global__ void __launch_bounds__(THREADS, 1)\n    mpk_bench_chain(' in src


def test_chain_args_match_the_kernel_signature():
    """The launch's argument types (CHAIN_ARGS) against mpk_bench_chain's parameters: same count, pointers where the
    source has pointers, 64-bit integers where it has 64-bit integers."""
    import re
    src = (ROOT / "device_kernels" / "bench_stream.cu").read_text()
    sig = src.split("mpk_bench_chain(", 1)[1].split(")", 1)[0]
    params = [p.strip() for p in sig.split(",")]
    assert len(params) == len(bench_stream.CHAIN_ARGS)
    for p, t in zip(params, bench_stream.CHAIN_ARGS):
        if "*" in p:
            assert t is bench_stream.ctypes.c_void_p, p
        elif re.match(r"(u?int64_t|uint64_t)\b", p):
            assert t in (bench_stream.ctypes.c_int64, bench_stream.ctypes.c_uint64), p
        else:
            assert t is bench_stream.ctypes.c_int, p
