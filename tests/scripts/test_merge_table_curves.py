"""scripts/merge_table_curves.py: each paged-curve point comes from the run whose page-table type the launch shape
names there (MPK_PAGED_TABLE=auto), against curves written here whose values say which run they came from."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import merge_table_curves as mtc  # noqa: E402
from mpk_runtime.runtime import paged_attention as pa  # noqa: E402

POINTS = [(8, 4097), (32, 513), (32, 4097), (128, 513), (128, 4097)]


def _runs():
    """i64 values are 1000 + B, i32 values 2000 + B; the TP=2 qwen3-8b shape (4 KV heads) has one point only the i32
    run measured."""
    shapes = ("8x64x4@paged", "8x128x4@paged", "4x128x4@paged")
    i64 = {s: [[b, k, 1000.0 + b] for b, k in POINTS] for s in shapes}
    i32 = {s: [[b, k, 2000.0 + b] for b, k in POINTS] for s in shapes}
    i32["4x128x4@paged"].append([64, 2049, 2064.0])
    i64["8x128x4"] = [[8, 513, 1.0]]   # a gather + SDPA curve: not the paged kernel's, left alone
    return i64, i32


def test_each_point_from_its_shapes_table_type(monkeypatch):
    monkeypatch.delenv("MPK_PAGED_TABLE", raising=False)
    monkeypatch.delenv("MPK_PAGED_SHAPE", raising=False)
    curves, picks, srcs = mtc.merged_curves(*_runs())
    assert set(curves) == {"8x64x4@paged", "8x128x4@paged", "4x128x4@paged"}
    run = {s: {(b, k): ("i32" if us >= 2000 else "i64") for b, k, us in pts} for s, pts in curves.items()}
    for s, pts in run.items():
        nkv, D = (int(x) for x in s.split("x")[:2])
        for (b, k), t in pts.items():
            want = pa.table_dtype_for(D, b, nkv, mtc.key_cap(k - 1, mtc._Cfg))
            assert t == ("i32" if want == pa.torch.int32 else "i64") or (s, b, k) == ("4x128x4@paged", 64, 2049)
    assert set(run["8x64x4@paged"].values()) == {"i32"}                      # llama: int32 everywhere
    assert run["8x128x4@paged"][(128, 513)] == "i32" and run["8x128x4@paged"][(8, 4097)] == "i64"
    assert run["4x128x4@paged"][(32, 4097)] == "i64"                           # qwen3-8b TP=2 B=32: int64
    assert run["4x128x4@paged"][(64, 2049)] == "i32" and sum(picks["4x128x4@paged"].values()) == 6
    assert srcs == run   # the source of each point, as its value says
    # the launch shape of each point: the one its run recorded, else config_for's with the run's table type
    r64 = dict(conv_attn_us_by_shape=_runs()[0], conv_attn_shape_by_shape={"8x64x4@paged": [[8, 4097, "recorded,i32"]]})
    r32 = dict(conv_attn_us_by_shape=_runs()[1])
    lab = mtc.point_shapes(curves, srcs, r64, r32)
    assert lab["8x64x4@paged"][0][:2] == [8, 4097]
    assert lab["8x64x4@paged"][0][2] == pa.shape_label(pa.config_for(64, 8, 8, mtc.key_cap(4096, mtc._Cfg)))  # i32 run
    assert all(lbl.endswith("," + srcs[s][(b, k)]) for s, pts in lab.items() for b, k, lbl in pts)
    r32["conv_attn_shape_by_shape"] = {"8x64x4@paged": [[8, 4097, "recorded,i32"]]}
    assert mtc.point_shapes(curves, srcs, r64, r32)["8x64x4@paged"][0][2] == "recorded,i32"


def test_the_cli_refuses_a_forced_table_type(tmp_path, monkeypatch):
    i64, i32 = _runs()
    for n, c in (("a.json", i64), ("b.json", i32)):
        (tmp_path / n).write_text(json.dumps(dict(meta={}, conv_attn_us_by_shape=c)))
    monkeypatch.setenv("MPK_PAGED_TABLE", "i32")
    with pytest.raises(SystemExit, match="unset MPK_PAGED_TABLE"):
        mtc.main(["--i64", str(tmp_path / "a.json"), "--i32", str(tmp_path / "b.json"), "--base", "h200_v47",
                  "--name", "x"])
