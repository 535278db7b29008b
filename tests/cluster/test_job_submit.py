"""A real `ray job submit` (through scripts/submit.py and the Job API) against a local head started with
`ray start --head`, token authentication on: the job writes the expected output file; a client without the
token is refused. Needs ray[default] (the dashboard); skips without it."""
import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("ray.dashboard")
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    env = dict(os.environ, RAY_AUTH_MODE="token")
    dash, gcs = _free_port(), _free_port()
    tmp = tmp_path_factory.mktemp("rayhead")
    cmd = ["ray", "start", "--head", "--num-cpus", "2", "--num-gpus", "2", "--dashboard-host", "127.0.0.1",
           "--dashboard-port", str(dash), "--port", str(gcs), "--include-dashboard", "true",
           "--object-store-memory", str(300 * 2**20), "--temp-dir", str(tmp)]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=120)
    try:
        yield f"http://127.0.0.1:{dash}", env
    finally:
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=60)


def test_job_writes_expected_output(head, tmp_path):
    address, env = head
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = [[1, 2, 3], [4, 5]]
    inp.write_text("".join(json.dumps({"prompt_token_ids": p, "max_tokens": 5, "temperature": 0}) + "\n"
                           for p in prompts))
    r = subprocess.run([sys.executable, "scripts/submit.py", "--address", address, "--timeout", "240", "--",
                        "--model", "tiny-qwen3", "--tp", "2", "--backend", "torch", "--dtype", "float32",
                        "--input", str(inp), "--output", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "SUCCEEDED" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    from mpk_runtime import LLM, SamplingParams
    with LLM("tiny-qwen3", backend="reference", dtype="float32") as llm:
        want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [row["token_ids"] for row in sorted(rows, key=lambda x: x["id"])] == [o.token_ids for o in want]


def test_job_api_refuses_a_wrong_token(head):
    address, env = head
    code = ("from ray.job_submission import JobSubmissionClient\n"
            f"JobSubmissionClient({address!r}).list_jobs()\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(env, RAY_AUTH_TOKEN="not-the-token"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "token" in (r.stdout + r.stderr).lower()
