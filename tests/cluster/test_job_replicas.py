"""The batch job's --replicas (cluster/jobs/generate.py _Models): data-parallel copies of the model behind the
router, each request to the least loaded one, results in input order and the same as one copy's (seeded requests
draw by their input index, not by replica)."""
import json
import re

import pytest

ROWS = ([{"prompt_token_ids": [1 + i, 2, 3 + i], "temperature": 0, "max_tokens": 6, "ignore_eos": True}
         for i in range(6)]
        + [{"prompt": f"hello {i}", "temperature": 0.8, "top_k": 20, "max_tokens": 5, "ignore_eos": True,
            "id": f"s{i}", "logprobs": 2} for i in range(6)])


def _job(tmp_path, demo_dir, name, *extra):
    from cluster.jobs.generate import main
    inp, out = tmp_path / "in.jsonl", tmp_path / f"{name}.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    rc = main(["--model", demo_dir, "--dtype", "float32", "--executor", "inprocess", "--max-seq-len", "64",
               "--max-batch", "4", "--seed", "5", "--input", str(inp), "--output", str(out), *extra])
    return rc, [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []


def test_replicas_write_what_one_copy_writes_and_share_the_requests(tmp_path, demo_dir, capsys):
    rc1, one = _job(tmp_path, demo_dir, "one")
    capsys.readouterr()
    rc2, two = _job(tmp_path, demo_dir, "two", "--replicas", "2")
    summary = capsys.readouterr().out
    assert rc1 == rc2 == 0 and len(two) == len(ROWS)
    assert [r["id"] for r in two] == [r["id"] for r in one]
    for a, b in zip(one, two):
        assert (a["token_ids"], a["text"], a["finish_reason"], a.get("logprobs")) == \
               (b["token_ids"], b["text"], b["finish_reason"], b.get("logprobs")), (a, b)
    m = re.search(r"2 replicas, requests (\d+)/(\d+)", summary)
    assert m and int(m[1]) + int(m[2]) == len(ROWS) and min(int(m[1]), int(m[2])) > 0, summary


def test_replicas_flag_checked_and_a_failed_request_named(tmp_path, demo_dir, capsys, monkeypatch):
    rc, _ = _job(tmp_path, demo_dir, "zero", "--replicas", "0")
    assert rc == 2 and "--replicas must be >= 1" in capsys.readouterr().err
    from mpk_runtime.engine import RequestFailedError
    from mpk_runtime.engine.engine import LLMEngine
    real = LLMEngine.step

    def failing_step(self):   # (a worker fault: every request in flight fails)
        if any(r.prompt_token_ids[:1] == [4] for r in self.scheduler.running):
            raise RuntimeError("injected worker fault")
        return real(self)
    monkeypatch.setattr(LLMEngine, "step", failing_step)
    with pytest.raises(RequestFailedError, match=r"in\.jsonl:\d+"):
        _job(tmp_path, demo_dir, "fail", "--replicas", "2")
    assert "rerun with --resume" in capsys.readouterr().err
