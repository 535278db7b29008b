"""The batch job (jsonl in/out) and a two-node Ray cluster with replicas spread over the nodes."""
import json
import os
import subprocess
import sys
import threading

import pytest

from mpk_runtime.engine import InvalidRequestError, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_generate_job_inprocess(tmp_path, demo_dir, ref_greedy):
    from cluster.jobs.generate import main
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [{"prompt_token_ids": [1, 2, 3], "temperature": 0, "max_tokens": 5, "ignore_eos": True},
                 {"prompt": "hello world", "temperature": 0, "max_tokens": 4, "ignore_eos": True, "id": "b"}])
    assert main(["--model", demo_dir, "--dtype", "float32", "--executor", "inprocess", "--max-seq-len", "64",
                 "--input", str(inp), "--output", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows[0]["token_ids"] == ref_greedy(demo_dir, [1, 2, 3], 5)
    assert rows[1]["id"] == "b" and len(rows[1]["token_ids"]) == 4 and isinstance(rows[1]["text"], str)


def test_generate_job_with_prefix_caching(tmp_path, demo_dir, ref_greedy):
    """--enable-prefix-caching (with --async-bursts): prompts sharing a head, admitted after the first finished
    (max batch 1), report cached tokens and keep the reference's tokens."""
    from cluster.jobs.generate import main
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    head = list(range(10, 30))
    prompts = [head + [i] for i in (1, 2, 3)]
    _write(inp, [{"prompt_token_ids": p, "temperature": 0, "max_tokens": 4, "ignore_eos": True} for p in prompts])
    assert main(["--model", demo_dir, "--backend", "torch", "--dtype", "float32", "--executor", "inprocess",
                 "--max-seq-len", "64", "--max-batch", "1", "--enable-prefix-caching", "--async-bursts",
                 "--input", str(inp), "--output", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["num_cached_tokens"] for r in rows] == [0, 16, 16]
    assert [r["token_ids"] for r in rows] == [ref_greedy(demo_dir, p, 4) for p in prompts]


@pytest.mark.parametrize("alloc", ["lazy", "reserve"])
def test_generate_job_kv_flags(tmp_path, demo_dir, ref_greedy, alloc, capsys):
    """--num-pages / --page-size / --max-num-batched-tokens / --kv-allocation reach the engine: few pages preempt
    (lazy) or queue (reserve), long prompts prefill in chunks, and the outputs stay the reference's."""
    from cluster.jobs.generate import main
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 6], [5, 3, 5, 8, 9, 7, 9], [3, 2, 3, 8]]
    _write(inp, [{"prompt_token_ids": p, "temperature": 0, "max_tokens": 24, "ignore_eos": True} for p in prompts])
    assert main(["--model", demo_dir, "--backend", "torch", "--dtype", "float32", "--executor", "inprocess",
                 "--max-seq-len", "64", "--max-batch", "4", "--num-pages", "12", "--page-size", "4",
                 "--max-num-batched-tokens", "8", "--kv-allocation", alloc, "--decode-steps", "1",
                 "--input", str(inp), "--output", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["token_ids"] for r in rows] == [ref_greedy(demo_dir, p, 24) for p in prompts]
    summary = capsys.readouterr().out
    # 12 pages of 4: reserve fits one request of up to 33 tokens (9 pages) at a time; lazy runs all four and preempts
    assert ("largest batch 1)" in summary) == (alloc == "reserve")
    assert ("preemptions for KV pages" in summary) == (alloc == "lazy")
    with pytest.raises(SystemExit):
        main(["--model", demo_dir, "--input", str(inp), "--output", str(out), "--kv-allocation", "eager"])


def test_generate_job_stop_strings_and_logprobs(tmp_path, demo_dir):
    from cluster.jobs.generate import main
    from mpk_runtime.engine import LLM
    with LLM(demo_dir, dtype="float32", max_seq_len=64) as llm:
        full = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
        stop = full.text[-3:-1]
        want = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=stop,
                                                            logprobs=1))[0]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [{"prompt": "hello world", "temperature": 0, "max_tokens": 10, "ignore_eos": True, "stop": [stop],
                  "logprobs": 1}, {"prompt": "hello world", "temperature": 0, "max_tokens": 3}])
    assert main(["--model", demo_dir, "--dtype", "float32", "--executor", "inprocess", "--max-seq-len", "64",
                 "--input", str(inp), "--output", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows[0]["text"] == want.text and rows[0]["finish_reason"] == "stop"
    assert [[t for t, _ in pos] for pos in rows[0]["logprobs"]] == [list(d) for d in want.logprobs]
    assert "logprobs" not in rows[1]


def test_generate_job_with_planner(tmp_path, ref_greedy, demo_dir):
    """--plan auto: the job's engine decodes through the planner's plans (pyvm) and still gives the reference."""
    from cluster.jobs.generate import main
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [{"prompt_token_ids": [1, 2, 3], "temperature": 0, "max_tokens": 5, "ignore_eos": True},
                 {"prompt_token_ids": [4, 5], "temperature": 0, "max_tokens": 5, "ignore_eos": True}])
    assert main(["--model", demo_dir, "--dtype", "float32", "--executor", "inprocess", "--max-seq-len", "64",
                 "--backend", "pyvm", "--max-batch", "2", "--plan", "auto",
                 "--input", str(inp), "--output", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows[0]["token_ids"] == ref_greedy(demo_dir, [1, 2, 3], 5)
    assert rows[1]["token_ids"] == ref_greedy(demo_dir, [4, 5], 5)


def test_cli_generate_plan_auto(capsys):
    from mpk_runtime.__main__ import main
    outs = []
    for plan in ("none", "auto"):
        assert main(["generate", "--model", "tiny-llama", "--prompt-ids", "1,2,3", "--prompt-ids", "4,5",
                     "--backend", "pyvm", "--max-tokens", "4", "--plan", plan]) == 0
        outs.append([json.loads(x)["token_ids"] for x in capsys.readouterr().out.splitlines()])
    assert outs[0] == outs[1] and len(outs[0]) == 2


def test_generate_job_bad_line_names_it(tmp_path):
    from cluster.jobs.generate import read_requests
    inp = tmp_path / "in.jsonl"
    _write(inp, [{"prompt": "x"}, {"prompt": "y", "temprature": 0}])
    with pytest.raises(InvalidRequestError, match=r"in.jsonl:2.*temprature"):
        read_requests(str(inp))


@pytest.mark.slow
def test_two_node_cluster_spreads_replicas(ref_greedy):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from cluster.router import build_router
    from cluster.ray_utils import worker_runtime_env
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0,
                                                      "object_store_memory": 100 * 1024 ** 2})
    nodes = [c.add_node(num_cpus=1, num_gpus=1, object_store_memory=100 * 1024 ** 2) for _ in range(2)]
    router = None
    try:
        ray.init(address=c.address, runtime_env=worker_runtime_env())
        c.wait_for_nodes()
        router = build_router("tiny-qwen3", num_replicas=2, executor="ray", dtype="float32", max_seq_len=64,
                              health_interval=None)
        placed = [r.llm.executor.node_ids()[0] for r in router.replicas]
        assert len(set(placed)) == 2 and set(placed) == {n.node_id for n in nodes}
        for r in router.replicas:  # through each replica's engine loop (the loop owns the engine)
            done, got = threading.Event(), {}

            def cb(out, got=got, done=done):
                if out.finished:
                    got["out"] = out
                    done.set()
            r.loop.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), cb)
            assert done.wait(60)
            assert got["out"].token_ids == ref_greedy("tiny-qwen3", [1, 2, 3], 6)
    finally:
        if router is not None:
            router.shutdown()
        ray.shutdown()
        c.shutdown()


