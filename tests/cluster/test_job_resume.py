"""The batch job's --resume: a job stopped part-way (a failed chunk, a killed process leaving half a line) is rerun
with --resume into the same --output and ends with the file a run in one go writes (sampled requests too: their
seeds come from their place in the input, not from how many requests this run's engine has seen); an --output that
is not this input's results is refused before the model loads, a complete one ends the job without loading it."""
import json

import pytest

from tests.cluster.test_cluster_jobs import _write

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
    real, calls = LLM.generate, []

    def flaky(self, prompts, params=None, use_tqdm=True):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise RequestFailedError("injected: the workers failed")
        return real(self, prompts, params, use_tqdm=use_tqdm)
    monkeypatch.setattr(LLM, "generate", flaky)
    with pytest.raises(RequestFailedError):
        _run(inp, out)
    err = capsys.readouterr().err
    assert "rerun with --resume to continue" in err and f"{inp}:4" in err and "another --output" not in err, err
    assert len(out.read_text().splitlines()) == 2
    monkeypatch.setattr(LLM, "generate", real)
    calls.clear()
    assert _run(inp, out, "--resume") == 0
    summary = capsys.readouterr().out
    assert "resumed" in summary and "2 already" in summary, summary
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


def test_resume_checks_text_prompts_against_the_tokenizer(tmp_path, demo_dir, capsys):
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


def test_without_resume_the_output_is_overwritten(tmp_path, one_go):
    inp, full = one_go
    out = tmp_path / "out.jsonl"
    out.write_text("old line\n" * 10)
    assert _run(inp, out) == 0
    assert _results(out) == _results(full)


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
