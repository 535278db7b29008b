"""runtime/paged_attention.py (decode attention straight from the KV pages, Triton; opt-in MPK_CONV_TRITON_ATTN=1)
against a per-row reference and against the conventional path's gather + SDPA attention. On a CPU it runs under the
Triton interpreter where Triton is installed (`pip install triton`, TRITON_INTERPRET=1; the interpreter has no bf16,
so fp32 / fp16 stand in); CI's CPU torch has no Triton, so there these skip. The gpu-marked tests run it compiled."""
from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

from mpk_runtime.runtime import paged_attention as pa

interp = pytest.mark.skipif(pa.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                            reason="needs Triton's interpreter (pip install triton; TRITON_INTERPRET=1)")


def reference(q, kc, vc, bt, pos, scale):
    """Row by row, head by head: softmax over the keys [0, pos + 1) gathered through the block table (fp32)."""
    B = pos.numel()
    _, PS, nkv, D = kc.shape
    nq = q.shape[1] // D
    out = torch.zeros(B, nq * D)
    for b in range(B):
        L = int(pos[b]) + 1
        if L <= 0:
            continue
        keys = torch.arange(L)
        pg, sl = bt[b].cpu()[keys // PS], keys % PS
        K, V = kc.cpu()[pg, sl].float(), vc.cpu()[pg, sl].float()
        for h in range(nq):
            s = (K[:, h // (nq // nkv)] @ q.cpu()[b].view(nq, D)[h].float()) * scale
            out[b, h * D:(h + 1) * D] = torch.softmax(s, 0) @ V[:, h // (nq // nkv)]
    return out


def case(B, nq, nkv, D, PS, L, dtype, dev="cpu", poison=False, seed=0, pos=None):
    """pos: each row's last key (-1: inactive); default L - 1 - 3b with row 1 inactive. Poisoning follows it."""
    g = torch.Generator().manual_seed(seed)
    pps = -(-L // PS)
    kc = torch.randn(B * pps + 1, PS, nkv, D, generator=g).to(dtype)
    vc = torch.randn(B * pps + 1, PS, nkv, D, generator=g).to(dtype)
    bt = (torch.randperm(B * pps, generator=g) + 1).view(B, pps)
    if pos is None:
        pos = torch.tensor([L - 1 - 3 * b for b in range(B)])
        if B > 1:
            pos[1] = -1                              # an inactive row: zeros
    if poison:                                       # every slot past a row's keys NaN (KVStore(poison=True))
        for b in range(B):
            for k in range(max(0, int(pos[b]) + 1), pps * PS):
                kc[bt[b, k // PS], k % PS] = float("nan")
                vc[bt[b, k // PS], k % PS] = float("nan")
    q = torch.randn(B, nq * D, generator=g).to(dtype)
    return [t.to(dev) for t in (q, kc, vc, bt, pos)]


SHAPES = [  # B, nq, nkv, D, page, L_cap, splits (None: the rule), dtype, tol
    (3, 8, 2, 16, 16, 40, None, torch.float32, 1e-5),
    (2, 4, 4, 32, 4, 70, 3, torch.float32, 1e-5),      # MHA, small pages, 3 splits
    (2, 6, 2, 16, 8, 33, 1, torch.float32, 1e-5),      # g = 3 (padded to 16 rows), one split
    (4, 8, 2, 16, 16, 130, None, torch.float16, 2e-3),
]


@interp
@pytest.mark.parametrize("heads", pa.HEADS)
@pytest.mark.parametrize("B,nq,nkv,D,PS,L,S,dtype,tol", SHAPES)
def test_paged_decode_attention_interpreter(monkeypatch, B, nq, nkv, D, PS, L, S, dtype, tol, heads):
    """Against the reference, both ways of giving programs their KV heads (MPK_PAGED_HEADS: one, or a group of
    them, here 2 / 4 / 2 / 2 / 2 heads: MHA, g = 3, g = 4)."""
    monkeypatch.setenv("MPK_PAGED_HEADS", heads)
    for poison in (False, True):
        q, kc, vc, bt, pos = case(B, nq, nkv, D, PS, L, dtype, poison=poison)
        out = torch.empty_like(q)
        pa.paged_decode_attention(q, kc, vc, bt, pos, 1 / math.sqrt(D), L, out, S)
        ref = reference(q, kc, vc, bt, pos, 1 / math.sqrt(D))
        assert torch.isfinite(out).all()
        assert (out.float() - ref).abs().max() < tol, (poison, (out.float() - ref).abs().max())
        assert (out[1] == 0).all() if B > 1 else True


def test_tuned_config_lookup():
    """config_for: the measured point nearest in log2 (programs, keys) of the head dim; the default elsewhere."""
    assert pa.config_for(64, 32, 8, 512) == pa.TUNED[(64, 256, 512)]
    assert pa.config_for(64, 1, 8, 300) == pa.TUNED[(64, 64, 512)]          # below the grid: its corner
    assert pa.config_for(128, 128, 8, 8192) == pa.TUNED[(128, 1024, 4096)]
    assert pa.config_for(128, 32, 4, 3000) == pa.TUNED[(128, 64, 4096)] or \
        pa.config_for(128, 32, 4, 3000) == pa.TUNED[(128, 256, 4096)]       # 128 programs: between two points
    assert pa.config_for(256, 8, 8, 512) == pa.DEFAULT_CONFIG                # a head dim never measured
    assert pa.splits_for(8, 8, 512, 128, 1056) == 4                          # 1056 programs wanted, 4 blocks of 128


def test_a_forced_shape_replaces_the_tuned_ones(monkeypatch):
    """$MPK_PAGED_SHAPE (the step-level A/B of a launch shape): every call takes it, whatever the head dim or point;
    a malformed value is an error that says the format, never a silent fallback."""
    monkeypatch.setenv("MPK_PAGED_SHAPE", "32,264,4,3,ahead")
    want = pa.PagedAttnConfig(32, 264, 4, 3, idx_ahead=True)
    assert pa.config_for(128, 32, 8, 4096) == want and pa.config_for(64, 1, 8, 300) == want
    assert pa.config_for(256, 8, 8, 512) == want
    monkeypatch.setenv("MPK_PAGED_SHAPE", " 128, 528, 4, 1 ")
    assert pa.config_for(64, 32, 8, 4096) == pa.PagedAttnConfig(128, 528, 4, 1)
    monkeypatch.setenv("MPK_PAGED_SHAPE", "64,528,4,2,i64")   # the page tables' type, last (session 43)
    assert pa.config_for(64, 32, 8, 4096) == pa.PagedAttnConfig(64, 528, 4, 2, table="i64")
    monkeypatch.setenv("MPK_PAGED_SHAPE", "32,264,4,3,ahead,i32")
    assert pa.config_for(128, 8, 8, 512) == pa.PagedAttnConfig(32, 264, 4, 3, idx_ahead=True, table="i32")
    for bad in ("32,264,4", "48,264,4,3", "32,264,3,3", "32,264,4,0", "32,264,4,3,behind", "a,b,c,d", "32,264,4,i32",
                "32,264,4,3,i32,ahead", "32,264,4,3,int32"):
        monkeypatch.setenv("MPK_PAGED_SHAPE", bad)
        with pytest.raises(ValueError, match="MPK_PAGED_SHAPE.*block_n,target_programs,warps,stages"):
            pa.config_for(64, 32, 8, 512)
    monkeypatch.setenv("MPK_PAGED_SHAPE", "")
    assert pa.config_for(64, 32, 8, 512) == pa.TUNED[(64, 256, 512)]


@interp
def test_a_forced_shape_gives_the_same_attention_interpreter(monkeypatch):
    """A forced shape no TUNED entry has (16-key blocks, indices read ahead), taken by a call without a config
    argument: the same attention as the reference."""
    B, nq, nkv, D, PS, L = 3, 8, 2, 16, 16, 150
    q, kc, vc, bt, pos = case(B, nq, nkv, D, PS, L, torch.float32)
    ref = reference(q, kc, vc, bt, pos, 0.25)
    monkeypatch.setenv("MPK_PAGED_SHAPE", "16,64,4,1,ahead")
    out = torch.empty_like(q)
    pa.paged_decode_attention(q, kc, vc, bt, pos, 0.25, L, out)
    assert (out - ref).abs().max() < 1e-5


@interp
@pytest.mark.parametrize("heads", pa.HEADS)
@pytest.mark.parametrize("config", [pa.PagedAttnConfig(32, 1056, 4, 2), pa.PagedAttnConfig(128, 264, 8, 3),
                                    pa.PagedAttnConfig(32, 264, 4, 3, idx_ahead=True)])
def test_paged_decode_attention_configs_interpreter(monkeypatch, config, heads):
    """Other launch shapes (keys a step, splits, warps) give the same attention, appends included, with a program
    per KV head or per group of them."""
    monkeypatch.setenv("MPK_PAGED_HEADS", heads)
    B, nq, nkv, D, PS, L = 3, 8, 2, 16, 16, 150
    q, kc, vc, bt, pos = case(B, nq, nkv, D, PS, L, torch.float32)
    ref = reference(q, kc, vc, bt, pos, 0.25)
    out = torch.empty_like(q)
    pa.paged_decode_attention(q, kc, vc, bt, pos, 0.25, L, out, config=config)
    assert (out - ref).abs().max() < 1e-5
    for S in (1, 3):   # several blocks a program (the index prefetch crosses blocks), and split ends
        pa.paged_decode_attention(q, kc, vc, bt, pos, 0.25, L, out, S, config=config)
        assert (out - ref).abs().max() < 1e-5, S


def _short_rows_case():
    """Rows far shorter than the key cap (199, 6 and 71 keys of 200) and an inactive one, NaN-poisoned slots past
    each row, deferred appends; and the reference on the cache with the new rows written first."""
    B, nq, nkv, D, PS, L = 4, 8, 2, 16, 16, 200
    q, kc, vc, bt, _ = case(B, nq, nkv, D, PS, L, torch.float32, poison=True)
    pos = torch.tensor([199, -1, 5, 70])
    new = torch.randn(B, 2 * nkv * D, generator=torch.Generator().manual_seed(1))
    kc2, vc2 = kc.clone(), vc.clone()
    for b in range(B):
        p = int(pos[b])
        if p >= 0:
            kc2[bt[b, p // PS], p % PS] = new[b, :nkv * D].view(nkv, D)
            vc2[bt[b, p // PS], p % PS] = new[b, nkv * D:].view(nkv, D)
    return q, kc, vc, bt, pos, new, L, reference(q, kc2, vc2, bt, pos, 0.25), (kc2, vc2)


def _short_rows_under(monkeypatch, var, values, S, cfg):
    """{value: (out, k cache, v cache)} of _short_rows_case's attention with appends, one run per value of `var`."""
    q, kc, vc, bt, pos, new, L, _, _ = _short_rows_case()
    outs = {}
    for v in values:
        monkeypatch.setenv(var, v)
        kc2, vc2, out = kc.clone(), vc.clone(), torch.zeros_like(q)
        pa.paged_decode_attention(q, kc2, vc2, bt, pos, 0.25, L, out, S, kv_new=new, config=cfg)
        outs[v] = (out, kc2, vc2)
    return outs


SHAPES_SHORT = [(1, None), (4, None), (13, None), (3, pa.PagedAttnConfig(32, 264, 4, 3, idx_ahead=True))]


@interp
@pytest.mark.parametrize("heads", pa.HEADS)
@pytest.mark.parametrize("mode", pa.ROW_KEYS)
@pytest.mark.parametrize("S,cfg", SHAPES_SHORT)
def test_rows_far_shorter_than_the_key_cap_interpreter(monkeypatch, S, cfg, mode, heads):
    """The key cap is the longest row's (a captured graph's static bound); a short row's blocks past its length,
    and a split with none of its keys, contribute nothing (NaN-poisoned slots past each row stay out), appends
    included: the result equals the reference on the cache with the new rows written first, each new row is
    appended once in its slot, the inactive row gets zeros. For every MPK_PAGED_ROW_KEYS (split: another partition
    of the same sums, to fp32 rounding), with a program per KV head or per group of them (MPK_PAGED_HEADS: the
    group's owner appends every head's row)."""
    q, kc, vc, bt, pos, new, L, ref, (kc_ref, vc_ref) = _short_rows_case()
    monkeypatch.setenv("MPK_PAGED_ROW_KEYS", mode)
    monkeypatch.setenv("MPK_PAGED_HEADS", heads)
    kc2, vc2, out = kc.clone(), vc.clone(), torch.empty_like(q)
    pa.paged_decode_attention(q, kc2, vc2, bt, pos, 0.25, L, out, S, kv_new=new, config=cfg)
    assert torch.isfinite(out).all() and (out - ref).abs().max() < 1e-5, (S, (out - ref).abs().max())
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for got, want in ((kc2, kc_ref), (vc2, vc_ref)):
        assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())


@interp
def test_head_dims_the_kernel_cannot_take_fall_back(monkeypatch):
    """A head dim that is not a power of two >= 16 (e.g. 24 here, 80 / 96 in some models) takes the gather + SDPA
    path: a whole step with the switch on gives the switch-off step's logits, tokens and caches, and never calls
    the kernel (which would raise on it). (That path appending deferred rows itself: test_kv_defer.py.)"""
    import tests.runtime.test_conventional_op_count as oc
    real_load = oc.load_config
    monkeypatch.setattr(oc, "load_config", lambda name: real_load(name).replace(head_dim=24))
    assert not pa.supports_head_dim(24) and pa.supports_head_dim(16) and not pa.supports_head_dim(8)
    calls = []
    real = pa.paged_decode_attention
    monkeypatch.setattr(pa, "paged_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    res = {}
    for on in ("1", "0"):
        monkeypatch.setenv("MPK_CONV_TRITON_ATTN", on)
        cfg, g, mem, ex, ctx = oc.build("tiny-llama", 3, context=70, dtype="float32", greedy=True)
        assert cfg.head_dim == 24
        ex.run([ctx])
        res[on] = (mem.t("logits").clone(), mem.t("next_tokens").clone(), [c.clone() for c in mem.kvstore.k + mem.kvstore.v])
    assert not calls
    torch.testing.assert_close(res["1"][0], res["0"][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(res["1"][1], res["0"][1])
    assert all(torch.equal(a, b) for a, b in zip(res["1"][2], res["0"][2]))


def test_splits_rule_and_bad_input():
    assert pa.splits_for(1, 8, 512) == 8           # 264 programs wanted, 8 blocks of keys
    assert pa.splits_for(128, 8, 4096) == 1
    assert pa.splits_for(8, 8, 100) == 2           # capped by the 2 blocks of 64 keys
    if pa.triton is None:
        with pytest.raises(RuntimeError, match="Triton"):
            pa.paged_decode_attention(*case(2, 4, 2, 16, 16, 20, torch.float32)[:4], torch.zeros(2), 0.25, 20,
                                      torch.zeros(2, 64))
        return
    q, kc, vc, bt, pos = case(2, 4, 2, 16, 16, 20, torch.float32)
    with pytest.raises(ValueError, match="heads"):
        pa.paged_decode_attention(q, kc, vc, bt, pos, 0.25, 20, torch.empty(2, 63))
    with pytest.raises(ValueError, match="power of two"):
        pa.paged_decode_attention(q[:, :48], kc[..., :12], vc[..., :12], bt, pos, 0.25, 20, torch.empty(2, 48))


def _conv_step(monkeypatch, model, on, dev, dtype, B=3):
    from tests.runtime.test_conventional_op_count import build
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", on)
    cfg, g, mem, ex, ctx = build(model, B, context=70, dtype=dtype, dev=dev, greedy=True)
    ex.run([ctx])
    return mem.t("logits").float().clone(), mem.t("next_tokens").clone()


@interp
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_conventional_step_through_paged_attention(model, monkeypatch):
    """A whole conventional decode step with the switch on gives the gather + SDPA path's logits and tokens (fp32),
    and takes the kernel (counted)."""
    calls = []
    real = pa.paged_decode_attention
    monkeypatch.setattr(pa, "paged_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    l_on, t_on = _conv_step(monkeypatch, model, "1", "cpu", "float32")
    assert calls, "MPK_CONV_TRITON_ATTN=1 did not route the conventional attention to the kernel"
    n = len(calls)
    l_off, t_off = _conv_step(monkeypatch, model, "0", "cpu", "float32")
    assert len(calls) == n
    torch.testing.assert_close(l_on, l_off, rtol=1e-4, atol=1e-4)
    assert torch.equal(t_on, t_off)


@pytest.mark.gpu
@pytest.mark.skipif(pa.triton is None or not torch.cuda.is_available(), reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize("B,nq,nkv,D,PS,L", [(8, 32, 8, 64, 16, 513), (32, 32, 8, 128, 16, 4097), (3, 8, 2, 16, 16, 40)])
def test_paged_decode_attention_gpu(B, nq, nkv, D, PS, L):
    q, kc, vc, bt, pos = case(B, nq, nkv, D, PS, L, torch.bfloat16, dev="cuda", poison=True)
    out = torch.empty_like(q)
    pa.paged_decode_attention(q, kc, vc, bt, pos, 1 / math.sqrt(D), L, out)
    ref = reference(q, kc, vc, bt, pos, 1 / math.sqrt(D))
    assert torch.isfinite(out).all() and (out.float().cpu() - ref).abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(pa.triton is None or not torch.cuda.is_available(), reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize("D,L", [(64, 2048), (128, 2048)])
def test_row_keys_gpu(D, L, monkeypatch):
    """The compiled kernel (not the interpreter), a serving-style cap (the power of two above the longest row) with
    rows of 1025 / 700 / 3 keys and an inactive one, bf16, the tuned launch shape: MPK_PAGED_ROW_KEYS=stop gives the
    full walk's output and appended rows bit for bit; split the same appended rows and the reference's attention."""
    B, nq, nkv, PS = 32, 32, 8, 16
    # poisoned past these rows (session 39: the rows were set after a case poisoned for its own, so row 1's 699 keys
    # were NaN and the reference NaN; the kernel turns a NaN row into zeros, as it does an inactive one)
    q, kc, vc, bt, pos = case(B, nq, nkv, D, PS, L, torch.bfloat16, dev="cuda", poison=True,
                              pos=torch.tensor([1024, 699, 2, -1] * (B // 4)))
    new = torch.randn(B, 2 * nkv * D, device="cuda", dtype=torch.bfloat16)
    off = (("MPK_PAGED_USED_SPLITS", "0", "1"), ("MPK_PAGED_APPEND", "regs", "cache"),   # (switch, off, on)
           ("MPK_PAGED_GRID", "row", "head"))
    for var, no, _ in off:
        monkeypatch.setenv(var, no)
    got = {}
    for mode in ("cap", "stop", "split"):
        monkeypatch.setenv("MPK_PAGED_ROW_KEYS", mode)
        kc2, vc2, out = kc.clone(), vc.clone(), torch.empty_like(q)
        pa.paged_decode_attention(q, kc2, vc2, bt, pos, 1 / math.sqrt(D), L, out, kv_new=new)
        got[mode] = (out, kc2, vc2)
    same = lambda a, b: torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())  # noqa: E731
    # the merge over the used splits only, the appends read back through the cache, the head-major grid: bitwise,
    # every mode
    for var, no, val in off:
        monkeypatch.setenv(var, val)
        for mode in ("cap", "stop", "split"):
            monkeypatch.setenv("MPK_PAGED_ROW_KEYS", mode)
            kc2, vc2, out = kc.clone(), vc.clone(), torch.empty_like(q)
            pa.paged_decode_attention(q, kc2, vc2, bt, pos, 1 / math.sqrt(D), L, out, kv_new=new)
            assert all(same(a, b) for a, b in zip(got[mode], (out, kc2, vc2))), (var, mode)
        monkeypatch.setenv(var, no)
    assert all(same(a, b) for a, b in zip(got["cap"], got["stop"]))
    assert same(got["cap"][1], got["split"][1]) and same(got["cap"][2], got["split"][2])
    ref = reference(q, got["cap"][1], got["cap"][2], bt, pos, 1 / math.sqrt(D))
    for mode in ("cap", "split"):
        assert torch.isfinite(got[mode][0]).all() and (got[mode][0].float().cpu() - ref).abs().max() < 2e-2, mode
    # a program per group of KV heads (MPK_PAGED_HEADS=group / all, 4 / 8 here, with the cache appends): the same appended
    # rows, bit for bit, and the reference's attention (its key blocks differ, so its sums round differently)
    monkeypatch.setenv("MPK_PAGED_APPEND", "cache")
    for heads, mode in itertools.product(("group", "all"), ("cap", "stop", "split")):
        monkeypatch.setenv("MPK_PAGED_HEADS", heads)
        monkeypatch.setenv("MPK_PAGED_ROW_KEYS", mode)
        kc2, vc2, out = kc.clone(), vc.clone(), torch.empty_like(q)
        pa.paged_decode_attention(q, kc2, vc2, bt, pos, 1 / math.sqrt(D), L, out, kv_new=new)
        assert same(kc2, got[mode][1]) and same(vc2, got[mode][2]), (heads, mode)
        assert torch.isfinite(out).all() and (out.float().cpu() - ref).abs().max() < 2e-2, (heads, mode)


@pytest.mark.gpu
@pytest.mark.skipif(pa.triton is None or not torch.cuda.is_available(), reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_conventional_step_through_paged_attention_gpu(model, monkeypatch):
    """bf16 on a GPU: the step's logits are as near the fp32 step's as the gather + SDPA path's bf16 logits are.
    (Against each other they differ by bf16 rounding: session 27's first GPU run saw 4 of 1920 tiny-qwen3 logits
    0.03-0.046 apart, two roundings of the same sum, so the bound is on each one's error against fp32.)"""
    l_ref, _ = _conv_step(monkeypatch, model, "0", "cuda", "float32")
    l_on, t_on = _conv_step(monkeypatch, model, "1", "cuda", "bfloat16")
    l_off, t_off = _conv_step(monkeypatch, model, "0", "cuda", "bfloat16")
    e_on, e_off = (l_on - l_ref).abs(), (l_off - l_ref).abs()
    assert e_on.max() <= 1.5 * e_off.max() + 1e-3 and e_on.mean() <= 1.5 * e_off.mean() + 1e-4, (
        e_on.max(), e_off.max(), e_on.mean(), e_off.mean())


@interp
def test_deferred_rows_appended_by_the_kernel():
    """kv_new: the step's k / v rows, not yet in the cache (its slot at pos still NaN-poisoned): the output is what
    the reference gives with them in place, and afterwards they are in the cache, written once (by the split that
    holds pos); inactive rows write nothing."""
    B, nq, nkv, D, PS, L = 3, 8, 2, 16, 16, 70
    for S in (None, 1, 3):
        q, kc, vc, bt, pos = case(B, nq, nkv, D, PS, L, torch.float32, poison=True)
        g = torch.Generator().manual_seed(5)
        new = torch.randn(B, 2, nkv, D, generator=g)
        kc2, vc2 = kc.clone(), vc.clone()
        for b in range(B):   # the reference's cache: the rows in place
            if pos[b] >= 0:
                kc2[bt[b, pos[b] // PS], pos[b] % PS] = new[b, 0]
                vc2[bt[b, pos[b] // PS], pos[b] % PS] = new[b, 1]
        before = kc.clone()
        out = torch.empty_like(q)
        pa.paged_decode_attention(q, kc, vc, bt, pos, 1 / math.sqrt(D), L, out, S, kv_new=new.view(B, -1))
        ref = reference(q, kc2, vc2, bt, pos, 1 / math.sqrt(D))
        assert torch.isfinite(out).all() and (out - ref).abs().max() < 1e-5, S
        assert torch.equal(kc.nan_to_num(7.0), kc2.nan_to_num(7.0)) and torch.equal(vc.nan_to_num(7.0), vc2.nan_to_num(7.0))
        assert torch.equal(kc[bt[1]].nan_to_num(7.0), before[bt[1]].nan_to_num(7.0))   # row 1 inactive


def _two_steps(model, monkeypatch, flag):
    """One decode step of `model` (B=3, row 1 inactive, fp32) with every layer's appends deferred to the
    conventional attention (ir/defer.py), against the same step with qkv_rope appending: logits, tokens, caches."""
    from mpk_runtime.ir.defer import defer_kv_appends
    from mpk_runtime.runtime.torch_exec import ConventionalExecutor
    from tests.runtime.test_conventional_op_count import build
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "0")
    cfg, g, mem, ex, ctx = build(model, 3, context=70, dtype="float32", greedy=True)
    ex.run([ctx])
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", flag)
    cfg2, g2, mem2, _, ctx2 = build(model, 3, context=70, dtype="float32", greedy=True)
    gd = defer_kv_appends(g2, set(range(cfg2.num_layers)))
    ConventionalExecutor([gd], [mem2]).run([ctx2])
    torch.testing.assert_close(mem2.t("logits"), mem.t("logits"), rtol=1e-4, atol=1e-4)
    assert torch.equal(mem2.t("next_tokens"), mem.t("next_tokens"))
    sc = mem.kvstore.scratch   # the page inactive rows' appends go to when qkv_rope appends (the kernel skips them)
    for a, b in zip(mem.kvstore.k + mem.kvstore.v, mem2.kvstore.k + mem2.kvstore.v):
        torch.testing.assert_close(b[:sc], a[:sc], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_deferred_appends_gather_path(model, monkeypatch):
    """Without the kernel (switch off, or no Triton: what CI runs) a conventional attention holding deferred rows
    appends them itself before its gather: the same logits, tokens and caches as qkv_rope appending."""
    _two_steps(model, monkeypatch, "0")


@interp
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_deferred_appends_through_the_kernel(model, monkeypatch):
    _two_steps(model, monkeypatch, "1")
