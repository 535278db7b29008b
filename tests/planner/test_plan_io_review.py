"""What a user hands the planner back: profile files of the right shape but wrong contents, plans and plan books read
back from JSON (corrupt, or made for another model / tp). Each is one clear ValueError (the CLI: `error: ...`, exit
2), never a traceback from deep in the search or a plan run for shapes it was not made for."""
import json
import os

import pytest

from mpk_runtime.__main__ import main
from mpk_runtime.models.config import PRESETS
from mpk_runtime.planner import book as bk
from mpk_runtime.planner.plan import Plan
from mpk_runtime.planner.profile import _DIR, HardwareProfile
from mpk_runtime.planner.search import candidates


def _profile_dict() -> dict:
    with open(os.path.join(_DIR, "h200_v57.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("field,value,word", [
    ("hbm_bw_by_sms", 3e12, "hbm_bw_by_sms"),             # a number where a curve belongs: AttributeError
    ("hbm_bw_by_sms", {}, "hbm_bw_by_sms is empty"),       # IndexError in _curve
    ("num_sms", "132", "num_sms"),                         # TypeError ('str' // int)
    ("num_sms", 0, "num_sms is 0"),                        # IndexError in the tiling
    ("sync_us", None, "sync_us"),                          # TypeError (float + None)
    ("step_band", 0.1, "step_band"),                       # TypeError at batch 1 of a profile without regimes
    ("conv_attn_us_by_shape", {"2x16x4": [[1, 2]]}, "conv_attn_us_by_shape"),   # 'not enough values to unpack'
    ("regimes", {"eight": {}}, "regimes key 'eight'"),     # "invalid literal for int()"
    ("regimes", {"1": {"sync_us": "fast"}}, "regimes['1']: sync_us"),   # TypeError in the search
])
def test_a_profile_with_a_field_of_the_wrong_type_is_a_clear_error(tmp_path, capsys, field, value, word):
    """A profile JSON that constructs a HardwareProfile but holds a field of the wrong type or an empty curve loaded,
    then failed deep in the search with a bare TypeError / IndexError / AttributeError traceback (or a message such
    as 'not enough values to unpack' that named neither the file nor the field)."""
    d = _profile_dict()
    d[field] = value
    if field == "step_band":
        d["regimes"] = {}
    f = tmp_path / "prof.json"
    f.write_text(json.dumps(d))
    assert main(["plan", "--model", "tiny-llama", "--search", "--context", "64", "--top", "1",
                 "--profile", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(f) in err and word in err and "Traceback" not in err, err
    with pytest.raises(ValueError, match="could not be read as a profile"):
        HardwareProfile.load(str(f))


def test_every_shipped_profile_passes_the_field_check():
    """The check refuses nothing a profile of this repository holds (older schemas included: fields they lack take
    their defaults)."""
    names = sorted(f[:-5] for f in os.listdir(_DIR) if f.endswith(".json"))
    assert len(names) > 30
    for n in names:
        assert HardwareProfile.load(n).name == n


def _plan_dict() -> dict:
    return candidates(PRESETS["tiny-llama"], batch=4, context=64, families=("attn-mk",))[0].to_dict()


@pytest.mark.parametrize("text,word", [
    ("{not json", "not a plan's JSON"),                        # a bare JSONDecodeError before
    ("[1, 2]", "got list"),                                    # TypeError
    ('{"name": "mono"}', "missing ['model', 'tp'"),            # KeyError 'segments'
    ("BOOK", "plan book"),                                     # KeyError 'segments': pick_plan was meant
    ("EXTRA", "unknown fields ['speedup']"),                   # TypeError: unexpected keyword argument
    ("SEGS_STR", "segment 0 is not an object"),                # TypeError: argument after ** must be a mapping
    ("SEG_NO_OPS", "segment 1 is not a Plan.to_dict: missing ['ops']"),
    ("SEG_KIND", "kind must be 'megakernel' or 'conventional'"),   # loaded; failed when the step ran it
    ("NO_SEGS", "segments must be a non-empty list"),          # loaded a plan of no segments
])
def test_a_corrupt_plan_json_is_a_clear_error(text, word):
    """Plan.from_json / from_dict on JSON that is not a plan raised KeyError / TypeError tracebacks, or built a Plan
    that failed only when a step ran it."""
    d = _plan_dict()
    if text == "BOOK":
        text = json.dumps({"buckets": {"1": d}, "tp": 1})
    elif text == "EXTRA":
        text = json.dumps(dict(d, speedup=2.0))
    elif text == "SEGS_STR":
        text = json.dumps(dict(d, segments=["L0.attention"]))
    elif text == "SEG_NO_OPS":
        segs = [dict(s) for s in d["segments"]]
        del segs[1]["ops"]
        text = json.dumps(dict(d, segments=segs))
    elif text == "SEG_KIND":
        text = json.dumps(dict(d, segments=[dict(d["segments"][0], kind="mk")] + d["segments"][1:]))
    elif text == "NO_SEGS":
        text = json.dumps(dict(d, segments=[]))
    with pytest.raises(ValueError) as e:
        Plan.from_json(text)
    assert word in str(e.value), str(e.value)


def test_a_plan_book_read_back_from_a_file_picks_by_bucket_and_refuses_another_model_or_tp(tmp_path):
    """A book written to a file and read back (string bucket keys) gives each batch its bucket's plan, equal to the
    one planned; asked for another model or tp it says whose book it is (a book of another model with the same op
    names ran its plans without a word)."""
    cfg = PRESETS["tiny-qwen3"]
    book = bk.plan_book(cfg, 2, (1, 8), context=64, cache=False)
    f = tmp_path / "book.json"
    f.write_text(json.dumps(book))
    back = json.loads(f.read_text())
    assert set(back["buckets"]) == {"1", "8"}
    for batch, bucket in ((1, 1), (2, 8), (8, 8), (9, 8)):
        got = bk.pick_plan(back, batch, model=cfg.name, tp=2)
        assert got == Plan.from_dict(book["buckets"][bucket]) and got.batch == bucket
    with pytest.raises(ValueError, match="made for model 'tiny-qwen3', not 'tiny-llama'"):
        bk.pick_plan(back, 1, model="tiny-llama")
    with pytest.raises(ValueError, match="made for tp 2, not 1"):
        bk.pick_plan(back, 1, tp=1)


@pytest.mark.parametrize("book,word", [
    ([{"name": "mono"}], "not a plan book"),                          # AttributeError: 'list' has no .get
    ({"buckets": [{"name": "mono"}]}, "buckets must map batch sizes"),   # TypeError in int()
    ({"buckets": {"eight": {}}}, "buckets must map batch sizes"),     # invalid literal for int()
    ({"buckets": {"8": {"name": "mono"}}}, "plan book bucket 8: plan is not a Plan.to_dict"),   # KeyError
])
def test_a_corrupt_plan_book_is_a_clear_error(book, word):
    with pytest.raises(ValueError) as e:
        bk.pick_plan(book, 4)
    assert word in str(e.value), str(e.value)


@pytest.mark.parametrize("profile,measured", [("h200_v57", True), ("h200", False)])
def test_search_header_says_whether_the_band_was_measured(capsys, profile, measured):
    """The header called the bracketed band 'the band that held 90% of measured steps in the profile's validation'
    for every profile, also for those without a measured band (h200, h200_measured, the *_cal profiles before v36),
    whose band is the field's unmeasured default +-12%."""
    assert main(["plan", "--model", "tiny-llama", "--search", "--context", "64", "--top", "1",
                 "--profile", profile]) == 0
    head, first = capsys.readouterr().out.splitlines()[:2]
    assert ("held 90% of measured steps" in head) is measured and ("not measured" in head) is not measured, head
    pred = float(first.split("predicted")[1].split("us")[0])
    lo, hi = (float(x) for x in first.rsplit("(", 1)[1].rstrip(")").split("-"))
    if not measured:   # the default +-12% around the prediction, as printed
        assert lo == pytest.approx(0.88 * pred, abs=1) and hi == pytest.approx(1.12 * pred, abs=1)
    assert lo <= pred <= hi


@pytest.mark.parametrize("content,word", [(None, "No such file"), ("{bad\n", "JSONDecodeError"),
                                          ("[]", "not validation rows")])
def test_fit_cli_bad_rows_are_a_message(tmp_path, monkeypatch, content, word):
    """`python -m mpk_runtime.planner.fit --rows X` with X not there, not JSON, or a .json without "rows" ended in a
    FileNotFoundError / JSONDecodeError / TypeError traceback (band.py's command line already said `error: ...`)."""
    from mpk_runtime.planner import fit_cli
    rows = tmp_path / ("rows.json" if content == "[]" else "rows.jsonl")
    if content is not None:
        rows.write_text(content)
    monkeypatch.setattr("sys.argv", ["fit", "--rows", str(rows), "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        fit_cli.main()
    msg = str(e.value.code)
    assert msg.startswith("error: ") and str(rows) in msg and word in msg, msg


def test_a_runner_refuses_a_plan_book_of_another_models_shapes_and_takes_one_of_the_same_shapes():
    """resolve_plan (the runners' entry for a user's book) compares the model by shapes, not by name: a book of
    another model is refused naming the entries that differ (it ran, priced for the other shapes, whenever the
    op names matched); a config of the same shapes under another name (a checkpoint directory) runs it."""
    from dataclasses import replace
    from mpk_runtime.runtime.pyvm_runner import resolve_plan
    cfg = PRESETS["tiny-qwen3"]
    book = json.loads(json.dumps(bk.plan_book(cfg, 1, (1, 8), context=64, cache=False)))
    assert book["model"] == cfg.name and book["shapes"]["hidden_size"] == cfg.hidden_size
    wider = replace(cfg, name="wider", intermediate_size=cfg.intermediate_size * 2)
    with pytest.raises(ValueError, match=r"made for 'tiny-qwen3'.*intermediate_size .*Make the book for this model"):
        resolve_plan(book, wider, 1, 8, 64)
    with pytest.raises(ValueError, match="made for tp=1 but this runner has tp=2"):
        resolve_plan(book, cfg, 2, 8, 64)
    assert resolve_plan(book, replace(cfg, name="/ckpt/my-qwen"), 1, 8, 64) is book
    old = {k: v for k, v in book.items() if k not in ("model", "shapes")}   # a book written before shapes were kept
    assert resolve_plan(old, wider, 1, 8, 64) is old
