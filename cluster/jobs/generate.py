"""Offline batch generation: jsonl in, jsonl out.

    python -m cluster.jobs.generate --model tiny-qwen3 --dtype float32 --tp 1 \
        --input prompts.jsonl --output out.jsonl [--executor ray|inprocess] [--replicas 2]   # 2 copies of the model

Each input line is {"prompt": str} or {"prompt_token_ids": [...]}, plus optional sampling fields (any of
SamplingParams': temperature, top_k, top_p, max_tokens, stop_token_ids, stop, seed, ignore_eos, logprobs,
penalties, ...; one left out takes the model's generation_config.json default where it sets one, as vLLM,
--generation-config) and an optional "id". Each output line (same order) is {"id", "prompt_token_ids", "token_ids",
"text", "finish_reason", "metrics", "num_cached_tokens", "sampling" (the line's sampling fields as given)}, plus
"logprobs" ([[token id, logprob], ...] a generated token) where asked, and for a line with "n" > 1 "completions"
(its n completions, each {"index", "token_ids", "text", "finish_reason"[, "logprobs"]}; the top-level fields are
completion 0's; the j-th seeded with seed + j, as LLM.generate and the HTTP server's n).
A bad line fails the job before any generation, naming the line. Results are written a --chunk at a time; after a
failure part-way, the same command with --resume keeps the results already in --output and generates the rest.
Beside --output the job writes <output>.run.json, the flags that decide its tokens (run_record); --resume refuses
to continue a run made with other ones.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from mpk_runtime.engine.cli_flags import add_engine_flags, engine_kwargs
from mpk_runtime.engine.generation_config import sampling_defaults
from mpk_runtime.engine import LLM, InvalidRequestError, RequestFailedError, SamplingParams, UnknownModelError
from mpk_runtime.engine.request import logprobs_by_id, merge_completions
from mpk_runtime.engine.sampling import completions, request_seed

SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__)


def read_requests(path: str) -> list[dict]:
    reqs = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:   # (decoded a line at a time: a stray byte names its line, not a UnicodeDecodeError traceback)
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InvalidRequestError(f"{path}:{n}: not UTF-8 text ({e})") from None
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(d, dict) or ("prompt" in d) == ("prompt_token_ids" in d):
                raise InvalidRequestError(f"{path}:{n}: give exactly one of 'prompt' (str) or 'prompt_token_ids'")
            extra = set(d) - SAMPLING_FIELDS - {"prompt", "prompt_token_ids", "id"}
            if extra:
                raise InvalidRequestError(f"{path}:{n}: unknown fields {sorted(extra)}; allowed: prompt, "
                                          f"prompt_token_ids, id, {', '.join(sorted(SAMPLING_FIELDS))}")
            if "prompt" in d and not isinstance(d["prompt"], str):
                raise InvalidRequestError(f"{path}:{n}: 'prompt' must be a string (token ids go in 'prompt_token_ids')")
            if "prompt_token_ids" in d and not (isinstance(d["prompt_token_ids"], list) and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in d["prompt_token_ids"])):
                raise InvalidRequestError(f"{path}:{n}: 'prompt_token_ids' must be a list of int token ids")
            given = {k: v for k, v in d.items() if k in SAMPLING_FIELDS}
            try:
                sp = SamplingParams.from_dict(given)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"{path}:{n}: {e}") from None
            reqs.append({"id": d.get("id", n - 1), "prompt": d.get("prompt", d.get("prompt_token_ids")), "params": sp,
                         "sampling": given, "where": f"{path}:{n}"})
    if not reqs:
        raise InvalidRequestError(f"{path} has no requests")
    return reqs


def _same(a, b) -> bool:
    """Equal as JSON values (1 is not 1.0 nor true)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _not_ours(output: str, inp: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"--output {output} does not belong to --input {inp}: {why}. --resume continues only a run of this same "
        "input into this file: give another --output, or run without --resume to overwrite it")


