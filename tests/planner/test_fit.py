"""fit.py recovers known calibration terms from synthetic measurements; prices from features equal candidates()'
prices; batch regimes; row-group re-streaming in the simulator."""
import copy
import dataclasses
import json
import os

import pytest

from mpk_runtime.ir import build_graph
from mpk_runtime.models import PRESETS
from mpk_runtime.planner import HardwareProfile, candidates, simulate
from mpk_runtime.planner.cost import price_from_features
from mpk_runtime.planner.simulate import task_stream_bytes
from mpk_runtime.planner.fit import fit_boundary, fit_profile
from mpk_runtime.planner.fit_cli import by_context, holdout
from mpk_runtime.planner.score import reprice, spearman, summarize
from mpk_runtime.tasks import Tiling, build_task_graphs

TRUE = {"1": {"mk_scale": 0.8, "mk_offset_us": 12.0, "conv_fixed_scale": 1.7, "conv_bw_fraction": 0.6,
              "conv_tc_eff": 0.5, "conv_attn_kv_passes": 2.5, "conv_attn_key_us": 0.04},
        "8": {"mk_scale": 1.3, "mk_offset_us": -20.0, "conv_fixed_scale": 0.6, "conv_bw_fraction": 0.85,
              "conv_tc_eff": 0.3, "conv_attn_kv_passes": 4.0, "conv_attn_key_us": 0.0}}


_BASE_PLANS: dict = {}


def _base_plans(name: str, B: int, base: HardwareProfile) -> list:
    """candidates() under the base profile, searched once per (model, batch) in this module (it is deterministic and
    every synthetic_rows call made the same search); each call takes its own copy of the features below."""
    key = (name, B, id(base))
    if key not in _BASE_PLANS:
        _BASE_PLANS[key] = (base, candidates(PRESETS[name], batch=B, context=64, prof=base))
    return _BASE_PLANS[key][1]


def synthetic_rows(prof_true: HardwareProfile, base: HardwareProfile) -> list[dict]:
    """Rows as validate_planner writes them, with 'measured' = the true profile's price of each segment."""
    rows = []
    for name in ("tiny-llama", "tiny-qwen3"):
        for B in (1, 2, 8, 16, 64):
            for p in _base_plans(name, B, base):
                pt = prof_true.for_batch(B)
                segs = [dict(kind=s.kind, ops=len(s.ops), first_op=s.ops[0], predicted_us=s.predicted_us,
                             features=copy.deepcopy(s.features),
                             measured_us=price_from_features(s.features, pt)) for s in p.segments]
                meas = sum(s["measured_us"] for s in segs) + pt.boundary_us * (len(segs) - 1)
                rows.append(dict(model=name, batch=B, tp=1, plan=p.name, chosen=p is candidates, segments=segs,
                                 predicted_us=p.predicted_us, measured_us=meas))
    return rows


@pytest.fixture(scope="module")
def base():
    return HardwareProfile.load("h200_measured")   # the synthetic fits were written against its terms


def test_price_from_features_equals_candidate_prices(base):
    prof = dataclasses.replace(base, regimes=TRUE)
    for B in (1, 8):
        for p in candidates(PRESETS["tiny-qwen3"], batch=B, context=64, prof=prof):
            for s in p.segments:
                assert price_from_features(s.features, prof.for_batch(B)) == pytest.approx(s.predicted_us, rel=1e-6)


def test_for_batch_applies_the_regime(base):
    prof = dataclasses.replace(base, regimes={"8": {"mk_scale": 2.0, "conv_fixed_us_by_kind": {"embed:1": 99.0}}})
    assert prof.for_batch(1).mk_scale == base.mk_scale
    p8 = prof.for_batch(32)
    assert p8.mk_scale == 2.0 and p8.regimes == {}
    assert p8.conv_fixed_us_by_kind["embed:1"] == 99.0
    assert p8.conv_fixed_us_by_kind["attention:2"] == base.conv_fixed_us_by_kind["attention:2"]  # inherited


def test_fit_recovers_known_terms(base):
    true = dataclasses.replace(base, regimes=TRUE)
    rows = synthetic_rows(true, base)
    fitted, rep = fit_profile(rows, base)
    for key, want in TRUE.items():
        got = fitted.regimes[key]
        for k, v in want.items():
            if key == "1" and k == "conv_tc_eff":
                assert got[k] >= v   # not identifiable at batch 1 (Tensor Core time never binds): the prior stays
                continue
            if key == "1" and k == "conv_attn_kv_passes":
                assert got[k] <= v   # not identifiable at batch 1-2 here: the per-key floor binds for every segment
                continue
            assert got[k] == pytest.approx(v, rel=1e-3, abs=1e-3), (key, k, got[k], v)
    s = summarize(reprice(rows, fitted))
    assert s["segment_mape"] < 1e-6
    assert all(p["regret"] == 0 for p in s["points"])


def test_fit_boundary_recovers_the_step_overlap(base):
    """A step that pays less than its segments measured alone (segment_boundary_us < 0): fit_boundary recovers the
    per-boundary term; scoped to one regime it moves that regime's steps only, and repriced steps then match."""
    true = dataclasses.replace(base, segment_boundary_us=-2.5)
    rows = synthetic_rows(true, base)
    assert max(len(r["segments"]) for r in rows) >= 3
    b, n = fit_boundary(rows, min_boundaries=2)
    assert n > 0 and b == pytest.approx(-2.5, abs=1e-9)
    assert fit_boundary(rows, min_boundaries=10_000) == (None, 0)
    assert base.boundary_us == base.graph_kernel_gap_us   # unset: the graph gap, as before
    fitted, rep = fit_profile(rows, base, terms=("boundary",), boundary_regimes=("8",), boundary_min=2)
    assert rep["boundary"]["plans"] == n
    assert fitted.for_batch(16).boundary_us == pytest.approx(-2.5)
    assert fitted.for_batch(1).boundary_us == base.graph_kernel_gap_us
    step_err = {B: max(abs(r["predicted_us"] - r["measured_us"]) for r in reprice(rows, fitted) if r["batch"] == B)
                for B in (1, 8)}
    assert step_err[8] < 1e-6 < step_err[1]   # regime 1 still prices the boundary at the graph gap
    everywhere, _ = fit_profile(rows, base, terms=("boundary",), boundary_min=2)
    assert all(abs(r["predicted_us"] - r["measured_us"]) < 1e-6 for r in reprice(rows, everywhere))


def test_holdout_reports_both_halves(base):
    rows = synthetic_rows(dataclasses.replace(base, regimes=TRUE), base)
    h = holdout(rows, base)
    assert h["half_a"] and h["half_b"] and not set(map(tuple, h["half_a"])) & set(map(tuple, h["half_b"]))
    for k in ("fit_a_test_b", "fit_b_test_a"):
        assert h[k]["test"]["segment_mape"] < 1e-3    # noise-free synthetic data: exact out of sample too
    assert h["base_profile"]["segment_mape"] > 0.05


def test_leave_one_context_out_scores_each_context_unseen(base):
    """fit --cv-context (by_context): one fold per context, each fitted without that context's rows; noise-free
    rows of one true profile are priced exactly in every held-out fold, and the pooled report sums the folds."""
    rows = synthetic_rows(dataclasses.replace(base, regimes=TRUE), base)
    rows = [dict(r, context=64 if r["model"] == "tiny-llama" else 128) for r in rows]
    cv = by_context(rows, base)
    assert sorted(cv["folds"]) == [64, 128]
    for f in cv["folds"].values():
        assert f["segment_mape"] < 1e-3 and f["max_regret"] == 0.0
        assert {p["context"] for p in f["points"]} and len({p["context"] for p in f["points"]}) == 1
    assert len(cv["pooled"]["points"]) == sum(len(f["points"]) for f in cv["folds"].values())
    assert by_context([dict(r, context=64) for r in rows], base) == {"folds": {}, "pooled": {}, "bands": {}}
    # noise-free: every held-out plan priced exactly, so each regime's band (where it has >= 10 plans) is ~0 wide
    assert cv["bands"] and all(-1e-3 <= lo <= hi <= 1e-3 for lo, hi in cv["bands"].values())


def test_held_out_bands_hold_the_central_share_per_regime():
    """held_bands (fit --cv-context --cv-bands, session 62): per regime, the order-statistic interval of measured /
    predicted - 1 over the held-out plans that holds 90% of them, rounded outwards; a regime of < 10 plans gets none."""
    from mpk_runtime.planner.fit import BATCH_REGIMES
    from mpk_runtime.planner.fit_cli import held_bands
    errs = [-0.10 + 0.01 * i for i in range(20)]   # -0.10 .. +0.09: leave one out on each side of 20
    priced = [{"batch": 8, "predicted_us": 100.0, "measured_us": 100.0 * (1 + e)} for e in errs]
    priced += [{"batch": 1, "predicted_us": 100.0, "measured_us": 150.0}] * 9   # too few for a band
    got = held_bands(priced, BATCH_REGIMES)
    assert set(got) == {"8"}
    lo, hi = got["8"]
    assert lo == pytest.approx(-0.09, abs=2e-4) and hi == pytest.approx(0.08, abs=2e-4)
    assert lo <= -0.09 and hi >= 0.08   # rounded outwards
    seen = [r["measured_us"] / r["predicted_us"] - 1.0 for r in priced if r["batch"] == 8]   # as held_bands sees them
    assert sum(lo <= e <= hi for e in seen) >= 0.9 * len(seen)


def test_spearman_and_summary_checks():
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    rows = [dict(model="m", batch=1, tp=1, plan=n, chosen=n == "mono", predicted_us=p, measured_us=q,
                 segments=[dict(predicted_us=p, measured_us=q)])
            for n, p, q in (("mono", 100, 100), ("conventional", 200, 210), ("mega2", 150, 104))]
    rows.append(dict(model="m", batch=1, tp=1, plan="per-layer", skipped="time budget"))
    s = summarize(rows, {("m", 1): 0.2})
    p = s["points"][0]
    assert p["regret"] == 0 and p["chosen_vs_best_of_mono_conv"] == 0 and p["faster_than_hf"]
    assert s["skipped"][0]["plan"] == "per-layer"
    # the same plans at another context are another point: their regret is their own, and the HF number of
    # context 512 does not apply there
    long = [dict(r, context=4096, measured_us=r["measured_us"] * (3 if r["plan"] == "mono" else 1))
            for r in rows if "measured_us" in r]
    s2 = summarize(rows + long, {("m", 1, 512): 0.2})
    pts = {p["context"]: p for p in s2["points"]}
    assert set(pts) == {512, 4096} and pts[512]["regret"] == 0 and pts[512]["faster_than_hf"]
    assert pts[4096]["best_measured"] == "mega2" and pts[4096]["regret"] > 1.0 and pts[4096]["hf_us"] is None


