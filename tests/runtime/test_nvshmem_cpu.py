"""CPU tests of the world-size > 1 megakernel contract: packing of multi-rank task graphs with fake peer base
addresses (peer slots, remote counters, system-scope waits), and the errors when NVSHMEM is unavailable."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mpk_runtime.codegen import layout as L
from mpk_runtime.ir.build import build_graph
from mpk_runtime.models.config import load_config
from mpk_runtime.runtime.packer import L_OPCODE, PeerTable, TaskPacker
from mpk_runtime.runtime.memory import KVStore, RankMemory
from mpk_runtime.runtime.pyvm_runner import shard_weights
from mpk_runtime.models.weights import get_weights
from mpk_runtime.tasks.build import build_task_graphs
from mpk_runtime.tasks.tiling import Tiling

W = 2
CTR = [0x7000_0000_0000, 0x7100_0000_0000]        # fake counter bases of rank 0 / rank 1 (as rank r sees them)


def _fake_sym_bases(mems, r):
    """Fake peer addresses: rank q's copy of sym `name` at 0x5q00_0000_0000 + its offset in q's memory."""
    out = {}
    for name in sorted(mems[r].syms):
        out[name] = [(0x5000_0000_0000 + (q << 40) + k * (1 << 24)) for k, q in
                     ((sorted(mems[r].syms).index(name), q) for q in range(W))]
        out[name][r] = mems[r].syms[name].data_ptr()
    return out


def _pack_tp(ll: bool = False):
    cfg = load_config("tiny-llama")
    full = get_weights("tiny-llama", cfg, seed=0, dtype="bfloat16")
    gs = [build_graph(cfg, mode="decode", batch=2, context_len=0, max_seq_len=64, tp=W, rank=r, attn_splits=2,
                      dtype="bfloat16", allreduce_ll=ll) for r in range(W)]
    tgs = build_task_graphs(gs, Tiling(num_sms=8))
    mems = []
    for r in range(W):
        kv = KVStore(cfg.num_layers, 9, 16, gs[r].tensors[[n for n in gs[r].tensors if n.endswith("k_cache")][0]].shape[2]
                     if False else 2, cfg.head_dim, torch.bfloat16)
        mems.append(RankMemory(gs[r], shard_weights(cfg, full, W, r), kv))
    out = []
    for r in range(W):
        table = PeerTable(r, W, [CTR[q] if q != r else 0x6000 for q in range(W)], _fake_sym_bases(mems, r))
        p = TaskPacker(tgs[r], mems[r], 0x6000, cfg.head_dim, peers=table, device="cpu")
        out.append((tgs[r], mems[r], table, p, p.pack()))
    return out


@pytest.fixture(scope="module")
def packed():
    return _pack_tp()


def test_ll_allreduce_packs_flag_words_and_no_remote_signals_from_the_pushes():
    """allreduce_ll: the push tiles store (fp32, flag) words (out_kind push_ll, twice the slot bytes) and signal no
    peer; the reduce tiles carry ll = 1 and do not wait on the pushes; the packer tells the Megakernel the build
    needs MPK_AR_LL (its own build then has it; the plain all-reduce's needs nothing)."""
    from mpk_runtime.codegen import nvcc
    for (tg, mem, table, p, (tasks, waits, signals, offs, flat)), (_, mem0, _t0, p0, _r) in zip(_pack_tp(True),
                                                                                               _pack_tp()):
        assert set(p.needs) == {"MPK_AR_LL"} and p0.needs == {}
        assert "-DMPK_AR_LL=1" in nvcc.build_flags(needs=p.needs)
        for t in tg.tasks:
            row = tasks[t.id]
            if t.kind == "linear" and t.params["push"]:
                assert int(row[L.arg_index("linear", "out_kind")]) == L.OUT_KINDS.index("push_ll")
                assert not any(r != tg.rank for r, _ in t.signals)
                name = t.params["out"]
                assert int(row[L.arg_index("linear", "par_stride")]) == 2 * mem0.syms[name][0].numel() * 4
            if t.kind == "allreduce":
                assert int(row[L.arg_index("allreduce", "ll")]) == 1
                prods = {tg.tasks[tid].kind for e, _ in t.waits for _r, tid in tg.events[e].producers}
                assert not any(tg.tasks[tid].params.get("push") for e, _ in t.waits
                               for _r, tid in tg.events[e].producers), prods


def test_ll_switch_is_checked(monkeypatch):
    """MPK_AR_LL builds graphs with the LL all-reduce (its kernel define then comes from the packer's needs:
    test_ll_allreduce_packs_flag_words_and_no_remote_signals_from_the_pushes); a value that is not a flag is refused."""
    monkeypatch.setenv("MPK_AR_LL", "maybe")
    with pytest.raises(ValueError, match="MPK_AR_LL='maybe'"):
        build_graph(load_config("tiny-llama"), tp=2, rank=0)


def test_remote_signals_point_at_peer_counters(packed):
    for tg, mem, table, p, (tasks, waits, signals, offs, flat) in packed:
        n_remote = 0
        for t in tg.tasks:
            row = tasks[t.id]
            b, e = int(row[L.TASK_HEADER.index("sig_begin")]), int(row[L.TASK_HEADER.index("sig_end")])
            assert e - b == len(t.signals)
            for (r, ev), word in zip(t.signals, signals[b:e].tolist()):
                if r == tg.rank:
                    assert word == 0x6000 + 8 * ev
                else:
                    n_remote += 1
                    assert word & L.SIGNAL_REMOTE_BIT
                    assert word & ~L.SIGNAL_REMOTE_BIT == CTR[r] + 8 * ev
        assert n_remote == sum(1 for t in tg.tasks for r, _ in t.signals if r != tg.rank) > 0


def test_waits_on_cross_rank_events_are_system_scope(packed):
    for tg, mem, table, p, (tasks, waits, *_rest) in packed:
        scope = L.WAIT_FIELDS.index("scope")
        assert waits.shape[1] == len(L.WAIT_FIELDS)
        seen = set()
        for t in tg.tasks:
            row = tasks[t.id]
            b, e = int(row[L.TASK_HEADER.index("wait_begin")]), int(row[L.TASK_HEADER.index("wait_end")])
            for (ev, lag), w in zip(t.waits, waits[b:e].tolist()):
                remote = any(r != tg.rank for r, _ in tg.events[ev].producers)
                assert w[0] == ev and w[2] == lag and w[scope] == int(remote)
                seen.add((t.kind, remote))
        assert ("allreduce", True) in seen and ("argmax_reduce", True) in seen


def test_push_tasks_carry_every_ranks_buffer(packed):
    for tg, mem, table, p, (tasks, *_rest) in packed:
        kinds = {"linear": L_OPCODE["linear"], "argmax_partial": L_OPCODE["argmax_partial"]}
        checked = 0
        for t in tg.tasks:
            row = tasks[t.id]
            if t.kind == "linear" and t.params["push"] or t.kind == "argmax_partial":
                name = t.params["out"] if t.kind == "linear" else t.params["part"]
                arr = p._peer_arrays[name]
                assert row[L.arg_index(t.kind, "peers")] == arr.data_ptr()
                assert row[L.arg_index(t.kind, "npeers")] == W
                assert arr.tolist() == table.syms[name]
                assert row[L.arg_index(t.kind, "slot")] == tg.rank
                s = mem.syms[name]
                assert row[L.arg_index(t.kind, "par_stride")] == s[0].numel() * 4   # one parity of (2, W, ...)
                assert int(row[0]) == kinds[t.kind]
                checked += 1
        assert checked > 0


def test_world_gt1_without_peer_table_is_a_clear_error(packed):
    tg, mem, *_ = packed[0]
    with pytest.raises(ValueError, match="PeerTable"):
        TaskPacker(tg, mem, 0x6000, 16)


def test_import_is_lazy_and_errors_say_what_to_do():
    code = ("import sys; import mpk_runtime, mpk_runtime.runtime.nvshmem as n, mpk_runtime.runtime.tp_launch; "
            "assert 'nvshmem' not in sys.modules and 'nvshmem.core' not in sys.modules; print('ok')")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "ok"
    code = ("import sys; sys.modules['nvshmem'] = None; sys.modules['nvshmem.core'] = None\n"
            "from mpk_runtime.runtime import nvshmem as n\n"
            "ok, why = n.available(); assert not ok and 'pip install nvshmem4py' in why, why\n"
            "try:\n    n.SymmetricHeap.init(b'x' * 128, 0, 2, 0)\nexcept n.NvshmemUnavailable as e:\n    print(e)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "nvshmem4py is not importable" in p.stdout


def test_safe_env_forces_multicast_off(monkeypatch):
    from mpk_runtime.runtime import nvshmem as n
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "0")
    n.safe_env()
    import os
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1" and os.environ["NCCL_NVLS_ENABLE"] == "0"


def _kernel_view(tasks, waits, signals, tid):
    """A task's waits and signals as megakernel.cu reads them: the inlined words first, then the tables from
    begin + (number inlined) to end."""
    row = tasks[tid].tolist()
    inl_w = [L.unpack_wait(w) for w in row[L.T_INLINE_WAIT:L.T_INLINE_WAIT + L.INLINE_WAITS] if w != 0]
    b, e = row[L.TASK_HEADER.index("wait_begin")], row[L.TASK_HEADER.index("wait_end")]
    ws = [tuple(w) for w in inl_w] + [tuple(w) for w in waits[b + len(inl_w):e].tolist()]
    inl_s = [s for s in row[L.T_INLINE_SIG:L.T_INLINE_SIG + L.INLINE_SIGNALS] if s != 0]
    b, e = row[L.TASK_HEADER.index("sig_begin")], row[L.TASK_HEADER.index("sig_end")]
    return ws, inl_s + signals[b + len(inl_s):e].tolist()


def _check_records(packs):
    many = 0
    for tg, (tasks, waits, signals, offs, flat) in packs:
        for lst in tg.sm_lists:
            walk = [lst[0]]
            for _ in range(2 * len(lst) - 1):
                walk.append(int(tasks[walk[-1], L.TASK_HEADER.index("next_task")]))
            assert walk == lst + lst
        for t in tg.tasks:
            ws, ss = _kernel_view(tasks, waits, signals, t.id)
            b, e = int(tasks[t.id, L.TASK_HEADER.index("wait_begin")]), int(tasks[t.id, L.TASK_HEADER.index("wait_end")])
            assert ws == [tuple(w) for w in waits[b:e].tolist()] and [w[0] for w in ws] == [ev for ev, _ in t.waits]
            b, e = int(tasks[t.id, L.TASK_HEADER.index("sig_begin")]), int(tasks[t.id, L.TASK_HEADER.index("sig_end")])
            assert ss == signals[b:e].tolist() and len(ss) == len(t.signals)
            many += len(t.waits) > L.INLINE_WAITS or len(t.signals) > L.INLINE_SIGNALS
    return many


def test_records_carry_next_task_and_inlined_waits_and_signals(packed, monkeypatch):
    """The kernel copies a task's successor record by `next_task` and reads the first waits / signals from the
    record: following the chain must walk each SM's list (wrapping to the next step's first task), and the
    inlined words plus the table remainder must be exactly the task's waits and signals, in order."""
    _check_records([(tg, pk) for tg, _m, _t, _p, pk in packed])
    # one inlined word each (as a -DMPK build of the GPU test does): tasks with two waits / signals overflow
    monkeypatch.setattr(L, "INLINE_WAITS", 1)
    monkeypatch.setattr(L, "INLINE_SIGNALS", 1)
    monkeypatch.setattr(L, "T_INLINE_SIG", L.ARG_END + 1)
    assert _check_records([(tg, p.pack()) for tg, _m, _t, p, _pk in packed]) > 0


def test_packed_wait_round_trips_and_rejects_what_does_not_fit():
    for w in [(0, 1, 0, 0), (123456, 264, 1, 1), ((1 << 32) - 1, (1 << 24) - 1, 63, 1)]:
        assert L.pack_wait(*w) != 0 and L.unpack_wait(L.pack_wait(*w)) == w
    for bad in [(1 << 32, 1, 0, 0), (0, 0, 0, 0), (0, 1 << 24, 0, 0), (0, 1, 64, 0), (0, 1, -1, 0)]:
        with pytest.raises(ValueError, match="packed record word"):
            L.pack_wait(*bad)
