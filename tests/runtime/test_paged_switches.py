"""The paged attention kernel's switches (runtime/paged_attention.py): the row-keys walk, the merge over used splits,
the appends through the cache, the head-major grid and the grouped heads, each against its other side (bit for bit
where the programs compute the same sums) under Triton's interpreter, and the values each switch takes. The kernel
against the reference: test_paged_attention.py, whose cases these share."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mpk_runtime.runtime import paged_attention as pa
from tests.runtime.test_paged_attention import SHAPES_SHORT, _short_rows_case, _short_rows_under, interp


def test_head_group(monkeypatch):
    """MPK_PAGED_HEADS=group: the largest power of two of KV heads dividing nkv whose q rows fit 16 (all: 64); one
    head under "one" (the default) and with appends substituted from registers."""
    monkeypatch.setenv("MPK_PAGED_HEADS", "group")
    for G, nkv, want in ((4, 8, 4), (4, 2, 2), (1, 4, 4), (1, 32, 16), (8, 8, 2), (16, 8, 1), (32, 8, 1), (3, 2, 2),
                         (4, 1, 1), (4, 6, 2)):
        assert pa.head_group(G, nkv) == want, (G, nkv)
    assert pa.head_group(4, 8, register_appends=True) == 1
    monkeypatch.setenv("MPK_PAGED_HEADS", "all")
    for G, nkv, want in ((4, 8, 8), (4, 2, 2), (1, 32, 32), (8, 8, 8), (16, 8, 4), (32, 8, 2), (4, 6, 2)):
        assert pa.head_group(G, nkv) == want, (G, nkv)
    monkeypatch.setenv("MPK_PAGED_HEADS", "one")
    assert pa.head_group(4, 8) == 1
    monkeypatch.delenv("MPK_PAGED_HEADS")
    assert pa.head_group(4, 8) == 1


def test_launch_shape_follows_the_head_group(monkeypatch):
    """launch_shape: one head a program -> the config's keys a step and B x nkv programs' splits; a group of 4 ->
    a quarter of the keys a step (the same tile rows), B x nkv / 4 programs, so more splits; q rows padded to 16."""
    cfg = pa.PagedAttnConfig(128, 528, 4, 1)
    assert pa.launch_shape(32, 32, 8, 4097, cfg) == (1, 16, 128, 3)
    monkeypatch.setenv("MPK_PAGED_HEADS", "group")
    assert pa.launch_shape(32, 32, 8, 4097, cfg) == (4, 16, 32, 9)
    assert pa.launch_shape(32, 32, 8, 4097, cfg, register_appends=True) == (1, 16, 128, 3)
    monkeypatch.setenv("MPK_PAGED_HEADS", "all")
    assert pa.launch_shape(128, 32, 8, 4097, cfg) == (8, 32, 16, 5)
    assert pa.launch_shape(128, 32, 8, 4097, cfg, heads="one") == (1, 16, 128, 1)   # the argument over the switch


@interp
@pytest.mark.parametrize("S,cfg", SHAPES_SHORT)
def test_row_keys_stop_is_bitwise_the_full_walk_interpreter(monkeypatch, S, cfg):
    """MPK_PAGED_ROW_KEYS=stop stops each program at its row's last key block: the output, the appended cache rows
    (and so the split partials the merge read) are the full walk's, bit for bit; the config's field does the same."""
    q, kc, vc, bt, pos, new, L, _, _ = _short_rows_case()
    outs = _short_rows_under(monkeypatch, "MPK_PAGED_ROW_KEYS", ("cap", "stop"), S, cfg)
    for a, b in zip(outs["cap"], outs["stop"]):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    assert torch.isfinite(outs["stop"][0]).all() and torch.equal(outs["stop"][0][1], torch.zeros_like(q[1]))
    monkeypatch.delenv("MPK_PAGED_ROW_KEYS")
    out = torch.empty_like(q)
    pa.paged_decode_attention(q, kc.clone(), vc.clone(), bt, pos, 0.25, L, out, S, kv_new=new,
                              config=dataclasses.replace(cfg or pa.PagedAttnConfig(), row_keys="stop"))
    assert torch.equal(out, outs["stop"][0])


@interp
@pytest.mark.parametrize("mode", pa.ROW_KEYS)
@pytest.mark.parametrize("S,cfg", [s for s in SHAPES_SHORT if s[0] > 1])
def test_used_splits_is_bitwise_the_full_merge_interpreter(monkeypatch, S, cfg, mode):
    """MPK_PAGED_USED_SPLITS=1: the merge reads only the splits holding its row's keys and the others store nothing
    (their partial buffers are NaN here, so reading one would show): the output and the appended rows are the full
    merge's, bit for bit, in every MPK_PAGED_ROW_KEYS mode; the inactive row still gets zeros."""
    q = _short_rows_case()[0]
    monkeypatch.setenv("MPK_PAGED_ROW_KEYS", mode)
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real(*a, **k).fill_(float("nan")))
    outs = _short_rows_under(monkeypatch, "MPK_PAGED_USED_SPLITS", ("0", "1"), S, cfg)
    assert torch.isfinite(outs["1"][0]).all() and torch.equal(outs["1"][0][1], torch.zeros_like(q[1]))
    for a, b in zip(outs["0"], outs["1"]):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())


