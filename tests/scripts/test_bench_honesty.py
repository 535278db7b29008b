"""scripts/bench_decode.py (one GPU and --tp 2) and scripts/_peers.py on the CPU: bad argument lists stop the run
before any GPU work; the TP run's peer ratio takes the peer's back-to-back time as the one-GPU run does, its floor
uses the card's own rate measured in the run, and its meta records the commit, CUDA version and settings; the HF
peer times its steps back to back too (tiny model, torch.compile's eager backend), with one compiled graph for every
position it cycles over."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import _bench_tp  # noqa: E402
import _tp_rig  # noqa: E402
import bench_decode  # noqa: E402
from mpk_runtime.models.config import load_config  # noqa: E402
from tests.scripts.test_bench_decode_tp import _threads  # noqa: E402  (ranks as threads)


# ------------------------------------------------------------------------------------------- argument checks
@pytest.mark.parametrize("argv,flag", [
    (["--batches", "1,x"], "--batches"),                 # a ValueError traceback after the CUDA check before
    (["--batches", "0,8"], "--batches"),                 # built and run as a cell before
    (["--batches", "8,8"], "--batches"),                 # the same cell twice
    (["--contexts", "-512"], "--contexts"),
    (["--models", "llama-3.2-1b,qwen3-8bb"], "qwen3-8bb"),   # failed after every llama cell had run
    (["--models", "llama-3.2-1b,"], "--models"),
    (["--peer-batches", "1,eight"], "--peer-batches"),
    (["--hf-batches", "0"], "--hf-batches"),
    (["--systems", "planned,vllm"], "--systems"),
    (["--budget-s", "0"], "--budget-s"),
    (["--tp", "2", "--batches", "1,-8"], "--batches"),
])
def test_bad_lists_stop_with_one_line(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        bench_decode.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


def test_good_lists_pass_and_empty_peer_lists_switch_peers_off():
    a = bench_decode.parse_args(["--models", "llama-3.2-1b,qwen3-8b", "--batches", "1, 8,32", "--contexts", "512",
                                 "--peer-batches", "", "--hf-batches", ""])
    assert a.batches == "1, 8,32" and a.peer_batches == ""
    a = bench_decode.parse_args(["--tp", "2"])
    assert (a.batches, a.contexts) == ("1,8", "512")


def test_bad_batch_is_an_argument_error_before_the_gpu_check(monkeypatch, capsys):
    """On a machine without a GPU the run stopped at the CUDA check; on one with a GPU a bad list got past it into
    the measurement. The argument error comes first now, whatever the machine."""
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--batches", "1,x"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: (_ for _ in ()).throw(AssertionError("GPU touched")))
    with pytest.raises(SystemExit) as e:
        bench_decode.main()
    assert e.value.code == 2 and "--batches" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- --tp 2 ratio
def _ok(system, ms, **kw):
    return dict(model="m", system=system, batch=1, context=512, ms=ms, floor_ms=0.5, pct_of_floor=50.0,
                status="ok", **kw)


def test_tp_peer_ratio_uses_its_steps_back_to_back():
    """The TP megakernel runs 8 steps a launch; the TP peer's ms times each step alone (its host work exposed). The
    one-GPU run compares against the peer's lower time since session 69, the TP summary still took ms alone."""
    rows = [_ok("megakernel_tp2", 1.1), _ok("gptfast_tp2", 2.0, ms_pipelined=1.8), _ok("megakernel", 1.5)]
    s = _bench_tp.summarize_tp(rows)[0]
    assert s["peer_over_megakernel_tp2"] == pytest.approx(1.8 / 1.1) and s["peer_ms_basis"] == "ms_pipelined"
    assert s["peer_synced_over_megakernel_tp2"] == pytest.approx(2.0 / 1.1)
    assert s["gptfast_tp2_ms"] == 2.0 and s["gptfast_tp2_ms_pipelined"] == 1.8
    # a queued time above the alone one never makes the peer slower than it measured
    rows[1]["ms_pipelined"] = 2.3
    s = _bench_tp.summarize_tp(rows)[0]
    assert s["peer_over_megakernel_tp2"] == pytest.approx(2.0 / 1.1) and s["peer_ms_basis"] == "ms"
    _bench_tp.print_tp(rows, [s], 3.0e12)


