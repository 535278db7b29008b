"""GPU: decode attention over long cached contexts (several key passes per split, sequences of different lengths)
matches the CPU pyvm on the same K/V pages (skips without a CUDA GPU + nvcc)."""
import pytest

from tests.gpu.marks import KERNEL

pytestmark = KERNEL


@pytest.mark.parametrize("model,batch,ctx,splits", [("tiny-llama", 1, 700, 1), ("tiny-llama", 3, 520, 2),
                                                    ("tiny-qwen3", 2, 600, 1), ("tiny-qwen3", 1, 300, 3)])
def test_long_context_attention_matches_pyvm(model, batch, ctx, splits, gpu_check):
    res = []
    r = gpu_check.check_long_context(model, batch, ctx, splits, res)
    assert r["ok"], r


@pytest.mark.parametrize("model,batch,ctx", [("tiny-llama", 3, 700), ("tiny-qwen3", 2, 450)])
def test_long_context_grouped_attention_matches_pyvm(model, batch, ctx, gpu_check, monkeypatch):
    """MPK_ATT_GROUPS=2: several passes per group, the second group's first rows in flight during the first
    group's last pass and merge (sequences of different lengths)."""
    monkeypatch.setenv("MPK_ATT_DIRECT", "1")
    monkeypatch.setenv("MPK_ATT_GROUPS", "2")
    res = []
    r = gpu_check.check_long_context(model, batch, ctx, 1, res)
    assert r["ok"], r


@pytest.mark.parametrize("model,batch,ctx,splits", [("tiny-qwen3-d128", 2, 600, 1)])
def test_long_context_wide_heads_narrow_passes_match_pyvm(model, batch, ctx, splits, gpu_check, monkeypatch):
    """128-wide heads (tiny-qwen3-d128: qwen3-8b's head dim and GQA group) with the default pass width, narrow for
    them (tasks/tiling.attn_wide: wide passes are for heads <= 64). Several passes per split, sequences of
    different lengths."""
    monkeypatch.delenv("MPK_ATT_WIDE", raising=False)
    res = []
    r = gpu_check.check_long_context(model, batch, ctx, splits, res)
    assert r["ok"], r


@pytest.mark.parametrize("model,batch,ctx,ps", [("tiny-llama-g8", 2, 2100, 2), ("tiny-llama", 2, 520, 12)])
def test_long_context_page_tables_and_page_sizes_match_pyvm(model, batch, ctx, ps, gpu_check):
    """Page size 2 at ~2100 keys: page tables of > ATT_MAX_PAGES (1024) entries, which attention reads from global
    memory (the lean issue loop's second table path); page size 12: not a power of two, the general issue loop."""
    from mpk_runtime.codegen.layout import CONSTANTS
    assert ps != 2 or -(-(ctx + 16) // ps) > CONSTANTS["ATT_MAX_PAGES"]   # the global-table path is the one run
    res = []
    r = gpu_check.check_long_context(model, batch, ctx, 1, res, ps=ps)
    assert r["ok"], r


@pytest.mark.parametrize("groups,batch,ctx,want", [("4", 3, 700, [4]), ("8", 2, 600, [8]), ("", 128, 520, [8])])
def test_attention_tasks_of_up_to_every_group_of_a_sequence_match_pyvm(groups, batch, ctx, want, gpu_check,
                                                                       monkeypatch):
    """tiny-llama-g8 (llama-3.2-1b's 32 q heads over 8 KV heads of 64): tasks of 4 and 8 KV groups (16 and 32 q
    heads, the q area's ATT_MAX_QH), asked for and chosen by the auto rule at 1024 (sequence, group) units,
    sequences of different lengths, several passes per group."""
    monkeypatch.setenv("MPK_ATT_DIRECT", "1")
    monkeypatch.setenv("MPK_ATT_GROUPS_MAX", "8")   # (the auto rule's cap: the default since session 23)
    if groups:
        monkeypatch.setenv("MPK_ATT_GROUPS", groups)
    else:
        monkeypatch.delenv("MPK_ATT_GROUPS", raising=False)
    res = []
    r = gpu_check.check_long_context("tiny-llama-g8", batch, ctx, 1, res)
    assert r["attn_groups_per_task"] == want and r["ok"], r
