"""The planner's choice reaches the engine: LLM(..., plan="auto") plans once (the executor / controller makes a
PlanBook per decode batch bucket), every rank runs the plan of its batch's bucket through PlanExecutor, and the
tokens equal the single-task-graph run; books of multi-segment and conventional plans too."""
import json

import pytest

from cluster.plan import make_plan
from mpk_runtime.engine.errors import InvalidRequestError
from mpk_runtime.engine.llm import LLM
from mpk_runtime.engine.sampling import SamplingParams
from mpk_runtime.models import PRESETS
from mpk_runtime.planner import pick_plan, plan_book

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
SP = SamplingParams(max_tokens=5)


def _tokens(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, SP, use_tqdm=False)]


def test_pick_plan_buckets_and_json_round_trip():
    book = plan_book(PRESETS["tiny-llama"], 1, (1, 4), context=64)
    book = json.loads(json.dumps(book))          # shipped as data: int keys become strings
    assert pick_plan(book, 1).batch == 1
    assert pick_plan(book, 2).batch == 4 and pick_plan(book, 4).batch == 4
    assert pick_plan(book, 9).batch == 4         # larger than every bucket: the largest
    with pytest.raises(ValueError, match="plan book"):
        pick_plan({}, 1)


@pytest.mark.parametrize("tp", [1, 2])
def test_llm_plan_auto_and_books_match_single_graph(tp):
    ref = LLM("tiny-qwen3", backend="pyvm", tp=tp, max_batch=4)
    want = _tokens(ref)
    ref.shutdown()
    cfg = PRESETS["tiny-qwen3"]
    books = {"auto": "auto"}
    for fam in ("mega2", "attn-conv", "conventional"):
        books[fam] = plan_book(cfg, tp, (1, 4), context=64, families=(fam,))
    for name, plan in books.items():
        llm = LLM("tiny-qwen3", backend="pyvm", tp=tp, max_batch=4, plan=plan)
        try:
            assert _tokens(llm) == want, name
            group = llm.executor.workers[0].runner.group
            assert group.plans is not None and group._planned, "decode did not go through the plan"
            used = {p.name for *_, p in group._planned.values()}
            if name != "auto":
                assert used == {name}
        finally:
            llm.shutdown()


def test_plan_on_other_backends_is_refused():
    with pytest.raises((InvalidRequestError, ValueError), match="pyvm"):
        LLM("tiny-llama", backend="torch", max_batch=2, plan="auto")
    with pytest.raises((InvalidRequestError, ValueError), match="plan must be"):
        LLM("tiny-llama", backend="pyvm", max_batch=2, plan="fastest")


def test_controller_make_plan_ships_one_book():
    kw = dict(model="tiny-llama", max_batch=8, max_seq_len=128)
    assert make_plan(None, 2, "pyvm", kw) is None                      # no plan asked: none shipped
    book = make_plan(None, 2, "pyvm", dict(kw, plan="auto"))
    assert sorted(book["buckets"]) == [1, 8] and book["tp"] == 2
    assert all(p["tp"] == 2 for p in book["buckets"].values())
    assert make_plan(None, 2, "pyvm", dict(kw, plan=book)) is book     # a given book travels as is


def test_plan_book_disk_cache(tmp_path, monkeypatch):
    """A book is searched once per (config, tp, buckets, context, profile, families, planner sources): the second
    call reads it from $MPK_CACHE_DIR/plans; other inputs miss; a corrupt file is re-planned; MPK_PLAN_CACHE=0 off."""
    from mpk_runtime.planner import book as bk
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    calls = []
    real = bk.candidates

    def counting(*a, **k):
        calls.append(k.get("batch"))
        return real(*a, **k)
    monkeypatch.setattr(bk, "candidates", counting)
    cfg = PRESETS["tiny-llama"]
    first = plan_book(cfg, 1, (1, 4), context=64)
    assert calls == [1, 4]
    again = plan_book(cfg, 1, (4, 1), context=64)
    assert calls == [1, 4] and again == first and pick_plan(again, 3).batch == 4
    plan_book(cfg, 1, (1, 4), context=32)                      # another context: searched
    assert calls == [1, 4, 1, 4]
    files = list((tmp_path / "plans").glob("*.json"))
    assert len(files) == 2
    for f in files:
        f.write_text("{not json")
    assert plan_book(cfg, 1, (1, 4), context=64) == first      # corrupt: re-planned and rewritten
    assert calls == [1, 4, 1, 4, 1, 4]
    monkeypatch.setenv("MPK_PLAN_CACHE", "0")
    plan_book(cfg, 1, (1, 4), context=64)
    assert len(calls) == 8


def test_a_plan_book_for_another_tp_is_refused_when_the_llm_is_made():
    """It was accepted, and then every decode step failed ('the plan book was made for tp=2, this group has
    tp=4') while the engine stayed up."""
    book = plan_book(PRESETS["tiny-llama"], 2, [1, 8], context=64)
    with pytest.raises(InvalidRequestError, match="plan book was made for tp=2 but this runner has tp=4"):
        LLM("tiny-llama", backend="pyvm", tp=4, dtype="float32", max_seq_len=64, plan=book)


def test_a_plan_family_the_model_cannot_have_is_a_clear_error():
    """tiny-llama has no per-layer candidate (the search keeps it for deeper models): an IndexError before."""
    with pytest.raises(ValueError, match="no plan of families"):
        plan_book(PRESETS["tiny-llama"], 1, [1], context=64, families=("per-layer",), cache=False)