# ------------------------------------------------------------------------------------------- --tp 2 floor
def test_tp_floor_is_at_the_cards_measured_rate(tmp_path, monkeypatch):
    """Every --tp 2 row's floor was the weights / the H200's 4.55 TB/s, on an H100 pair too (the one-GPU run has
    measured the card's own rate since session 55): rank 0 now measures it and both ranks use it."""
    import torch.distributed as dist
    store = dist.PrefixStore("honesty", dist.HashStore())
    monkeypatch.setattr(_bench_tp, "_default_store", lambda d: store)
    asked = []
    monkeypatch.setattr(_bench_tp, "_bandwidth", lambda gpu: asked.append(gpu) or (3.0e12, "3.00 TB/s measured now"))
    monkeypatch.setattr(_bench_tp, "CELL_FNS", {
        "megakernel_tp2": lambda tctx, *a: dict(ms=1.0), "megakernel": lambda tctx, *a: dict(ms=1.5),
        "gptfast_tp2": lambda tctx, *a: dict(ms=2.0, ms_pipelined=1.8)})

    class Ctx:
        def __init__(self, r):
            self.rank, self.nranks = r, 2

        def heap(self):
            return None

        def dist(self):
            return dist

    cfg = load_config("llama-3.2-1b")
    cells = _bench_tp.tp_cells(["llama-3.2-1b"], [1], 512, set(), {"llama-3.2-1b": cfg.num_layers})
    opts = dict(t0=time.time(), steps_per_launch=8, launches=12, sync_timeout_s=30)
    rows_path = tmp_path / "rows.json"
    _threads(lambda r: _bench_tp.tp_rank_main(Ctx(r), cells, time.time() + 100, opts, str(rows_path)))
    state = json.loads(rows_path.read_text())
    assert len(asked) == 1   # rank 0 measures, rank 1 takes its number
    assert state["hbm_bytes_per_s"] == 3.0e12 and "measured" in state["bandwidth_source"]
    by = {r["system"]: r for r in state["rows"]}
    assert by["megakernel_tp2"]["floor_ms"] == pytest.approx(_tp_rig.floor_ms_per_rank(cfg, 2, 3.0e12)[0])
    assert by["megakernel"]["floor_ms"] == pytest.approx(bench_decode.floor_ms(cfg, 3.0e12)[0])
    assert by["gptfast_tp2"]["pct_of_floor"] == pytest.approx(100 * by["gptfast_tp2"]["floor_ms"] / 2.0)


# ------------------------------------------------------------------------------------------- --tp 2 meta
def test_tp_meta_records_commit_cuda_and_settings(tmp_path, monkeypatch):
    """The --tp 2 file's commit was "unknown" unless $GIT_COMMIT was set, and it had no CUDA version and no record of
    the batches / contexts / models it was asked for."""
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs: the script would run")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    monkeypatch.setattr(bench_decode, "OUT", tmp_path)
    monkeypatch.setattr(_bench_tp, "OUT", tmp_path)
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--tp", "2", "--budget-s", "5", "--models", "llama-3.2-1b",
                                      "--batches", "1"])
    bench_decode.main()
    m = json.loads((tmp_path / "bench_decode_tp2.json").read_text())["meta"]
    assert m["git_commit"].split("-")[0] == head.stdout.strip()
    assert "cuda" in m and m["torch"] == torch.__version__
    assert (m["args"]["models"], m["args"]["batches"], m["args"]["contexts"]) == ("llama-3.2-1b", "1", "512")
    import datetime
    assert datetime.datetime.fromisoformat(m["date"]).utcoffset() is not None
    assert m["hbm_bytes_per_s"] is None   # no rank ran: no rate claimed


# ------------------------------------------------------------------------------------------- HF peer
def test_hf_peer_times_its_steps_back_to_back_on_one_graph():
    """bench_hf timed only each step alone (synchronised, its host work exposed), so HF's ratio against ours (8
    steps a launch, or replays queued back to back) carried a cost ours did not; it now records ms_pipelined as
    gpt-fast does, and summarize takes the lower. Its compiled step is one graph over every position it cycles
    over (no recompiling per step)."""
    pytest.importorskip("transformers")
    from torch._dynamo.utils import counters
    import _peers
    torch._dynamo.reset()
    counters.clear()
    cfg = load_config("tiny-llama")
    r = _peers.bench_hf(cfg, 2, 13, steps=6, warm=2, device="cpu", compile_kw=dict(backend="eager", fullgraph=True))
    assert r["ms_pipelined"] > 0 and r["ms"] > 0 and r["cache_keys"] == 13 + _peers.AHEAD
    assert "queued back to back" in r["timing"]
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
    ours = _ok("megakernel", 1.0)
    peer = dict(_ok("hf", 3.0), ms_pipelined=2.5)
    bench_decode.summarize([ours, peer])
    assert peer["ratio_vs_ours"] == pytest.approx(2.5) and peer["peer_ms_basis"] == "ms_pipelined"


