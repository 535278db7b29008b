"""`python -m mpk_runtime plan` as a user meets it: bad input is one clear error (no traceback), every flag given is
either used or refused, and what the planner writes (search JSON, plan books) is consistent with what it computes."""
import json

import pytest

from mpk_runtime.__main__ import main
from mpk_runtime.models.config import PRESETS
from mpk_runtime.planner import book as bk
from mpk_runtime.planner.plan import Plan
from mpk_runtime.planner.search import candidates


@pytest.fixture(autouse=True)
def _triton_attn(monkeypatch):
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "1")   # price plans the way the GPU runs them


def _err(capsys, argv) -> str:
    """main(argv) must fail with exit code 2 and a one-line message (no traceback); the message."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("content", ["{}", "[1, 2]", '{"name": "x"}', "{bad json"])
def test_a_malformed_profile_json_is_a_clear_error(tmp_path, capsys, content):
    """A profile JSON that is not an object with a profile's fields gave a TypeError / AttributeError traceback, and
    invalid JSON a bare 'Expecting property name' that named neither the file nor what to do."""
    f = tmp_path / "prof.json"
    f.write_text(content)
    err = _err(capsys, ["plan", "--model", "tiny-llama", "--search", "--profile", str(f)])
    assert str(f) in err and "profile_hw.py" in err


def test_a_directory_as_profile_is_a_clear_error(tmp_path, capsys):
    """--profile pointing at a directory raised IsADirectoryError with a traceback."""
    err = _err(capsys, ["plan", "--model", "tiny-llama", "--search", "--profile", str(tmp_path)])
    assert str(tmp_path) in err


def test_search_classify_json_carries_the_category(capsys):
    """`plan --search --classify --json` (docs/planner.md's example) printed the candidates only: the category the
    user asked for was silently dropped."""
    assert main(["plan", "--model", "tiny-llama", "--search", "--classify", "--json", "--context", "64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["classify"]["category"] and set(out["classify"]["best"]) == {"1", "8", "32", "128"}
    plans = [Plan.from_dict(d) for d in out["plans"]]
    assert plans and plans[0].batch == 1 and plans[0].predicted_us == min(p.predicted_us for p in plans)


def test_search_json_without_classify_stays_a_list(capsys):
    assert main(["plan", "--model", "tiny-llama", "--search", "--json", "--context", "64"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), list)


@pytest.mark.parametrize("flag", ["--sms", "--attn-splits"])
def test_search_refuses_the_graph_view_flags_it_does_not_use(capsys, flag):
    """--sms and --attn-splits shape the graph view only; with --search they were silently ignored (the search
    takes the SMs from the profile and the splits from its rule), so `--search --sms 114` priced 132 SMs."""
    err = _err(capsys, ["plan", "--model", "tiny-llama", "--search", flag, "4"])
    assert flag in err and "--search" in err


def test_default_context_fits_a_model_with_a_short_context(tmp_path, capsys):
    """A local model with max_position_embeddings below 512 failed every `plan` call with '--context 512 exceeds',
    a flag the user never passed: the default context is now the model's maximum where that is shorter."""
    d = PRESETS["tiny-llama"].to_hf_config()
    d["max_position_embeddings"] = 256
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert main(["plan", "--model", str(tmp_path), "--search", "--top", "1"]) == 0
    assert "context=256" in capsys.readouterr().out
    _err(capsys, ["plan", "--model", str(tmp_path), "--context", "512"])   # given: still refused


def test_negative_show_ops_is_refused(capsys):
    """--show-ops -3 printed all but three ops and then '... 16 more' of a 13-op graph."""
    assert "--show-ops" in _err(capsys, ["plan", "--model", "tiny-llama", "--show-ops", "-3", "--no-check"])


def test_cached_book_misses_when_an_env_switch_changes_the_prices(tmp_path, monkeypatch):
    """The book cache was keyed by five of the environment switches the planner reads: a book made under the default
    was returned under MPK_ATT_WIDE=0 (narrow attention passes), whose prices differ."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    cfg = PRESETS["tiny-llama"]
    first = bk.plan_book(cfg, 1, (1, 128), context=64)
    monkeypatch.setenv("MPK_ATT_WIDE", "0")
    fresh = bk.plan_book(cfg, 1, (1, 128), context=64, cache=False)
    assert fresh != first   # (the switch moves the prices here)
    assert bk.plan_book(cfg, 1, (1, 128), context=64) == fresh
    monkeypatch.delenv("MPK_ATT_WIDE")
    assert bk.plan_book(cfg, 1, (1, 128), context=64) == first


def test_a_cache_file_of_the_wrong_shape_is_re_planned(tmp_path, monkeypatch):
    """A cached book that is JSON but not an object (e.g. `[]`) raised TypeError instead of being re-planned."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    cfg = PRESETS["tiny-llama"]
    first = bk.plan_book(cfg, 1, (1,), context=64)
    for f in (tmp_path / "plans").glob("*.json"):
        f.write_text("[]")
    assert bk.plan_book(cfg, 1, (1,), context=64) == first


def test_an_unknown_family_is_refused():
    """A misspelt family was dropped without a word (families=("mono", "conventinal") priced mono alone), and a bare
    string was matched as a substring ("mono-w2" also built "mono")."""
    cfg = PRESETS["tiny-llama"]
    with pytest.raises(ValueError, match="conventinal"):
        candidates(cfg, context=64, families=("mono", "conventinal"))
    assert [p.name for p in candidates(cfg, context=64, families="mono-w2")] == ["mono-w2"]


@pytest.mark.parametrize("args,word", [(["--rows", "/no/such/rows.jsonl"], "/no/such/rows.jsonl"),
                                       (["--rows", "ROWS", "--profile", "no-such-profile"], "no-such-profile")])
def test_band_cli_bad_input_is_a_message(tmp_path, monkeypatch, args, word):
    """`python -m mpk_runtime.planner.band` with a rows file or profile that is not there ended in a traceback."""
    from mpk_runtime.planner import band
    rows = tmp_path / "rows.jsonl"
    rows.write_text("")
    monkeypatch.setattr("sys.argv", ["band", *[str(rows) if x == "ROWS" else x for x in args], "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        band.main()
    assert word in str(e.value.code) and str(e.value.code).startswith("error: ")


def test_hardware_profile_load_itself_refuses_a_file_that_is_not_a_profile(tmp_path):
    """The check is HardwareProfile.load's, not only the CLI's: the engine and plan_book load profiles too (from
    MPK_PLANNER_PROFILE), and a malformed file gave them a TypeError / AttributeError traceback."""
    from mpk_runtime.planner.profile import HardwareProfile
    for text in ("{}", "[1, 2]", "{not json"):
        p = tmp_path / "p.json"
        p.write_text(text)
        with pytest.raises(ValueError, match="could not be read as a profile"):
            HardwareProfile.load(str(p))