def test_an_unmeasured_hf_peer_is_not_a_missed_target():
    """A validation run without the HF peer (validate_planner at ctx 8192, session 73) reported "all targets met:
    False" only because no HF time was there to compare; an unmeasured target is None and not counted, a measured
    loss still fails."""
    rows = [dict(model="m", batch=1, tp=1, plan=n, chosen=n == "mono", predicted_us=p, measured_us=q,
                 segments=[dict(predicted_us=p, measured_us=q)])
            for n, p, q in (("mono", 100, 100), ("conventional", 200, 210), ("mega2", 150, 160))]
    s = summarize(rows, {})
    assert s["targets"]["faster_than_hf_everywhere"] is None and s["targets_met"] is True
    assert s["targets_unmeasured"] == ["faster_than_hf_everywhere"]
    slow = summarize(rows, {("m", 1): 0.05})   # HF 50 us, ours 100
    assert slow["targets"]["faster_than_hf_everywhere"] is False and slow["targets_met"] is False
    # one point with the peer, one without: judged on the one measured
    more = rows + [dict(r, batch=8) for r in rows]
    mixed = summarize(more, {("m", 1): 0.2})
    assert mixed["targets"]["faster_than_hf_everywhere"] is True and mixed["targets_met"] is True


def test_megakernel_row_groups_restream_weights(base):
    """The legacy CUDA-core model (mk_linear_model "row_tile", only when a profile asks for it)."""
    cfg = PRESETS["tiny-llama"]
    tgs = build_task_graphs([build_graph(cfg, batch=32)], Tiling(num_sms=8))
    legacy = dataclasses.replace(base, num_sms=8, mk_linear_model="row_tile")
    one = simulate(tgs, dataclasses.replace(legacy, row_tile=0))
    grp = simulate(tgs, dataclasses.replace(legacy, row_tile=8))
    assert grp.stream_bytes > one.stream_bytes and grp.makespan_us >= one.makespan_us
    lin = next(t for t in tgs[0].tasks if t.kind == "linear" and t.op.endswith("gate_up"))
    K = lin.reads[0].ranges[1][1]
    wbytes = 2 * (lin.params["n1"] - lin.params["n0"]) * K * 2
    assert task_stream_bytes(lin, dataclasses.replace(legacy, row_tile=8)) == lin.est_bytes + 3 * wbytes  # 4 groups