# ------------------------------------------------------------------------------------------- cells not reached
def test_pending_rows_name_the_cells_not_reached():
    cells = [("m", "megakernel", 1, 512), ("m", "megakernel", 1, 512), ("m", "gptfast", 1, 512), ("q", "hf", 1, 512)]
    done = [dict(model="m", system="megakernel", batch=1, context=512, status="ok", ms=1.0)]
    got = bench_decode.pending_rows(done, cells)   # a --before cell and its usual place: two cells, one done
    assert [(r["model"], r["system"]) for r in got] == [("m", "megakernel"), ("m", "gptfast"), ("q", "hf")]
    assert all(r["status"].startswith("pending") and "ms" not in r for r in got)
    assert bench_decode.pending_rows(done + [dict(done[0])] + [dict(model=c[0], system=c[1], batch=c[2],
                                                                     context=c[3]) for c in cells[2:]], cells) == []


def test_a_run_killed_mid_way_leaves_its_unreached_cells_in_the_file(tmp_path, monkeypatch):
    """gpu_pending.sh runs the bench under `timeout`; when it killed the process the file held the cells done so
    far and nothing about the rest. Here the second megakernel cell is interrupted (a kill, not an exception the
    loop records): the file names every cell after it as pending, and the first cell's number stands."""
    import mpk_runtime.models.weights as W
    import mpk_runtime.runtime.conventional_fused as CF
    monkeypatch.setattr(bench_decode, "OUT", tmp_path)
    monkeypatch.setattr(bench_decode, "ROWS", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(W, "random_weights", lambda *a, **k: {})
    monkeypatch.setattr(CF, "prepare_weights", lambda w, cfg: w)
    calls = []

    def mk(model, weights, B, ctx, *a, **k):
        calls.append((B, ctx))
        if len(calls) == 2:
            raise KeyboardInterrupt   # SIGTERM / the timeout's kill
        return dict(system="megakernel", ms=1.0)

    monkeypatch.setattr(bench_decode, "bench_megakernel", mk)
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--models", "tiny-llama", "--batches", "1,8",
                                      "--contexts", "64,128", "--no-planned", "--peer-batches", "1",
                                      "--hf-batches", "", "--budget-s", "600"])
    with pytest.raises(KeyboardInterrupt):
        bench_decode.main()
    rows = json.loads((tmp_path / "bench_decode.json").read_text())["rows"]
    assert rows[0]["status"] == "ok" and (rows[0]["batch"], rows[0]["context"]) == (1, 64)
    left = [(r["system"], r["batch"], r["context"]) for r in rows[1:]]
    assert left == [("megakernel", 1, 128), ("megakernel", 8, 64), ("megakernel", 8, 128), ("gptfast", 1, 64),
                    ("gptfast", 1, 128)]
    assert all(r["status"].startswith("pending") for r in rows[1:])


def test_one_gpu_meta_names_the_dtype_and_decode():
    """Every cell runs bf16 weights and greedy (argmax) decoding; the file said so nowhere but the script's docstring."""
    args = bench_decode.parse_args(["--models", "tiny-llama"])
    meta = bench_decode.run_meta(args, "NVIDIA H200", 1, 4.55e12, "x")
    assert meta["dtype"] == "bfloat16" and "greedy" in meta["weights"]


def test_the_floor_share_and_the_ratio_use_the_same_time():
    """A peer's % of floor was of its each-step-alone time while its ratio was of the lower (back to back) one."""
    peer = dict(system="gptfast", model="m", batch=8, context=512, status="ok", ms=2.0, ms_pipelined=1.6)
    ours = dict(system="planned", model="m", batch=8, context=512, status="ok", ms=1.7, ms_pipelined=1.5)
    assert bench_decode.best_ms(peer) == 1.6 and bench_decode.best_ms(ours) == 1.5
    assert bench_decode.best_ms(dict(ms=1.2)) == 1.2 and bench_decode.best_ms(dict(ms=1.2, ms_pipelined=None)) == 1.2
    for r in (peer, ours):
        r.update(floor_ms=0.8, pct_of_floor=100 * 0.8 / bench_decode.best_ms(r), floor_kv_ms=0.9,
                 pct_of_floor_kv=100 * 0.9 / bench_decode.best_ms(r))
    bench_decode.summarize([ours, peer])
    assert peer["ratio_vs_ours"] == pytest.approx(1.6 / 1.5) and peer["peer_ms_basis"] == "ms_pipelined"
    src = Path(bench_decode.__file__).read_text()
    assert 'pct_of_floor=100 * fl / best' in src and 'best = best_ms(r)' in src   # the run loop's % uses best_ms
