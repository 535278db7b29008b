"""The plan when none is named (runtime/executor.default_plan): the megakernel backend gets the planner's book (the
plan each batch bucket runs; at world size > 1 one whole-step megakernel per bucket), everything else keeps
plan=None; the command lines' --plan none still reaches the one megakernel."""
import argparse

import pytest

from mpk_runtime.engine.cli_flags import add_engine_flags, engine_kwargs
from mpk_runtime.runtime.executor import default_plan, plan_once


def test_megakernel_at_world_size_1_is_planned_by_default():
    kw = {"model": "tiny-llama", "max_batch": 8, "max_seq_len": 128}
    got = plan_once("megakernel", 1, kw)
    assert set(got["plan"]["buckets"]) == {1, 8}            # a book, made here once for the ranks
    assert got["plan"]["buckets"][1]["name"] == "mono"


@pytest.mark.parametrize("world,kw", [(2, {}), (1, {"tp": 2})])
def test_megakernel_at_tp2_gets_a_book_it_can_run(world, kw):
    from mpk_runtime.runtime.tp_buckets import TP_FAMILIES
    got = plan_once("megakernel", world, dict(kw, model="tiny-llama", max_batch=8, max_seq_len=128))
    book = got["plan"]
    assert book["tp"] == 2 and set(book["buckets"]) == {1, 8}
    for plan in book["buckets"].values():
        kinds = [s["kind"] for s in plan["segments"]]
        assert plan["name"] in TP_FAMILIES and (kinds == ["megakernel"] or set(kinds) == {"conventional"})
    # the CPU twin is not restricted: its book may hold any family (the same call for pyvm, plan named)
    assert plan_once("pyvm", 2, {"model": "tiny-llama", "max_batch": 8, "plan": "auto"})["plan"]["tp"] == 2


@pytest.mark.parametrize("backend,world,kw", [
    ("megakernel", 1, {"attn_splits": 4}),         # the one megakernel's knobs asked for
    ("megakernel", 1, {"tp_invariant": 2}),
    ("pyvm", 1, {}), ("torch", 1, {}), ("reference", 1, {})])
def test_no_default_plan_elsewhere(backend, world, kw):
    assert default_plan(backend, world, kw) is None
    base = dict(kw, model="tiny-llama", max_batch=4)
    assert plan_once(backend, world, base) == base


def test_explicit_none_keeps_the_one_megakernel():
    kw = {"model": "tiny-llama", "max_batch": 4, "plan": None}
    assert plan_once("megakernel", 1, kw) == kw


@pytest.mark.parametrize("argv,backend,want", [([], "megakernel", "absent"), (["--plan", "none"], "megakernel", None),
                                               (["--plan", "auto"], "pyvm", "auto"), (["--plan", "none"], "torch",
                                                                                      "absent")])
def test_cli_plan_flag(argv, backend, want):
    ap = argparse.ArgumentParser()
    add_engine_flags(ap)
    a = ap.parse_args(argv)
    a.backend = backend
    kw = engine_kwargs(a)
    assert kw.get("plan", "absent") == want