@pytest.mark.parametrize("M", [1, 2, 3, 8, 32, 128])
@pytest.mark.parametrize("name", ["qwen3-8b", "llama-3.2-1b"])
def test_simulator_passes_equal_the_packer(name, M, base):
    """Rows per pass / passes per linear tile in the simulator == what the packer hands the kernel
    (codegen/layout.linear_tile -> tc_rows; op_linear_tc loops M in tc_rows passes, op_linear in ROW_TILE),
    and the weight tile is streamed once per pass (Tensor Core model, the default)."""
    from mpk_runtime.codegen import layout as L
    from mpk_runtime.planner.simulate import linear_passes, linear_shape
    cfg = PRESETS[name].replace(num_layers=1)
    g = build_graph(cfg, batch=M, context_len=64)
    tgs = build_task_graphs([g], Tiling(num_sms=132))
    assert base.mk_linear_model == "tc"
    seen = set()
    for t in tgs[0].tasks:
        if t.kind != "linear":
            continue
        Mo, K, w, nw, kseg = linear_shape(t)
        assert Mo == M
        tc_rows, need = L.linear_geometry(Mo, K, w, nw, kseg)
        assert need <= 227 * 1024
        rows = tc_rows or L.CONSTANTS["ROW_TILE"]
        passes = -(-M // rows)
        assert linear_passes(t) == (tc_rows, passes), (t.op, M, K, w)
        assert (tc_rows > 0) == (M >= L.CONSTANTS["TC_MIN_M"]) or K % 32, (t.op, M, K, w, nw)
        wbytes = nw * w * K * 2
        assert task_stream_bytes(t, base) == pytest.approx(t.est_bytes + (passes - 1) * wbytes * base.restream_frac)
        seen.add((t.op.split(".")[-1], tc_rows, passes))
    assert seen
    if name == "qwen3-8b" and M == 128:   # K = 12288 (down) fits only 8 rows per pass, gate_up 16: many passes
        assert ("down", 8, 16) in seen and ("gate_up", 16, 8) in seen
    if M <= 2:
        assert all(tc == 0 and p == 1 for _, tc, p in seen)


def test_packer_geometry_is_the_layout_function():
    """One definition: the packer packs codegen/layout.linear_tile, whose rows and bytes are linear_geometry's (the
    simulator's); these tiles all hold whole input rows (no x chunks)."""
    from mpk_runtime.codegen import layout as L
    from mpk_runtime.runtime.packer import SMEM_BUDGET
    assert SMEM_BUDGET == L.SMEM_BUDGET
    for args in [(1, 2048, 64, 2, 1), (8, 4096, 32, 1, 1), (32, 2048, 16, 1, 1), (128, 12288, 32, 1, 1),
                 (128, 12288, 64, 1, 1), (32, 4096, 96, 2, 1), (64, 4096, 32, 1, 2)]:
        assert L.linear_tile(*args) == L.linear_geometry(*args) + (1,)
    assert L.linear_passes(128, 12288, 32, 1, 1) == (8, 16)
    assert L.linear_passes(2, 4096, 32, 1, 1) == (8, 1)


def test_tensor_core_model_is_cheaper_than_the_legacy_one_at_batch_32(base):
    cfg = PRESETS["tiny-llama"]
    tgs = build_task_graphs([build_graph(cfg, batch=32)], Tiling(num_sms=8))
    tc = simulate(tgs, dataclasses.replace(base, num_sms=8, row_tile=8))
    legacy = simulate(tgs, dataclasses.replace(base, num_sms=8, row_tile=8, mk_linear_model="row_tile"))
    assert tc.stream_bytes < legacy.stream_bytes


def test_grid_fixed_cost_terms_apply_to_a_copy():
    from mpk_runtime.planner.fit import with_terms
    from mpk_runtime.planner.fit_cli import _grid
    from mpk_runtime.planner.profile import HardwareProfile
    base = HardwareProfile.load("h200_measured")
    before = dict(base.task_fixed_us_by_kind)
    combos = _grid("fixed.qkv_rope=4,12;mk_tc_eff=0.5")
    assert len(combos) == 2
    p = with_terms(base, combos[1])
    assert p.task_fixed_us_by_kind["qkv_rope"] == 12.0 and p.mk_tc_eff == 0.5
    assert p.task_fixed_us_by_kind["attn_partial"] == before["attn_partial"]
    assert base.task_fixed_us_by_kind == before            # the base profile is not modified
    assert p.fixed_us("qkv_rope") == 12.0 and base.fixed_us("qkv_rope") == before["qkv_rope"]
    flops = dict(base.flop_us_by_kind)
    q = with_terms(base, _grid("flop.attn_partial=3e-6;fixed.attn_partial=2")[0])
    assert q.flop_us("attn_partial") == 3e-6 and q.fixed_us("attn_partial") == 2.0
    assert base.flop_us_by_kind == flops and q.flop_us("linear") == base.flop_us("linear")
    with pytest.raises(AssertionError, match="--grid field"):
        _grid("attn_partial=3e-6")


def test_conventional_collectives_priced_at_tp2(base):
    """TP > 1: every conventional all-reduce and the distributed argmax pay conv_collective_us (features and the
    cost function agree); TP = 1 segments have none."""
    regs = {k: dict(v, conv_collective_us=0.0) for k, v in TRUE.items()}
    p0 = dataclasses.replace(base, regimes=regs)
    p1 = dataclasses.replace(base, regimes={k: dict(v, conv_collective_us=50.0) for k, v in TRUE.items()})
    cfg = PRESETS["tiny-qwen3"]
    a = {p.name: p for p in candidates(cfg, tp=2, batch=2, context=64, prof=p0, families=("conventional",))}
    b = {p.name: p for p in candidates(cfg, tp=2, batch=2, context=64, prof=p1, families=("conventional",))}
    seg0, seg1 = a["conventional"].segments[0], b["conventional"].segments[0]
    n = seg1.features["n_coll"]
    assert n == 2 * cfg.num_layers + 1        # two all-reduces per layer + the distributed argmax
    assert seg1.predicted_us - seg0.predicted_us == pytest.approx(50.0 * n, rel=1e-9)
    assert price_from_features(seg1.features, p1.for_batch(2)) == pytest.approx(seg1.predicted_us, rel=1e-6)
    one = candidates(cfg, tp=1, batch=2, context=64, prof=p1, families=("conventional",))[0]
    assert one.segments[0].features["n_coll"] == 0


def test_conventional_attention_per_key_floor(base):
    """Conventional attention: the larger of its KV passes at bandwidth and its per-key floor; features recorded
    before the floor existed (no "attn" list) are priced by the bandwidth term alone."""
    from mpk_runtime.planner.cost import conv_attn_us
    f = {"kind": "conventional", "fixed_us": 10.0, "attn_kv_us": 2.0, "n_coll": 0, "st": [],
         "attn": [[1.0, 4097.0, 2]]}
    p = dataclasses.replace(base, conv_attn_kv_passes=5.0, conv_attn_key_us=0.0)
    assert conv_attn_us(f, p.conv_attn_kv_passes, p.conv_attn_key_us) == pytest.approx(10.0)                        # 2 ops x 1 us x 5 passes
    p = dataclasses.replace(base, conv_attn_kv_passes=5.0, conv_attn_key_us=0.03)
    assert conv_attn_us(f, p.conv_attn_kv_passes, p.conv_attn_key_us) == pytest.approx(2 * 4097 * 0.03)             # the floor binds
    old = {k: v for k, v in f.items() if k != "attn"}
    assert conv_attn_us(old, p.conv_attn_kv_passes, p.conv_attn_key_us) == pytest.approx(10.0)
    cfg = PRESETS["tiny-llama"]
    for B, ctx in ((1, 64), (8, 1000)):
        plans = candidates(cfg, batch=B, context=ctx, prof=p, families=("conventional",))
        s = plans[0].segments[0]
        keys = [n for _, n, _ in s.features["attn"]]
        assert keys == [pytest.approx(ctx + 1)]                             # keys read per row, from the op
        assert price_from_features(s.features, p.for_batch(B)) == pytest.approx(s.predicted_us, rel=1e-9)


def test_rows_are_resimulated_under_the_environment_they_were_measured_in(base, tmp_path, monkeypatch):
    """load_rows' `path@VAR=VALUE`: rows measured before a switch became the default (here grouped attention tasks,
    auto since session 17) are re-planned with the switch as it was, so the fit compares like with like; the
    process environment is left as it was."""
    from mpk_runtime.planner.score import load_rows, resimulate
    monkeypatch.delenv("MPK_ATT_GROUPS", raising=False)
    B = 128   # tiny-qwen3: 128 sequences x 2 KV heads = 256 units >= 1.5 x 132 SMs: auto groups them in twos
    rows = synthetic_rows_at("tiny-qwen3", B, base)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    now, then = load_rows(str(path)), load_rows(f"{path}@MPK_ATT_GROUPS=1")
    assert all("env" not in r for r in now) and all(r["env"] == {"MPK_ATT_GROUPS": "1"} for r in then)
    a, b = resimulate(now, base, procs=1), resimulate(then, base, procs=1)
    assert len(a) == len(b) == len(rows) and "MPK_ATT_GROUPS" not in os.environ
    mono = [next(r for r in x if r["plan"] == "mono")["segments"][0]["features"]["sim_us"] for x in (a, b)]
    assert mono[0] != mono[1]   # one task per two groups vs one per group: a different schedule
    monkeypatch.setenv("MPK_ATT_GROUPS", "1")                 # the same plan as the process-wide switch gives
    c = resimulate(now, base, procs=1)
    assert next(r for r in c if r["plan"] == "mono")["segments"][0]["features"]["sim_us"] == mono[1]
    with pytest.raises(ValueError, match="path@VAR=VALUE"):
        load_rows(f"{path}@MPK_ATT_GROUPS")


def synthetic_rows_at(name: str, B: int, base: HardwareProfile) -> list[dict]:
    return [dict(model=name, batch=B, tp=1, context=64, plan=p.name, predicted_us=p.predicted_us, measured_us=1.0,
                 segments=[dict(kind=s.kind, ops=len(s.ops), predicted_us=s.predicted_us, features=s.features,
                                measured_us=1.0) for s in p.segments])
            for p in candidates(PRESETS[name], batch=B, context=64, prof=base)]


def test_plans_split_attention_like_the_bench_and_old_rows_keep_their_rule(base):
    """Every plan's attention splits come from tasks.tiling.attn_splits_for (what the one-megakernel bench runs);
    candidates(splits=n) prices n; rows that record no attn_splits (validate rows before session 18) are re-priced
    under the rule they ran with (search.legacy_attn_splits), rows that record it under theirs."""
    from mpk_runtime.planner.score import resimulate
    from mpk_runtime.planner.search import legacy_attn_splits
    from mpk_runtime.tasks.tiling import attn_splits_for
    cfg = PRESETS["tiny-llama"]
    new, old = attn_splits_for(1, cfg.num_kv_heads, 512), legacy_attn_splits(cfg, 1, 1, 512, base.num_sms)
    assert (new, old) == (8, 2)
    assert {p.attn_splits for p in candidates(cfg, batch=1, context=512, prof=base, families=("mono",))} == {new}
    assert candidates(cfg, batch=1, context=512, prof=base, families=("mono",), splits=old)[0].attn_splits == old
    with pytest.raises(ValueError, match="splits must be >= 1"):
        candidates(cfg, batch=1, context=512, prof=base, families=("mono",), splits=0)
    sims = {}
    for s in (old, new):
        p = candidates(cfg, batch=1, context=512, prof=base, families=("mono",), splits=s)[0]
        sims[s] = p.segments[0].features["sim_us"]
    row = dict(model="tiny-llama", batch=1, tp=1, context=512, plan="mono", predicted_us=1.0, measured_us=1.0,
               segments=[dict(kind="megakernel", ops=len(p.segments[0].ops), first_op=p.segments[0].ops[0],
                              measured_us=1.0, predicted_us=1.0, features={})])
    legacy, recorded = resimulate([row], base, procs=1), resimulate([dict(row, attn_splits=new)], base, procs=1)
    assert legacy[0]["segments"][0]["features"]["sim_us"] == sims[old] != sims[new]
    assert recorded[0]["segments"][0]["features"]["sim_us"] == sims[new]


def test_load_rows_reads_gzipped_results(tmp_path):
    """bench/results keeps planner_validation.json (and JSONL rows) gzipped: load_rows reads both forms alike."""
    import gzip
    from mpk_runtime.planner.score import load_rows
    row = dict(model="m", batch=8, plan="mono", segments=[])
    (tmp_path / "v.json").write_text(json.dumps({"rows": [row]}))
    with gzip.open(tmp_path / "v.json.gz", "wt") as f:
        json.dump({"rows": [row]}, f)
    with gzip.open(tmp_path / "r.jsonl.gz", "wt") as f:
        f.write(json.dumps(row) + "\n")
    got = [load_rows(str(tmp_path / n)) for n in ("v.json", "v.json.gz", "r.jsonl.gz")]
    assert got[0] == got[1] == got[2] == [row]


def test_attention_only_megakernels_get_their_own_factor(base):
    """attn-mk's megakernel segments (attention tasks alone) are priced times mk_attn_factor; fit.py fits the
    factor beside mk_scale / mk_offset_us (fitted on the whole-layer segments), and rows written before the feature
    existed tell it from their segments' op count and first op."""
    true_regimes = {k: dict(v, mk_attn_factor=f) for (k, v), f in zip(TRUE.items(), (1.1, 0.9))}
    true = dataclasses.replace(base, regimes=true_regimes)
    plans = {p.name: p for p in candidates(PRESETS["tiny-llama"], batch=8, context=64, prof=true)}
    attn = [s for s in plans["attn-mk"].segments if s.kind == "megakernel"]
    assert attn and all(s.features["attn_only"] for s in attn)
    assert not any(s.features["attn_only"] for s in plans["mono"].segments)
    p8 = true.for_batch(8)
    s = attn[0]
    assert s.predicted_us == pytest.approx(0.9 * price_from_features(dict(s.features, attn_only=False), p8))
    rows = synthetic_rows(true, base)
    fitted, _rep = fit_profile(rows, base)
    for key, f in (("1", 1.1), ("8", 0.9)):
        assert fitted.regimes[key]["mk_attn_factor"] == pytest.approx(f, rel=1e-3)
        assert fitted.regimes[key]["mk_scale"] == pytest.approx(TRUE[key]["mk_scale"], rel=1e-3)
    # an older row: no attn_only in its features; one op, an attention -> the factor applies
    old = [dict(r, segments=[dict(sg, features={k: v for k, v in sg["features"].items() if k != "attn_only"},
                                  first_op="L0.attention" if sg["features"].get("attn_only") else "embed")
                             for sg in r["segments"]]) for r in rows]
    a = summarize(reprice(rows, fitted))
    b = summarize(reprice(old, fitted))
    assert a["segment_mape"] < 1e-6 and b["segment_mape"] == pytest.approx(a["segment_mape"], abs=1e-9)


def test_rows_are_resimulated_with_the_conventional_attention_they_ran(monkeypatch):
    """MPK_CONV_TRITON_ATTN unset means the paged Triton kernel where Triton is installed (the GPU machine) and
    the gather + SDPA path where it is not (CI, a laptop): a row recorded without the switch is re-planned with the
    attention its conventional segment was priced as, whatever this machine has, so a CPU refit compares like
    with like. Rows that record the switch keep it."""
    from mpk_runtime.planner.score import resimulate
    prof = HardwareProfile.load("h200_v41")
    rows = {}
    for flag in ("1", "0"):   # as a GPU run with Triton priced it, and as one without
        monkeypatch.setenv("MPK_CONV_TRITON_ATTN", flag)
        p = candidates(PRESETS["llama-3.2-1b"], batch=1, context=512, prof=prof, families=("conventional",))[0]
        rows[flag] = dict(model="llama-3.2-1b", batch=1, tp=1, context=512, attn_splits=p.attn_splits,
                          attn_wide_passes=True, plan=p.name, predicted_us=p.predicted_us, measured_us=1.0,
                          segments=[dict(kind=s.kind, ops=len(s.ops), first_op=s.ops[0], predicted_us=s.predicted_us,
                                         features=s.features, measured_us=1.0) for s in p.segments])
    paged = [s for s in rows["1"]["segments"] if s["features"].get("attn_curve_paged_us", 0) > 0]
    assert paged and rows["1"]["predicted_us"] != pytest.approx(rows["0"]["predicted_us"], rel=1e-3)
    for here in ("0", "1"):   # this machine's default either way
        monkeypatch.setenv("MPK_CONV_TRITON_ATTN", here)
        for flag, row in rows.items():
            got = resimulate([row], prof, procs=1)[0]
            assert got["predicted_us"] == pytest.approx(row["predicted_us"], rel=1e-9), (here, flag)
            assert "conv_paged" not in got or got["conv_paged"] == (flag == "1")
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "0")   # a row that records the switch is re-planned under it
    forced = resimulate([dict(rows["1"], env={"MPK_CONV_TRITON_ATTN": "0"})], prof, procs=1)[0]
    assert forced["predicted_us"] == pytest.approx(rows["0"]["predicted_us"], rel=1e-9)