def read_done(output: str, inp: str, reqs: list[dict]) -> tuple[int, int, int, dict[int, list]]:
    """--resume: the results a run of this input already wrote to `output`, checked line by line to be those of its
    first requests in order (ids, prompt token ids where the input gives them, and the sampling fields where the
    line recorded them); (how many, the bytes of their
    lines, the bytes after them: a last line cut mid-write, i.e. without its newline or not JSON, to drop, and the
    prompt token ids of the kept lines whose request is text, for check_done_prompts). Raises InvalidRequestError
    when the file is not this input's results (another input's, a line that is not a result, more lines than
    requests)."""
    k = size = 0
    text_ids: dict[int, list] = {}

    def parse(raw: bytes):
        if not raw.endswith(b"\n"):
            return None
        try:
            return json.loads(raw)
        except ValueError:   # (not UTF-8, not JSON)
            return None

    def take(d, n: int, raw: bytes) -> None:
        nonlocal k, size
        if not isinstance(d, dict) or "id" not in d or not isinstance(d.get("prompt_token_ids"), list):
            raise _not_ours(output, inp, f"its line {n} is not a result line of this job")
        if k >= len(reqs):
            raise _not_ours(output, inp, f"it has more lines than the {len(reqs)} requests of the input")
        r = reqs[k]
        if not _same(d["id"], r["id"]):
            raise _not_ours(output, inp, f"its line {n} is the result of id {json.dumps(d['id'])}, where request "
                                         f"{k + 1} ({r['where']}) has id {json.dumps(r['id'])}")
        if isinstance(r["prompt"], str):
            text_ids[k] = d["prompt_token_ids"]
        elif not _same(d["prompt_token_ids"], r["prompt"]):
            raise _not_ours(output, inp, f"its line {n} has other prompt_token_ids than {r['where']}")
        if "sampling" in d:   # (lines written before the job recorded them: unchecked)
            _check_sampling(output, d["sampling"], n, r)
        k += 1
        size += len(raw)

    prev, n = None, 0
    with open(output, "rb") as f:
        for raw in f:
            if prev is not None:   # (a line before the last: complete, or the file is not a job's output)
                d = parse(prev)
                if d is None:
                    raise _not_ours(output, inp, f"its line {n} is not JSON")
                take(d, n, prev)
            prev, n = raw, n + 1
    if prev is not None:
        d = parse(prev)
        if d is not None:
            take(d, n, prev)
    return k, size, os.path.getsize(output) - size, text_ids


def _check_sampling(output: str, was, n: int, r: dict) -> None:
    """--resume: the sampling fields a kept result (its line n) was generated with against its input line's now
    (InvalidRequestError naming each field that changed). Compared as SamplingParams: 0 and 0.0, a field left out
    and its default given explicitly, are the same."""
    try:
        old = SamplingParams.from_dict(was) if isinstance(was, dict) else None
    except (InvalidRequestError, TypeError):
        old = None
    if old is None:
        raise InvalidRequestError(f"--output {output}: its line {n} has a 'sampling' that is not the sampling fields "
                                  "of a request; it is not a result line of this job")
    new = r["params"]
    if old == new:
        return
    diff = [f"{f} was {json.dumps(getattr(old, f))}, now {json.dumps(getattr(new, f))}"
            for f in SamplingParams.__dataclass_fields__ if getattr(old, f) != getattr(new, f)]
    raise InvalidRequestError(
        f"--output {output} holds the result of {r['where']} (its line {n}) generated with other sampling fields "
        f"than the input now gives: {'; '.join(diff)}. --resume keeps the results already written: restore the "
        "input's fields for the lines already done to continue, run without --resume to generate every line with "
        "the new ones, or give another --output")