@interp
@pytest.mark.parametrize("used", ["0", "1"])
@pytest.mark.parametrize("mode", pa.ROW_KEYS)
@pytest.mark.parametrize("S,cfg", SHAPES_SHORT)
def test_append_through_the_cache_is_bitwise_the_register_path_interpreter(monkeypatch, S, cfg, mode, used):
    """MPK_PAGED_APPEND=cache: the program owning a row's new key writes it into the cache and reads it back like
    any key (no per-block substitution): the output and the appended rows are the default's, bit for bit, in every
    row-keys mode and split count, with MPK_PAGED_USED_SPLITS either way; the inactive row gets zeros."""
    q = _short_rows_case()[0]
    monkeypatch.setenv("MPK_PAGED_ROW_KEYS", mode)
    monkeypatch.setenv("MPK_PAGED_USED_SPLITS", used)
    outs = _short_rows_under(monkeypatch, "MPK_PAGED_APPEND", ("regs", "cache"), S, cfg)
    assert torch.isfinite(outs["cache"][0]).all() and torch.equal(outs["cache"][0][1], torch.zeros_like(q[1]))
    for a, b in zip(outs["regs"], outs["cache"]):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())


@interp
@pytest.mark.parametrize("mode", pa.ROW_KEYS)
@pytest.mark.parametrize("S,cfg", SHAPES_SHORT)
def test_head_major_grid_is_bitwise_the_row_major_interpreter(monkeypatch, S, cfg, mode):
    """MPK_PAGED_GRID=head launches the same programs with the KV head as the fastest index: the output and the
    appended rows are the row-major grid's, bit for bit, in every row-keys mode and split count."""
    monkeypatch.setenv("MPK_PAGED_ROW_KEYS", mode)
    outs = _short_rows_under(monkeypatch, "MPK_PAGED_GRID", ("row", "head"), S, cfg)
    for a, b in zip(outs["row"], outs["head"]):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())


@interp
@pytest.mark.parametrize("S,cfg", SHAPES_SHORT)
def test_int32_page_tables_are_bitwise_the_int64_ones_interpreter(S, cfg):
    """int32 page tables (what MPK_PAGED_TABLE=i32 hands the kernel): the same page indices, so the output and the
    appended rows are the int64 tables' bit for bit."""
    q, kc, vc, bt, pos, new, L, _, _ = _short_rows_case()
    outs = {}
    for dt in (torch.int64, torch.int32):
        kc2, vc2, out = kc.clone(), vc.clone(), torch.zeros_like(q)
        pa.paged_decode_attention(q, kc2, vc2, bt.to(dt), pos, 0.25, L, out, S, kv_new=new, config=cfg)
        outs[dt] = (out, kc2, vc2)
    for a, b in zip(outs[torch.int64], outs[torch.int32]):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())


@interp
def test_int32_page_tables_in_a_whole_step_interpreter(monkeypatch):
    """A whole conventional step under MPK_PAGED_TABLE=i32: the int32 copy is made once a step (not once a layer)
    and the step's logits, tokens and caches are the int64 tables' bit for bit."""
    import tests.runtime.test_conventional_op_count as oc
    seen = []
    real = pa.paged_decode_attention
    monkeypatch.setattr(pa, "paged_decode_attention", lambda q, kc, vc, bt, *a, **k: seen.append(bt) or
                        real(q, kc, vc, bt, *a, **k))
    res = {}
    for t in pa.TABLES:
        monkeypatch.setenv("MPK_PAGED_TABLE", t)
        seen.clear()
        cfg, g, mem, ex, ctx = oc.build("tiny-llama", 3, context=70, dtype="float32", greedy=True)
        ex.run([ctx])
        assert len(seen) == cfg.num_layers and all(b is seen[0] for b in seen)          # one table for every layer
        assert seen[0].dtype == (torch.int32 if t == "i32" else torch.int64)
        res[t] = (mem.t("logits").clone(), mem.t("next_tokens").clone(), [c.clone() for c in mem.kvstore.k])
    assert torch.equal(res["i64"][0], res["i32"][0]) and torch.equal(res["i64"][1], res["i32"][1])
    assert all(torch.equal(a, b) for a, b in zip(res["i64"][2], res["i32"][2]))


