"""A PlanBook: the planner's choice per decode batch bucket, made once and shipped to every rank as plain data.

The controller (cluster/plan.py, or the in-process runner) calls `plan_book(cfg, tp, buckets)`; workers get the
dict and call `pick_plan(book, batch)`: the plan of the smallest bucket >= batch (the largest bucket if the batch
is larger). A plan's segments name the Graph's ops, which do not depend on the batch, so the plan of a bucket
runs any batch of that bucket.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from ..ir.defer import conv_attn_appends, kv_defer
from ..ir.sampling import conv_bf16_argmax
from ..tasks.tiling import attn_groups_max
from ..models.config import ModelConfig
from .plan import Plan
from .profile import HardwareProfile
from .search import candidates

DEFAULT_BUCKETS = (1, 8, 32, 128)

# the config entries a plan's prices and op list depend on: a book is run only by a model with the same ones
SHAPE_FIELDS = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "tie_word_embeddings")


def book_shapes(cfg: ModelConfig) -> dict:
    """The model shapes a book is made for (SHAPE_FIELDS), stored in it as "shapes"."""
    return {f: getattr(cfg, f) for f in SHAPE_FIELDS}


def check_book_for(book: dict, cfg: ModelConfig, tp: int) -> dict:
    """The book, if it was made for tp and for a model of cfg's shapes; else a ValueError saying what differs and
    what to do. The model is compared by shapes, not by name: a checkpoint directory's name is not its preset's
    (a local llama-3.2-1b runs the preset's book), and a book of another model with the same layer count named the
    same ops and ran its plans, priced for the other shapes, without a word. A book without "shapes" (written
    before they were stored) is checked for tp only."""
    if not isinstance(book, dict) or "buckets" not in book:
        raise ValueError("plan must be None, 'auto' or a plan book dict (planner.book.plan_book)")
    if book.get("tp", tp) != tp:   # else every decode step fails later, request after request
        raise ValueError(f"the plan book was made for tp={book['tp']} but this runner has tp={tp}: make the book "
                         f"for tp={tp} (planner.book.plan_book) or pass plan='auto'")
    shapes = book.get("shapes")
    if isinstance(shapes, dict):
        mine = book_shapes(cfg)
        diff = [f"{k} {shapes.get(k)!r} (this model: {v!r})" for k, v in mine.items() if shapes.get(k) != v]
        if diff:
            raise ValueError(f"the plan book was made for {book.get('model', 'another model')!r}, not a model of "
                             f"{cfg.name!r}'s shapes: {'; '.join(diff)}. Make the book for this model "
                             "(planner.book.plan_book(cfg, tp, buckets)) or pass plan='auto'")
    return book


@functools.lru_cache(maxsize=1)
def _planner_code_hash() -> str:
    """What a plan depends on besides its inputs: the IR, task decomposition, layout and planner sources."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for sub in ("ir", "tasks", "planner", "codegen"):
        for f in sorted((root / sub).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


# environment variables that do not change a plan (the profile is keyed by its contents)
_NOT_PLAN_INPUTS = {"MPK_PLAN_CACHE", "MPK_CACHE_DIR", "MPK_PLANNER_PROFILE"}


def _cache_path(cfg: ModelConfig, tp: int, buckets: list[int], context: int, p: HardwareProfile,
                families) -> Path | None:
    if os.environ.get("MPK_PLAN_CACHE", "1") == "0":
        return None
    # (MPK_KV_DEFER, MPK_CONV_TRITON_ATTN and MPK_CONV_BF16_ARGMAX change the conventional segments' prices:
    # ir/defer.py, ir/sampling.py; MPK_ATT_GROUPS_MAX the attention tasks; and the other MPK_* switches the IR, tasks
    # and codegen read, e.g. MPK_ATT_WIDE, MPK_NVCC_DEFINES: all of them are keyed, a needless miss only re-plans)
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("MPK_") and k not in _NOT_PLAN_INPUTS)
    key = json.dumps([cfg.to_dict(), tp, buckets, context, p.to_json(), list(families or []), _planner_code_hash(),
                      kv_defer(), conv_attn_appends(), attn_groups_max(), conv_bf16_argmax(), env], sort_keys=True,
                     default=str)
    from ..codegen.nvcc import cache_dir
    return cache_dir() / "plans" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def plan_book(cfg: ModelConfig, tp: int, buckets=DEFAULT_BUCKETS, context: int = 512,
              prof: HardwareProfile | str | None = None, families: tuple[str, ...] | None = None,
              cache: bool = True) -> dict:
    """{"buckets": {batch: plan dict}, "profile", "context", "tp", "model", "shapes" (book_shapes)}: the lowest
    predicted plan per bucket.

    Searching takes seconds per bucket (tens for an 8B model), so books are cached on disk under
    $MPK_CACHE_DIR/plans (MPK_PLAN_CACHE=0 or cache=False: off), keyed by the model config, TP, buckets, context,
    the profile's contents, the plan families and a hash of the planner's own sources (a code change re-plans)."""
    if not buckets or any(int(b) < 1 for b in buckets):
        raise ValueError(f"plan buckets must be positive batch sizes, got {buckets!r}")
    p = prof if isinstance(prof, HardwareProfile) else (HardwareProfile.load(prof) if prof else HardwareProfile.load())
    bs = sorted({int(b) for b in buckets})
    path = _cache_path(cfg, tp, bs, context, p, families) if cache else None
    if path is not None and path.exists():
        try:
            book = json.loads(path.read_text())
            book["buckets"] = {int(k): v for k, v in book["buckets"].items()}
            return book
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            pass   # unreadable: plan again and overwrite
    out = {}
    for b in bs:
        plans = candidates(cfg, tp=tp, batch=b, context=context, prof=p, families=families)
        if not plans:   # e.g. per-layer or mega3 on a model of fewer layers than the family needs
            raise ValueError(f"no plan of families {families!r} exists for {cfg.name} ({cfg.num_layers} layers) at "
                             f"tp={tp} batch={b}: pick other families (or None for every family)")
        out[b] = plans[0].to_dict()
    book = json.loads(json.dumps({"buckets": out, "profile": p.name, "context": context, "tp": tp,
                                  "model": cfg.name, "shapes": book_shapes(cfg)}))
    book["buckets"] = {int(k): v for k, v in book["buckets"].items()}   # plain JSON data, as a cached book reads
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(book))
            os.replace(tmp, path)   # atomic: concurrent planners never see half a file
        except OSError:
            pass   # a read-only cache only costs the next call a re-plan
    return book


