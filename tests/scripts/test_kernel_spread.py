"""scripts/kernel_spread.py: kernels of several profile logs aligned by name, ranked by their spread; a kernel
missing from one log counts 0 there; only a log's first table is read; a log without a table is refused."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import kernel_spread as ks  # noqa: E402

LOG = """== qwen3-8b B=8 ctx=512 conventional: 711 GPU kernels/copies per step, 5.44 ms GPU busy
      {a} us     36x  triton_per_fused__to_copy_cat_mean_pow_0
      1904.9 us     36x  nvjet_sm90_tst_256x8_64x6_4x1_v_bz_TNT
{extra}== qwen3-8b B=32 ctx=512 conventional: 711 GPU kernels/copies per step
        999.0 us     36x  triton_per_fused__to_copy_cat_mean_pow_0
"""


def _write(tmp_path, name, a, extra=""):
    p = tmp_path / name
    p.write_text(LOG.format(a=a, extra=extra))
    return str(p)


def test_spread_ranks_the_kernel_that_moved(tmp_path, capsys):
    p1 = _write(tmp_path, "p1.log", "59.6")
    p2 = _write(tmp_path, "p2.log", "122.3", extra="        5.0 us      1x  only_here\n")
    t1, t2 = ks.parse(p1), ks.parse(p2)
    assert t1 == {"triton_per_fused__to_copy_cat_mean_pow_0": 59.6, "nvjet_sm90_tst_256x8_64x6_4x1_v_bz_TNT": 1904.9}
    rows = ks.spread([t1, t2])
    assert rows[0][0] == "triton_per_fused__to_copy_cat_mean_pow_0"
    assert rows[0][1] == [59.6, 122.3] and rows[0][2] == pytest.approx(122.3 / 59.6)
    only = [r for r in rows if r[0] == "only_here"][0]
    assert only[1] == [0.0, 5.0] and only[2] == float("inf")
    assert ks.main([p1, p2, "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("*") and "x 2.05" in out[1]


def test_a_log_without_a_table_is_refused(tmp_path):
    p1 = _write(tmp_path, "p1.log", "59.6")
    bad = tmp_path / "bad.log"
    bad.write_text("Traceback (most recent call last):\n")
    with pytest.raises(SystemExit, match="no kernel table in .*bad.log"):
        ks.main([p1, str(bad)])
    with pytest.raises(SystemExit, match="two or more"):
        ks.main([p1])
