"""`python -m mpk_runtime generate` as a user meets it: flags, error messages, exit codes and the output lines."""
import json

import pytest

from mpk_runtime.__main__ import main

BASE = ["generate", "--model", "tiny-llama", "--backend", "torch", "--dtype", "float32", "--max-tokens", "4"]


def _lines(out: str) -> list[dict]:
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from mpk_runtime.engine.demo_model import save_demo_model
    return save_demo_model(str(tmp_path_factory.mktemp("demo") / "tiny-qwen3-demo"))


def test_a_bad_stop_token_id_names_its_own_flag(capsys):
    """A typo in --stop-token-ids was reported as '--prompt-ids must be integers ...', pointing at the wrong flag."""
    assert main(BASE + ["--prompt-ids", "1,2", "--stop-token-ids", "3,x"]) == 2
    err = capsys.readouterr().err
    assert "--stop-token-ids" in err and "--prompt-ids" not in err


def test_outputs_follow_the_command_line_order_of_prompts(demo, capsys):
    """--prompt and --prompt-ids were gathered into two lists (ids first), so `--prompt A --prompt-ids 1,2` printed
    the token-id prompt's line first: output lines did not match the order the prompts were given in."""
    args = ["generate", "--model", demo, "--backend", "torch", "--dtype", "float32", "--max-tokens", "2",
            "--prompt", "hello world", "--prompt-ids", "1,2,3", "--prompt", "hello"]
    assert main(args) == 0
    got = _lines(capsys.readouterr().out)
    assert [g.get("prompt") for g in got] == ["hello world", None, "hello"]
    assert got[1]["prompt_token_ids"] == [1, 2, 3] and len(got[0]["prompt_token_ids"]) > len(got[2]["prompt_token_ids"])
    assert [g["index"] for g in got] == [0, 1, 2]


def test_sampled_prompts_given_twice_draw_different_tokens(capsys):
    """Every prompt was sampled with the same seed (--seed, 0 by default), so `--prompt-ids 1,2 --prompt-ids 1,2
    --temperature 1` printed two identical samples; vLLM / the engine derive a seed per request from the engine seed."""
    args = BASE + ["--max-tokens", "8", "--temperature", "1", "--ignore-eos", "--prompt-ids", "1,2", "--prompt-ids", "1,2"]
    assert main(args) == 0
    a, b = _lines(capsys.readouterr().out)
    assert a["token_ids"] != b["token_ids"]
    assert main(args) == 0   # still reproducible run to run
    assert [x["token_ids"] for x in _lines(capsys.readouterr().out)] == [a["token_ids"], b["token_ids"]]


def test_an_explicit_max_batch_is_kept(monkeypatch, capsys):
    """--max-batch was replaced by max(--max-batch, number of prompts): a user capping the batch (and the KV cache
    sized for it) got as many rows as prompts, and --max-batch 0 passed silently."""
    import mpk_runtime.engine as eng
    seen = []

    class Spy(eng.LLM):
        def __init__(self, *a, **k):
            seen.append(k["max_batch"])
            super().__init__(*a, **k)
    monkeypatch.setattr(eng, "LLM", Spy)
    prompts = ["--prompt-ids", "1,2", "--prompt-ids", "3,4", "--prompt-ids", "5"]
    assert main(BASE + prompts + ["--max-batch", "2"]) == 0
    assert len(_lines(capsys.readouterr().out)) == 3
    assert main(BASE + prompts) == 0           # not given: one row a prompt (at least 8), as before
    assert seen == [2, 8]
    assert main(BASE + prompts + ["--max-batch", "0"]) == 2
    assert "max_batch" in capsys.readouterr().err