def test_terms_chosen_on_some_batches_price_only_those(base):
    """planner.fit --batches: a grid term chosen on batch-1 / 8 rows goes into those regimes' overrides; the other
    regimes (and the global field) keep the base's value, so their prices do not move."""
    from mpk_runtime.planner.fit import scoped_terms
    prof = dataclasses.replace(base, regimes={"1": {"mk_scale": 1.1}, "8": {"mk_scale": 1.2}, "32": {"mk_scale": 1.3}})
    combo = (("fixed.attn_partial", 7.0), ("linear_pass_us", 2.0))
    got = scoped_terms(prof, base, combo, {"1", "8"})
    assert got.task_fixed_us_by_kind == base.task_fixed_us_by_kind and got.linear_pass_us == base.linear_pass_us
    for B in (1, 8):
        p = got.for_batch(B)
        assert p.fixed_us("attn_partial") == 7.0 and p.linear_pass_us == 2.0 and p.mk_scale == prof.regimes[str(B)]["mk_scale"]
        assert p.fixed_us("linear") == base.fixed_us("linear")   # the other kinds inherited
    p32 = got.for_batch(32)
    assert p32.fixed_us("attn_partial") == base.fixed_us("attn_partial") and p32.linear_pass_us == base.linear_pass_us
    assert p32.mk_scale == 1.3
    cfg = PRESETS["tiny-qwen3"]   # and the simulated mono step moves at B=1 only
    for B, moves in ((1, True), (32, False)):
        a = candidates(cfg, batch=B, context=64, prof=prof, families=("mono",))[0].segments[0].features["sim_us"]
        b = candidates(cfg, batch=B, context=64, prof=got, families=("mono",))[0].segments[0].features["sim_us"]
        assert (a != b) == moves, B


