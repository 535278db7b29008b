"""The batch job's --resume: a job stopped part-way (a failed chunk, a killed process leaving half a line) is rerun
with --resume into the same --output and ends with the file a run in one go writes (sampled requests too: their
seeds come from their place in the input, not from how many requests this run's engine has seen); an --output that
is not this input's results is refused before the model loads, a complete one ends the job without loading it. The
job records the flags that decide the tokens beside --output (<output>.run.json): --resume with other ones is refused
before the model loads, an --output without that record (written before it existed) is continued with a warning."""
import os
import json

import pytest

from tests.cluster.test_cluster_jobs import _fail_second_generate, _write

JOB = ["--model", "tiny-llama", "--backend", "torch", "--dtype", "float32", "--executor", "inprocess",
       "--max-seq-len", "64", "--chunk", "2", "--seed", "7"]
# sampled (temperature 1, no seed), greedy, seeded, default and own ids
ROWS = [{"prompt_token_ids": [1, 2, 3], "max_tokens": 6},
        {"prompt_token_ids": [4, 5], "max_tokens": 6, "id": "b"},
        {"prompt_token_ids": [6, 7, 8], "max_tokens": 6, "temperature": 0},
        {"prompt_token_ids": [9], "max_tokens": 6, "seed": 11},
        {"prompt_token_ids": [2, 9], "max_tokens": 6},
        {"prompt_token_ids": [3, 3, 1], "max_tokens": 5, "top_k": 4}]
KEYS = ("id", "prompt_token_ids", "token_ids", "text", "finish_reason")
RUN = ".run.json"   # the record of the run's flags beside --output
UNCHECKED = "cannot be checked"   # the warning for an --output without one


def _results(path):
    return [{k: d.get(k) for k in KEYS} for d in map(json.loads, path.read_text().splitlines())]


def _run(inp, out, *extra):
    from cluster.jobs.generate import main
    return main([*JOB, *extra, "--input", str(inp), "--output", str(out)])


@pytest.fixture(scope="module")
def one_go(tmp_path_factory):
    """The input (blank lines included: ids and seeds count requests, not lines) and a run in one go."""
    d = tmp_path_factory.mktemp("one_go")
    inp, out = d / "in.jsonl", d / "out.jsonl"
    inp.write_text("\n".join(json.dumps(r) for r in ROWS[:2]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in ROWS[2:]))
    assert _run(inp, out) == 0
    assert len(out.read_text().splitlines()) == len(ROWS)
    return inp, out


def _record(out):
    return json.loads((out.parent / (out.name + RUN)).read_text())


def _copy(full, out, n=None):
    """The first n lines of the one-go output (all: None) and its run record, as a job left them."""
    out.write_text("".join(full.read_text().splitlines(keepends=True)[:n]))
    (out.parent / (out.name + RUN)).write_bytes((full.parent / (full.name + RUN)).read_bytes())


def _no_model(monkeypatch):
    from cluster.jobs import generate as job
    loaded = []
    monkeypatch.setattr(job, "LLM", lambda *a, **k: loaded.append(1) or pytest.fail("model loaded"))
    return loaded


def test_one_go_keeps_the_seeds_of_one_generate_call(one_go):
    """The job's sampled requests (no seed of their own) draw as one LLM.generate call of the whole input does
    (the engine's seed for request i: seed * 1_000_003 + i): what the job wrote before --resume existed."""
    from mpk_runtime.engine import LLM, SamplingParams
    inp, out = one_go
    rows = [json.loads(l) for l in inp.read_text().splitlines() if l.strip()]
    with LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=64, seed=7) as llm:
        want = llm.generate([r["prompt_token_ids"] for r in rows],
                            [SamplingParams.from_dict({k: v for k, v in r.items() if k not in ("prompt_token_ids", "id")})
                             for r in rows], use_tqdm=False)
    assert [r["token_ids"] for r in _results(out)] == [o.token_ids for o in want]


def test_resume_after_a_failed_chunk_gives_the_one_go_output(tmp_path, one_go, monkeypatch, capsys):
    from mpk_runtime.engine import LLM, RequestFailedError
    inp, full = one_go
    out = tmp_path / "out.jsonl"
    real = LLM.generate
    _fail_second_generate(monkeypatch)
    with pytest.raises(RequestFailedError):
        _run(inp, out)
    err = capsys.readouterr().err
    assert "rerun with --resume to continue" in err and f"{inp}:4" in err and "another --output" not in err, err
    assert len(out.read_text().splitlines()) == 2
    monkeypatch.setattr(LLM, "generate", real)
    assert _run(inp, out, "--resume") == 0
    said = capsys.readouterr()
    assert "resumed" in said.out and "2 already" in said.out, said.out
    assert UNCHECKED not in said.err, said.err   # the failed run's own record: the same flags
    assert _results(out) == _results(full)


