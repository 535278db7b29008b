"""The conventional attention measured whole (HardwareProfile.conv_attn_us_by_shape, scripts/profile_conv_attn.py):
interpolated on its (batch x keys) grid, it prices the op where the profile has the shape's curve; prices from
features equal candidates()' prices; fit.py recovers its calibration; the script writes a profile that loads."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from mpk_runtime.ir import build_graph
from mpk_runtime.models import PRESETS, load_config
from mpk_runtime.planner import HardwareProfile, candidates
from mpk_runtime.planner.cost import conventional_features, conventional_op_us, price_from_features
from mpk_runtime.planner.fit import fit_profile
from mpk_runtime.planner.profile import _grid2, conv_attn_shape

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# an affine-in-keys, affine-in-batch table (what the interpolation reproduces exactly)
GRID = [[b, k, 5.0 + 0.01 * k + 0.002 * b * k] for b in (1, 8, 32) for k in (64, 256, 1024)]


def _true(b, k):
    return 5.0 + 0.01 * k + 0.002 * b * k


@pytest.mark.parametrize("b,k", [(1, 64), (8, 256), (32, 1024), (4, 100), (20, 700), (64, 2048), (1, 16)])
def test_grid_interpolation_is_exact_on_bilinear_data_and_extends_past_the_grid(b, k):
    assert _grid2(GRID, b, k) == pytest.approx(_true(b, k), rel=1e-9)
    assert _grid2(GRID + GRID[:3], b, k) == pytest.approx(_true(b, k), rel=1e-9)   # a point measured twice


def test_grid_interpolation_never_goes_negative():
    assert _grid2([[1, 100, 1.0], [1, 200, 10.0]], 1, 1) == 0.0


def _with_curve(prof, cfg, pts, scale=1.0):
    key = conv_attn_shape(cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads)
    return dataclasses.replace(prof, conv_attn_us_by_shape={key: pts}, conv_attn_curve_scale=scale)


def test_a_curve_prices_the_conventional_attention_op():
    cfg = PRESETS["tiny-qwen3"]
    base = HardwareProfile.load()
    g = build_graph(cfg, batch=8, context_len=255, max_seq_len=512)
    att = g.op("L0.attention")
    without = conventional_op_us(att, g, base)
    prof = _with_curve(base, cfg, GRID, scale=1.5)
    assert conventional_op_us(att, g, prof) == pytest.approx(1.5 * _true(8, 256), rel=1e-9)
    other = _with_curve(base, PRESETS["tiny-llama"], GRID)   # a curve of another shape (2x16x4): the terms as before
    assert conventional_op_us(att, g, other) == pytest.approx(without, rel=1e-12)


def test_the_paged_kernels_curve_prices_the_op_when_it_is_on(monkeypatch):
    """MPK_CONV_TRITON_ATTN=1 (runtime/paged_attention.py): a decode step's conventional attention takes the
    "<shape>@paged" curve where the profile has one, and the gather + SDPA curve where it does not; off, the
    gather curve always."""
    cfg = PRESETS["tiny-qwen3"]
    g = build_graph(cfg, batch=8, context_len=255, max_seq_len=512)
    att = g.op("L1.attention")
    key = conv_attn_shape(cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads)
    assert conv_attn_shape(cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads, "paged") == key + "@paged"
    paged = [[b, k, 0.25 * v] for b, k, v in GRID]
    both = dataclasses.replace(HardwareProfile.load(), conv_attn_us_by_shape={key: GRID, key + "@paged": paged})
    gather_only = dataclasses.replace(both, conv_attn_us_by_shape={key: GRID})
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "1")
    assert conventional_op_us(att, g, both) == pytest.approx(0.25 * _true(8, 256), rel=1e-9)
    assert conventional_op_us(att, g, gather_only) == pytest.approx(_true(8, 256), rel=1e-9)
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "0")
    assert conventional_op_us(att, g, both) == pytest.approx(_true(8, 256), rel=1e-9)


def test_the_paged_curves_have_their_own_scale(monkeypatch):
    """conv_attn_paged_scale prices the "@paged" curves (None: conv_attn_curve_scale does), and the gather curve keeps
    conv_attn_curve_scale; segment features carry the two apart, so price_from_features (fit.py) agrees."""
    cfg = PRESETS["tiny-qwen3"]
    g = build_graph(cfg, batch=8, context_len=255, max_seq_len=512)
    att = g.op("L1.attention")
    key = conv_attn_shape(cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads)
    paged = [[b, k, 0.25 * v] for b, k, v in GRID]
    both = dataclasses.replace(HardwareProfile.load(), regimes={}, conv_attn_us_by_shape={key: GRID, key + "@paged": paged},
                               conv_attn_curve_scale=1.5, conv_attn_paged_scale=None)
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "1")
    assert conventional_op_us(att, g, both) == pytest.approx(1.5 * 0.25 * _true(8, 256), rel=1e-9)
    own = dataclasses.replace(both, conv_attn_paged_scale=1.0)
    assert conventional_op_us(att, g, own) == pytest.approx(0.25 * _true(8, 256), rel=1e-9)
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "0")
    assert conventional_op_us(att, g, own) == pytest.approx(1.5 * _true(8, 256), rel=1e-9)
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "1")
    ops = [o.name for o in g.ops]
    f = conventional_features(g, ops, own)
    assert f["attn_curve_paged_us"] > 0 and f["attn_curve_us"] == 0
    assert price_from_features(f, own) == pytest.approx(sum(conventional_op_us(o, g, own) for o in g.ops), rel=1e-9)


def test_the_default_profile_prices_the_paged_curves_as_measured():
    """B=8 since session 28, B=1 and 32 since session 29, B=128 since session 40 (h200_v46): the HBM-measured paged
    curves as measured. Until then B=128 took the gather curves' scale for them, which had priced the register-path
    appends of the whole conventional step (docs/planner.md session 40); the gather curves keep their scale."""
    prof = HardwareProfile.load()
    for b in (1, 8, 16, 32, 64, 128, 256):
        assert prof.for_batch(b).paged_scale() == 1.0, b
    p = prof.for_batch(128)
    assert p.conv_attn_curve_scale != 1.0


def test_a_head_dim_the_paged_kernel_does_not_take_is_priced_by_the_gather_curve(monkeypatch):
    """Head dim 24 (not a power of two): the runtime takes gather + SDPA there (paged_attention.enabled), so the
    planner prices it by that curve even when the profile has an "@paged" one for the shape and the switch is on."""
    cfg = dataclasses.replace(PRESETS["tiny-qwen3"], name="hd24", head_dim=24)
    g = build_graph(cfg, batch=8, context_len=255, max_seq_len=512)
    att = g.op("L1.attention")
    key = conv_attn_shape(cfg.num_kv_heads, 24, cfg.num_heads // cfg.num_kv_heads)
    paged = [[b, k, 0.25 * v] for b, k, v in GRID]
    both = dataclasses.replace(HardwareProfile.load(), conv_attn_us_by_shape={key: GRID, key + "@paged": paged})
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "1")
    assert conventional_op_us(att, g, both) == pytest.approx(_true(8, 256), rel=1e-9)


def test_prices_from_features_equal_candidate_prices_with_a_curve():
    cfg = PRESETS["tiny-qwen3"]
    prof = _with_curve(HardwareProfile.load(), cfg, GRID, scale=0.8)
    for B in (1, 8, 32):
        for p in candidates(cfg, batch=B, context=255, prof=prof):
            for s in p.segments:
                assert price_from_features(s.features, prof.for_batch(B)) == pytest.approx(s.predicted_us, rel=1e-6)
            if p.name in ("conventional", "attn-conv"):
                assert sum(s.features.get("attn_curve_us", 0) for s in p.segments) > 0


def test_fit_recovers_the_curve_scale():
    cfg = PRESETS["tiny-qwen3"]
    base = dataclasses.replace(_with_curve(HardwareProfile.load("h200_measured"), cfg, GRID), regimes={})
    true = dataclasses.replace(base, conv_attn_curve_scale=1.7, conv_fixed_scale=0.4)
    rows = []
    for B in (8, 16, 32):
        for ctx in (63, 255, 1023):
            for p in candidates(cfg, batch=B, context=ctx, prof=base, families=("conventional", "attn-conv", "attn-mk")):
                segs = [dict(kind=s.kind, ops=len(s.ops), predicted_us=s.predicted_us, features=s.features,
                             measured_us=price_from_features(s.features, true.for_batch(B))) for s in p.segments]
                rows.append(dict(model=cfg.name, batch=B, tp=1, context=ctx, plan=p.name, chosen=False, segments=segs,
                                 predicted_us=p.predicted_us,
                                 measured_us=sum(s["measured_us"] for s in segs)
                                 + true.graph_kernel_gap_us * (len(segs) - 1)))
    fitted, _ = fit_profile(rows, base, terms=("conv",))
    got = fitted.regimes["8"]
    assert got["conv_attn_curve_scale"] == pytest.approx(1.7, rel=1e-3)
    assert got["conv_fixed_scale"] == pytest.approx(0.4, rel=1e-3)
    # every attention here is priced by the curve: the KV-passes / per-key terms are not identified, so not written
    assert "conv_attn_kv_passes" not in got and "conv_attn_key_us" not in got


def test_the_nonnegative_fit_keeps_the_columns_that_explain_the_data():
    """Three columns (fixed, collectives, curve): a negative unconstrained coefficient drops that column and refits
    the others together (not one column alone, which priced the attention at 0 in session 20's review)."""
    from mpk_runtime.planner.fit import _wls
    c0 = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    c1 = [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    c2 = [5.0, 3.0, 4.0, 1.0, 2.0, 0.5]
    y = [2 * a - 0.3 * b + 3 * c for a, b, c in zip(c0, c1, c2)]
    b = _wls([c0, c1, c2], y, [1.0] * 6)
    assert b[1] == 0.0 and b[0] > 1.5 and b[2] > 2.5
    assert _wls([c0, c2], [2 * a + 3 * c for a, c in zip(c0, c2)], [1.0] * 6) == pytest.approx([2.0, 3.0])


def test_the_steps_first_attention_carries_the_once_per_step_part():
    cfg = PRESETS["tiny-qwen3"]
    key = conv_attn_shape(cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads)
    prof = dataclasses.replace(_with_curve(HardwareProfile.load(), cfg, GRID),
                               conv_attn_step_us_by_shape={key: [[b, k, 7.0] for b, k, _ in GRID]})
    g = build_graph(cfg, batch=8, context_len=255, max_seq_len=512)
    first, later = conventional_op_us(g.op("L0.attention"), g, prof), conventional_op_us(g.op("L1.attention"), g, prof)
    assert later == pytest.approx(_true(8, 256)) and first == pytest.approx(later + 7.0)


def test_the_script_writes_curves_and_a_profile_that_prices_with_them(tmp_path):
    """A CPU smoke run (--device cpu: the script's code path without CUDA graphs; its times mean nothing)."""
    r = subprocess.run([sys.executable, "scripts/profile_conv_attn.py", "--device", "cpu", "--models", "tiny-qwen3",
                        "--tp", "1,2", "--batches", "1,2", "--keys", "32,64", "--out", str(tmp_path),
                        "--merge", "h200_v33_cal", "--name", "h200_smoke"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-2000:]
    curves = json.loads((tmp_path / "conv_attn.json").read_text())["conv_attn_us_by_shape"]
    assert set(curves) == {"2x32x2", "1x32x2"}
    assert all(len(v) == 4 and all(us > 0 for _, _, us in v) for v in curves.values())
    once = json.loads((tmp_path / "conv_attn.json").read_text())["conv_attn_step_us_by_shape"]
    assert set(once) == set(curves) and all(us >= 0 for v in once.values() for _, _, us in v)
    prof = HardwareProfile.load(str(tmp_path / "h200_smoke.json"))
    assert prof.conv_attn_curve_us(2, 32, 2, 2, 64) is not None and prof.conv_attn_curve_us(4, 64, 4, 2, 64) is None


def test_a_run_over_more_keys_extends_the_merged_profiles_curves(tmp_path):
    """--merge over a profile that has the shape's curve: the new keys are added to it and the old points kept (a run
    at 16k-131k keys must not replace the 257-8193-key grid the planner prices short contexts by)."""
    def run(keys, merge, name):
        r = subprocess.run([sys.executable, "scripts/profile_conv_attn.py", "--device", "cpu", "--models",
                            "tiny-qwen3", "--tp", "1", "--batches", "1,2", "--keys", keys, "--out", str(tmp_path),
                            "--merge", merge, "--name", name], cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": ROOT})
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads((tmp_path / f"{name}.json").read_text())
    first = run("32,64", "h200_v33_cal", "h200_a")
    second = run("64,128", str(tmp_path / "h200_a.json"), "h200_b")
    for field in ("conv_attn_us_by_shape", "conv_attn_step_us_by_shape"):
        got = {(b, k): us for b, k, us in second[field]["2x32x2"]}
        assert sorted(got) == [(1, 32), (1, 64), (1, 128), (2, 32), (2, 64), (2, 128)]
        was = {(b, k): us for b, k, us in first[field]["2x32x2"]}
        assert got[(1, 32)] == was[(1, 32)] and got[(2, 32)] == was[(2, 32)]   # kept as measured
    # every other shape of the base profile is untouched
    base = json.loads(HardwareProfile.load("h200_v33_cal").to_json())["conv_attn_us_by_shape"]
    assert all(second["conv_attn_us_by_shape"][k] == v for k, v in base.items() if k != "2x32x2")


def test_the_script_measures_the_op_with_deferred_appends(tmp_path):
    """--appends: the op as the whole conventional plan runs it (the step's new K / V rows deferred into it), under
    its own curve key (a CPU smoke run: the path, not the times)."""
    r = subprocess.run([sys.executable, "scripts/profile_conv_attn.py", "--device", "cpu", "--models", "tiny-qwen3",
                        "--tp", "1", "--batches", "2", "--keys", "33", "--appends", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads((tmp_path / "conv_attn.json").read_text())
    assert set(got["conv_attn_us_by_shape"]) == {"2x32x2+append"} and got["meta"]["appends"] is True


def test_the_script_refuses_bad_input(tmp_path):
    r = subprocess.run([sys.executable, "scripts/profile_conv_attn.py", "--device", "cpu", "--batches", "1,x",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode != 0 and "comma-separated integers" in r.stderr


def test_profile_from_environment(monkeypatch, tmp_path):
    """MPK_PLANNER_PROFILE names the profile every planner not handed one loads; a missing one says what exists."""
    import json as _json
    d = _json.loads(HardwareProfile.load().to_json())
    d["name"] = "mine"
    path = tmp_path / "mine.json"
    path.write_text(_json.dumps(d))
    monkeypatch.setenv("MPK_PLANNER_PROFILE", str(path))
    assert HardwareProfile.load().name == "mine"
    assert HardwareProfile.load("h200").name != "mine"      # an explicit one wins
    monkeypatch.setenv("MPK_PLANNER_PROFILE", "no_such_profile")
    with pytest.raises(FileNotFoundError, match="known"):
        HardwareProfile.load()


def test_default_profile_prices_the_paged_kernel():
    """The conventional attention takes runtime/paged_attention.py by default where Triton is installed, so the
    default profile carries its measured curves for both models' TP=1 and TP=2 shapes (else the planner falls back
    to the gather curve, which over-prices it ~2x at small KV: session 27's first run chose attn-mk where the
    conventional plan was 7-10% faster)."""
    prof = HardwareProfile.load()
    for model in ("llama-3.2-1b", "qwen3-8b"):
        c = load_config(model)
        for tp in (1, 2):
            nkv = c.num_kv_heads // tp
            key = conv_attn_shape(nkv, c.head_dim, c.num_heads // c.num_kv_heads, "paged")
            assert key in prof.conv_attn_us_by_shape, key
            gather = prof.conv_attn_curve_us(nkv, c.head_dim, c.num_heads // c.num_kv_heads, 32, 512)
            paged = prof.conv_attn_curve_us(nkv, c.head_dim, c.num_heads // c.num_kv_heads, 32, 512, impl="paged")
            assert paged < gather, (model, tp, paged, gather)


def test_a_gpu_that_is_not_the_profiles_card_is_named():
    from mpk_runtime.planner.profile import card_mismatch
    assert card_mismatch("h200_v56", "NVIDIA H200") is None
    msg = card_mismatch("h200_v56", "NVIDIA H100 80GB HBM3")
    assert "H200" in msg and "NVIDIA H100 80GB HBM3" in msg and "MPK_PLANNER_PROFILE" in msg
    assert card_mismatch("/tmp/x/h100_measured.json", "NVIDIA H100 80GB HBM3") is None
    assert card_mismatch("h200.json", "NVIDIA H100 80GB HBM3") is not None
    assert card_mismatch("/tmp/x/measured.json", "NVIDIA H100 80GB HBM3") is None   # no card in the name


def test_a_shape_without_a_paged_curve_takes_the_nearest_at_equal_kv_bytes():
    """Session 61: qwen2.5-7b's paged attention (4 KV heads x 128 x 7 q heads each) has no measured curve; it was
    priced by the gather path's per-key floor (496 us a layer at 16384 keys, 39 measured on an H100). It now reads
    the measured paged curve of the same head dim with the nearest KV heads, at the keys of equal K / V bytes a row."""
    prof = HardwareProfile.load("h100_v2")
    assert prof.has_conv_attn_curve(4, 128, 4, "paged") and prof.paged_stand_in(4, 128, 4) is not None
    assert prof.paged_stand_in(4, 128, 7) == ("4x128x4@paged", 1.0)     # same KV heads: only the q heads differ
    key, scale = prof.paged_stand_in(2, 128, 7)
    assert key == "4x128x4@paged" and scale == 0.5
    assert prof.has_conv_attn_curve(2, 128, 7, "paged") and not prof.has_conv_attn_curve(2, 128, 7)
    for B, keys in ((1, 16384), (8, 4096), (32, 16386)):
        got = prof.conv_attn_curve_us(2, 128, 7, B, keys, impl="paged")
        assert got == pytest.approx(prof.conv_attn_curve_us(4, 128, 4, B, keys / 2, impl="paged"))
    # Past the nearest curve's last point (4x128x4 ends at 8193 keys) a curve measured that far is read instead
    # (its line past the end does not hold: the kernel takes its long-key launch shapes there).
    assert max(p[1] for p in prof.conv_attn_us_by_shape["4x128x4@paged"]) == 8193
    assert prof.paged_stand_in(2, 128, 7, 30000) == ("8x128x4@paged", 0.25)
    got = prof.conv_attn_curve_us(2, 128, 7, 32, 30000, impl="paged")
    assert got == pytest.approx(prof.conv_attn_curve_us(8, 128, 4, 32, 7500, impl="paged"))
    assert prof.paged_stand_in(4, 128, 7, 16385) == ("8x128x4@paged", 0.5)
    assert prof.paged_stand_in(4, 128, 4, 131073) == ("4x128x4@paged", 1.0)   # its own curve, however far
    assert prof.paged_stand_in(8, 96, 4) is None and not prof.has_conv_attn_curve(8, 96, 4, "paged")   # no head dim 96
    assert prof.conv_attn_curve_us(8, 96, 4, 8, 4096, impl="paged") is None


def test_the_h100_profile_has_every_tp1_preset_shape_measured():
    """Session 62: h100_v3 (the H100's profile by card) measured qwen2.5-7b's paged shape; every TP=1 preset the
    validation ran on an H100 (llama-3.2-1b, llama-3.1-8b, qwen3-8b, qwen2.5-7b) prices its paged attention from its
    own curve, not a stand-in; only a shape nobody measured still borrows one."""
    from mpk_runtime.models import PRESETS
    from mpk_runtime.planner.profile import PROFILE_BY_CARD
    prof = HardwareProfile.load(PROFILE_BY_CARD["H100"])
    for name in ("llama-3.2-1b", "llama-3.1-8b", "qwen3-8b", "qwen2.5-7b"):
        c = PRESETS[name]
        gs = c.num_heads // c.num_kv_heads
        key, factor = prof.paged_stand_in(c.num_kv_heads, c.head_dim, gs, c.max_position_embeddings)
        assert (key, factor) == (f"{c.num_kv_heads}x{c.head_dim}x{gs}@paged", 1.0), name
    q = prof.conv_attn_us_by_shape["4x128x7@paged"]
    assert {p[0] for p in q} == {1, 2, 4, 8, 16, 32, 64, 128} and max(p[1] for p in q) == 32769


def test_qwen25_conventional_attention_is_priced_from_a_paged_curve(monkeypatch):
    """The conventional plan's attention ops of a model whose shape has no curve of its own (qwen2.5-7b) take the
    stand-in curve, not the per-key floor, where the runtime runs the paged kernel."""
    from mpk_runtime.ir import build_graph
    from mpk_runtime.models import PRESETS
    from mpk_runtime.planner.cost import conv_op_terms
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "1")
    prof = HardwareProfile.load("h100_v2").for_batch(8)
    g = build_graph(PRESETS["qwen2.5-7b"], batch=8, context_len=16384)
    attn = next(o for o in g.ops if o.kind == "attention" and o.attrs.get("layer") == 1)
    t = conv_op_terms(attn, g, prof)
    assert "attn_curve_paged_us" in t and "attn_keys" not in t
    assert 20.0 < t["attn_curve_paged_us"] < 200.0     # session 61 measured ~100 us a layer at B=8 (not 592)