def bucket_key(book: dict, batch: int) -> int:
    """The bucket a decode batch runs in: the smallest bucket >= batch, else the largest bucket."""
    if not isinstance(book, dict) or not book.get("buckets"):
        raise ValueError(f"{'empty plan book' if not book else 'not a plan book'}: make one with "
                         "planner.book.plan_book(cfg, tp, buckets)")
    try:   # (a book read back from a file: keys are strings; a corrupt one is named, not an int() traceback)
        keys = sorted(int(k) for k in dict(book["buckets"]))
    except (TypeError, ValueError):
        raise ValueError(f"not a plan book: its buckets must map batch sizes to plans, got "
                         f"{json.dumps(book['buckets'], default=str)[:60]}; make one with planner.book.plan_book") from None
    return next((k for k in keys if k >= batch), keys[-1])


def pick_plan(book: dict, batch: int, *, model: str | None = None, tp: int | None = None) -> Plan:
    """The plan for a decode batch: that of bucket_key(book, batch). With `model` (the runner's cfg.name) and / or
    `tp`: a ValueError where the book was made for another (Plan.check_for), not a plan priced for other shapes run
    silently. A bucket that is not a plan is a ValueError naming the bucket (Plan.from_dict)."""
    b = bucket_key(book, batch)
    d = book["buckets"].get(b, book["buckets"].get(str(b)))   # JSON round trips turn int keys into strings
    try:
        plan = Plan.from_dict(d)
    except ValueError as e:
        raise ValueError(f"plan book bucket {b}: {e}") from None
    return plan.check_for(model=model, tp=tp)
