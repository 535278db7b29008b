"""CPU tests of the pure parts of `scripts/bench_decode.py --tp 2` (scripts/_bench_tp.py) and `scripts/_tp_rig.py`: the TP gpt-fast
peer's sharding (TP=2 simulated by two threads with an in-process all-reduce equals TP=1), per-rank weight
bytes, the exposed-communication trace analysis, the store-based agreement and the rank loop's bookkeeping
(skips, a failing cell, the summary) with fake cells."""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import _bench_tp  # noqa: E402
import _tp_rig  # noqa: E402
import bench_decode  # noqa: E402

from mpk_runtime.models.config import load_config  # noqa: E402
from mpk_runtime.models.weights import weight_shapes  # noqa: E402


# ------------------------------------------------------------------------------------------- TP peer sharding
class ThreadComm:
    """all_reduce / all_gather between the threads of one process (world size = number of threads), summing in
    rank order; `reduce=False` makes a broken all-reduce (returns the local partial) to show the test can fail."""

    def __init__(self, world, rank, shared, reduce=True):
        self.world, self.rank, self.sh, self.reduce = world, rank, shared, reduce

    def _exchange(self, x):
        self.sh["slots"][self.rank] = x
        self.sh["barrier"].wait()
        xs = list(self.sh["slots"])
        self.sh["barrier"].wait()
        return xs

    def all_reduce(self, x):
        xs = self._exchange(x)
        if not self.reduce:
            return x
        out = xs[0]
        for y in xs[1:]:
            out = out + y
        return out

    def all_gather(self, x):
        return torch.cat(self._exchange(x), dim=0)


