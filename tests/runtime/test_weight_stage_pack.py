"""Weight staging (codegen/layout.py TASK_HEADER "stage"): which tasks get weight rows copied into shared memory
while they wait, where, and how many, as the packer writes them and the kernel reads them
(megakernel.cu stage_task_weights re-derives the rows' addresses from the record; mirrored here)."""
import pytest
import torch

from mpk_runtime.codegen import layout as L
from mpk_runtime.ir.build import build_graph
from mpk_runtime.models.config import load_config
from mpk_runtime.models.weights import get_weights
from mpk_runtime.runtime.packer import L_OPCODE, TaskPacker
from mpk_runtime.runtime.memory import KVStore, RankMemory
from mpk_runtime.tasks.build import build_task_graphs
from mpk_runtime.tasks.tiling import Tiling

_CACHE = {}


def _rig(model, batch):
    if (model, batch) not in _CACHE:
        cfg = load_config(model)
        g = build_graph(cfg, mode="decode", batch=batch, context_len=0, max_seq_len=64, tp=1, rank=0, attn_splits=2,
                        dtype="bfloat16")
        tg = build_task_graphs([g], Tiling(num_sms=8))[0]
        kv = KVStore(cfg.num_layers, batch * 4 + 1, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
        _CACHE[model, batch] = (cfg, tg, RankMemory(g, get_weights(model, cfg, seed=0, dtype="bfloat16"), kv))
    return _CACHE[model, batch]


def _pack(model, batch, stage_smem, stage_ops="."):
    cfg, tg, mem = _rig(model, batch)
    p = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu", stage_smem=stage_smem, stage_ops=stage_ops)
    tasks = p.pack()[0]
    return tg, p, tasks


def _kernel_ranges(row):
    """The staged rows' global addresses as stage_task_weights computes them from the record (bytes per row)."""
    a = lambda k, n: int(row[L.arg_index(k, n)])   # noqa: E731
    op = int(row[L.TASK_HEADER.index("opcode")])
    if op == L_OPCODE["linear"]:
        K = a("linear", "k")
        return [w + a("linear", "n0") * K * 2 for w in (a("linear", "w0"), a("linear", "w1")) if w], K * 2
    K, D, r0 = a("qkv_rope", "k"), a("qkv_rope", "d"), a("qkv_rope", "r0")
    return [a("qkv_rope", "w") + r0 * K * 2, a("qkv_rope", "w") + (D // 2 + r0) * K * 2], K * 2


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("batch", [1, 2])
def test_batch1_tiles_stage_their_weights_above_their_own_shared_memory(model, batch):
    stage = 224 * 1024
    tg, p, tasks = _pack(model, batch, stage)
    staged = 0
    for t in tg.tasks:
        row = tasks[t.id]
        word = int(row[L.TASK_HEADER.index("stage")])
        if t.kind not in ("linear", "qkv_rope"):
            assert word == 0, t.kind
            continue
        assert word != 0, (t.kind, t.op)   # CUDA-core tiles at batch <= 2: every one is staged
        rows, off = L.unpack_stage(word)
        need, off2, rows2, nbytes = p.stage_info[t.id]
        assert (rows, off) == (rows2, off2)
        assert off % 128 == 0 and off >= need and off + nbytes <= p.smem <= stage
        # the kernel's addresses are the packer's weight ranges (prefetch table), rows from their start
        addrs, row_bytes = _kernel_ranges(row)
        pf = p.prefetch[t.id].tolist()
        assert addrs == [pf[2 * j] for j in range(len(addrs))]
        assert nbytes == rows * row_bytes * len(addrs)
        assert rows <= pf[1] // row_bytes and (rows == pf[1] // row_bytes or rows % 2 == 0)
        staged += nbytes
    assert staged == p.staged_bytes > 0


def test_a_small_budget_stages_an_even_prefix_and_zero_turns_it_off():
    tg, full, _ = _pack("tiny-llama", 1, 224 * 1024)
    t = max((t for t in tg.tasks if t.id in full.stage_info), key=lambda t: full.stage_info[t.id][3])
    need, off, rows, nbytes = full.stage_info[t.id]
    assert rows >= 4
    row_bytes = nbytes // rows // (2 if t.kind == "qkv_rope" or t.params.get("epilogue") == "silu_mul" else 1)
    nr = nbytes // (rows * row_bytes)
    budget = off + 3 * nr * row_bytes + 64          # room for 3 rows: an even prefix of 2
    _, p, tasks = _pack("tiny-llama", 1, budget)
    assert p.stage_info[t.id][2] == 2
    assert L.unpack_stage(int(tasks[t.id, L.TASK_HEADER.index("stage")])) == (2, off)
    _, p0, tasks0 = _pack("tiny-llama", 1, 0)
    assert p0.staged_bytes == 0 and not tasks0[:, L.TASK_HEADER.index("stage")].any()


def test_tensor_core_tiles_are_not_staged():
    tg, p, tasks = _pack("tiny-llama", 8, 224 * 1024)
    for t in tg.tasks:
        if t.kind == "linear" and int(tasks[t.id, L.arg_index("linear", "tc_rows")]) > 0:
            assert int(tasks[t.id, L.TASK_HEADER.index("stage")]) == 0


def test_default_stages_the_tiles_that_wait_on_attention_within_the_graphs_own_shared_memory():
    """STAGE_AUTO: the budget is the shared memory the graph needs anyway (the launch's L1 carveout is unchanged);
    the default op choice: tasks waiting on attention (o_proj), whose SMs idle while attention runs."""
    for model in ("tiny-llama", "tiny-qwen3"):
        tg, off, _ = _pack(model, 1, 0)
        _, p, tasks = _pack(model, 1, L.STAGE_AUTO, stage_ops="")
        assert p.smem == off.smem and p.staged_bytes > 0
        staged = {tg.tasks[i].op.split(".", 1)[1] for i in p.stage_info}
        assert staged == {"o_proj"}, staged
        for i, (need, o, rows, nbytes) in p.stage_info.items():
            assert o + nbytes <= off.smem


def test_stage_word_round_trip_and_bad_values():
    assert L.unpack_stage(L.pack_stage(37, 128 * 300)) == (37, 128 * 300)
    assert L.pack_stage(0, 0) == 0
    with pytest.raises(ValueError, match="128-aligned"):
        L.pack_stage(3, 100)
    with pytest.raises(ValueError, match="227 KiB"):
        TaskPacker(*_rig("tiny-llama", 1)[1:], 0x6000, 64, device="cpu", stage_smem=300 * 1024)


def test_the_stage_budget_variable_says_what_it_takes(monkeypatch):
    monkeypatch.setenv("MPK_STAGE_KB", "lots")
    with pytest.raises(ValueError, match="expected 'auto' or kilobytes"):
        L._env_kb("MPK_STAGE_KB", "0")
    monkeypatch.setenv("MPK_STAGE_KB", "400")
    with pytest.raises(ValueError, match="at most 227 KB"):
        L._env_kb("MPK_STAGE_KB", "0")
    monkeypatch.setenv("MPK_STAGE_KB", "auto")
    assert L._env_kb("MPK_STAGE_KB", "0") == L.STAGE_AUTO


def test_a_cap_stages_at_most_its_bytes_per_task_and_comes_from_the_environment(monkeypatch):
    """MPK_STAGE_CAP_KB: each staged task's rows, all ranges together, fit the cap (even rows unless the whole range
    fits); a cap below one row of each range stages nothing for that task. Read when a packer is made, like
    MPK_STAGE_KB (packer settings: the build does not change)."""
    tg, full, _ = _pack("tiny-llama", 1, 224 * 1024)
    row = {t: full.stage_info[t][3] // full.stage_info[t][2] for t in full.stage_info}   # bytes a row, ranges together
    cap = 4 * min(row.values())
    p = TaskPacker(*_rig("tiny-llama", 1)[1:], 0x6000, 64, device="cpu", stage_smem=224 * 1024, stage_ops=".",
                   stage_cap=cap)
    p.pack()
    assert p.stage_info and p.staged_bytes < full.staged_bytes
    for t, (need, off, rows, nbytes) in p.stage_info.items():
        assert nbytes <= cap and nbytes == rows * row[t]
        assert rows == min(full.stage_info[t][2], cap // row[t]) or rows == (cap // row[t]) & ~1
    for t in full.stage_info:
        if row[t] > cap:
            assert t not in p.stage_info
    monkeypatch.setenv("MPK_STAGE_CAP_KB", "64")
    monkeypatch.setenv("MPK_STAGE_KB", "auto")
    q = TaskPacker(*_rig("tiny-llama", 1)[1:], 0x6000, 64, device="cpu")
    assert (q.stage_cap, q.stage_smem) == (64 * 1024, L.STAGE_AUTO)
    monkeypatch.setenv("MPK_STAGE_CAP_KB", "-1")
    with pytest.raises(ValueError, match="MPK_STAGE_CAP_KB"):
        TaskPacker(*_rig("tiny-llama", 1)[1:], 0x6000, 64, device="cpu")


def test_staging_settings_are_not_build_constants():
    """The kernel reads only the stage word: the staging budget and cap must not change the build's cache key."""
    from mpk_runtime.codegen import header
    text = header.generate_header()
    assert "STAGE_SMEM" not in text and "STAGE_CAP" not in text and "STAGE_SMEM" not in L.CONSTANTS


def test_qwen2_qkv_tasks_carry_their_heads_bias_and_need_the_bias_build():
    """A qkv_rope task's bias word is the address of its own head's (D,) bias row (q, k or v, by head), and the
    packer asks for the -DMPK_QKV_BIAS=1 build, which the default (bias-free) graphs never do."""
    tg, p, tasks = _pack("tiny-qwen2", 2, 0)
    cfg, _, mem = _rig("tiny-qwen2", 2)
    D = cfg.head_dim
    assert "MPK_QKV_BIAS" in p.needs
    seen = set()
    for t in tg.tasks:
        if t.kind != "qkv_rope":
            continue
        b = mem.t(f"model.layers.{t.params['layer']}.self_attn.{t.params['which']}_proj.bias")
        assert int(tasks[t.id][L.arg_index("qkv_rope", "bias")]) == b.data_ptr() + t.params["head"] * D * 2
        seen.add(t.params["which"])
    assert seen == {"q", "k", "v"}
    assert "MPK_QKV_BIAS" not in _pack("tiny-llama", 2, 0)[1].needs
