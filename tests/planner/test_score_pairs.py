"""planner/score.py resolved_pairs: plan pairs whose measured steps differ beyond noise, and how many of them the
prediction orders as measured (reported beside Spearman)."""
from mpk_runtime.planner.score import resolved_pairs, summarize


def _row(plan, pred, meas, band=None, chosen=False):
    r = {"model": "m", "tp": 1, "batch": 32, "context": 512, "plan": plan, "chosen": chosen,
         "predicted_us": pred, "measured_us": meas, "segments": [{"predicted_us": pred, "measured_us": meas}]}
    if band:
        r["measured_q_us"] = list(band)
    return r


def test_near_ties_are_not_counted_and_a_misordered_resolved_pair_is():
    # mono / mega2 measure within 0.5% in the opposite order to their predictions (a tie: not resolved); both are
    # 4x the chosen plan, which the prediction ranks first (two resolved pairs, ordered)
    rows = [_row("attn-mk", 1000, 1000, chosen=True), _row("mono", 4000, 4010), _row("mega2", 4010, 3995)]
    assert resolved_pairs(rows) == (2, 2)
    s = summarize(rows)
    assert s["points"][0]["spearman"] < 0.9 and s["points"][0]["pairs_ordered"] == "2/2"
    assert s["resolved_pairs_ordered"] == 1.0
    # a resolved pair predicted the wrong way round counts against it
    rows.append(_row("conventional", 900, 2000))
    assert resolved_pairs(rows) == (4, 5)


def test_overlapping_quartile_bands_leave_a_pair_unresolved():
    a = _row("a", 100, 100, band=(95, 106))
    b = _row("b", 90, 103, band=(101, 108))   # 3% apart, but the bands overlap: noise
    assert resolved_pairs([a, b]) == (0, 0)
    b["measured_q_us"] = [102, 108]
    a["measured_q_us"] = [95, 101]
    assert resolved_pairs([a, b]) == (0, 1)   # separated, and predicted the wrong way round


def test_each_point_reports_its_own_step_mape():
    rows = [_row("attn-mk", 1100, 1000, chosen=True), _row("mono", 3600, 4000)]   # +10%, -10%
    other = dict(_row("mono", 500, 500), batch=8)                                  # another point, exact
    s = summarize(rows + [other])
    by_batch = {p["batch"]: p["step_mape"] for p in s["points"]}
    assert by_batch == {32: 0.1, 8: 0.0}
    assert abs(s["step_mape"] - 0.2 / 3) < 1e-9