def test_submit_builds_job_with_working_dir():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import submit
    job = submit.build_job(["--model", "tiny-qwen3", "--input", "a b.jsonl", "--output", "o.jsonl"])
    assert job["entrypoint"].startswith("python -m cluster.jobs.generate --model tiny-qwen3")
    assert "'a b.jsonl'" in job["entrypoint"]  # quoted
    assert job["runtime_env"]["working_dir"] == ROOT and ".git" in job["runtime_env"]["excludes"]


def test_generate_job_errors_name_the_line_and_are_messages(tmp_path, capsys):
    """Type errors in a line, and prompts the model cannot take (out of vocabulary, over the context), fail
    before any generation with the line named; a missing input file is a message, not a traceback."""
    from cluster.jobs.generate import main, read_requests
    inp = tmp_path / "in.jsonl"
    _write(inp, [{"prompt_token_ids": [1, 2]}, {"prompt": 5}])
    with pytest.raises(InvalidRequestError, match=r"in.jsonl:2.*'prompt' must be a string"):
        read_requests(str(inp))
    _write(inp, [{"prompt_token_ids": "abc"}])
    with pytest.raises(InvalidRequestError, match=r"in.jsonl:1.*prompt_token_ids"):
        read_requests(str(inp))
    out = tmp_path / "out.jsonl"
    for rows, word in (([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [1, 10 ** 6]}], "in.jsonl:2"),
                       ([{"prompt_token_ids": list(range(100))}], "in.jsonl:1")):
        _write(inp, rows)
        rc = main(["--model", "tiny-qwen3", "--dtype", "float32", "--max-seq-len", "64", "--input", str(inp),
                   "--output", str(out)])
        err = capsys.readouterr().err
        assert rc == 2 and word in err and "Traceback" not in err, err
        assert not out.exists()
    rc = main(["--model", "tiny-qwen3", "--input", str(tmp_path / "missing.jsonl"), "--output", str(out)])
    assert rc == 2 and "missing.jsonl" in capsys.readouterr().err


