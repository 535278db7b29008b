"""`python -m mpk_runtime plan` with values a user may type by mistake: a batch far past any decode step, and the
--search flags given without --search. Each is one line on stderr and exit code 2, before any graph is built."""
import pytest

import mpk_runtime.ir as ir
import mpk_runtime.planner as planner
from mpk_runtime.__main__ import MAX_PLAN_BATCH, main


class _Reached(Exception):
    pass


@pytest.fixture
def no_work(monkeypatch):
    """Building a graph or pricing candidates raises _Reached: a refused command must stop before either."""
    def reached(*a, **k):
        raise _Reached
    monkeypatch.setattr(ir, "build_graph", reached)
    monkeypatch.setattr(planner, "candidates", reached)


def _err(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("search", [[], ["--search"]])
def test_a_batch_past_the_limit_is_refused_before_any_work(no_work, capsys, search):
    """`plan --batch 100000` built task graphs of ~100k sequences' attention tasks and ran for minutes (the search;
    the graph view and its dependency check longer) before printing anything: now one line saying the limit."""
    err = _err(capsys, ["plan", "--model", "tiny-llama", "--batch", "100000", *search])
    assert "--batch" in err and str(MAX_PLAN_BATCH) in err


@pytest.mark.parametrize("search", [[], ["--search"]])
def test_the_limit_itself_is_planned(no_work, search):
    with pytest.raises(_Reached):
        main(["plan", "--model", "tiny-llama", "--batch", str(MAX_PLAN_BATCH), *search])


@pytest.mark.parametrize("flag,value", [("--profile", "no-such-profile"), ("--profile", "h100_v4"), ("--top", "3")])
def test_search_flags_without_search_are_refused(no_work, capsys, flag, value):
    """--profile and --top only act on --search; without it they were silently ignored (an unknown profile name
    printed the graph view and exit code 0, as if it had been used)."""
    err = _err(capsys, ["plan", "--model", "tiny-llama", flag, value])
    assert flag in err and "--search" in err


def test_search_json_keeps_the_top_n_given(capsys):
    """`plan --search --json --top 2` wrote every candidate: --top was silently ignored with --json. Given, it now
    cuts the JSON list as it cuts the text listing; not given, the JSON still holds every candidate."""
    import json
    argv = ["plan", "--model", "tiny-llama", "--search", "--json", "--context", "64"]
    assert main(argv) == 0
    every = json.loads(capsys.readouterr().out)
    assert len(every) > 2
    assert main(argv + ["--top", "2"]) == 0
    assert json.loads(capsys.readouterr().out) == every[:2]


def test_more_attention_splits_than_keys_are_refused_before_any_work(no_work, capsys):
    """(session 74) `plan --attn-splits 100000` built an attention task a split and KV group and ran past 20 s; a
    split holds at least one key, so more splits than --context keys (or than 1024) is one line now."""
    err = _err(capsys, ["plan", "--model", "tiny-llama", "--attn-splits", "100000"])
    assert "--attn-splits 100000" in err and "at most 512" in err
    err = _err(capsys, ["plan", "--model", "tiny-llama", "--context", "64", "--attn-splits", "65"])
    assert "at most 64" in err
    with pytest.raises(_Reached):
        main(["plan", "--model", "tiny-llama", "--context", "64", "--attn-splits", "64"])