def test_a_failed_request_keeps_the_finished_ones_and_exits_1(monkeypatch, capsys):
    """One request failing (a worker / sampling error) raised RequestFailedError out of main: a traceback, and the
    outputs of every prompt that had finished were never printed. Now each prompt gets its line (the failed one with
    finish_reason "error" and the message), stderr says what failed, and the exit code is 1 (2 is for bad input)."""
    import mpk_runtime.engine.engine as eng
    real, calls = eng.sample, []

    def flaky(*a, **k):          # the 4th host sample: prompt 1's second token (prompt 0 has finished by then)
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("probability tensor contains nan")
        return real(*a, **k)
    monkeypatch.setattr(eng, "sample", flaky)
    args = ["generate", "--model", "tiny-llama", "--backend", "reference", "--dtype", "float32", "--max-tokens", "2",
            "--ignore-eos", "--prompt-ids", "1,2", "--prompt-ids", "3,4"]
    assert main(args) == 1
    cap = capsys.readouterr()
    ok, bad = _lines(cap.out)
    assert ok["finish_reason"] == "length" and len(ok["token_ids"]) == 2
    assert bad["finish_reason"] == "error" and "nan" in bad["error"]
    assert "1 of 2" in cap.err and "Traceback" not in cap.err


def test_the_summary_line_says_when_the_weights_are_a_presets_random_ones(demo, capsys):
    """`--model Llama-3.2-1B` is the preset (names are case-insensitive): seeded random weights, not Meta's. The
    summary line said nothing about it, so gibberish output looked like a broken runtime."""
    assert main(BASE + ["--prompt-ids", "1,2", "--seed", "3"]) == 0
    assert "seeded random weights, seed 3" in capsys.readouterr().err
    assert main(["generate", "--model", demo, "--backend", "torch", "--dtype", "float32", "--max-tokens", "2",
                 "--prompt-ids", "1,2"]) == 0
    assert "random" not in capsys.readouterr().err   # a model directory's own weights


def test_a_seed_past_int64_generates(capsys):
    """--seed 99999999999999999999 (argparse takes any int) exited 2 with "rank 0 failed in 'init_model': ValueError:
    Overflow when unpacking long long" (torch's manual_seed, for the preset's random weights)."""
    assert main(BASE + ["--prompt-ids", "1,2", "--seed", "99999999999999999999"]) == 0
    lines = _lines(capsys.readouterr().out)
    assert len(lines) == 1 and len(lines[0]["token_ids"]) == 4


def test_max_seq_len_1_exits_2_saying_why(capsys):
    """--max-seq-len 1 said "shorten it to at most 0 tokens" about a one-token prompt."""
    assert main(BASE + ["--prompt-ids", "1", "--max-seq-len", "1"]) == 2
    err = capsys.readouterr().err
    assert "max_seq_len" in err and "at most 0 tokens" not in err and "Traceback" not in err


def test_n_prints_each_prompts_completions_and_a_bad_n_exits_2(capsys):
    """--n (session 75): a line a prompt, its n completions in "completions" (distinct samples), the top-level fields
    the first's; the summary counts every completion's tokens; n outside [1, 64] is a usage error."""
    assert main(BASE + ["--temperature", "1", "--ignore-eos", "--n", "3", "--prompt-ids", "1,2"]) == 0
    cap = capsys.readouterr()
    (line,) = _lines(cap.out)
    assert [c["index"] for c in line["completions"]] == [0, 1, 2]
    assert line["token_ids"] == line["completions"][0]["token_ids"]
    assert len({tuple(c["token_ids"]) for c in line["completions"]}) > 1 and "12 tokens" in cap.err
    assert main(BASE + ["--n", "65", "--prompt-ids", "1,2"]) == 2
    assert "n must be an int in [1, 64]" in capsys.readouterr().err


def test_the_default_max_batch_counts_every_completion(capsys, monkeypatch):
    """--max-batch's default was max(8, prompts): 3 prompts at --n 4 are 12 sequences, and 4 of them queued behind the
    first 8 (a second pass of decode steps for them). It is now prompts x n (at least 8); --max-batch still rules."""
    import mpk_runtime.engine as engine
    seen = []

    class Spy(engine.LLM):
        def __init__(self, *args, **kwargs):
            seen.append(kwargs["max_batch"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(engine, "LLM", Spy)
    ids = ["--prompt-ids", "1,2", "--prompt-ids", "3", "--prompt-ids", "4,5"]
    assert main(BASE + ["--temperature", "1", "--n", "4"] + ids) == 0
    assert main(BASE + ["--temperature", "1", "--n", "4", "--max-batch", "5"] + ids) == 0
    assert main(BASE + ids) == 0
    assert seen == [12, 5, 8]
    assert len(_lines(capsys.readouterr().out)) == 9
