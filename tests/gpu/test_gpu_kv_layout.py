"""GPU: the head-major KV layout (MPK_KV_LAYOUT=hnd: KVStore layout "hnd", the megakernel's P_KV_HND): the
megakernel writes (qkv_rope, qk_norm_rope) and reads (attention) the head-major pages and matches pyvm on the same
layout; a planned attn-mk decode (K/V appended by the conventional path through (page, slot) pairs, read by the
attention megakernels) stays within bf16 tolerance of the reference (skips without a CUDA GPU + nvcc)."""
import pytest

from tests.gpu.marks import KERNEL

pytestmark = KERNEL


@pytest.mark.parametrize("model,batch,splits,groups", [("tiny-llama", 1, 2, ""), ("tiny-llama", 8, 2, ""),
                                                       ("tiny-qwen3", 8, 1, "2"), ("tiny-qwen3", 4, 4, "")])
def test_head_major_kv_matches_pyvm(gpu_check, monkeypatch, model, batch, splits, groups):
    from mpk_runtime.codegen import layout as L
    monkeypatch.setenv("MPK_KV_LAYOUT", "hnd")
    monkeypatch.setenv("MPK_ATT_GROUPS", groups)
    res = []
    rig = gpu_check.check_correct(model, batch, 8, res, splits=splits)
    assert rig.mem.kvstore.layout == "hnd" and rig.ref.kv[0].layout == "hnd"
    assert int(rig.mk.params[L.PARAMS.index("kv_hnd")]) == 1
    assert res[-1]["ok"], res[-1]


@pytest.mark.parametrize("model,batch,ctx,splits", [("tiny-llama", 3, 520, 2), ("tiny-qwen3", 2, 450, 1)])
def test_head_major_kv_long_context(gpu_check, monkeypatch, model, batch, ctx, splits):
    monkeypatch.setenv("MPK_KV_LAYOUT", "hnd")
    res = []
    gpu_check.check_long_context(model, batch, ctx, splits, res)
    assert res[-1]["ok"], res[-1]


def test_head_major_kv_attn_mk_plan(monkeypatch):
    import importlib.util
    import pathlib
    from mpk_runtime.models.config import load_config
    from mpk_runtime.planner import plan_book
    monkeypatch.setenv("MPK_KV_LAYOUT", "hnd")
    spec = importlib.util.spec_from_file_location("gpu_check_plans",
                                                  pathlib.Path(__file__).parents[2] / "scripts/gpu_check_plans.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    book = plan_book(load_config("tiny-qwen3"), 1, (2, 4), context=256, families=("attn-mk",))
    r = m.forced("tiny-qwen3", book, 3, 250, 10)
    assert r["plan"] == "attn-mk" and r["ok"], r
