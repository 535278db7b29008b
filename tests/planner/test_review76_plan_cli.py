"""Session 76's review of `python -m mpk_runtime plan` as a user meets it: a profile whose rates are 0 or negative,
--context 0 in the graph view and an --sms far past any GPU were tracebacks, a hang or a refusal of a flag never
given; each is now planned or one clear error (exit code 2)."""
import json

import pytest

import mpk_runtime.ir as ir
from mpk_runtime.__main__ import MAX_PLAN_SMS, main
from mpk_runtime.planner.profile import _DIR, HardwareProfile


def _err(capsys, argv) -> str:
    """main(argv) must fail with exit code 2 and one line on stderr (no traceback); the line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _profile(tmp_path, **changes) -> str:
    with open(f"{_DIR}/h100_v4.json") as f:
        d = json.load(f)
    d.update(changes)
    p = tmp_path / "prof.json"
    p.write_text(json.dumps(d))
    return str(p)


@pytest.mark.parametrize("field,value", [
    ("tc_flops_per_s", 0),                        # ZeroDivisionError in simulate._mma_us
    ("mk_tc_eff", 0),                             # the same
    ("wgmma_m", 0),                               # ZeroDivisionError in tc_time_us
    ("hbm_bw_by_sms", {"1": 0.0}),               # ZeroDivisionError in simulate
    ("hbm_bw_by_sms", {"1": -5.0}),              # the simulation never ended
    ("hbm_bw_by_sms", {"1": -5.0, "132": -9.0}),  # "error: math domain error"
    ("stream_eff_by_kind", {"linear": 0.0}),      # ZeroDivisionError
    ("kv_piece_eff_by_bytes", {"128": 0.0}),      # ZeroDivisionError
    ("regimes", {"8": {"conv_bw_fraction": 0}}),   # a regime's override of a rate
])
def test_a_profile_rate_of_zero_or_less_is_a_clear_error(tmp_path, capsys, monkeypatch, field, value):
    """A profile JSON (hand-edited, or another tool's) with a bandwidth, flop rate or efficiency of 0 loaded and
    failed deep in the search with a ZeroDivisionError traceback (exit 1); a negative bandwidth curve hung the
    search or printed "error: math domain error". _check_fields refused 0 SMs but not 0 bandwidth."""
    import mpk_runtime.planner as planner

    def reached(*a, **k):   # a refused profile must stop before any pricing (the negative curve never returned)
        raise AssertionError("priced with a bad profile")
    monkeypatch.setattr(planner, "candidates", reached)
    path = _profile(tmp_path, **{field: value})
    err = _err(capsys, ["plan", "--model", "tiny-llama", "--search", "--batch", "8", "--profile", path])
    assert path in err and field.split("_by")[0] in err and "> 0" in err
    if field != "regimes":
        assert field in err
    with pytest.raises(ValueError, match="not > 0"):
        HardwareProfile.load(path)


def test_every_shipped_profile_has_positive_rates():
    import os
    for f in sorted(os.listdir(_DIR)):
        if f.endswith(".json"):
            HardwareProfile.load(f[:-5])


def test_context_0_graph_view_is_planned(capsys):
    """`plan --context 0` (the search takes it) was refused as "--attn-splits 1: at most 0 here": a flag not given,
    and no value it could take. A decode step at context 0 still reads its own key: one split."""
    assert main(["plan", "--model", "tiny-llama", "--context", "0"]) == 0
    assert "ctx=0" in capsys.readouterr().out
    err = _err(capsys, ["plan", "--model", "tiny-llama", "--context", "0", "--attn-splits", "2"])
    assert "--attn-splits 2" in err and "at most 1" in err


def test_context_below_0_in_the_graph_view_names_the_context(capsys):
    err = _err(capsys, ["plan", "--model", "tiny-llama", "--context", "-5"])
    assert "--attn-splits" not in err and "-5" in err


def test_sms_far_past_any_gpu_is_refused_before_any_work(capsys, monkeypatch):
    """`plan --sms 1000000000` built a task list and a simulator heap entry per SM: a MemoryError traceback after
    ~15 s (--sms 10^7: ~10 s for tiny-llama's 163 tasks). Now one line, before any graph is built."""
    def reached(*a, **k):
        raise AssertionError("built a graph")
    monkeypatch.setattr(ir, "build_graph", reached)
    err = _err(capsys, ["plan", "--model", "tiny-llama", "--sms", "1000000000"])
    assert "--sms 1000000000" in err and str(MAX_PLAN_SMS) in err


def test_sms_at_the_limit_is_planned(capsys):
    assert main(["plan", "--model", "tiny-llama", "--sms", str(MAX_PLAN_SMS), "--no-check"]) == 0
    assert f"on {MAX_PLAN_SMS} SMs" in capsys.readouterr().out


@pytest.mark.parametrize("value,bad", [("no-such-profile", None), (None, "{bad json")])
def test_a_bad_profile_from_the_environment_names_the_variable(tmp_path, capsys, monkeypatch, value, bad):
    """`MPK_PLANNER_PROFILE=... plan --search` (no --profile) with a name that is not a profile, or a file that is not
    one, said "no hardware profile 'no-such-profile'": a name the user never typed here, and nothing about the
    variable it came from."""
    if bad is not None:
        value = str(tmp_path / "p.json")
        (tmp_path / "p.json").write_text(bad)
    monkeypatch.setenv("MPK_PLANNER_PROFILE", value)
    err = _err(capsys, ["plan", "--model", "tiny-llama", "--search"])
    assert value in err and "MPK_PLANNER_PROFILE" in err
    err = _err(capsys, ["plan", "--model", "tiny-llama", "--search", "--profile", value])   # typed: no mention
    assert "MPK_PLANNER_PROFILE" not in err


def test_a_reader_that_leaves_early_is_no_traceback():
    """`plan ... --json | head -c 10` printed a BrokenPipeError traceback (and another at exit)."""
    import subprocess
    import sys
    p = subprocess.run(f"{sys.executable} -m mpk_runtime plan --model tiny-llama --json --no-check | head -c 10",
                       shell=True, capture_output=True, text=True, timeout=120)
    assert p.stdout.startswith('{"graphs"') and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr
