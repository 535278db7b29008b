"""The KV cache's piece rate in the planner: an attention partial streams its K/V bytes at the profile's
kv_piece_eff for the contiguous run it reads per head (head_dim x 2 bytes of a (page, slot, head, D) page),
measured by scripts/bench_stream.py --pieces; a profile without the table prices as before."""
import dataclasses

import pytest

from mpk_runtime.ir import build_graph
from mpk_runtime.models import PRESETS
from mpk_runtime.planner import HardwareProfile, simulate
from mpk_runtime.planner.simulate import kv_piece_bytes, task_stream_eff
from mpk_runtime.tasks import Tiling, build_task_graphs


def _graphs(cfg, B=8, ctx=512):
    return build_task_graphs([build_graph(cfg, batch=B, context_len=ctx, attn_splits=1)], Tiling(num_sms=132))


def test_pieces_are_rows():
    assert kv_piece_bytes(64) == 128 and kv_piece_bytes(128) == 256


def test_attention_priced_at_the_piece_rate():
    base = HardwareProfile.load("h200_v31_cal").for_batch(8)
    assert base.kv_piece_eff_by_bytes == {} and base.kv_piece_eff(128) == 1.0
    slow = dataclasses.replace(base, kv_piece_eff_by_bytes={"128": 0.25, "256": 0.6, "2048": 0.95})
    cfg = PRESETS["llama-3.2-1b"].replace(num_layers=1)   # head_dim 64: 128-byte rows
    tg = _graphs(cfg, B=32, ctx=2048)
    att = next(t for t in tg[0].tasks if t.kind == "attn_partial")
    lin = next(t for t in tg[0].tasks if t.kind == "linear")
    e = base.stream_eff("attn_partial")
    assert task_stream_eff(att, slow) == pytest.approx(e * 0.25)
    assert task_stream_eff(lin, slow) == task_stream_eff(lin, base)        # weights: not KV pieces
    t_base, t_slow = simulate(tg, base).makespan_us, simulate(tg, slow).makespan_us
    # the fitted per-flop floor of attention (flop.attn_partial) does not hide a 4x slower stream
    assert t_slow > 1.1 * t_base
    assert slow.kv_piece_eff(1024) == pytest.approx(0.6 * (0.95 / 0.6) ** (2 / 3))   # log-log between points