RUN_RECORD = ".run.json"   # <output>.run.json: the run's flags (run_record), beside its results
WRITTEN_BY = "cluster.jobs.generate"
# The flags that decide the tokens a run writes, recorded and checked by --resume: the weights and how they are
# computed (--model, --backend, --dtype, --tp: another TP split sums in another order), the seed of the requests
# without their own (--seed), the length cap and the checks it makes (--max-seq-len); the requests themselves
# (--input) are checked line by line (ids, prompt ids, sampling fields). Not recorded: what schedules, batches or
# stores the same computation (--chunk, --max-batch, the engine flags of add_engine_flags: --num-pages, --page-size,
# --max-num-batched-tokens, --kv-allocation, --decode-steps, --async-bursts, --plan, --enable-prefix-caching) and
# where it runs (--executor, --ray-address). Sampling draws do not depend on the batch (engine/sampling.py: a hash
# of the request's seed and position), so these change a token only through the logits' rounding (a bf16 step
# differs with the batch size and plan bucket: a near-tie may break otherwise), which a resumed run's other batches
# change anyway; and a rerun after running out of memory is what would change them (fewer pages, a smaller batch).
RECORDED_FLAGS = {"model": "--model", "backend": "--backend", "dtype": "--dtype", "seed": "--seed", "tp": "--tp",
                  "max_seq_len": "--max-seq-len",
                  "sampling_defaults": "the model's sampling defaults (--generation-config)"}
# (--input's path is recorded, not compared: `ray job submit` unpacks its working_dir to another path per Ray session,
# so a resumed job's input moves; its requests are checked line by line by ids, prompt ids and sampling fields
# instead.)


def run_record_path(output: str) -> str:
    return output + RUN_RECORD


def run_record(a: argparse.Namespace) -> dict:
    """This run's flags that decide its tokens (RECORDED_FLAGS), as written to <output>.run.json: --model as given,
    and for a local directory its real path (model_path: the same directory by another path is the same model),
    --input's absolute path."""
    return {"written_by": WRITTEN_BY, "model": a.model,
            "model_path": os.path.realpath(a.model) if os.path.isdir(a.model) else None,
            "backend": a.backend, "dtype": a.dtype, "seed": a.seed, "tp": a.tp, "max_seq_len": a.max_seq_len,
            "sampling_defaults": sampling_defaults(a.model, a.generation_config),
            "input": os.path.abspath(a.input)}


def write_run_record(output: str, record: dict) -> None:
    path = run_record_path(output)
    with open(path + ".tmp", "w") as f:   # (replaced whole: a job killed mid-write leaves the old record or the new)
        f.write(json.dumps(record, indent=1) + "\n")
    os.replace(path + ".tmp", path)


def _flag_value(record: dict, key: str) -> str:
    v = record.get(key)
    if v is None:
        return "not given"
    if key == "model" and record.get("model_path") not in (None, v):
        return f"{v} ({record['model_path']})"
    return str(v)


def _run_key(record: dict, key: str):
    if key == "model":   # a directory by its real path; a preset by its name, in any case (as load_config takes it)
        return record.get("model_path") or str(record.get("model")).lower()
    return record.get(key)


def check_run_record(a: argparse.Namespace, done: int) -> None:
    """--resume with `done` results kept in --output: this run's flags against those <output>.run.json recorded
    (InvalidRequestError naming each that differs, with both values); without a record (an --output written before
    the job recorded one, or a file of that name that is not its record) a warning that they cannot be checked."""
    path = run_record_path(a.output)
    try:
        with open(path, "rb") as f:
            old = json.loads(f.read())
        why = None if isinstance(old, dict) and old.get("written_by") == WRITTEN_BY else \
            "is not a record of this job's flags"
    except FileNotFoundError:
        why = "does not exist (an --output written before the job recorded its flags)"
    except ValueError:   # (not UTF-8, not JSON)
        why = "is not JSON"
    if why:
        print(f"warning: --resume: {path} {why}, so the flags of the run that wrote the {done} results kept in "
              f"{a.output} cannot be checked against this run's ({', '.join(RECORDED_FLAGS.values())}): unless "
              "they were the same, the file ends with the results of two runs", file=sys.stderr)
        return
    new = run_record(a)
    diff = [f"{flag} was {_flag_value(old, k)}, now {_flag_value(new, k)}" for k, flag in RECORDED_FLAGS.items()
            if k in old and not _same(_run_key(old, k), _run_key(new, k))]
    if diff:
        raise InvalidRequestError(
            f"--output {a.output} holds {done} results of a run with other flags ({path}): {'; '.join(diff)}. "
            "--resume continues only that run, with its flags: rerun with the original flags, give another "
            "--output, or run without --resume to overwrite it")


