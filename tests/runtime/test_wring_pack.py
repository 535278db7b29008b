"""Per-warp weight page rings (runtime/wring.py, a -DMPK_WRING build): which tiles read their weights from the rings,
where the rings sit in shared memory, and that each warp's segments, cut into pages as the kernel cuts them and read
in order, are exactly its rows of every ring tile of its SM (device_kernels/ops/wring.cuh consumes them in that order; tests/gpu/test_wring.py checks the
kernel's sums bitwise against the global-memory path)."""
import ctypes

import pytest
import torch

from mpk_runtime.codegen import layout as L
from mpk_runtime.ir.build import build_graph
from mpk_runtime.models.config import load_config
from mpk_runtime.models.weights import get_weights
from mpk_runtime.runtime import wring
from mpk_runtime.runtime.memory import KVStore, RankMemory
from mpk_runtime.runtime.packer import L_OPCODE, TaskPacker
from mpk_runtime.tasks.build import build_task_graphs
from mpk_runtime.tasks.tiling import Tiling

STAGE = L.TASK_HEADER.index("stage")


def _pack(monkeypatch, model, batch, defines, ring=None):
    monkeypatch.setenv("MPK_NVCC_DEFINES", defines)
    cfg = load_config(model)
    g = build_graph(cfg, mode="decode", batch=batch, context_len=0, max_seq_len=64, tp=1, rank=0, attn_splits=2,
                    dtype="bfloat16")
    tg = build_task_graphs([g], Tiling(num_sms=8))[0]
    kv = KVStore(cfg.num_layers, batch * 4 + 1, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    mem = RankMemory(g, get_weights(model, cfg, seed=0, dtype="bfloat16"), kv)
    p = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu", stage_smem=0, ring=ring)
    return tg, p, p.pack()[0]


def _rows(row):
    """(n0, n1, K, w0, w1) of a ring tile from its record: a linear tile's rows [n0, n1) of w0 / w1; a qkv_rope
    part's pairs [r0, r0 + nr) of the head's first half rows (w) and of its second half (w + D/2 rows)."""
    if int(row[L.TASK_HEADER.index("opcode")]) == L_OPCODE["linear"]:
        a = lambda n: int(row[L.arg_index("linear", n)])   # noqa: E731
        return a("n0"), a("n1"), a("k"), a("w0"), a("w1")
    a = lambda n: int(row[L.arg_index("qkv_rope", n)])   # noqa: E731
    K = a("k")
    return a("r0"), a("r0") + a("nr"), K, a("w"), a("w") + a("d") // 2 * K * 2


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("defines", ["-DMPK_WRING=16 -DMPK_RING_SLOT=512", "-DMPK_WRING=24 -DMPK_RING_SLOT=96"])
@pytest.mark.parametrize("ops", ["", "o_proj,down,qkv_rope"])
def test_each_warps_pages_are_its_rows_of_every_ring_tile_in_order(monkeypatch, model, defines, ops):
    monkeypatch.setenv("MPK_RING_OPS", ops)
    tg, p, tasks = _pack(monkeypatch, model, 1, defines)
    cfg = p.ring_cfg
    assert cfg is not None and cfg.slots >= 1
    # batch 1: every linear tile is a CUDA-core one, and every qkv_rope part is served too (of the ops MPK_RING_OPS
    # names, where it names any)
    ring = {t.id for t in tg.tasks if t.kind in ("linear", "qkv_rope")
            and (not ops or t.op.split(".")[-1] in ops.split(","))}
    assert p.ring_tasks == ring and ring
    if ops:
        assert {t.op.split(".")[-1] for t in tg.tasks if t.id in ring} == set(ops.split(","))
    for t in tg.tasks:
        assert int(tasks[t.id, STAGE]) & ~(1 << L.RING_CLOB_SHIFT) == (1 << L.RING_SHIFT if t.id in ring else 0), \
            t.label()
    # the rings sit right above the ring tiles' own layouts; the tasks whose layouts reach past that clobber them
    _tg, plain, _ = _pack(monkeypatch, model, 1, defines, ring=False)
    _check_placement(tg, p, plain, tasks)
    nw = wring.NWARPS
    offs = p.ring_offs.tolist()
    assert len(offs) == tg.num_sms * nw + 1 and offs[0] == 0 and offs[-1] == p.ring_segs.shape[0]
    covered = {tid: 0 for tid in ring}
    for sm, lst in enumerate(tg.sm_lists):
        for w in range(nw):
            segs = p.ring_segs[offs[sm * nw + w]:offs[sm * nw + w + 1]].tolist()
            assert all(nb > 0 for _a, _b, nb, _g in segs)
            # the pages the kernel cuts from them (wring.cuh ring_issue: parts of slot / weights bytes, in order)
            pages = [pg for s0, s1, nb, _pad in segs for pg in wring.pages((s0, s1, nb), cfg.slot)]
            got0, got1 = b"", b""
            want0, want1 = b"", b""
            for tid in lst:
                if tid not in ring:
                    continue
                n0, n1, K, w0, w1 = _rows(tasks[tid])
                ra, rb = L.ring_rows(n0, n1, w, nw)
                if ra < rb:
                    covered[tid] += rb - ra
                    want0 += ctypes.string_at(w0 + ra * K * 2, (rb - ra) * K * 2)
                    want1 += ctypes.string_at(w1 + ra * K * 2, (rb - ra) * K * 2) if w1 else b""
            for s0, s1, nb in pages:
                assert 0 < nb <= cfg.slot // (2 if s1 else 1) and nb % 16 == 0 and s0 % 16 == 0
                got0 += ctypes.string_at(s0, nb)
                got1 += ctypes.string_at(s1, nb) if s1 else b""
            assert got0 == want0 and got1 == want1, (sm, w)
    for tid in ring:   # the warps' blocks cover each tile's rows once
        n0, n1 = _rows(tasks[tid])[:2]
        assert covered[tid] == n1 - n0
    # and the protocol, gates included, neither hangs nor has a copy in flight while a clobbering task runs
    assert wring.replay(tg.sm_lists, p.ring_args, p.ring_clobbers, p.ring_segs, p.ring_offs, cfg, nsteps=3) > 0


def _check_placement(tg, p, plain, tasks):
    """The rings start at the first 128-byte boundary above every ring tile's own layout (measured on the packer's
    `_need` calls, task by task); every other task whose layout reaches past that start carries RING_CLOB_SHIFT and
    no other does; the launch's shared memory is the larger of the layouts' and the rings' end."""
    own = _pack_needs(p)
    ring_top = max(own.get(tid, 0) for tid in p.ring_tasks)
    assert p.ring_off == (ring_top + 127) // 128 * 128
    clob = {t.id for t in tg.tasks if t.id not in p.ring_tasks and own.get(t.id, 0) > p.ring_off}
    assert p.ring_clobbers == clob
    for t in tg.tasks:
        assert bool(int(tasks[t.id, STAGE]) >> L.RING_CLOB_SHIFT & 1) == (t.id in clob), t.label()
    assert p.smem == max(plain.smem, p.ring_off + p.ring_cfg.nbytes)


def _pack_needs(p):
    """Each task's own shared bytes, recorded from the packer's `_need` calls on a repack of the same graph."""
    needs: dict[int, int] = {}
    q = TaskPacker(p.tg, p.mem, 0x6000, p.D, device="cpu", stage_smem=0, ring=False)
    orig = q._need

    def rec(nbytes, q=q):
        orig(nbytes)
        needs[q._task.id] = max(needs.get(q._task.id, 0), int(nbytes))
    q._need = rec
    q.pack()
    return needs


def _pack_real(monkeypatch, model, defines, ring=None):
    """A real model's batch-1 graph at its real shapes, cut to two layers (every layer packs alike), on 132 SMs
    with 8 attention splits (the megakernel's batch-1 default), weights allocated but never written."""
    import dataclasses
    from mpk_runtime.models.weights import weight_shapes
    monkeypatch.setenv("MPK_NVCC_DEFINES", defines)
    cfg = dataclasses.replace(load_config(model), num_layers=2)
    g = build_graph(cfg, mode="decode", batch=1, context_len=0, max_seq_len=1024, tp=1, rank=0, attn_splits=8,
                    dtype="bfloat16")
    tg = build_task_graphs([g], Tiling(num_sms=132))[0]
    kv = KVStore(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    w = {k: torch.empty(sh, dtype=torch.bfloat16) for k, sh in weight_shapes(cfg).items()}
    p = TaskPacker(tg, RankMemory(g, w, kv), 0x6000, cfg.head_dim, device="cpu", stage_smem=0, ring=ring)
    return tg, p, p.pack()[0]


@pytest.mark.parametrize("model,defines,ops", [
    ("llama-3.2-1b", "-DMPK_WRING=128", "o_proj,down,qkv_rope"),      # gpu_pending.sh wring's g128s
    ("llama-3.2-1b", "-DMPK_WRING=112 -DMPK_RING_SLOT=3584", ""),      # g112: every op, the LM head's rows below
    ("qwen3-8b", "-DMPK_WRING=112 -DMPK_RING_SLOT=3584", "o_proj,down,qkv_rope"),
])
def test_real_shapes_rings_fit_inside_attention_and_gate_on_it(monkeypatch, model, defines, ops):
    """At the real batch-1 shapes the rings fit inside the shared memory attention's layout takes anyway (the launch
    asks for no more than without them: session 29's rings above every layout shrank L1 and lost), every attention
    task clobbers them, and the replayed protocol neither hangs nor lets a copy land in a running attention task."""
    monkeypatch.setenv("MPK_RING_OPS", ops)
    tg, p, tasks = _pack_real(monkeypatch, model, defines)
    _tg, plain, _ = _pack_real(monkeypatch, model, defines, ring=False)
    assert p.ring_tasks and p.smem == plain.smem
    _check_placement(tg, p, plain, tasks)
    att = {t.id for t in tg.tasks if t.kind in ("attn_partial", "attn_merge")}
    assert att and att <= p.ring_clobbers
    assert wring.replay(tg.sm_lists, p.ring_args, p.ring_clobbers, p.ring_segs, p.ring_offs, p.ring_cfg) > 0
    # without the gates the same rings would land pages in attention's buffers while it runs: the replay says so
    segs, offs = wring.lay_out(tg.sm_lists, p.ring_args)
    with pytest.raises(AssertionError, match="in flight while task"):
        wring.replay(tg.sm_lists, p.ring_args, p.ring_clobbers, segs, offs, p.ring_cfg)


def test_only_batch1_cuda_core_tiles_read_the_rings(monkeypatch):
    tg, p, tasks = _pack(monkeypatch, "tiny-llama", 4, "-DMPK_WRING=16 -DMPK_RING_SLOT=512")
    assert p.ring_tasks == set() and p.ring_off == 0   # batch 4: Tensor Core tiles
    assert all(int(tasks[t.id, STAGE]) == 0 for t in tg.tasks)


def test_the_switch_and_its_errors(monkeypatch):
    _tg, p, _ = _pack(monkeypatch, "tiny-llama", 1, "-DMPK_WRING=16 -DMPK_RING_SLOT=512", ring=False)
    assert p.ring_tasks == set() and p.ring_cfg is None   # the same build, every row from global memory
    _tg, p, _ = _pack(monkeypatch, "tiny-llama", 1, "")
    assert p.ring_tasks == set()                           # the default build has no rings
    with pytest.raises(ValueError, match="MPK_WRING"):
        _pack(monkeypatch, "tiny-llama", 1, "", ring=True)
    with pytest.raises(ValueError, match="no 4096-byte page slot"):
        _pack(monkeypatch, "tiny-llama", 1, "-DMPK_WRING=16")
    monkeypatch.setenv("MPK_RING_OPS", "o_proj,attention")
    with pytest.raises(ValueError, match=r"MPK_RING_OPS names \['attention'\]"):
        _pack(monkeypatch, "tiny-llama", 1, "-DMPK_WRING=16 -DMPK_RING_SLOT=512")
    monkeypatch.delenv("MPK_RING_OPS")
    with pytest.raises(ValueError, match="multiple of 16"):
        _pack(monkeypatch, "tiny-llama", 1, "-DMPK_WRING=16 -DMPK_RING_SLOT=40")


@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen3-8b"])
def test_quiet_rings_issue_nothing_during_attention(monkeypatch, model):
    """MPK_RING_QUIET=1: the tasks that wait on attention (o_proj's tiles) open the gates when they start, so an SM
    has no ring copy in flight from its last tile before attention until then (the replay asserts it at each
    opener), on the SMs without an attention task too; the rings serve down and qkv_rope there."""
    monkeypatch.setenv("MPK_RING_OPS", "down,qkv_rope")
    monkeypatch.setenv("MPK_RING_QUIET", "1")
    tg, p, tasks = _pack_real(monkeypatch, model, "-DMPK_WRING=112 -DMPK_RING_SLOT=4096"
                              if model == "qwen3-8b" else "-DMPK_WRING=128")
    o_proj = {t.id for t in tg.tasks if t.op.endswith("o_proj")}
    assert o_proj and p.ring_openers == o_proj and not (p.ring_openers & p.ring_clobbers)
    for t in tg.tasks:
        assert bool(int(tasks[t.id, STAGE]) >> L.RING_OPEN_SHIFT & 1) == (t.id in o_proj), t.label()
    assert wring.replay(tg.sm_lists, p.ring_args, p.ring_clobbers, p.ring_segs, p.ring_offs, p.ring_cfg,
                        openers=p.ring_openers) > 0
    # the same rings without the openers' gates keep copies in flight into attention on the other SMs
    segs, offs = wring.lay_out(tg.sm_lists, p.ring_args, p.ring_clobbers)
    with pytest.raises(AssertionError, match="in flight before opener"):
        wring.replay(tg.sm_lists, p.ring_args, p.ring_clobbers, segs, offs, p.ring_cfg, openers=p.ring_openers)
    monkeypatch.setenv("MPK_RING_QUIET", "yes")
    with pytest.raises(ValueError, match="MPK_RING_QUIET"):
        _pack_real(monkeypatch, model, "-DMPK_WRING=128")