def test_table_type_follows_the_launch_shape_unless_forced(monkeypatch):
    """MPK_PAGED_TABLE=auto (the default): the page tables' type is the launch shape's (TUNED's nearest point), int32
    where the shape names none; i32 / i64 force one type everywhere. The points: llama-3.2-1b B=8 ctx 4096 (int32:
    session 43's -7.3% step), qwen3-8b B=128 ctx 512 (int32: -15% on the op), qwen3-8b B=8 ctx 4096 (int64) and
    qwen3-8b at TP=2 B=32 (4 KV heads: 128 programs, nearest to B=8's int64 points; int32 measured +6..+25%)."""
    monkeypatch.delenv("MPK_PAGED_TABLE", raising=False)
    monkeypatch.delenv("MPK_PAGED_SHAPE", raising=False)
    pts = {(64, 8, 8, 8192): torch.int32, (128, 128, 8, 1024): torch.int32, (128, 8, 8, 8192): torch.int64,
           (128, 32, 4, 1024): torch.int64, (128, 32, 4, 4096): torch.int64, (128, 32, 4, 8192): torch.int64}
    for (D, B, nkv, L), want in pts.items():
        c = pa.config_for(D, B, nkv, L)
        assert pa.table_dtype_for(D, B, nkv, L) == want == (torch.int64 if c.table == "i64" else torch.int32)
    monkeypatch.setenv("MPK_PAGED_SHAPE", "64,528,4,2")   # a forced shape names no type: int32
    assert pa.table_dtype_for(128, 8, 8, 8192) == torch.int32
    monkeypatch.delenv("MPK_PAGED_SHAPE")
    for v, want in (("i32", torch.int32), ("i64", torch.int64)):
        monkeypatch.setenv("MPK_PAGED_TABLE", v)
        assert all(pa.table_dtype_for(*p) == want for p in pts)


@interp
def test_auto_tables_in_a_whole_step_interpreter(monkeypatch):
    """Under MPK_PAGED_TABLE=auto the conventional step hands every layer the one table of the type config_for's shape
    names (a head-dim-64 tiny model: int32), converted once a step, and the step is the int64 step bit for bit."""
    import tests.runtime.test_conventional_op_count as oc
    seen = []
    real = pa.paged_decode_attention
    monkeypatch.setattr(pa, "paged_decode_attention", lambda q, kc, vc, bt, *a, **k: seen.append(bt) or
                        real(q, kc, vc, bt, *a, **k))
    res = {}
    for t in ("auto", "i64"):
        monkeypatch.setenv("MPK_PAGED_TABLE", t)
        seen.clear()
        cfg, g, mem, ex, ctx = oc.build("tiny-llama", 3, context=70, dtype="float32", greedy=True)
        ex.run([ctx])
        assert len(seen) == cfg.num_layers and all(b is seen[0] for b in seen)
        want = pa.config_for(cfg.head_dim, 3, cfg.num_kv_heads, seen[0].shape[1] * 16).table
        assert seen[0].dtype == (torch.int64 if t == "i64" or want == "i64" else torch.int32)
        res[t] = (mem.t("logits").clone(), mem.t("next_tokens").clone())
    assert torch.equal(res["auto"][0], res["i64"][0]) and torch.equal(res["auto"][1], res["i64"][1])