def check_done_prompts(llm: LLM, output: str, inp: str, reqs: list[dict], text_ids: dict[int, list]) -> None:
    """The kept results of text prompts against their prompts' tokens (known once the model's tokenizer is)."""
    for i, ids in text_ids.items():
        if not _same(llm.engine.tokenize(reqs[i]["prompt"]), ids):
            raise _not_ours(output, inp, f"its line {i + 1} has other prompt_token_ids than {reqs[i]['where']}'s "
                                         "prompt")


def apply_sampling_defaults(reqs: list[dict], defaults: dict) -> None:
    """A line's sampling fields left out take the model's generation_config.json defaults (--generation-config,
    engine/generation_config.py), as LLM.generate and the HTTP server take them."""
    if defaults:
        for r in reqs:
            r["params"] = SamplingParams.from_dict({**defaults, **r["sampling"]})


def seed_requests(reqs: list[dict], engine_seed: int) -> None:
    """A request without a seed of its own samples with the seed the engine gives the i-th request it is sent
    (request_seed: engine_seed * 1_000_003 + i), fixed here from its place in the input: a --resume run sends
    the engine only the requests from k on, which it would number from 0. (A run in one go sends request i as
    the engine's i-th: the same seeds as before.) A line with n > 1 draws its j-th completion with that seed
    + j (sampling.completions), so its seed is moved by (i + 1) * 2^32 off the next lines' ones."""
    for i, r in enumerate(reqs):
        if r["params"].seed is None:
            seed = request_seed(r["params"], engine_seed, i) + ((i + 1) << 32 if r["params"].n > 1 else 0)
            r["params"] = dataclasses.replace(r["params"], seed=seed)


def validate_requests(llm: LLM, reqs: list[dict]) -> None:
    """Tokenize and check every request against the loaded model before generating; errors name the line."""
    for r in reqs:
        try:
            ids = llm.engine.tokenize(r["prompt"]) if isinstance(r["prompt"], str) else r["prompt"]
            llm.engine.validate(ids, r["params"])
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{r['where']}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    return user_errors_exit_2(_main, argv)