def test_keep_attn_refits_whole_layer_segments_and_leaves_attention_prices(base):
    """fit --keep-attn (session 35): the whole-layer megakernel segments' mk_scale is fitted with the base's offset
    kept, and attention-only segments keep the base's scale (mk_attn_scale), offset and factor, so their prices do
    not move. Synthetic rows: whole-layer segments measured at scale 1.5 with the base regime's offset; attention-only
    ones at the base's own price. The fit recovers 1.5 and re-prices the attention segments exactly as the base did;
    the grid's pass.<rows> terms land in tc_pass_us_by_rows."""
    from mpk_runtime.planner.fit import with_terms
    regs = {k: dict(v, mk_attn_factor=f) for (k, v), f in zip(TRUE.items(), (1.1, 0.9))}
    b0 = dataclasses.replace(base, regimes=regs)
    true = dataclasses.replace(base, regimes={k: dict(v, mk_scale=1.5) for k, v in regs.items()})
    rows = []
    for name in ("tiny-llama", "tiny-qwen3"):
        for B in (8, 16):
            for p in candidates(PRESETS[name], batch=B, context=64, prof=b0):
                segs = []
                for s in p.segments:
                    f = s.features
                    pt = (b0 if f.get("attn_only") else true).for_batch(B)
                    segs.append(dict(kind=s.kind, ops=len(s.ops), predicted_us=s.predicted_us, features=f,
                                     measured_us=price_from_features(f, pt)))
                rows.append(dict(model=name, batch=B, tp=1, plan=p.name, chosen=False, segments=segs,
                                 predicted_us=p.predicted_us, measured_us=sum(s["measured_us"] for s in segs)))
    fitted, _ = fit_profile(rows, b0, regimes=((1, "1"), (8, "8")), terms=("mk",), keep_attn=True)
    r8 = fitted.regimes["8"]
    assert r8["mk_scale"] == pytest.approx(1.5, rel=1e-6)
    assert r8["mk_offset_us"] == TRUE["8"]["mk_offset_us"] and r8["mk_attn_factor"] == 0.9
    assert r8["mk_attn_scale"] == TRUE["8"]["mk_scale"]
    attn = [s for r in rows for s in r["segments"] if s["features"].get("attn_only")]
    assert attn
    for s in attn:
        assert price_from_features(s["features"], fitted.for_batch(8)) == pytest.approx(s["measured_us"], rel=1e-9)
    unkept, _ = fit_profile(rows, b0, regimes=((1, "1"), (8, "8")), terms=("mk",))
    assert "mk_attn_scale" not in unkept.regimes["8"]
    assert with_terms(b0, (("pass.8", 1.5), ("pass.32", 9.0))).tc_pass_us_by_rows == {"8": 1.5, "32": 9.0}


