"""scripts/bench_decode.py's cell order (work_order): this runtime's planned cells run before anything else in the
process, the megakernel's next, the peers last (session 44: the planned steps measured ~95 us slower at llama B=8 / 32
after the batch-1 megakernel and peer cells had run in the same process); every requested cell appears once."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_decode  # noqa: E402


def _order(**kw):
    args = dict(batches=[1, 8, 32, 128], ctxs=[512, 4096], planned=[(b, c) for b in (8, 32, 128) for c in (512, 4096)],
                mk_max_batch=128, peer_batches=[1, 8, 32, 128], hf_batches=[1, 8, 32, 128])
    args.update(kw)
    return bench_decode.work_order(**args)


def test_planned_first_then_megakernel_then_peers():
    w = _order()
    systems = [s for s, _, _ in w]
    last_ours = max(i for i, s in enumerate(systems) if s in ("planned", "megakernel"))
    first_peer = min(i for i, s in enumerate(systems) if s in ("gptfast", "hf"))
    assert last_ours < first_peer
    assert systems[:6] == ["planned"] * 6
    assert w[6:8] == [("megakernel", 1, 512), ("megakernel", 1, 4096)]   # batch 1 first among the megakernel's
    assert w[first_peer] == ("gptfast", 1, 512)


def test_every_cell_once():
    w = _order()
    assert len(w) == len(set(w))
    assert {(b, c) for s, b, c in w if s == "megakernel"} == {(b, c) for b in (1, 8, 32, 128) for c in (512, 4096)}
    assert {(b, c) for s, b, c in w if s == "gptfast"} == {(b, c) for b in (1, 8, 32, 128) for c in (512, 4096)}
    assert {(b, c) for s, b, c in w if s == "hf"} == {(b, c) for b in (1, 8, 32, 128) for c in (512, 4096)}
    assert [(b, c) for s, b, c in w if s == "planned"] == [(b, c) for b in (8, 32, 128) for c in (512, 4096)]


def test_no_peers_and_megakernel_cap():
    w = _order(mk_max_batch=0, peers=False)
    assert {s for s, _, _ in w} == {"planned", "megakernel"}
    assert [(b, c) for s, b, c in w if s == "megakernel"] == [(1, 512), (1, 4096)]   # B=1 is always the megakernel's
    assert _order(batches=[8, 32], mk_max_batch=0, peer_batches=[8], hf_batches=[]) == \
        [("planned", b, c) for b in (8, 32, 128) for c in (512, 4096)] + [("gptfast", 8, 512), ("gptfast", 8, 4096)]


def test_before_cells_run_first_and_parse():
    before = bench_decode.parse_cells("megakernel:1:512, gptfast:1:512")
    assert before == [("megakernel", 1, 512), ("gptfast", 1, 512)]
    w = _order(before=before)
    assert w[:2] == before and w[2][0] == "planned"
    assert bench_decode.parse_cells("") == []


def test_before_bad_spec_says_what_to_write():
    import pytest
    for bad in ("megakernel:1", "vllm:1:512", "megakernel:0:512", "gptfast:x:512"):
        with pytest.raises(SystemExit, match="system:batch:context"):
            bench_decode.parse_cells(bad)


def test_isolate_runs_one_child_per_system_with_the_same_arguments(tmp_path):
    argv = ["--models", "llama-3.2-1b", "--isolate", "--batches", "8,32"]
    cmds = bench_decode.isolated_commands(argv, 300.0, tmp_path)
    assert [s for s, _, _ in cmds] == list(bench_decode.SYSTEMS)
    for sysname, cmd, out in cmds:
        assert "--isolate" not in cmd and cmd[:4] == ["--models", "llama-3.2-1b", "--batches", "8,32"]
        assert cmd[-4:] == ["--systems", sysname, "--budget-s", "{budget}"]
        assert out == tmp_path / f"iso_{sysname}"
    a = bench_decode.parse_args(cmds[0][1][:-2] + ["--budget-s", "120"])   # the child's own parse
    assert a.systems == "planned" and a.budget_s == 120.0 and not a.isolate


def test_summarize_takes_the_planned_row_as_ours(capsys):
    rows = [dict(model="m", system="megakernel", batch=8, context=512, ms=2.0, floor_ms=0.5, pct_of_floor=25.0,
                 status="ok"),
            dict(model="m", system="planned", batch=8, context=512, ms=1.0, floor_ms=0.5, pct_of_floor=50.0,
                 status="ok", plan="conventional"),
            dict(model="m", system="gptfast", batch=8, context=512, ms=1.5, floor_ms=0.5, pct_of_floor=33.0,
                 status="ok"),
            dict(model="m", system="hf", batch=8, context=512, status="skipped (time budget)")]
    bench_decode.summarize(rows)
    assert rows[2]["ratio_vs_ours"] == 1.5 and rows[0]["ratio_vs_ours"] == 2.0 and "ratio_vs_ours" not in rows[3]
    assert "(conventional)" in capsys.readouterr().out