def user_errors_exit_2(run, argv) -> int:
    """run(argv), with what the user is to fix (a bad line or flag, a missing file, an unknown model, a Ray address
    nobody answers, a --tp or --replicas the cluster cannot hold) as one line on stderr and exit code 2, not a
    traceback. The jobs' and the server's command lines."""
    from cluster.ray_executor import PlacementError   # (does not import ray)
    try:
        return run(argv)
    except (InvalidRequestError, UnknownModelError, OSError, PlacementError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The job's flags (scripts/submit.py parses a job's arguments with it before shipping the job)."""
    ap = argparse.ArgumentParser(prog="python -m cluster.jobs.generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--executor", default="ray", choices=["ray", "inprocess"])
    ap.add_argument("--ray-address", default=None, help="default: RAY_ADDRESS (set by `ray job submit`) or local")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=1,
                    help="data-parallel copies of the model (each a TP group of --tp ranks; with Ray, spread over the "
                         "cluster's nodes): each request goes to the least loaded one, results are written in input "
                         "order as with one")
    ap.add_argument("--max-seq-len", type=int, default=None)
    add_engine_flags(ap)
    ap.add_argument("--chunk", type=int, default=256,
                    help="requests generated (and their results written and flushed) together: a failure part-way "
                         "keeps every finished chunk's lines in --output")
    ap.add_argument("--resume", action="store_true",
                    help="continue a run of this input that stopped part-way: keep the results already in --output "
                         "(checked to be this input's first ones, made with this run's --model, --backend, --dtype, "
                         "--seed, --tp, --max-seq-len as <output>.run.json recorded them) and generate the rest, "
                         "appended (without --resume --output is overwritten)")
    return ap


def check_args(a: argparse.Namespace) -> None:
    """What the parser cannot say: counts below 1 (InvalidRequestError)."""
    for flag, v in (("--chunk", a.chunk), ("--tp", a.tp), ("--max-batch", a.max_batch), ("--replicas", a.replicas)):
        if v < 1:
            raise InvalidRequestError(f"{flag} must be >= 1, got {v}")


def _main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    check_args(a)
    reqs = read_requests(a.input)
    apply_sampling_defaults(reqs, sampling_defaults(a.model, a.generation_config))
    out_dir = os.path.dirname(os.path.abspath(a.output))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):   # before the (slow) model load, not after
        raise InvalidRequestError(f"--output {a.output}: directory {out_dir} does not exist or is not writable")
    if os.path.isdir(a.output):
        raise InvalidRequestError(f"--output {a.output} is a directory: give the file to write "
                                  f"(e.g. {os.path.join(a.output, 'out.jsonl')})")
    done, text_ids, resumed = 0, {}, a.resume and os.path.exists(a.output)
    if resumed:   # (checked before the model loads: that can take minutes)
        done, size, cut, text_ids = read_done(a.output, a.input, reqs)
        if done:   # (before the cut line goes: a refused run changes nothing)
            check_run_record(a, done)
        if cut:
            os.truncate(a.output, size)
            print(f"--resume: dropped the last line of {a.output}, cut mid-write ({cut} bytes); it is generated "
                  "again", file=sys.stderr)
        if done == len(reqs):
            print(f"all {len(reqs)} results are already in {a.output} (--resume): nothing to do")
            return 0
    seed_requests(reqs, a.seed)
    executor = a.executor
    if executor == "ray":
        import cluster  # noqa: F401  (registers the "ray" executor)
        from cluster.ray_utils import ensure_ray
        ensure_ray(a.ray_address)
    t0 = time.monotonic()
    with _Models(a, executor) as models:
        llm = models.llm
        check_done_prompts(llm, a.output, a.input, reqs, text_ids)
        validate_requests(llm, reqs[done:])
        written, n = done, 0
        with open(a.output, "a" if resumed else "w") as f:
            # (once --output is this run's: before, a run that failed to load its model would leave the old results
            # recorded as made with its flags; before generating, so a failed first chunk still leaves it)
            write_run_record(a.output, run_record(a))
            try:
                for c0 in range(done, len(reqs), a.chunk):   # in input order, a chunk at a time
                    part = reqs[c0:c0 + a.chunk]
                    outs = models.generate(part)
                    for r, o in zip(part, outs):
                        line = {"id": r["id"], "prompt_token_ids": o.prompt_token_ids, "token_ids": o.token_ids,
                                "text": o.text, "finish_reason": o.finish_reason, "metrics": o.metrics.to_dict(),
                                "num_cached_tokens": o.num_cached_tokens,
                                "sampling": r["sampling"]}   # (the line's fields as given: --resume checks them)
                        if o.logprobs is not None:
                            line["logprobs"] = logprobs_by_id(o.logprobs)
                        if o.completions is not None:   # ("n" > 1: the top-level fields are completion 0's)
                            line["completions"] = o.to_dict()["completions"]
                        f.write(json.dumps(line) + "\n")
                    f.flush()
                    written += len(outs)
                    n += sum(len(c.token_ids) for o in outs for c in o.outputs)
            except BaseException:   # (input line numbers count blank lines: the request's own "where")
                kept = f"they are in {a.output} (lines 1-{written})" if written else f"none in {a.output} yet"
                print(f"error after {written} of {len(reqs)} results: {kept}; rerun with --resume to continue "
                      f"(the same command: it keeps them and generates the rest, from {reqs[written]['where']} on)",
                      file=sys.stderr)
                raise
        st = models.stats()
    pre = (f"; {st['preemptions']} preemptions for KV pages ({st['recomputed_tokens']} tokens computed again: "
           "more --num-pages would avoid them)" if st["preemptions"] else "")
    res = (f" (resumed after the {done} already there: {written} of {len(reqs)} in all)" if done else "")
    reps = (f"; {a.replicas} replicas, requests {'/'.join(map(str, st['requests_by_replica']))}"
            if a.replicas > 1 else "")
    print(f"wrote {written - done} results to {a.output}{res}: {n} tokens in {time.monotonic() - t0:.2f} s"
          f" (largest batch {st['max_batch_size_seen']}{pre}{reps})")
    return 0


class _Models:
    """The job's model: one LLM (--replicas 1), or a router over --replicas of them (cluster/router.py: with Ray each
    replica's TP group is placed on a node of its own where the cluster has them), which takes each request to its
    least loaded replica. Either way generate(part) returns part's outputs in its order, raising the first failure."""

    def __init__(self, a: argparse.Namespace, executor: str):
        self.a, self.executor = a, executor
        self.router = None
        self._served: list[int] = []

    def __enter__(self) -> "_Models":
        a = self.a
        kw = dict(dtype=a.dtype, seed=a.seed, max_batch=a.max_batch, max_seq_len=a.max_seq_len, **engine_kwargs(a))
        if a.replicas == 1:
            self.llm = LLM(a.model, backend=a.backend, tp=a.tp, executor=self.executor, **kw)
        else:
            from cluster.router import build_router
            self.router = build_router(a.model, backend=a.backend, tp=a.tp, num_replicas=a.replicas,
                                       executor=self.executor, step_timeout=None, health_interval=None, **kw)
            self.llm = self.router.replicas[0].llm   # (tokenize / validate: every replica has the same model)
            self._served = [0] * a.replicas
        return self

    def __exit__(self, *exc) -> None:
        if self.router is not None:
            self.router.shutdown()
        else:
            self.llm.shutdown()

    def generate(self, part: list[dict]) -> list:
        if self.router is None:
            return self.llm.generate([r["prompt"] for r in part], [r["params"] for r in part],
                                     use_tqdm=sys.stderr.isatty())
        import threading
        total = sum(r["params"].n for r in part)   # (n completions a line)
        outs: list = [None] * total
        left = [total]
        done, lock = threading.Event(), threading.Lock()

        def finished(i: int):
            def cb(o) -> None:
                if not o.finished:
                    return
                with lock:
                    outs[i] = o
                    left[0] -= 1
                    if left[0] == 0 or o.finish_reason == "error":
                        done.set()
            return cb
        names = [r.name for r in self.router.replicas]
        spans, k = [], 0   # (line i's completions are outs[spans[i][0]:spans[i][1]])
        for r in part:
            text = r["prompt"] if isinstance(r["prompt"], str) else None
            ids = self.llm.engine.tokenize(text) if text is not None else list(r["prompt"])
            spans.append((k, k + r["params"].n))
            for one in completions(r["params"]):
                rep, _ = self.router.submit(ids, one, finished(k), prompt=text, stream=False)
                self._served[names.index(rep.name)] += 1
                k += 1
        done.wait()
        bad = next((k for k, o in enumerate(outs) if o is not None and o.finish_reason == "error"), None)
        if bad is not None:
            line = next(i for i, (a, b) in enumerate(spans) if a <= bad < b)
            raise RequestFailedError(f"{part[line]['where']}: {outs[bad].error}")
        return [merge_completions(outs[a:b]) for a, b in spans]

    def stats(self) -> dict:
        if self.router is None:
            return self.llm.engine.stats
        every = [r.engine.stats for r in self.router.replicas]
        return dict(preemptions=sum(s["preemptions"] for s in every),
                    recomputed_tokens=sum(s["recomputed_tokens"] for s in every),
                    max_batch_size_seen=max(s["max_batch_size_seen"] for s in every),
                    requests_by_replica=list(self._served))


if __name__ == "__main__":
    sys.exit(main())