def test_conv_weight_plan_gives_a_whole_step_plan_its_share(base):
    """conv_weight="plan": each plan's conventional segments share one weight, so the one-segment conventional
    plan counts as much as a plan of many small conventional segments. With that plan's step measured 30% above
    the true price, the plan-weighted fit prices it closer than the per-segment fit; on exact rows both recover
    the terms."""
    true = dataclasses.replace(base, regimes=TRUE)
    rows = synthetic_rows(true, base)
    for r in rows:
        if r["plan"] == "conventional" and r["batch"] >= 8:
            r["segments"] = [dict(s, measured_us=1.3 * s["measured_us"]) for s in r["segments"]]
            r["measured_us"] *= 1.3
    many = max(sum(s["kind"] == "conventional" for s in r["segments"]) for r in rows if r["batch"] >= 8)
    assert many >= 4   # plans of several conventional segments share the regime with the one-segment plan

    def conv_err(prof):
        return max(abs(r["predicted_us"] / r["measured_us"] - 1) for r in reprice(rows, prof)
                   if r["plan"] == "conventional" and r["batch"] >= 8)
    by_seg, _ = fit_profile(rows, base, terms=("conv",))
    by_plan, _ = fit_profile(rows, base, terms=("conv",), conv_weight="plan")
    assert conv_err(by_plan) < conv_err(by_seg) - 0.01
    exact = synthetic_rows(true, base)
    fitted, _ = fit_profile(exact, base, terms=("conv",), conv_weight="plan")
    assert fitted.regimes["8"]["conv_fixed_scale"] == pytest.approx(TRUE["8"]["conv_fixed_scale"], rel=1e-3)
    with pytest.raises(ValueError, match="conv_weight 'time': expected segment or plan"):
        fit_profile(rows, base, conv_weight="time")


