"""The cheapest CPU recipes of README.md and docs/serving.md, run as a user runs them (subprocesses, the command taken
from the doc's own code block where it runs as written), asserting on what the docs say they print: the output
fields, exit codes and defaults. A doc that drifts from the code (a renamed flag, a field no longer printed) fails here.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SERVING = (ROOT / "docs" / "serving.md").read_text()
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
GENERATE_FIELDS = ["index", "prompt_token_ids", "token_ids", "text", "finish_reason"]


def _blocks(doc: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", doc, re.S)


def _command(doc: str, start: str) -> list[str]:
    """The command of a ```bash block line that starts with `start` (continuation lines joined, comment dropped)."""
    for block in _blocks(doc, "bash"):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            if line.startswith(start):
                return shlex.split(line, comments=True)
    raise AssertionError(f"no command starting {start!r} in the doc's bash blocks (renamed?)")


def _python(doc: str, needle: str) -> str:
    for block in _blocks(doc, "python"):
        if needle in block:
            return block
    raise AssertionError(f"no python block with {needle!r} in the doc")


def _run(argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    if argv[0] == "python":
        argv = [sys.executable] + argv[1:]
    return subprocess.run(argv, cwd=kw.pop("cwd", ROOT), env=ENV, capture_output=True, text=True, timeout=timeout,
                          **kw)


def _json_lines(out: str) -> list[dict]:
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> str:
    """docs/serving.md's demo directory (a toy tokenizer), made by the doc's own one-liner."""
    d = str(tmp_path_factory.mktemp("doc") / "demo")
    cmd = _command(SERVING, 'python -c "from mpk_runtime.engine.demo_model import save_demo_model')
    assert cmd[1] == "-c" and "'/tmp/demo'" in cmd[2]
    exec(cmd[2].replace("'/tmp/demo'", repr(d)), {})   # (in this process: a subprocess costs ~3 s of imports)
    assert os.path.isfile(os.path.join(d, "config.json")) and os.path.isfile(os.path.join(d, "tokenizer.json"))
    return d


def test_readme_plan_json():
    """README "Use": `plan ... --json` dumps the graphs, the task graphs and the check, one per TP rank."""
    cmd = _command(README, "python -m mpk_runtime plan --model tiny-qwen3")
    assert "--json" in cmd and cmd[cmd.index("--tp") + 1] == "2"
    r = _run(cmd)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert set(d) == {"graphs", "task_graphs", "check"}
    assert len(d["graphs"]) == len(d["task_graphs"]) == 2 and d["check"]["deps"] > 0


def test_readme_generate_line_and_exit_codes():
    """README "Use": one JSON line a prompt with the documented fields, 16 tokens by default, exit 0; bad input 2."""
    cmd = _command(README, "python -m mpk_runtime generate --model tiny-llama")
    r = _run(cmd)
    assert r.returncode == 0, r.stderr
    (line,) = _json_lines(r.stdout)
    assert list(line) == GENERATE_FIELDS, line            # no `prompt` for an ids prompt, no logprobs unasked
    assert line["index"] == 0 and line["prompt_token_ids"] == [1, 2, 3]
    assert len(line["token_ids"]) == 16 and line["finish_reason"] == "length"   # --max-tokens' default
    bad = _run(cmd[:cmd.index("--prompt-ids") + 1] + ["1,x"] + cmd[cmd.index("--prompt-ids") + 2:])
    assert bad.returncode == 2 and "error:" in bad.stderr and not bad.stdout.strip()


def test_readme_llm_snippet():
    """README "Use": the LLM snippet (pyvm, tp=2) prints 16 greedy token ids."""
    code = _python(README, 'LLM("tiny-qwen3", backend="pyvm"')
    r = _run(["python", "-c", code])
    assert r.returncode == 0, r.stderr
    ids = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(ids) == 16 and all(isinstance(t, int) for t in ids)


def test_serving_batch_job_inprocess(demo, tmp_path):
    """docs/serving.md 3: the jsonl job without Ray writes one line a request, in order, with the documented fields."""
    block = next(b for b in _blocks(SERVING, "bash") if "cat > /tmp/in.jsonl" in b)
    lines = block.split("<<'J'\n", 1)[1].split("\nJ\n", 1)[0]
    (tmp_path / "in.jsonl").write_text(lines + "\n")
    cmd = _command(SERVING, "python -m cluster.jobs.generate --model /tmp/demo --dtype float32 --executor inprocess")
    cmd = [{"/tmp/demo": demo, "/tmp/in.jsonl": str(tmp_path / "in.jsonl"),
            "/tmp/out.jsonl": str(tmp_path / "out.jsonl")}.get(a, a) for a in cmd]
    r = _run(cmd)
    assert r.returncode == 0, r.stderr
    assert re.match(r"wrote 3 results to .*out\.jsonl: 40 tokens in [\d.]+ s \(largest batch \d+\)", r.stdout), r.stdout
    out = _json_lines((tmp_path / "out.jsonl").read_text())
    assert [o["id"] for o in out] == [0, "b", "c"]
    for o in out:
        assert list(o) == ["id", "prompt_token_ids", "token_ids", "text", "finish_reason", "metrics",
                           "num_cached_tokens", "sampling"] + (["completions"] if o["id"] == "c" else []), o
        assert len(o["token_ids"]) == 8 and isinstance(o["text"], str)
    assert out[0]["prompt_token_ids"] == [1, 2, 3]
    assert [c["index"] for c in out[2]["completions"]] == [0, 1, 2] and out[2]["completions"][0]["text"] == out[2]["text"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serving_http_inprocess(demo):
    """docs/serving.md 5: the in-process server answers the doc's curl body and its Client call; the served model
    name is the directory's last component, and another name is a 404."""
    import httpx
    port = _free_port()
    cmd = _command(SERVING, "python -m cluster.server --model /tmp/demo --dtype float32 --port 8000")
    cmd = [demo if a == "/tmp/demo" else str(port) if a == "8000" else a for a in cmd]
    proc = subprocess.Popen([sys.executable] + cmd[1:], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server not up in 60 s"
            time.sleep(0.3)
        assert [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]] == ["demo"]
        curl = next(b for b in _blocks(SERVING, "bash") if "curl -s localhost:8000/v1/completions" in b)
        body = json.loads(re.search(r"-d '(\{.*\})'", curl).group(1))
        r = httpx.post(base + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert {"text", "finish_reason", "token_ids", "prompt_token_ids", "metrics"} <= set(choice)
        assert choice["prompt_token_ids"] == body["prompt"] and len(choice["token_ids"]) == body["max_tokens"]
        assert httpx.post(base + "/v1/completions", json={**body, "model": "not-served"}, timeout=30).status_code == 404
        code = _python(SERVING, "from cluster import Client")
        code = code[code.index("from cluster import Client"):].replace("http://127.0.0.1:8000", base)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code, {})
        lines = out.getvalue().strip().splitlines()
        assert json.loads(lines[0]) == choice["token_ids"]   # Client.generate: greedy, the same ids
        streamed: dict[str, list] = {}   # Client.stream's lines: "<request_id> <delta ids>", requests interleaved
        for ln in lines[1:]:
            rid, delta = ln.split(" ", 1)
            streamed.setdefault(rid, []).extend(json.loads(delta))
        assert streamed["0"] == choice["token_ids"] and set(streamed) == {"0", "1"}
        metrics = httpx.get(base + "/metrics").text
        for name in ("mpk_requests_total", "mpk_kv_pages_total", "mpk_preemptions_total"):
            assert name in metrics, name
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_generate_without_a_prompt_is_bad_input_exit_2():
    """README: exit 2 for bad input. No prompt at all exited 1 (a SystemExit of a message), the failed-request code."""
    p = subprocess.run([sys.executable, "-m", "mpk_runtime", "generate", "--model", "tiny-llama"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env=ENV)
    assert p.returncode == 2 and "--prompt-ids" in p.stderr, (p.returncode, p.stderr)