def _run_peer(cfg, tp, reduce=True, steps=3, B=2, ctx=5, max_ctx=16):
    """Per rank: per step (logits of this rank's vocab slice, tokens)."""
    shared = {"slots": [None] * tp, "barrier": threading.Barrier(tp)}
    out, errs = [None] * tp, []

    def rank_fn(r):
        try:
            comm = ThreadComm(tp, r, shared, reduce) if tp > 1 else None
            m = bench_decode.GptFast(cfg, B, max_ctx, tp=tp, rank=r, comm=comm, device="cpu", dtype=torch.float32)
            tok = torch.tensor([[3], [7]])[:B]
            ar = torch.arange(max_ctx)
            res = []
            with torch.no_grad():
                for i in range(steps):
                    p = ctx + i
                    pos, mask = torch.tensor([p]), (ar <= p).view(1, 1, 1, max_ctx)
                    lg = m.logits(tok, pos, mask)
                    tok = m.forward(tok, pos, mask)        # rewrites the same K/V at p, then the token
                    res.append((lg, tok.clone()))
            out[r] = res
        except BaseException as e:  # noqa: BLE001
            errs.append(e)
            shared["barrier"].abort()

    ths = [threading.Thread(target=rank_fn, args=(r,)) for r in range(tp)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    if errs:
        raise errs[0]
    return out


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_tp2_peer_equals_tp1(model):
    cfg = load_config(model)
    ref = _run_peer(cfg, 1)[0]
    tp2 = _run_peer(cfg, 2)
    for s, (lg1, tok1) in enumerate(ref):
        lg2 = torch.cat([tp2[0][s][0], tp2[1][s][0]], dim=-1)       # vocab-parallel slices, rank order
        torch.testing.assert_close(lg2, lg1, rtol=1e-4, atol=1e-5, msg=f"step {s}")
        assert torch.equal(tp2[0][s][1], tok1) and torch.equal(tp2[1][s][1], tok1), f"step {s} tokens"
    # the same check fails when the row-parallel partial sums are not all-reduced
    bad = _run_peer(cfg, 2, reduce=False, steps=1)
    assert not torch.allclose(torch.cat([bad[0][0][0], bad[1][0][0]], -1), ref[0][0], atol=1e-3)


def test_peer_argmax_ties_go_to_lowest_index():
    cfg = load_config("tiny-llama")
    m = bench_decode.GptFast(cfg, 1, 8, tp=2, rank=0, comm=object(), device="cpu", dtype=torch.float32)
    m.logits = lambda tok, pos, mask: torch.tensor([[[0.0, 2.0, 2.0, 1.0]]])   # rank 0's slice: max 2 at 1
    for other, want in ((2.0, 1), (3.0, 300), (1.0, 1)):   # "rank 1" reports (other, index 300)
        m.comm = type("C", (), {"all_gather": staticmethod(
            lambda x, v=other: torch.cat([x, torch.tensor([[[v, 300.0]]])]))})
        assert m.forward(None, None, None).item() == want, other


# ------------------------------------------------------------------------------------------- floors
@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen3-8b", "tiny-llama", "tiny-qwen3"])
def test_rank_weight_bytes(model):
    cfg = load_config(model)
    _, b1 = bench_decode.floor_ms(cfg)
    assert _tp_rig.rank_weight_bytes(cfg, 1, 0) == b1
    norms = sum(2 * s[0] for s in weight_shapes(cfg).values() if len(s) == 1)
    assert sum(_tp_rig.rank_weight_bytes(cfg, 2, r) for r in range(2)) == b1 + norms   # norms replicated
    fl, nb = _tp_rig.floor_ms_per_rank(cfg, 2, 4.55e12)
    assert nb == max(_tp_rig.rank_weight_bytes(cfg, 2, r) for r in range(2)) and fl == pytest.approx(nb / 4.55e9)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_peer_streams_the_floor_bytes(model):
    cfg = load_config(model)
    for r in range(2):
        m = bench_decode.GptFast(cfg, 1, 8, tp=2, rank=r, comm=object(), device="cpu")
        assert m.weight_bytes() == _tp_rig.rank_weight_bytes(cfg, 2, r)


# ------------------------------------------------------------------------------------------- comm analysis
def _synthetic():
    """SM 0: linear 0 then allreduce 1 (local producer 0); SM 1: linear 2 (a peer-independent task), other 3.
    Times in ns; 3 steps, step k offset by 10 us."""
    meta = {"rank": 0, "sm_lists": [[0, 1], [2, 3]], "kind": ["linear", "allreduce", "linear", "embed"],
            "op": ["L0.o", "L0.o.allreduce", "L0.q", "embed"], "label": ["a", "b", "c", "d"],
            "remote": [False, True, False, False], "local_preds": [[], [(0, 0)], [], []]}
    trace = []
    for k in range(3):
        o = 10_000 * k
        # linear 0: 1000-3000; allreduce waits until 7000 (remote partials), runs to 8000
        trace.append([[o + 1000, o + 3000], [o + 7000, o + 8000], [o + 1000, o + 2000], [o + 2500, o + 9000]])
    return trace, meta


def test_analyze_comm_synthetic():
    trace, meta = _synthetic()
    a = _tp_rig.analyze_comm(trace, meta)
    assert a["steps_analyzed"] == 2 and a["step_us"] == pytest.approx(10.0)
    k = a["kinds"]["allreduce"]
    assert k["tiles_per_step"] == 1 and k["ops_per_step"] == 1
    assert k["tile_us_sum"] == pytest.approx(1.0)                 # (a) 7000 -> 8000
    assert k["wait_us_mean"] == pytest.approx(4.0)                # (b) predecessor ends 3000, start 7000
    assert k["remote_wait_us_mean"] == pytest.approx(4.0)         # local producer also ended at 3000
    assert k["exposed_us"] == pytest.approx(5.0)                  # op end 8000 - local ready 3000
    assert k["exposed_frac_of_step"] == pytest.approx(0.5)
    # other tasks: 0 waits 3 us after the previous step's allreduce (8000 - 10000 + 1000 + ...), 2 waits 2 us
    # after the previous step's task 3, 3 waits 0.5 us after task 2
    assert a["other_tasks_wait_us_mean"] == pytest.approx((3.0 + 2.0 + 0.5) / 3)


def test_analyze_comm_remote_part_excludes_local_waits():
    trace, meta = _synthetic()
    for k in range(3):   # the local producer now ends late (6000): only 1 us of the 4 us wait is remote
        trace[k][0][1] = 10_000 * k + 6000
    a = _tp_rig.analyze_comm(trace, meta)["kinds"]["allreduce"]
    assert a["wait_us_mean"] == pytest.approx(1.0)                # predecessor on the SM (task 0) ends at 6000
    assert a["remote_wait_us_mean"] == pytest.approx(1.0)
    assert a["exposed_us"] == pytest.approx(2.0)                  # 8000 - 6000


def test_comm_meta_on_a_real_tp2_graph():
    from mpk_runtime.ir.build import build_graph
    from mpk_runtime.tasks.build import build_task_graphs
    from mpk_runtime.tasks.tiling import Tiling
    cfg = load_config("tiny-llama")
    gs = [build_graph(cfg, mode="decode", batch=1, context_len=16, max_seq_len=32, tp=2, rank=r, attn_splits=1,
                      dtype="bfloat16", **_tp_rig.graph_kwargs(2, 2)) for r in range(2)]
    tg = build_task_graphs(gs, Tiling(num_sms=8))[1]
    meta = _tp_rig.comm_meta(tg)
    kinds = {meta["kind"][t] for t, r in enumerate(meta["remote"]) if r}
    assert kinds == {"allreduce", "argmax_reduce"}
    for t, r in enumerate(meta["remote"]):
        if r and meta["kind"][t] == "allreduce":   # its local producers: this rank's row-parallel tiles of that op
            ops = {meta["op"][p] for p, _ in meta["local_preds"][t]}
            assert meta["op"][t].removesuffix(".allreduce") in ops
    # every SM runs its list back to back, 1 us per task: the analysis runs over the real structure
    trace = []
    for k in range(3):
        row = [[0, 0] for _ in tg.tasks]
        for sm, lst in enumerate(meta["sm_lists"]):
            for i, t in enumerate(lst):
                s = 1_000_000 * (k + 1) + 1000 * i
                row[t] = [s, s + 1000]
        trace.append(row)
    a = _tp_rig.analyze_comm(trace, meta)
    assert a["kinds"]["allreduce"]["ops_per_step"] == 2 * cfg.num_layers
    assert a["kinds"]["allreduce"]["wait_us_mean"] == pytest.approx(0.0)
    ch = _tp_rig.chrome_trace(trace, meta, steps=(1, 2))
    assert len(ch["traceEvents"]) == 2 * len(tg.tasks)
    assert any(e["args"].get("remote") for e in ch["traceEvents"])
    json.dumps(ch)


# ------------------------------------------------------------------------------------------- orchestration
def _threads(fn, n=2):
    out, errs = [None] * n, []

    def run(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ths = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    if errs:
        raise errs[0]
    return out


def test_store_sync():
    import torch.distributed as dist
    store = dist.PrefixStore("x", dist.HashStore())
    syncs = [_tp_rig.StoreSync(store, r, 2, timeout_s=10) for r in range(2)]
    got = _threads(lambda r: (syncs[r].bcast("a", "run" if r == 0 else None),
                              syncs[r].gather("b", {"r": r, "v": [r * 1.5]})))
    assert got[0] == got[1] == ("run", [{"r": 0, "v": [0.0]}, {"r": 1, "v": [1.5]}])


def test_rank_loop_records_skips_and_failures(tmp_path, monkeypatch):
    import time

    import torch.distributed as dist
    store = dist.PrefixStore("y", dist.HashStore())
    monkeypatch.setattr(_bench_tp, "_default_store", lambda d: store)
    monkeypatch.setattr(_bench_tp.gc, "collect", lambda *a: 0)   # 2 threads x 12 cells of full collections

    def mk(tctx, heap, cell, cfg, wts, opts):
        return dict(ms=1.0 + tctx.rank * 0.1, ms_min=0.9, comm={"rank": tctx.rank, "step_us": 1000.0,
                    "kinds": {"allreduce": {"tile_us_sum": 5.0, "wait_us_mean": 1.0, "remote_wait_us_mean": 0.5,
                                            "exposed_us": 100.0, "exposed_frac_of_step": 0.1, "ops_per_step": 32}}})

    def one(tctx, heap, cell, cfg, wts, opts):
        return dict(ms=1.5) if tctx.rank == 0 else None

    def peer(tctx, heap, cell, cfg, wts, opts):
        if tctx.rank == 1 and cell["model"] == "qwen3-8b":
            raise RuntimeError("boom on rank 1")
        return dict(ms=2.0, ms_pipelined=1.8)

    monkeypatch.setattr(_bench_tp, "CELL_FNS", {"megakernel_tp2": mk, "megakernel": one, "gptfast_tp2": peer})

    class Ctx:
        def __init__(self, r):
            self.rank, self.nranks = r, 2

        def heap(self):
            raise RuntimeError("no NVSHMEM in this test")

        def dist(self):
            return dist

    models = ["llama-3.2-1b", "qwen3-8b"]
    cells = _bench_tp.tp_cells(models, [1, 8], 512, {1}, {m: load_config(m).num_layers for m in models},
                                  peer_batches={1})
    assert [c["system"] for c in cells[:6]] == ["megakernel_tp2", "megakernel"] * 2 + ["gptfast_tp2"] * 2
    for c in cells[6:]:
        c["est_s"] = 1e6                                  # B=8: never fits
    opts = dict(t0=time.time(), steps_per_launch=8, launches=12, sync_timeout_s=30)
    rows_path = tmp_path / "rows.json"
    _threads(lambda r: _bench_tp.tp_rank_main(Ctx(r), cells, time.time() + 100, opts, str(rows_path)))
    state = json.loads(rows_path.read_text())
    rows = state["rows"]
    assert [r["cell"] for r in rows] == list(range(len(cells)))
    assert state["ranks"][1]["env_ok"] and state["ranks"][0]["heap"] is False
    by = {(r["system"], r["model"], r["batch"]): r for r in rows}
    r = by[("megakernel_tp2", "llama-3.2-1b", 1)]
    assert r["status"] == "ok" and r["ms"] == pytest.approx(1.1) and r["ms_per_rank"] == [1.0, 1.1]
    assert r["floor_ms"] == pytest.approx(_tp_rig.floor_ms_per_rank(load_config("llama-3.2-1b"), 2, 4.55e12)[0])
    assert by[("megakernel", "qwen3-8b", 1)]["ms"] == 1.5
    assert "boom on rank 1" in by[("gptfast_tp2", "qwen3-8b", 1)]["status"]
    assert by[("megakernel_tp2", "qwen3-8b", 8)]["status"].startswith("skipped (time budget")
    summ = _bench_tp.summarize_tp(rows)
    s = [x for x in summ if x["model"] == "llama-3.2-1b" and x["batch"] == 1][0]
    assert s["peer_over_megakernel_tp2"] == pytest.approx(1.8 / 1.1)   # the peer's back-to-back time (ms_pipelined)
    assert s["peer_synced_over_megakernel_tp2"] == pytest.approx(2.0 / 1.1)
    assert s["megakernel_1gpu_over_tp2"] == pytest.approx(1.5 / 1.1)
    assert s["comm"][1]["allreduce_exposed_us"] == 100.0
    _bench_tp.print_tp(rows, summ)


def test_cli_without_gpus_records_every_cell(tmp_path, monkeypatch):
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs: the script would run")
    monkeypatch.setattr(bench_decode, "OUT", tmp_path)
    monkeypatch.setattr(_bench_tp, "OUT", tmp_path)
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--tp", "2", "--budget-s", "5"])
    bench_decode.main()
    d = json.loads((tmp_path / "bench_decode_tp2.json").read_text())
    assert d["meta"]["env"] == {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0",
                                "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    systems = {(r["system"], r["model"], r["batch"]) for r in d["rows"]}
    assert ("megakernel_tp2", "qwen3-8b", 1) in systems and ("gptfast_tp2", "llama-3.2-1b", 8) in systems
    assert all(r["status"].startswith("skipped (needs 2 GPUs") for r in d["rows"])
    assert len(d["skipped"]) == len(d["rows"])


def test_graph_kwargs_default_is_the_engine_setting():
    # bench_decode --tp 2 measures what the engine runs (tp_invariant 1: Tensor Core tiles k-sliced); the
    # bitwise-TP=1 setting is opt-in, and it changes the tiles (k_slices forced to 1)
    from mpk_runtime.ir.build import build_graph
    from mpk_runtime.tasks.build import build_task_graphs
    from mpk_runtime.tasks.tiling import Tiling
    assert _tp_rig.graph_kwargs(2) == {} and _tp_rig.graph_kwargs(2, 2) == {"tp_invariant": 2}
    cfg = load_config("llama-3.2-1b")

    def kslices(kw):
        gs = [build_graph(cfg, mode="decode", batch=8, context_len=64, max_seq_len=96, tp=2, rank=r, attn_splits=1,
                          dtype="bfloat16", **kw) for r in range(2)]
        tg = build_task_graphs(gs, Tiling(num_sms=132))[0]
        return {t.params.get("k_slices") for t in tg.tasks if t.kind == "linear" and t.op.endswith("down")}
    assert kslices(_tp_rig.graph_kwargs(2, 2)) == {1}
    assert kslices(_tp_rig.graph_kwargs(2)) == {0}


def test_floor_with_the_kv_cache_and_the_cards_own_bandwidth():
    """floor_kv_ms adds every row's cached K / V (llama-3.2-1b: 32 KiB a token; 131072 keys: 4 GiB, more than its
    2.47 GB of weights); a card that is not an H200 gets its own measured rate, not the H200's 4.55 TB/s."""
    from _bench_common import HBM, floor_kv_ms, kv_bytes_per_token, stream_bandwidth
    cfg = load_config("llama-3.2-1b")
    assert kv_bytes_per_token(cfg) == 32 * 1024
    fl, nb = bench_decode.floor_ms(cfg)
    assert floor_kv_ms(cfg, 1, 0) == pytest.approx(fl)
    assert floor_kv_ms(cfg, 1, 131072) == pytest.approx((nb + 131072 * 32768) / HBM * 1e3)
    assert floor_kv_ms(cfg, 8, 4096, 3e12) == pytest.approx((nb + 8 * 4096 * 32768) / 3e9)
    assert stream_bandwidth("NVIDIA H200", measure=lambda: 1 / 0)[0] == HBM
    bw, src = stream_bandwidth("NVIDIA H100 80GB HBM3", measure=lambda: 3.1e12)
    assert bw == 3.1e12 and "H100" in src and "measured now" in src


def test_token_check_counts_divergences_and_passes_only_near_ties():
    """_tp_rig.TokenCheck (gpu_check_tp.py and gpu_check_tp_loopback.py): identical steps pass under either mode; a
    divergence where TP=1's top two are 1 bf16 ulp apart passes under tp_invariant 1 only; one at a wide margin
    fails both; non-finite TP logits raise."""
    import _tp_rig
    lr = torch.tensor([[4.0, 1.0, 0.0], [0.0, 2.0, 2.0 - 2.0 ** -6]])   # row 1: top two 1 ulp apart (at 2: 2^-6)
    same = _tp_rig.TokenCheck()
    same.step(0, lr, lr.clone(), torch.tensor([0, 1]), torch.tensor([0, 1]))
    assert same.result(1)["ok"] and same.result(2)["ok"] and same.result(1)["tokens_identical"]
    tie = _tp_rig.TokenCheck()
    tie.step(0, lr, lr.clone(), torch.tensor([0, 1]), torch.tensor([0, 1]))
    tie.step(1, lr, lr + 1e-3, torch.tensor([0, 1]), torch.tensor([0, 2]))
    r = tie.result(1)
    assert r["ok"] and r["first_mismatch_step"] == 1 and r["token_mismatches"] == 1
    assert r["top2_margin_in_bf16_ulps"] == pytest.approx(1.0) and r["worst_rel_logit_err_before_divergence"] == 0.0
    assert not tie.result(2)["ok"]
    wide = _tp_rig.TokenCheck()
    wide.step(0, lr, lr.clone(), torch.tensor([0, 1]), torch.tensor([1, 1]))
    assert not wide.result(1)["ok"] and wide.result(1)["top2_margin_in_bf16_ulps"] == pytest.approx(96.0)   # (margin 3 at 4: ulp 2^-5)
    with pytest.raises(AssertionError, match="non-finite"):
        wide.step(1, lr, lr * float("nan"), torch.tensor([0, 1]), torch.tensor([0, 1]))


def test_shard_weights_of_the_tp_scripts_is_the_runtimes():
    """_tp_rig.shard_weights slices with runtime.pyvm_runner.shard_weights (one slicing for the scripts and the
    runtime): the shards of a seeded model, and the whole model at world 1."""
    import _tp_rig
    from mpk_runtime.models.config import load_config
    from mpk_runtime.runtime.pyvm_runner import shard_weights
    cfg = load_config("tiny-qwen3")
    full, part = _tp_rig.shard_weights(cfg, 3, 1, 2, device="cpu")
    ref = shard_weights(cfg, full, 2, 1)
    assert part.keys() == ref.keys() and all(torch.equal(part[k], ref[k]) for k in ref)
    assert part["model.layers.0.self_attn.q_proj.weight"].shape[0] * 2 == \
        full["model.layers.0.self_attn.q_proj.weight"].shape[0]
    f1, p1 = _tp_rig.shard_weights(cfg, 3, 0, 1, device="cpu")
    assert p1 is f1