def test_rows_from_before_the_bf16_argmax_are_resimulated_with_the_copy(monkeypatch):
    """A row that does not record MPK_CONV_BF16_ARGMAX and whose plans were priced without the skipped logits copy
    (every row before session 43, when the runtime always made the copy) is re-planned with the switch off, whatever
    the default now; one priced with it (features carry logits_copy_us) with it on; a recorded switch wins."""
    from mpk_runtime.planner.score import resimulate
    prof = HardwareProfile.load("h200_v48")
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "1")   # as the rows record it (the paged curves)
    rows = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("MPK_CONV_BF16_ARGMAX", flag)
        p = candidates(PRESETS["llama-3.2-1b"], batch=32, context=512, prof=prof, families=("conventional",))[0]
        rows[flag] = dict(model="llama-3.2-1b", batch=32, tp=1, context=512, attn_splits=p.attn_splits,
                          attn_wide_passes=True, plan=p.name, predicted_us=p.predicted_us, measured_us=1.0,
                          env={"MPK_CONV_TRITON_ATTN": "1"},
                          segments=[dict(kind=s.kind, ops=len(s.ops), first_op=s.ops[0], predicted_us=s.predicted_us,
                                         features=s.features, measured_us=1.0) for s in p.segments])
    assert rows["0"]["predicted_us"] - rows["1"]["predicted_us"] > 10   # ~12 us at B=32 (cost.logits_copy_saved_us)
    monkeypatch.delenv("MPK_CONV_BF16_ARGMAX")   # the default (on)
    for flag, row in rows.items():
        got = resimulate([row], prof, procs=1)[0]
        assert got["predicted_us"] == pytest.approx(row["predicted_us"], rel=1e-9), flag
    forced = resimulate([dict(rows["0"], env={"MPK_CONV_TRITON_ATTN": "1", "MPK_CONV_BF16_ARGMAX": "1"})], prof,
                        procs=1)[0]
    assert forced["predicted_us"] == pytest.approx(rows["1"]["predicted_us"], rel=1e-9)


def test_segments_holding_attention_among_other_ops_get_their_own_term(base):
    """mk_mixed_attn_us (session 47): a megakernel segment holding a layer's attention among other ops (mono, megaN,
    per-layer) pays it once; attn-conv's segments (no attention) and attn-mk's (attention alone) do not. fit.py fits
    it beside mk_scale / mk_offset_us, and rows written before the feature tell it from op count and first op."""
    true_regimes = {k: dict(v, mk_mixed_attn_us=x) for (k, v), x in zip(TRUE.items(), (9.0, 6.0))}
    true = dataclasses.replace(base, regimes=true_regimes)
    plans = {p.name: p for p in candidates(PRESETS["tiny-llama"], batch=1, context=64, prof=true,
                                           families=("mono", "mega2", "attn-conv", "attn-mk"))}
    def mixed(name):
        return [s.features.get("attn_mixed") for s in plans[name].segments if s.kind == "megakernel"]
    assert mixed("mono") == [True] and mixed("mega2") == [True, True]   # (two layers: mega2 is per-layer here)
    assert not any(mixed("attn-conv")) and not any(mixed("attn-mk"))
    s = plans["mono"].segments[0]
    p1 = true.for_batch(1)
    assert s.predicted_us == pytest.approx(price_from_features(dict(s.features, attn_mixed=False), p1) + 9.0)
    rows = synthetic_rows(true, base)
    fitted, _rep = fit_profile(rows, base)
    for key, x in (("1", 9.0), ("8", 6.0)):
        assert fitted.regimes[key]["mk_mixed_attn_us"] == pytest.approx(x, rel=1e-3, abs=1e-3)
        assert fitted.regimes[key]["mk_offset_us"] == pytest.approx(TRUE[key]["mk_offset_us"], rel=1e-3)
    # older rows: no attn_mixed in the features; their op count and first op tell it
    from mpk_runtime.planner.score import features
    for r in rows:
        for sg in r["segments"]:
            if sg["kind"] != "megakernel":
                continue
            f = {k: v for k, v in sg["features"].items() if k != "attn_mixed"}
            assert features(dict(sg, features=f))["attn_mixed"] == sg["features"]["attn_mixed"], (r["plan"], sg)


def test_a_price_per_attention_layer_beyond_the_first(base):
    """mk_attn_layer_us (session 48): a mixed segment pays it for every attention layer beyond its first (mono over
    tiny-llama's two layers once, per-layer segments never); fit.py's `mklayer` term recovers a planted value with the
    offset kept (--keep-attn), and rows written before the feature tell the layer count from their op count."""
    true_regimes = {k: dict(v, mk_attn_layer_us=x) for (k, v), x in zip(TRUE.items(), (7.0, 30.0))}
    true = dataclasses.replace(base, regimes=true_regimes)
    plans = {p.name: p for p in candidates(PRESETS["tiny-llama"], batch=8, context=64, prof=true,
                                           families=("mono", "mega2", "attn-mk"))}
    mono = plans["mono"].segments[0]
    assert mono.features["attn_layers"] == 2
    assert [s.features["attn_layers"] for s in plans["mega2"].segments if s.kind == "megakernel"] == [1, 1]
    p8 = true.for_batch(8)
    assert mono.predicted_us == pytest.approx(price_from_features(dict(mono.features, attn_layers=1), p8) + 30.0)
    rows = synthetic_rows(true, base)
    fitted, _rep = fit_profile(rows, dataclasses.replace(base, regimes=TRUE), terms=("mklayer",), keep_attn=True)
    for key, x in (("1", 7.0), ("8", 30.0)):
        assert fitted.regimes[key]["mk_attn_layer_us"] == pytest.approx(x, rel=1e-3, abs=1e-3)
        assert fitted.regimes[key]["mk_scale"] == pytest.approx(TRUE[key]["mk_scale"], rel=1e-3)
    from mpk_runtime.planner.score import features
    for r in rows:
        for sg in r["segments"]:
            if sg["kind"] == "megakernel":
                f = {k: v for k, v in sg["features"].items() if k != "attn_layers"}
                got = features(dict(sg, features=f))["attn_layers"]
                assert got == (sg["features"]["attn_layers"] if sg["features"]["attn_mixed"] or
                               sg["features"]["attn_only"] else 0), (r["plan"], sg)
