"""Review of scripts/bench_decode.py, _bench_common.py, _peers.py and score_bench.py (CPU): the floor's bytes
recomputed by hand from the published model shapes, which cells a switched-off peer still ran, which number a peer's
ratio uses and against which of our rows, --isolate's children that left no rows, the run's meta, and score_bench's
profile for rows measured on another card."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_decode  # noqa: E402
import score_bench  # noqa: E402
import _bench_common  # noqa: E402
from mpk_runtime.models.config import load_config  # noqa: E402


# ------------------------------------------------------------------------------------------- the floor's bytes
def _hand_bytes(V, D, L, H, KV, hd, I, tied, qk_norm=False, qkv_bias=False):
    """bf16 bytes one decode step streams: per layer q, k, v, o, gate, up, down and two norms (+ q / k norms, + q / k / v
    biases), the final norm and the LM head (V x D: the embedding itself when tied; an untied embedding table is
    gathered B rows a step, not streamed)."""
    layer = D * H * hd + 2 * D * KV * hd + H * hd * D + 3 * D * I + 2 * D
    layer += 2 * hd if qk_norm else 0
    layer += (H + 2 * KV) * hd if qkv_bias else 0
    return 2 * (L * layer + D + V * D)


@pytest.mark.parametrize("model,shape", [
    # published shapes: V, D, L, H, KV, hd, I, tied, qk_norm, qkv_bias
    ("llama-3.2-1b", (128256, 2048, 16, 32, 8, 64, 8192, True, False, False)),
    ("qwen3-8b", (151936, 4096, 36, 32, 8, 128, 12288, False, True, False)),
    ("qwen2.5-7b", (152064, 3584, 28, 28, 4, 128, 18944, False, False, True)),
])
def test_floor_bytes_match_the_model_by_hand(model, shape):
    cfg = load_config(model)
    want = _hand_bytes(*shape)
    fl, nb = bench_decode.floor_ms(cfg, 4.55e12)
    assert nb == want and fl == pytest.approx(want / 4.55e12 * 1e3)
    V, D, L, _, KV, hd = shape[:6]
    # K and V, bf16, every layer: the floor+kv of 8 rows at 4096 keys adds 8 * 4096 of them
    assert _bench_common.kv_bytes_per_token(cfg) == 2 * L * KV * hd * 2
    assert _bench_common.floor_kv_ms(cfg, 8, 4096, 3e12) == pytest.approx((want + 8 * 4096 * 4 * L * KV * hd) / 3e9)


def test_llama_1b_floor_is_its_published_size():
    # 1.236 B parameters (tied), all streamed but the gather: 2.47 GB in bf16 (docs/benchmarks.md)
    assert bench_decode.floor_ms(load_config("llama-3.2-1b"))[1] == pytest.approx(2.471e9, rel=1e-3)


# ------------------------------------------------------------------------------------------- which cells run
def test_empty_peer_batches_switch_gptfast_off_at_batch_1_too():
    """gpu_ab.sh / gpu_verify_v8.sh pass --peer-batches "" --hf-batches "" for megakernel-only A/B runs; gpt-fast's
    B=1 cells ran anyway (a ~25 s compile inside a 60 s budget, and a peer's state after ours)."""
    w = bench_decode.work_order([1, 8], [512], [], 8, [], [])
    assert {s for s, _, _ in w} == {"megakernel"}
    w = bench_decode.work_order([1, 8], [512, 4096], [], 8, [8], [1])   # gpu_pending.sh b_after_peers
    assert [c for c in w if c[0] == "gptfast"] == [("gptfast", 8, 512), ("gptfast", 8, 4096)]
    assert [c for c in w if c[0] == "hf"] == [("hf", 1, 512), ("hf", 1, 4096)]


def test_hf_batch_1_needs_batch_1_at_every_context():
    """Without 1 in --batches the HF peer's B=1 cell was left out at the first context but run at the others."""
    w = bench_decode.work_order([8], [512, 4096], [], 8, [8], [1, 8])
    assert sorted(c for c in w if c[0] == "hf") == [("hf", 8, 512), ("hf", 8, 4096)]


# ------------------------------------------------------------------------------------------- ratios
def _row(system, B, ms, status="ok", **kw):
    return dict(model="m", system=system, batch=B, context=512, ms=ms, floor_ms=0.5, pct_of_floor=50.0,
                status=status, **kw)


def test_peer_ratio_uses_its_steps_back_to_back_like_our_launch_of_8():
    """The megakernel's ms is one launch of 8 steps / 8 (host work paid once); gpt-fast's ms times each step alone,
    its host overhead exposed every step. s62 (H100, llama ctx 512): gpt-fast B=1 1.560 alone, 1.400 queued, ours
    1.241: the stored ratio 1.26 was 1.13 against the peer's own back-to-back number."""
    rows = [_row("megakernel", 1, 1.241), _row("gptfast", 1, 1.560, ms_pipelined=1.400), _row("hf", 1, 2.298)]
    bench_decode.summarize(rows)
    g, h = rows[1], rows[2]
    assert g["ratio_vs_ours"] == pytest.approx(1.400 / 1.241) and g["peer_ms_basis"] == "ms_pipelined"
    assert g["ratio_synced_vs_ours"] == pytest.approx(1.560 / 1.241) and g["ratio_vs"] == "megakernel"
    assert h["ratio_vs_ours"] == pytest.approx(2.298 / 1.241) and h["peer_ms_basis"] == "ms"   # no queued timing
    # a queued time above the alone one (noise) never makes the peer look slower than it measured
    rows = [_row("megakernel", 1, 1.0), _row("gptfast", 1, 1.5, ms_pipelined=1.6)]
    bench_decode.summarize(rows)
    assert rows[1]["ratio_vs_ours"] == pytest.approx(1.5)


def test_no_ratio_against_the_one_megakernel_where_the_planned_cell_failed():
    """Where the planner chose another plan, 'ours' is that plan's row; when it failed the peer got its ratio against
    the one megakernel (what a user does not get there) as if nothing had happened."""
    rows = [_row("planned", 32, None, status="error: RuntimeError: boom", plan="conventional"),
            _row("megakernel", 32, 3.9), _row("gptfast", 32, 2.1)]
    bench_decode.summarize(rows)
    assert "ratio_vs_ours" not in rows[2] and "ratio_vs_ours" not in rows[1]
    rows = [_row("planned", 32, 1.7, plan="conventional"), _row("gptfast", 32, 2.1)]
    bench_decode.summarize(rows)
    assert rows[1]["ratio_vs"] == "planned (conventional)" and rows[1]["ratio_vs_ours"] == pytest.approx(2.1 / 1.7)


def test_merged_rows_drop_a_childs_stale_ratio():
    """--isolate merges children's rows; a ratio a child computed against its own rows must not survive where the
    merged rows have no ours for the cell."""
    rows = [_row("megakernel", 8, 1.6, ratio_vs_ours=1.0), _row("planned", 8, None, status="skipped (time budget)")]
    bench_decode.summarize(rows)
    assert "ratio_vs_ours" not in rows[0]


# ------------------------------------------------------------------------------------------- --isolate
def test_isolate_names_children_that_left_no_rows(tmp_path, monkeypatch, capsys):
    """A child that crashed before writing, or was never started for lack of budget, lost its system's cells without
    a word in the merged file."""
    monkeypatch.setattr(bench_decode, "OUT", tmp_path)
    monkeypatch.setattr(bench_decode, "T0", __import__("time").time())
    ran = []

    def fake_run(cmd, env, check):
        sysname = cmd[cmd.index("--systems") + 1]
        ran.append(sysname)
        if sysname == "megakernel":
            (Path(env["OUT"]) / "bench_decode.json").write_text(json.dumps(dict(meta={"machine": "X"}, rows=[
                _row("megakernel", 1, 1.0)])))
            return subprocess.CompletedProcess(cmd, 0)
        if sysname == "gptfast":   # killed before its first save; the run's budget is spent by then
            monkeypatch.setattr(bench_decode, "T0", bench_decode.T0 - 1000)
            return subprocess.CompletedProcess(cmd, -9)
        return subprocess.CompletedProcess(cmd, 1)   # planned: failed at once, wrote nothing

    # an old run's result in the planned child's folder is not this child's
    (tmp_path / "iso_planned").mkdir()
    (tmp_path / "iso_planned" / "bench_decode.json").write_text(json.dumps(dict(meta={"stale": True}, rows=[
        _row("planned", 8, 9.9, plan="conventional")])))
    monkeypatch.setattr(subprocess, "run", fake_run)
    args = bench_decode.parse_args(["--isolate", "--budget-s", "300"])
    bench_decode.run_isolated(args, ["--isolate", "--budget-s", "300"])
    d = json.loads((tmp_path / "bench_decode.json").read_text())
    assert ran == ["planned", "megakernel", "gptfast"]
    assert [r["system"] for r in d["rows"]] == ["megakernel"]
    assert d["meta"]["missing_systems"] == ["gptfast", "hf", "planned"]
    ch = d["meta"]["children"]
    assert ch["gptfast"]["status"].startswith("error: child exited -9")
    assert ch["hf"]["status"].startswith("skipped (time budget")
    assert ch["megakernel"]["machine"] == "X" and d["meta"]["machine"] == "X" and d["meta"]["args"]["isolate"]
    assert "gptfast: no rows" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------- meta
def test_meta_records_the_settings_versions_and_commit(monkeypatch):
    monkeypatch.setenv("GIT_COMMIT", "abc123")
    args = bench_decode.parse_args(["--models", "qwen3-8b", "--peer-batches", "1", "--hf-batches", "", "--waves", "2"])
    meta = bench_decode.run_meta(args, "NVIDIA H100 80GB HBM3", 1, 3.0e12, "measured")
    assert meta["git_commit"] == "abc123" and meta["machine"].startswith("NVIDIA H100 80GB HBM3 (GPU 0 of 1")
    a = meta["args"]
    assert (a["models"], a["batches"], a["contexts"], a["peer_batches"], a["hf_batches"], a["waves"],
            a["mk_max_batch"], a["budget_s"]) == ("qwen3-8b", "1,8,32,128", "512,4096", "1", "", 2.0, 128, 300.0)
    assert {"torch", "cuda", "python", "planner_profile", "hbm_bytes_per_s", "bandwidth_source"} <= set(meta)
    import datetime
    assert datetime.datetime.fromisoformat(meta["date"]).utcoffset() is not None   # a date with its zone
    json.dumps(meta)


def test_commit_without_git_commit_is_this_checkout(monkeypatch):
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    got = _bench_common.git_commit()
    assert got.split("-")[0] == head.stdout.strip()
    monkeypatch.setenv("GIT_COMMIT", "deadbeef")
    assert _bench_common.git_commit() == "deadbeef"


# ------------------------------------------------------------------------------------------- score_bench
def test_repredict_prices_an_h100_file_under_the_h100_profile(tmp_path, monkeypatch, capsys):
    """score_bench --repredict priced every file under this machine's default profile (the H200's here), so an H100
    run's rows were scored against another card's prices."""
    from mpk_runtime.models import PRESETS
    from mpk_runtime.planner import candidates
    from mpk_runtime.planner.profile import PROFILE_BY_CARD, HardwareProfile
    monkeypatch.delenv("MPK_PLANNER_PROFILE", raising=False)
    p = tmp_path / "bench_decode.json"
    p.write_text(json.dumps({"meta": {"machine": "NVIDIA H100 80GB HBM3 (GPU 0 of 1 visible), vm"}, "rows": [
        {"model": "tiny-llama", "batch": 32, "context": 64, "system": "planned", "plan": "attn-mk", "ms": 2.0,
         "status": "ok"}]}))
    assert score_bench.profile_for(str(p)) == PROFILE_BY_CARD["H100"]
    assert score_bench.profile_for(str(p), "h200_v56") == "h200_v56"
    want = {n: candidates(PRESETS["tiny-llama"], batch=32, context=64, prof=HardwareProfile.load(n),
                          families=("attn-mk",))[0].predicted_us / 1e3 for n in (PROFILE_BY_CARD["H100"], None)}
    monkeypatch.setattr(sys, "argv", ["score_bench.py", str(p), "--repredict"])
    assert score_bench.main() == 0
    out = capsys.readouterr().out
    assert f"priced under profile {PROFILE_BY_CARD['H100']}" in out
    assert f"predicted {want[PROFILE_BY_CARD['H100']]:8.3f}" in out


def test_mape_says_how_many_measured_rows_had_no_prediction(tmp_path, monkeypatch, capsys):
    p = tmp_path / "b.json"
    p.write_text(json.dumps({"meta": {}, "rows": [
        {"model": "m", "batch": 1, "context": 64, "system": "megakernel", "ms": 0.5, "status": "ok"},
        {"model": "m", "batch": 8, "context": 64, "system": "planned", "plan": "conventional", "ms": 2.0,
         "predicted_ms": 2.2, "status": "ok"}]}))
    monkeypatch.setattr(sys, "argv", ["score_bench.py", str(p)])
    score_bench.main()
    assert "1 rows, step MAPE 10.0% (1 measured rows without a prediction left out)" in capsys.readouterr().out


def test_peer_warm_up_is_the_same_step_count_on_every_tp_rank():
    """~WARM_S of untimed peer steps at tp == 1; none at tp > 1, where a count from each rank's own clock could differ
    between ranks and hang their collectives."""
    import _peers
    assert _peers._warm_count(1e-3, 1) == int(_bench_common.WARM_S / 1e-3)
    assert _peers._warm_count(1e-3, 2) == 0 and _peers._warm_count(10.0, 1) == 2


def test_repredict_prices_the_megakernel_build_that_ran():
    """A one-megakernel row is repriced with its own attention splits and waves (mono-w2 at waves 2); an L2-prefetch
    build, which no plan prices, is left out instead of scored as the plain mono kernel."""
    from mpk_runtime.models import PRESETS
    from mpk_runtime.planner import candidates
    row = dict(model="tiny-llama", system="megakernel", batch=4, context=64, ms=1.0, status="ok", attn_splits=2,
               waves=2.0, l2_prefetch_mb=0.0)
    got = score_bench.score([row], score_bench.repricer(None))[0]["predicted_ms"]
    want = candidates(PRESETS["tiny-llama"], batch=4, context=64, families=("mono-w2",), splits=2)[0].predicted_us
    assert got == want / 1e3
    other = candidates(PRESETS["tiny-llama"], batch=4, context=64, families=("mono",))[0].predicted_us / 1e3
    assert got != other   # what it was priced as before
    assert score_bench.score([dict(row, waves=1.0, l2_prefetch_mb=16.0)], score_bench.repricer(None)) == []


def test_a_planned_cells_back_to_back_time_is_ours_where_it_is_lower():
    """Giving only the peer its back-to-back time leaves a planned cell (each replay timed alone, its host replay and
    sync counted) at a disadvantage; since session 69 measure_plan times queued replays too, and the ratio uses the
    lower of ours' two times as it does the peer's (ours_ms_basis says which)."""
    rows = [_row("planned", 8, 1.482, plan="conventional", ms_pipelined=1.450), _row("gptfast", 8, 1.941, ms_pipelined=1.502)]
    bench_decode.summarize(rows)
    g = rows[1]
    assert g["ratio_vs_ours"] == pytest.approx(1.502 / 1.450) and g["ours_ms_basis"] == "ms_pipelined"
    assert g["ratio_synced_vs_ours"] == pytest.approx(1.941 / 1.482)
    rows = [_row("planned", 8, 1.482, plan="conventional"), _row("gptfast", 8, 1.941, ms_pipelined=1.502)]
    bench_decode.summarize(rows)   # an older file: ours has no queued time, its ms stands
    assert rows[1]["ratio_vs_ours"] == pytest.approx(1.502 / 1.482) and rows[1]["ours_ms_basis"] == "ms"