@pytest.mark.parametrize("tail", ["half", "no-newline", "bad-json"])
def test_resume_drops_a_line_cut_mid_write(tmp_path, one_go, monkeypatch, tail):
    """A process killed mid-write leaves part of a line (or one without its newline): it is dropped, truncated
    away, and generated again; only the requests from there on go to the model."""
    from mpk_runtime.engine import LLM
    inp, full = one_go
    lines = full.read_text().splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    cut = {"half": lines[3][:len(lines[3]) // 2], "no-newline": lines[3].rstrip("\n"),
           "bad-json": lines[3][:20] + "\n"}[tail]
    out.write_text("".join(lines[:3]) + cut)
    real, sent = LLM.generate, []
    monkeypatch.setattr(LLM, "generate", lambda self, p, sp=None, use_tqdm=True: sent.extend(p) or
                        real(self, p, sp, use_tqdm=use_tqdm))
    assert _run(inp, out, "--resume") == 0
    assert _results(out) == _results(full)
    assert out.read_text().startswith("".join(lines[:3]))   # the kept lines untouched (their metrics too)
    assert sent == [r["prompt_token_ids"] for r in ROWS[3:]]


def test_resume_with_a_complete_output_does_not_load_the_model(tmp_path, one_go, monkeypatch, capsys):
    inp, full = one_go
    out = tmp_path / "out.jsonl"
    out.write_bytes(full.read_bytes())
    loaded = _no_model(monkeypatch)
    assert _run(inp, out, "--resume") == 0
    assert not loaded and out.read_bytes() == full.read_bytes()
    said = capsys.readouterr().out
    assert f"all {len(ROWS)} results" in said and "nothing to do" in said, said


@pytest.mark.parametrize("case", ["other ids", "other prompts", "more lines", "bad middle line", "not a result"])
def test_resume_refuses_an_output_of_another_input_before_loading_the_model(tmp_path, one_go, monkeypatch,
                                                                             capsys, case):
    inp, full = one_go
    lines = full.read_text().splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    if case == "other ids":
        text = "".join(lines[:1]) + lines[1].replace('"id": "b"', '"id": "c"')
    elif case == "other prompts":   # default ids (0, 1, ...) match any input's: the prompts tell them apart
        other = json.loads(lines[0])
        other["prompt_token_ids"] = [7, 7]
        text = json.dumps(other) + "\n" + lines[1]
    elif case == "more lines":
        text = "".join(lines) + lines[-1]
    elif case == "bad middle line":
        text = lines[0] + "{not json\n" + lines[2]
    else:
        text = lines[0] + json.dumps([1, 2]) + "\n"
    out.write_text(text)
    loaded = _no_model(monkeypatch)
    assert _run(inp, out, "--resume") == 2
    err = capsys.readouterr().err
    assert not loaded and out.read_text() == text   # refused, and the file left as it was
    assert "does not belong to" in err and str(inp) in err and "another --output" in err and \
        "without --resume" in err and "Traceback" not in err, err


def test_resume_checks_text_prompts_against_the_tokenizer(tmp_path, demo_dir, capsys, monkeypatch):
    """Text prompts' token ids are known only once the tokenizer loads: a kept line whose prompt_token_ids are not
    its prompt's still fails the job, before anything is generated or written."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    args = ["--model", demo_dir, "--dtype", "float32", "--executor", "inprocess", "--max-seq-len", "64",
            "--chunk", "1", "--input", str(inp), "--output", str(out)]
    from cluster.jobs.generate import main
    _write(inp, [{"prompt": "hello world", "max_tokens": 3}, {"prompt": "hello there", "max_tokens": 3}])
    assert main(args) == 0
    full = out.read_text()
    first = json.loads(full.splitlines()[0])
    first["prompt_token_ids"] = first["prompt_token_ids"][:-1] + [first["prompt_token_ids"][-1] + 1]
    out.write_text(json.dumps(first) + "\n")
    assert main(args + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert "does not belong to" in err and f"{inp}:1" in err, err
    assert out.read_text() == json.dumps(first) + "\n"
    out.write_text(full.splitlines(keepends=True)[0])
    assert main(args + ["--resume"]) == 0
    assert [l["token_ids"] for l in _results(out)] == [json.loads(l)["token_ids"] for l in full.splitlines()]
    rec = _record(out)
    assert rec["model"] == demo_dir and rec["model_path"] == os.path.realpath(demo_dir), rec
    capsys.readouterr()
    monkeypatch.chdir(os.path.dirname(demo_dir))   # the same directory by a relative path: the same model
    rel = args.copy()
    rel[rel.index("--model") + 1] = os.path.basename(demo_dir)
    assert main(rel + ["--resume"]) == 0
    said = capsys.readouterr()
    assert "nothing to do" in said.out and not said.err, said


def test_without_resume_the_output_is_overwritten(tmp_path, one_go):
    inp, full = one_go
    out = tmp_path / "out.jsonl"
    out.write_text("old line\n" * 10)
    (tmp_path / ("out.jsonl" + RUN)).write_text(json.dumps({**_record(full), "seed": 99, "model": "other"}))
    assert _run(inp, out) == 0
    assert _results(out) == _results(full)
    assert _record(out) == _record(full)   # the record rewritten too: this run's flags


def test_the_run_flags_are_recorded_beside_the_output(one_go):
    """What decides the tokens, as this run had it; not what only changes speed or memory (--chunk, --max-batch,
    the KV cache's sizes, ...)."""
    inp, full = one_go
    rec = _record(full)
    assert rec == {"written_by": "cluster.jobs.generate", "model": "tiny-llama", "model_path": None,
                   "backend": "torch", "dtype": "float32", "seed": 7, "tp": 1, "max_seq_len": 64,
                   "sampling_defaults": {}, "input": os.path.abspath(inp)}, rec


def test_the_run_flags_are_recorded_before_the_first_chunk(tmp_path, one_go, monkeypatch, capsys):
    from mpk_runtime.engine import LLM, RequestFailedError
    inp, full = one_go
    out = tmp_path / "out.jsonl"

    def fail(self, prompts, params=None, use_tqdm=True):
        raise RequestFailedError("injected: the workers failed")
    monkeypatch.setattr(LLM, "generate", fail)
    with pytest.raises(RequestFailedError):
        _run(inp, out)
    assert out.read_text() == "" and _record(out) == _record(full)


@pytest.mark.parametrize("kept", [3, None])   # part of the results, all of them
@pytest.mark.parametrize("other,said", [
    (["--seed", "8"], ["--seed was 7, now 8"]),
    (["--model", "tiny-qwen3"], ["--model was tiny-llama, now tiny-qwen3"]),
    (["--dtype", "bfloat16"], ["--dtype was float32, now bfloat16"]),
    (["--max-seq-len", "48", "--backend", "reference"], ["--max-seq-len was 64, now 48",
                                                         "--backend was torch, now reference"]),
])
def test_resume_with_other_flags_is_refused_before_the_model_loads(tmp_path, one_go, monkeypatch, capsys, kept,
                                                                   other, said):
    """The kept lines came from another run's flags: appending this one's would mix two runs in one file."""
    inp, full = one_go
    out = tmp_path / "out.jsonl"
    _copy(full, out, kept)
    text, record = out.read_text(), _record(out)
    loaded = _no_model(monkeypatch)
    assert _run(inp, out, *other, "--resume") == 2
    err = capsys.readouterr().err
    assert not loaded and out.read_text() == text and _record(out) == record   # nothing changed
    for s in said:
        assert s in err, err
    assert str(out) + RUN in err and "original flags" in err and "another --output" in err and \
        "without --resume" in err and "Traceback" not in err, err


def test_resume_ignores_flags_that_do_not_change_the_tokens(tmp_path, one_go, capsys):
    """--chunk, --max-batch, the KV cache's pages, prefix caching, the executor: a rerun after running out of memory
    may change them."""
    inp, full = one_go
    out = tmp_path / "out.jsonl"
    _copy(full, out, 2)
    assert _run(inp, out, "--resume", "--chunk", "3", "--max-batch", "2", "--num-pages", "40", "--page-size", "8",
                "--no-enable-prefix-caching", "--kv-allocation", "reserve") == 0
    assert UNCHECKED not in capsys.readouterr().err
    assert _results(out) == _results(full) and _record(out) == _record(full)


@pytest.mark.parametrize("record", ["missing", "not json", "not this job's"])
def test_resume_without_a_run_record_warns_and_goes_on(tmp_path, one_go, capsys, record):
    """An --output written before the job recorded its flags (or beside a file of that name that is not its
    record): the flags cannot be checked, which the job says; then it goes on as before, and records this run's."""
    inp, full = one_go
    out = tmp_path / "out.jsonl"
    _copy(full, out, 3)
    side = tmp_path / ("out.jsonl" + RUN)
    if record == "missing":
        side.unlink()
    else:
        side.write_text("{not json" if record == "not json" else json.dumps({"seed": 1}))
    assert _run(inp, out, "--resume") == 0
    err = capsys.readouterr().err
    assert UNCHECKED in err and str(side) in err and "Traceback" not in err, err
    assert _results(out) == _results(full) and _record(out) == _record(full)


def test_resume_without_an_output_yet_is_a_normal_run(tmp_path, one_go, capsys):
    inp, full = one_go
    out = tmp_path / "new.jsonl"
    assert _run(inp, out, "--resume") == 0
    assert _results(out) == _results(full)
    assert "already" not in capsys.readouterr().out


def test_submit_passes_resume_to_the_job():
    from tests.cluster.test_launch_review import _submit
    submit = _submit()
    job = ["--model", "m", "--input", "/d/in.jsonl", "--output", "/d/out.jsonl", "--resume"]
    submit.check_job_args(job)
    assert submit.build_job(job)["entrypoint"].endswith(" --resume")
