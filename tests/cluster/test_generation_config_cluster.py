"""The model's generation_config.json sampling defaults on every way in (session 76): the HTTP server (a request's
left-out fields, its max_tokens capped by the model's max_new_tokens, as vLLM's server), cluster.Client called without
SamplingParams, `python -m mpk_runtime generate` without sampling flags, and a batch job's lines without sampling
fields. Each took SamplingParams' own defaults (temperature 1, 16 tokens) whatever the model set. "vllm" turns it off;
a bad file stops the server and the job before the model loads (exit 2)."""
import json
import os
import shutil

import httpx
import pytest

from mpk_runtime.engine import SamplingParams

GEN = {"temperature": 0.0, "max_new_tokens": 3, "do_sample": False}


@pytest.fixture(scope="module")
def gc_dir(demo_dir, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("gc") / "demo-gc")
    shutil.copytree(demo_dir, d)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump(GEN, f)
    return d


@pytest.fixture(scope="module")
def gc_server(gc_dir):
    from cluster.router import build_router
    from cluster.server import ServerThread, create_app
    router = build_router(gc_dir, executor="inprocess", dtype="float32", max_seq_len=64, max_batch=8,
                          health_interval=None)
    srv, off = ServerThread(create_app(router)), ServerThread(create_app(router, generation_config="vllm"))
    yield srv, off, router
    srv.stop()
    off.stop()
    router.shutdown()


def _post(srv, path, body):
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_the_server_fills_left_out_fields_from_the_model(gc_server):
    srv, off, _ = gc_server
    ids = [5, 6, 7, 8]
    greedy = _post(srv, "/v1/completions", {"prompt": ids, "temperature": 0, "max_tokens": 3, "ignore_eos": True})
    # left out: the model's temperature 0 (two unseeded requests agree, and with the explicit greedy one) and its 3
    for _ in range(2):
        got = _post(srv, "/v1/completions", {"prompt": ids, "ignore_eos": True})
        assert got["token_ids"] == greedy["token_ids"] and len(got["token_ids"]) == 3
    # null is left out too; an explicit max_tokens is capped at the model's max_new_tokens (vLLM: the min of both)
    got = _post(srv, "/v1/completions", {"prompt": ids, "temperature": None, "max_tokens": 10, "ignore_eos": True})
    assert got["token_ids"] == greedy["token_ids"]
    # a chat request without max_tokens: the model's 3, not the rest of the context
    chat = _post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
    assert len(chat["token_ids"]) == 3
    # a field the request sets is its own: temperature 1 with a seed samples (not the greedy tokens every time)
    draws = {tuple(_post(srv, "/v1/completions", {"prompt": ids, "temperature": 1.0, "seed": s, "max_tokens": 3,
                                                  "ignore_eos": True})["token_ids"]) for s in range(6)}
    assert len(draws) > 1
    # generation_config="vllm": SamplingParams' defaults (16 tokens)
    assert len(_post(off, "/v1/completions", {"prompt": ids, "ignore_eos": True})["token_ids"]) == 16


def test_client_without_params_takes_the_servers_model_defaults(gc_server):
    from cluster.client import Client
    srv, _, _ = gc_server
    with Client(srv.url) as c:
        got = c.generate([[5, 6, 7, 8], [9, 10]])
        want = c.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0, max_tokens=3))
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        # explicit params are sent whole (temperature 1 is asked for, not left to the model)
        body = c._sampling(SamplingParams(), False)
        assert body["temperature"] == 1.0 and body["top_p"] == 1.0


def test_cli_generate_without_sampling_flags(gc_dir, capsys):
    from mpk_runtime.__main__ import main
    base = ["generate", "--model", gc_dir, "--backend", "torch", "--dtype", "float32", "--ignore-eos",
            "--prompt-ids", "5,6,7,8"]
    assert main(base) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    assert len(line["token_ids"]) == 3
    assert main(base + ["--max-tokens", "5", "--generation-config", "vllm"]) == 0
    assert len(json.loads(capsys.readouterr().out.splitlines()[0])["token_ids"]) == 5


def test_a_jobs_lines_without_sampling_fields(gc_dir, tmp_path):
    from cluster.jobs.generate import main
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"prompt_token_ids": [5, 6, 7, 8], "ignore_eos": True}) + "\n"
                   + json.dumps({"prompt_token_ids": [5, 6, 7, 8], "ignore_eos": True, "max_tokens": 5}) + "\n")
    job = ["--model", gc_dir, "--backend", "torch", "--dtype", "float32", "--executor", "inprocess",
           "--input", str(inp), "--output", str(out)]
    assert main(job) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [len(x["token_ids"]) for x in lines] == [3, 5]   # (a line's own max_tokens is its own)
    assert lines[1]["token_ids"][:3] == lines[0]["token_ids"]   # (greedy: the model's temperature 0)
    rec = json.loads((tmp_path / "out.jsonl.run.json").read_text())
    assert rec["sampling_defaults"] == {"temperature": 0.0, "max_tokens": 3}
    # --resume with other defaults than the run that wrote the results: refused, naming them
    with open(out, "r+") as f:
        first = f.readline()
        f.seek(0)
        f.truncate()
        f.write(first)
    assert main(job + ["--resume", "--generation-config", "vllm"]) == 2


def test_a_bad_generation_config_stops_the_server_before_the_model_loads(tmp_path, capsys):
    from cluster.serve import main
    d = tmp_path / "bad"
    d.mkdir()
    (d / "generation_config.json").write_text("{oops")
    assert main(["--model", "tiny-llama", "--generation-config", str(d), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "generation_config.json" in err and "vllm" in err
