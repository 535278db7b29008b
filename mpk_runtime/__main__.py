"""Command line: `python -m mpk_runtime plan ...` and `python -m mpk_runtime generate ...`."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time


def _search(a: argparse.Namespace, cfg) -> int:
    from .planner import HardwareProfile, candidates
    prof = HardwareProfile.load(a.profile)
    top = 8 if a.top is None else a.top
    plans = candidates(cfg, tp=a.tp, batch=a.batch, context=a.context, prof=prof)
    if a.json:   # every candidate, or the top N where --top is given
        out = [p.to_dict() for p in plans[: a.top]]
        if a.classify:   # one JSON document: the candidates and the category
            from .planner.categories import classify
            out = {"plans": out, "classify": classify(cfg, tp=a.tp, context=a.context, prof=prof)}
        json.dump(out, sys.stdout)
        print()
        return 0
    # a profile without a measured band for this batch (h200, the *_cal profiles before v36) prices every plan's band
    # as the field's default +-12%, which the header called the band that held 90% of measured steps
    from dataclasses import fields as dc_fields
    default_band = next(f.default for f in dc_fields(prof) if f.name == "step_band")
    lo, hi = prof.for_batch(a.batch).step_band
    band = ("in brackets the band that held 90% of measured steps in the profile's validation: planner/band.py"
            if (lo, hi) != tuple(default_band) else
            f"in brackets {lo:+.0%} / {hi:+.0%}: a default band, not measured for this profile at batch {a.batch} "
            "(planner/band.py measures one)")
    print(f"{cfg.name} tp={a.tp} batch={a.batch} context={a.context}, profile {prof.name}: "
          f"{len(plans)} candidate plans, best first{f' (the top {top}: --top N for more)' if len(plans) > top else ''} "
          f"(predicted step time; {band})")
    for p in plans[:top]:
        print("  " + p.describe())
    for fam, why in (plans[0].notes.get("infeasible") or {}).items() if plans else ():
        print(f"  {fam:<14} not a candidate: {why}")
    from .runtime.tp_buckets import plan_families
    fams = plan_families("megakernel", a.tp)
    if fams is not None and plans and plans[0].name not in fams:   # what LLM(backend="megakernel") would run instead
        run = next((p for p in plans if p.name in fams), None)
        if run is not None:
            print(f"note: at tp > 1 the engine runs families {', '.join(fams)} only (runtime/tp_buckets.py): here "
                  f"{run.name}, predicted {run.predicted_us:.1f} us ({run.predicted_us / plans[0].predicted_us - 1:+.1%} "
                  f"against the best)")
    from .ir.defer import conv_attn_appends
    if not conv_attn_appends():   # the GPU runs the paged Triton kernel; without Triton here it is priced as the old path
        print("note: conventional attention priced as gather + SDPA (Triton is not installed here, or "
              "MPK_CONV_TRITON_ATTN=0); a GPU with Triton runs the paged kernel: MPK_CONV_TRITON_ATTN=1 prices that")
    else:
        _note_stale_curves(prof, cfg, a.tp)
    if a.classify:
        from .planner.categories import classify
        c = classify(cfg, tp=a.tp, context=a.context, prof=prof)
        print(f"category: {c['category']}  (best per batch: "
              + ", ".join(f"{b}: {v['plan']}" for b, v in c["best"].items()) + ")")
    return 0


def _note_stale_curves(prof, cfg, tp: int) -> None:
    """Say where the profile's paged-attention curve for this model's shape was measured under a launch shape that
    TUNED has since replaced (those points price the old kernel; scripts/gpu_run.sh cattn re-measures them)."""
    from .ir.shard import shard_for
    from .planner.profile import conv_attn_shape
    from .runtime.megakernel_plans import kv_cap
    from .runtime.paged_shapes import stale_curve_points
    sh = shard_for(cfg, tp, 0)
    key = conv_attn_shape(sh.n_kv, cfg.head_dim, sh.n_q // sh.n_kv, "paged")
    if key not in prof.conv_attn_us_by_shape:
        return
    rec = prof.conv_attn_shape_by_shape.get(key)
    if not rec:
        print(f"note: profile {prof.name} does not record the launch shapes its {key} curve was measured under "
              "(profiles before h200_v49): whether TUNED has replaced any is unknown")
        return
    stale = stale_curve_points({key: rec}, lambda k: kv_cap(k, max(k, cfg.max_position_embeddings)))
    if stale:
        _, b, n, was, cur = stale[0]
        print(f"note: {len(stale)} of {len(rec)} points of profile {prof.name}'s {key} curve were measured under a "
              f"launch shape TUNED has since replaced (e.g. B={b} {n} keys: {was} -> now {cur}); they price the old "
              "kernel. Re-measure: scripts/gpu_run.sh cattn (docs/planner.md)")


# The most rows `plan` takes a step: the engine's default step budget (engine.DEFAULT_MAX_NUM_BATCHED_TOKENS; a decode
# step of B rows computes B tokens). The task graphs grow with the batch (an attention task per sequence, KV group and
# split) and so does this command's time (2-core CPU): --search of llama-3.1-70b at 4096 rows ~40 s and 1.7 GB,
# qwen3-8b's graph view with its check ~165 s at 1024; --batch 100000 ran for many minutes. The profiles are measured
# at batches 1-128.
MAX_PLAN_BATCH = 4096
MAX_PLAN_SPLITS = 1024   # attention key splits a KV group in the graph view (search.attn_splits gives 1-32)
# SMs a GPU in the graph view (an H100 / H200 has 132): each SM gets its task list and simulated heap entry, so
# --sms 1000000000 ran out of memory with a MemoryError traceback (10^7 took ~10 s for tiny-llama's 163 tasks)
MAX_PLAN_SMS = 1024


def _plan(a: argparse.Namespace) -> int:
    from .ir import build_graph
    from .models import load_config
    from .tasks import Tiling, build_task_graphs, check_task_graphs
    cfg = load_config(a.model)
    for flag, v in (("--tp", a.tp), ("--batch", a.batch), ("--sms", a.sms),
                    ("--attn-splits", a.attn_splits), ("--top", a.top)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if a.batch > MAX_PLAN_BATCH:
        raise ValueError(f"--batch {a.batch} is more rows than plan takes (at most {MAX_PLAN_BATCH}, the engine's "
                         "default step budget; the task graphs and this command's time grow with the batch, and the "
                         f"profiles are measured at batches 1-128): pass --batch {MAX_PLAN_BATCH} or less")
    if a.sms is not None and a.sms > MAX_PLAN_SMS:
        raise ValueError(f"--sms {a.sms}: at most {MAX_PLAN_SMS} SMs a GPU (an H100 / H200 has 132; the graph view "
                         "keeps a task list per SM): pass the card's SM count")
    if a.show_ops < 0:
        raise ValueError(f"--show-ops must be >= 0, got {a.show_ops}")
    if a.classify and not a.search:
        raise ValueError("--classify prices every batch bucket's candidates: add --search")
    for flag, given in (("--profile", a.profile is not None), ("--top", a.top is not None)):
        if given and not a.search:   # (the graph view uses neither: they were silently ignored)
            raise ValueError(f"{flag} acts on --search's candidate plans only: add --search, or drop {flag} for the "
                             "graph view")
    if a.search:   # the search takes the SMs from the profile and the key splits from its rule (search.attn_splits)
        for flag, v in (("--sms", a.sms), ("--attn-splits", a.attn_splits)):
            if v is not None:
                raise ValueError(f"{flag} shapes the graph view only and --search does not use it (the SMs come "
                                 "from --profile, the attention splits from the planner's rule): drop one of them")
    a.sms = 132 if a.sms is None else a.sms
    a.attn_splits = 1 if a.attn_splits is None else a.attn_splits
    if a.context is None:   # (a model of a shorter context plans at its maximum)
        a.context = min(512, cfg.max_position_embeddings)
    if a.context > cfg.max_position_embeddings:
        raise ValueError(f"--context {a.context} exceeds {cfg.name}'s max_position_embeddings "
                         f"({cfg.max_position_embeddings}); plan for a context the model takes")
    if a.search:
        return _search(a, cfg)
    # (100000 splits built an attention task each for minutes; at --context 0 the step still reads its own key, so
    # one split, the default, is planned: it was refused as "--attn-splits 1: at most 0", a flag not given)
    most_splits = max(1, min(a.context, MAX_PLAN_SPLITS))
    if a.attn_splits > most_splits:
        raise ValueError(f"--attn-splits {a.attn_splits}: at most {most_splits} here (a split "
                         f"holds at least one of the --context {a.context} keys, and at most {MAX_PLAN_SPLITS}; the "
                         "planner's own rule takes 1-32)")
    graphs = [build_graph(cfg, batch=a.batch, context_len=a.context, tp=a.tp, rank=r, attn_splits=a.attn_splits)
              for r in range(a.tp)]
    tgs = build_task_graphs(graphs, Tiling(num_sms=a.sms))
    stats = check_task_graphs(tgs, steps=2) if a.check else None
    if a.json:
        json.dump({"graphs": [g.to_dict() for g in graphs], "task_graphs": [t.to_dict() for t in tgs],
                   "check": stats}, sys.stdout)
        print()
        return 0
    g = graphs[0]
    print(g.summary())
    print(f"weights per rank: {g.weight_bytes() / 1e9:.3f} GB")
    print("ops:")
    for op in g.ops[: a.show_ops]:
        print(f"  {op.name:28s} {op.kind:10s} {op.bytes / 1e6:9.3f} MB {op.flops / 1e6:10.2f} MFLOP")
    if len(g.ops) > a.show_ops:
        print(f"  ... {len(g.ops) - a.show_ops} more (--show-ops N, or --json)")
    for t in tgs:
        print(t.summary())
    if stats:
        print(f"checks passed: {stats['deps']} data dependencies covered, no deadlock over 2 steps")
    return 0


def _parse_ids(s: str, flag: str = "--prompt-ids") -> list[int]:
    try:
        return [int(x) for x in s.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"{flag} must be integers separated by commas or spaces, got {s!r}") from None


class _Prompts(argparse.Action):
    """--prompt-ids and --prompt into one list of (kind, value), in command-line order (the output lines follow it)."""

    def __call__(self, parser, ns, values, option_string=None):
        ns.prompts = (getattr(ns, "prompts", None) or []) + [(self.const, values)]


def _generate(a: argparse.Namespace) -> int:
    from .engine import LLM, RequestFailedError, SamplingParams
    from .engine.request import logprobs_by_id
    prompts = [_parse_ids(v) if kind == "ids" else v for kind, v in a.prompts or ()]
    if not prompts:
        raise ValueError("no prompt: give --prompt-ids 1,2,3 (repeatable) or --prompt TEXT (needs a tokenizer in the "
                         "model dir)")   # (bad input: exit 2, as the README says; a SystemExit of a string exited 1)
    # seed=None: each request's sampling seed comes from the engine seed (--seed) and its index, so a prompt given
    # twice draws two samples (one seed for all drew the same tokens twice). A sampling flag not given: the model's
    # generation_config.json default (LLM.default_sampling, after the load), else the CLI's (checked here, before it)
    unset = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 16}
    sp = SamplingParams(**{k: v if getattr(a, k) is None else getattr(a, k) for k, v in unset.items()}, seed=None,
                        stop_token_ids=_parse_ids(a.stop_token_ids, "--stop-token-ids") if a.stop_token_ids else (),
                        ignore_eos=a.ignore_eos, stop=tuple(a.stop or ()), logprobs=a.logprobs,
                        presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                        min_tokens=a.min_tokens, n=a.n)
    t0 = time.perf_counter()
    from .engine.cli_flags import engine_kwargs
    llm = LLM(a.model, backend=a.backend, tp=a.tp, seed=a.seed, dtype=a.dtype, max_seq_len=a.max_seq_len,
              max_batch=max(8, len(prompts) * a.n) if a.max_batch is None else a.max_batch, **engine_kwargs(a))
    t1 = time.perf_counter()
    model_set = {k: v for k, v in llm.default_sampling.items() if getattr(a, k) is None}
    if model_set:
        sp = dataclasses.replace(sp, **model_set)

    def emit(i, o) -> None:
        line = {"index": i, "prompt_token_ids": o.prompt_token_ids, "token_ids": o.token_ids, "text": o.text,
                "finish_reason": o.finish_reason}
        if o.prompt is not None:
            line["prompt"] = o.prompt
        if o.logprobs is not None:
            line["logprobs"] = logprobs_by_id(o.logprobs)
        if o.completions is not None:
            line["completions"] = o.to_dict()["completions"]
        if o.finish_reason == "error":
            line["error"] = o.error
        print(json.dumps(line), flush=True)
    outs: list = []
    stopped = None
    try:   # each line as soon as it and those before it end: a failed request or ^C keeps the lines printed
        llm.generate(prompts, sp, use_tqdm=len(prompts) > 1, on_output=lambda i, o: (outs.append(o), emit(i, o)))
    except RequestFailedError as e:
        stopped = e   # its requests' lines carry finish_reason "error"; the exit code below says so
    finally:
        pre = llm.engine.stats["preemptions"]
        llm.shutdown()
    t2 = time.perf_counter()
    n = sum(len(c.token_ids) for o in outs for c in o.outputs)
    weights = "" if os.path.isdir(a.model) else f" (a preset: seeded random weights, seed {a.seed})"
    print(f"# {a.model}{weights} backend={a.backend} tp={a.tp}: load {t1 - t0:.1f}s, {n} tokens in {t2 - t1:.2f}s"
          + (f", {pre} preemptions for KV pages (more --num-pages would avoid them)" if pre else ""), file=sys.stderr)
    # (every completion: with --n a later one fails while the line's top-level fields, the first's, look fine)
    every = [c for o in outs for c in o.outputs]
    failed = [c for c in every if c.finish_reason == "error"]
    if failed:
        print(f"error: {len(failed)} of {len(every)} requests failed (finish_reason \"error\" above), e.g.: "
              f"{failed[0].error}", file=sys.stderr)
        return 1
    if stopped is not None:   # (the engine itself failed, e.g. could not admit a request: no line tells it)
        print(f"error: {stopped} ({len(outs)} of {len(prompts)} prompts' lines printed)", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpk_runtime", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan", help="show the step's ops, tasks per SM, events, bytes and flops")
    pl.add_argument("--model", required=True, help="preset name or local Hugging Face model directory")
    pl.add_argument("--tp", type=int, default=1)
    pl.add_argument("--batch", type=int, default=1, help=f"decode rows a step (default 1, at most {MAX_PLAN_BATCH})")
    pl.add_argument("--context", type=int, default=None, help="context length for cost estimates (default 512, "
                    "or the model's maximum if shorter)")
    pl.add_argument("--sms", type=int, default=None, help="SMs per GPU (default 132, an H100's / H200's; without "
                    "--search)")
    pl.add_argument("--attn-splits", type=int, default=None, help="attention key splits (default 1; without --search)")
    pl.add_argument("--json", action="store_true", help="dump graphs and task graphs as JSON (with --search: the "
                    "candidates' plans, all or the --top N given; with --classify too: {\"plans\": [...], "
                    "\"classify\": {...}})")
    pl.add_argument("--no-check", dest="check", action="store_false")
    pl.add_argument("--show-ops", type=int, default=12)
    pl.add_argument("--search", action="store_true", help="price candidate partitions (megakernels vs "
                    "conventional) and show the best ones")
    pl.add_argument("--top", type=int, default=None, help="with --search: plans listed (default 8)")
    pl.add_argument("--profile", default=None, help="with --search: hardware profile name (h100_v4 for an H100) or "
                    "a JSON path (default: this machine's card's, else planner.profile.DEFAULT_PROFILE)")
    pl.add_argument("--classify", action="store_true", help="with --search: category over batch 1/8/32/128")
    g = sub.add_parser("generate", help="generate tokens")
    g.add_argument("--model", required=True)
    g.add_argument("--prompt-ids", action=_Prompts, const="ids", dest="prompts", default=None,
                   help="comma-separated token ids (repeat for a batch; output lines follow the prompts' order)")
    g.add_argument("--prompt", action=_Prompts, const="text", dest="prompts", default=None,
                   help="text prompt (needs a tokenizer in the model directory)")
    g.add_argument("--backend", default="pyvm", help="pyvm | torch | reference | megakernel")
    g.add_argument("--tp", type=int, default=1)
    # (sampling flags left out: the model's generation_config.json default where it sets one, --generation-config)
    g.add_argument("--max-tokens", type=int, default=None, help="default 16")
    g.add_argument("--temperature", type=float, default=None, help="default 0 (greedy)")
    g.add_argument("--top-k", type=int, default=None, help="default 0 (no limit)")
    g.add_argument("--top-p", type=float, default=None, help="default 1")
    g.add_argument("--seed", type=int, default=0, help="engine seed: a preset's random weights, and each request's "
                   "sampling seed (derived from it and the request's index)")
    g.add_argument("--dtype", default=None)
    g.add_argument("--max-seq-len", type=int, default=None)
    g.add_argument("--max-batch", type=int, default=None, help="requests run together at most (the rest queue; "
                   "default: the number of sequences, prompts x --n, at least 8)")
    g.add_argument("--stop-token-ids", default=None, help="comma-separated token ids that end a sequence")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the tokenizer's / model's EOS")
    g.add_argument("--stop", action="append", help="a stop string (repeatable; needs a tokenizer): the text ends "
                   "before it")
    g.add_argument("--logprobs", type=int, default=None, help="print each token's logprob and the N most likely "
                   "tokens' ([[token id, logprob], ...] per generated token)")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=None, help="default 1 (off)")
    g.add_argument("--min-p", type=float, default=None, help="drop tokens below min-p x the top token's probability "
                   "(default 0)")
    g.add_argument("--min-tokens", type=int, default=0, help="EOS / stop token ids cannot end a sequence sooner")
    g.add_argument("--n", type=int, default=1, help="completions a prompt (up to 64): a line's \"completions\" list, "
                   "its top-level fields the first's")
    from .engine.cli_flags import add_engine_flags
    add_engine_flags(g)
    a = p.parse_args(argv)
    try:
        return _plan(a) if a.cmd == "plan" else _generate(a)
    except (ValueError, FileNotFoundError) as e:  # bad input (a value, a profile or weights not there): no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:   # (`plan ... | head`: the reader left; a traceback each time, and another at exit)
        sys.stdout = open(os.devnull, "w")   # noqa: SIM115 - what is left to flush goes nowhere
        return 0


if __name__ == "__main__":
    sys.exit(main())