@pytest.mark.gpu
@pytest.mark.skipif(pa.triton is None or not torch.cuda.is_available(), reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize("B,nq,nkv,D,L", [(8, 32, 8, 64, 4097), (8, 32, 8, 128, 4097), (32, 32, 8, 64, 513)])
def test_int32_page_tables_are_bitwise_the_int64_ones_gpu(B, nq, nkv, D, L):
    """The compiled kernels (another binary for each table type: 160 / 128 registers at llama B=8, 4096 keys) at the
    models' shapes under a serving cap, bf16, with appends: the same output and appended rows bit for bit."""
    from tests.runtime.test_paged_attention import case
    cap = 1 << (L - 1).bit_length()
    q, kc, vc, bt, pos = case(B, nq, nkv, D, 16, L, torch.bfloat16, dev="cuda")
    bt = torch.cat([bt, torch.zeros(B, cap // 16 - bt.shape[1], dtype=bt.dtype, device="cuda")], 1)
    new = torch.randn(B, 2 * nkv * D, device="cuda").to(torch.bfloat16)
    outs = {}
    for dt in (torch.int64, torch.int32):
        kc2, vc2, out = kc.clone(), vc.clone(), torch.zeros_like(q)
        pa.paged_decode_attention(q, kc2, vc2, bt.to(dt), pos, D ** -0.5, cap, out, kv_new=new)
        outs[dt] = (out, kc2, vc2)
    assert all(torch.equal(a, b) for a, b in zip(outs[torch.int64], outs[torch.int32]))


@pytest.mark.parametrize("var,read,table,bad,msg", [
    ("MPK_PAGED_ROW_KEYS", pa.row_keys, (("", "split"), ("cap", "cap"), ("stop", "stop"), ("split", "split")), "1",
     "expected one of cap, stop, split .unset: split"),
    ("MPK_PAGED_USED_SPLITS", pa.used_splits, (("", True), ("0", False), ("1", True)), "yes",
     "expected 1 .on. or 0 .off."),
    ("MPK_PAGED_APPEND", pa.append_cache, (("", True), ("regs", False), ("cache", True)), "1",
     "expected one of regs, cache .unset: cache"),
    ("MPK_PAGED_GRID", pa.grid_order, (("", "row"), ("row", "row"), ("head", "head")), "kv",
     "expected one of row, head .unset: row"),
    ("MPK_PAGED_HEADS", pa.heads_mode, (("", "one"), ("one", "one"), ("group", "group"), ("all", "all")), "8",
     "expected one of one, group, all .unset: one"),
    ("MPK_PAGED_TABLE", pa.table_choice, (("", "auto"), ("auto", "auto"), ("i64", "i64"), ("i32", "i32")), "int32",
     "expected one of auto, i64, i32 .unset: auto")])
def test_switch_values(monkeypatch, var, read, table, bad, msg):
    """The paged kernel's switches: each value, unset = the default, anything else an error naming the switch."""
    for v, want in table:
        monkeypatch.setenv(var, v)
        assert read() == want and type(read()) is type(want)
    monkeypatch.setenv(var, bad)
    with pytest.raises(ValueError, match=f"{var}='{bad}': {msg}"):
        read()


@interp
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_grouped_heads_in_a_whole_step_interpreter(monkeypatch, model):
    """A whole conventional step (deferred appends into the kernel) with a program per group of KV heads
    (MPK_PAGED_HEADS=group / all, the kernel taking more than one head a program here) against one a head: the same
    tokens, logits and caches to fp32 rounding (layer 0's appended rows bit for bit)."""
    import tests.runtime.test_conventional_op_count as oc
    hgs = []
    real = pa.head_group
    monkeypatch.setattr(pa, "head_group", lambda *a, **k: hgs.append(real(*a, **k)) or hgs[-1])
    res = {}
    for heads in pa.HEADS:
        monkeypatch.setenv("MPK_PAGED_HEADS", heads)
        cfg, g, mem, ex, ctx = oc.build(model, 3, context=70, dtype="float32", greedy=True)
        ex.run([ctx])
        res[heads] = (mem.t("logits").clone(), mem.t("next_tokens").clone(),
                      [c.clone() for c in mem.kvstore.k], [c.clone() for c in mem.kvstore.v])
    assert hgs and max(hgs) > 1 and min(hgs) == 1
    lo, to, ko, vo = res["one"]
    for heads in ("group", "all"):
        lg, tg, kg, vg = res[heads]
        torch.testing.assert_close(lg, lo, rtol=1e-5, atol=1e-5)
        assert torch.equal(tg, to)
        # layer 0's appended rows come before any attention: bit for bit; later layers' from its output, to rounding
        assert torch.equal(kg[0], ko[0]) and torch.equal(vg[0], vo[0])
        for a, b in zip(kg + vg, ko + vo):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