def test_submit_refuses_relative_paths():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import submit
    with pytest.raises(SystemExit, match="absolute path"):
        submit.check_paths(["--model", "m", "--input", "/data/in.jsonl", "--output", "out.jsonl"])
    with pytest.raises(SystemExit, match="absolute path"):
        submit.check_paths(["--input=in.jsonl"])
    submit.check_paths(["--model", "m", "--input", "/data/in.jsonl", "--output", "/data/out.jsonl"])


def _fail_second_generate(monkeypatch) -> list[int]:
    """LLM.generate patched to raise RequestFailedError on its second call (a job's second chunk); returns the list
    of each call's prompt count. monkeypatch.undo() or setattr(LLM, "generate", ...) restores it."""
    from mpk_runtime.engine import LLM, RequestFailedError
    real, calls = LLM.generate, []

    def flaky(self, prompts, params=None, use_tqdm=True):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise RequestFailedError("injected: the workers failed")
        return real(self, prompts, params, use_tqdm=use_tqdm)
    monkeypatch.setattr(LLM, "generate", flaky)
    return calls


def test_generate_job_keeps_finished_chunks_when_a_later_one_fails(tmp_path, monkeypatch, capsys):
    """Results are written a chunk at a time: a failure part-way (here the second generate call) leaves the first
    chunk's lines, in input order, and says where to resume (they were all lost before)."""
    from cluster.jobs.generate import main
    from mpk_runtime.engine import RequestFailedError
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [{"prompt_token_ids": [i + 1, i + 2], "temperature": 0, "max_tokens": 3, "id": i} for i in range(5)])
    calls = _fail_second_generate(monkeypatch)
    with pytest.raises(RequestFailedError):
        main(["--model", "tiny-qwen3", "--dtype", "float32", "--max-seq-len", "64", "--executor", "inprocess",
              "--chunk", "2", "--input", str(inp), "--output", str(out)])
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    assert [l["id"] for l in lines] == [0, 1] and all(len(l["token_ids"]) == 3 for l in lines)
    assert "rerun with --resume to continue" in capsys.readouterr().err and calls == [2, 2]
