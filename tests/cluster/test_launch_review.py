"""The ways onto a cluster as a user meets them: the batch job's failure messages, scripts/submit.py, the multi-node
launch scripts (run against fake `ray`, `srun`, `hostname` ... on PATH) and cluster.client.Client."""
import json
import os
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NVLS = ("NCCL_NVLS_ENABLE=0", "NVSHMEM_DISABLE_NVLS=1", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1")


def _submit():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import submit
    return submit


# --- cluster/jobs/generate.py ---------------------------------------------------------------------------------

def test_job_resume_hint_names_the_input_line_past_blank_lines(tmp_path, monkeypatch, capsys):
    """After a failed chunk the job said 'rerun the rest from in.jsonl line <results written + 1>', which is not the
    input line once the file has blank lines; and rerunning into the same --output would have truncated the kept
    results (now: rerun with --resume, tests/cluster/test_job_resume.py)."""
    from cluster.jobs.generate import main
    from mpk_runtime.engine import LLM, RequestFailedError
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [json.dumps({"prompt_token_ids": [i + 1, i + 2], "temperature": 0, "max_tokens": 2}) for i in range(3)]
    inp.write_text(rows[0] + "\n\n\n" + rows[1] + "\n" + rows[2] + "\n")   # requests on lines 1, 4, 5
    real, calls = LLM.generate, []

    def flaky(self, prompts, params=None, use_tqdm=True):
        calls.append(1)
        if len(calls) == 2:
            raise RequestFailedError("injected: the workers failed")
        return real(self, prompts, params, use_tqdm=use_tqdm)
    monkeypatch.setattr(LLM, "generate", flaky)
    with pytest.raises(RequestFailedError):
        main(["--model", "tiny-qwen3", "--dtype", "float32", "--max-seq-len", "64", "--executor", "inprocess",
              "--chunk", "1", "--input", str(inp), "--output", str(out)])
    err = capsys.readouterr().err
    assert f"{inp}:4" in err and "rerun with --resume to continue" in err, err
    assert len(out.read_text().splitlines()) == 1


def test_job_checks_the_output_directory_before_loading_the_model(tmp_path, monkeypatch, capsys):
    """An --output in a directory that does not exist failed only after the model was loaded and every request
    checked (minutes for a large model on a cluster); it is now refused first."""
    from cluster.jobs import generate as job
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt_token_ids": [1, 2]}) + "\n")
    loaded = []
    monkeypatch.setattr(job, "LLM", lambda *a, **k: loaded.append(1) or pytest.fail("model loaded"))
    rc = job.main(["--model", "tiny-qwen3", "--executor", "inprocess", "--input", str(inp),
                   "--output", str(tmp_path / "no-such-dir" / "out.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and "no-such-dir" in err and "--output" in err and not loaded


# --- scripts/submit.py ----------------------------------------------------------------------------------------

def test_submit_keeps_nvlink_multicast_off_whatever_env_asks():
    """build_job(env=...) merged the caller's variables over NCCL_NVLS_ENABLE=0 / NVSHMEM_DISABLE_NVLS=1, so a
    job could run with NVLink multicast on; asking for that is now an error."""
    submit = _submit()
    with pytest.raises(SystemExit, match="NCCL_NVLS_ENABLE"):
        submit.build_job(["--model", "m"], env={"NCCL_NVLS_ENABLE": "1"})
    env = submit.build_job(["--model", "m"], env={"FOO": "1"})["runtime_env"]["env_vars"]
    assert env["FOO"] == "1" and all(env[k] == v for k, v in (x.split("=") for x in NVLS))


def test_submit_refuses_a_relative_model_directory(tmp_path, monkeypatch):
    """A relative --model that is a local directory passed: on the cluster it names a path inside the job's copy
    of this checkout, where the weights are never shipped (*.safetensors is excluded) or the directory is absent."""
    submit = _submit()
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="absolute path"):
        submit.check_paths(["--model", "models/m", "--input", "/d/in.jsonl", "--output", "/d/out.jsonl"])
    with pytest.raises(SystemExit, match="absolute path"):
        submit.check_paths(["--model=models/m"])
    submit.check_paths(["--model", "tiny-qwen3", "--input", "/d/in.jsonl"])   # a preset name is not a path


def test_submit_says_to_put_job_arguments_after_the_separator(capsys):
    """`submit.py --model m --input ...` (no `--`) died with argparse's 'unrecognized arguments', not saying that
    the job's arguments go after `--`."""
    submit = _submit()
    with pytest.raises(SystemExit) as e:
        submit.main(["--address", "http://h:8265", "--model", "m", "--input", "/d/in.jsonl"])
    assert "after `--`" in str(e.value.code) + capsys.readouterr().err


def _fake_job_api(monkeypatch, submit, submit_job):
    """ray.job_submission replaced by a client whose submit_job is `submit_job` and whose job stays RUNNING."""
    class Status:
        RUNNING, SUCCEEDED, FAILED, STOPPED = "RUNNING", "SUCCEEDED", "FAILED", "STOPPED"

    class FakeClient:
        def __init__(self, address):
            pass

        def submit_job(self, **job):
            return submit_job()

        def get_job_status(self, job_id):
            return Status.RUNNING

        def get_job_logs(self, job_id):
            return "log"
    mod = types.ModuleType("ray.job_submission")
    mod.JobStatus, mod.JobSubmissionClient = Status, FakeClient
    monkeypatch.setitem(sys.modules, "ray.job_submission", mod)
    monkeypatch.setattr(submit.time, "sleep", lambda s: None)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")   # (main sets it in this process: undone after the test)


JOB = ["--model", "m", "--input", "/d/in.jsonl", "--output", "/d/out.jsonl"]


def test_submit_to_an_address_nobody_answers_is_a_message(monkeypatch):
    """`--address http://127.0.0.1:8265` with the SSH tunnel (or the head) down ended in Ray's traceback
    ("ConnectionError: Failed to connect to Ray at address"), a GCS host:port in an RpcError traceback after 40 s;
    a message now, with what to check."""
    submit = _submit()
    _fake_job_api(monkeypatch, submit, lambda: pytest.fail("submitted"))

    def refuse(address):
        raise ConnectionError(f"Failed to connect to Ray at address: {address}.")
    monkeypatch.setattr(sys.modules["ray.job_submission"], "JobSubmissionClient", refuse)
    with pytest.raises(SystemExit) as e:
        submit.main(["--address", "http://127.0.0.1:1", "--no-wait", "--", "--model", "tiny-qwen3", "--input",
                     "/d/in.jsonl", "--output", "/d/out.jsonl"])
    msg = str(e.value.code)
    assert msg.startswith("cannot reach the Ray Job API at http://127.0.0.1:1: ConnectionError") and "ssh -N -L" in msg


@pytest.mark.parametrize("job,word", [
    (["--model", "m", "--input", "/d/in.jsonl"], "the following arguments are required: --output"),
    (JOB + ["--max-tokns", "5"], "unrecognized arguments: --max-tokns"),
    (JOB + ["--tp", "two"], "argument --tp: invalid int value"),
    (JOB + ["--chunk", "0"], "--chunk must be >= 1"),
])
def test_submit_checks_the_jobs_arguments_before_shipping_it(monkeypatch, capsys, job, word):
    """A job's misspelt or missing flag was an error in the job's log on the cluster, after the checkout's upload;
    submit.py parses the job's arguments with the job's own parser first and submits nothing."""
    submit = _submit()
    sent = []
    _fake_job_api(monkeypatch, submit, lambda: sent.append(1) or "raysubmit_x")
    with pytest.raises(SystemExit) as e:
        submit.main(["--no-wait", "--", *job])
    said = str(e.value.code) + capsys.readouterr().err
    assert word in said and not sent, said


def test_submit_timeout_says_the_job_is_still_running(monkeypatch, capsys):
    """Past --timeout submit.py printed 'job X: RUNNING' and exited 1 as if it had failed; the job goes on on the
    cluster, and the message now says so and how to follow or stop it."""
    submit = _submit()
    _fake_job_api(monkeypatch, submit, lambda: "raysubmit_1")
    rc = submit.main(["--address", "http://h:8265", "--timeout", "0.01", "--", *JOB])
    out = capsys.readouterr().out
    assert rc == 1 and "still running" in out and "ray job stop raysubmit_1" in out


def test_submit_waits_for_the_heads_job_agent(monkeypatch, capsys):
    """Right after `ray start --head` the Job API answers 500 'No available agent to submit job, please try again
    later' until the node's job agent is up (seen in tests/cluster/test_job_submit.py on a busy machine); submit.py
    died with that traceback instead of trying again."""
    submit = _submit()
    tries = []

    def submit_job():
        tries.append(1)
        if len(tries) < 3:
            raise RuntimeError("Request failed with status code 500: No available agent to submit job, please "
                               "try again later..")
        return "raysubmit_2"
    _fake_job_api(monkeypatch, submit, submit_job)
    assert submit.main(["--no-wait", "--", *JOB]) == 0
    assert len(tries) == 3 and "submitted raysubmit_2" in capsys.readouterr().out


# --- launch scripts -------------------------------------------------------------------------------------------

def _fakes(tmp_path, hostname_body: str) -> dict:
    """Fake ray / hostname / srun / scontrol / python / sleep; every call logged with the NVLS variables it saw."""
    b = tmp_path / "bin"
    b.mkdir()
    log = tmp_path / "log"
    rec = f'echo "$(basename "$0") $* | $NCCL_NVLS_ENABLE $NVSHMEM_DISABLE_NVLS $TORCH_SYMM_MEM_DISABLE_MULTICAST ' \
          f'${{RAY_ADDRESS:-}}" >> {log}\n'
    files = {
        "ray": rec,
        "python": rec + 'for a in "$@"; do echo "arg[$a]" >> ' + str(log) + '; done\n',
        "hostname": hostname_body,
        "sleep": "exit 0\n",
        "scontrol": 'echo n1; echo n2\n',
        # Slurm's steps: one holding a node's CPUs (ray start --block) makes a later step there wait unless it
        # passes --overlap (here: fail instead of hanging); SLURM_EXPORT_ENV=NONE (sbatch --export=NONE) gives a
        # step none of the caller's variables unless it passes --export=ALL
        "srun": f'''node=""; overlap=0; export_all=0
while [[ $# -gt 0 ]]; do case "$1" in
  -w) node="$2"; shift 2;; --overlap) overlap=1; shift;; --export=ALL) export_all=1; shift;;
  --export=*) shift;; -*) shift;; *) break;; esac; done
busy={tmp_path}/busy_$node
if [[ -f $busy && $overlap == 0 ]]; then echo "srun: Job step creation temporarily disabled, retrying" >&2; exit 1; fi
case "$*" in *--block*) touch "$busy";; esac
if [[ "${{SLURM_EXPORT_ENV:-ALL}}" == NONE && $export_all == 0 ]]; then exec env -i PATH="$PATH" "$@"; fi
exec "$@"
''',
    }
    for name, body in files.items():
        (b / name).write_text("#!/bin/bash\n" + body)
        (b / name).chmod(0o755)
    return {"PATH": f"{b}:/usr/bin:/bin", "HOME": str(tmp_path), "log": log}


def _log(f) -> list[str]:
    return f.read_text().splitlines() if f.exists() else []


@pytest.mark.parametrize("script", ["launch_head.sh", "launch_worker.sh"])
@pytest.mark.parametrize("hostname_body", ["exit 1\n", "echo\n"])
def test_launch_scripts_say_when_they_cannot_find_the_node_ip(tmp_path, script, hostname_body):
    """Where `hostname -I` fails (macOS, busybox) the scripts exited 1 without a word (set -e, pipefail); where it
    prints nothing they ran `ray start --node-ip-address=` (empty). Both now stop with a message naming NODE_IP."""
    f = _fakes(tmp_path, hostname_body)
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t")
    args = ["HEAD:6379"] if script == "launch_worker.sh" else []
    env = {"PATH": f["PATH"], "HOME": f["HOME"]}
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", script), *args, "--num-gpus", "2"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "NODE_IP" in r.stderr and not _log(f["log"]), r.stdout + r.stderr
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", script), *args, "--num-gpus", "2"],
                       env=dict(env, NODE_IP="10.1.2.3", NCCL_NVLS_ENABLE="1"), capture_output=True, text=True,
                       timeout=60)
    (line,) = _log(f["log"])
    assert r.returncode == 0 and "--node-ip-address=10.1.2.3" in line and line.endswith("| 0 1 1 "), line


def test_launch_worker_refuses_a_flag_for_the_head_address(tmp_path):
    """`launch_worker.sh --num-gpus 2` (the head address forgotten) ran `ray start --address=--num-gpus 2`."""
    f = _fakes(tmp_path, "echo 10.0.0.9\n")
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_worker.sh"), "--num-gpus", "2"],
                       env={"PATH": f["PATH"], "HOME": f["HOME"], "RAY_AUTH_TOKEN": "t"}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "HEAD_IP:PORT" in r.stderr and not _log(f["log"])


@pytest.mark.parametrize("extra", [["--port", "6380", "--node-ip-address", "10.0.0.7"],
                                   ["--port=6380", "--node-ip-address=10.0.0.7"]])
def test_launch_head_prints_the_address_ray_start_was_given(tmp_path, extra):
    """`launch_head.sh --port 6380` (an extra ray start arg, as the usage invites): ray start takes the last --port,
    so the head listened on 6380, but the line for the workers said `launch_worker.sh 10.0.0.9:6379` (RAY_PORT's
    default), and a worker started with it could not join. Likewise --node-ip-address and NODE_IP."""
    f = _fakes(tmp_path, "echo 10.0.0.9\n")
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_head.sh"), "--num-gpus", "2", *extra],
                       env={"PATH": f["PATH"], "HOME": f["HOME"]}, capture_output=True, text=True, timeout=60)
    (line,) = _log(f["log"])
    assert r.returncode == 0 and line.startswith("ray start --head --node-ip-address=10.0.0.7 --port=6380 "), line
    assert "launch_worker.sh 10.0.0.7:6380" in r.stdout, r.stdout


def test_launch_worker_refuses_the_dashboard_url(tmp_path):
    """`launch_worker.sh http://10.0.0.1:8265` (the dashboard URL submit.py takes, beside it in docs/serving.md) passed
    the address check and ray start died in a traceback ("ValueError: Invalid address format"); the usage says to
    give the GCS HEAD_IP:PORT now."""
    f = _fakes(tmp_path, "echo 10.0.0.9\n")
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_worker.sh"), "http://10.0.0.1:8265"],
                       env={"PATH": f["PATH"], "HOME": f["HOME"], "RAY_AUTH_TOKEN": "t"}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "HEAD_IP:PORT" in r.stderr and "http://" in r.stderr and not _log(f["log"])


@pytest.mark.parametrize("export", ["ALL", "NONE"])
def test_slurm_template_runs_the_job_beside_the_ray_head(tmp_path, export):
    """The driver was a second `srun` step on the head node, whose `ray start --block` step holds the node's CPUs
    and GPUs: Slurm's steps do not overlap by default, so the job waited ('step creation temporarily disabled')
    until its time limit. And under `sbatch --export=NONE` the ray start steps got none of the script's exports,
    NVSHMEM_DISABLE_NVLS=1 / NCCL_NVLS_ENABLE=0 among them."""
    f = _fakes(tmp_path, 'echo "10.0.0.5 fe80::1"\n')
    env = {"PATH": f["PATH"], "HOME": f["HOME"], "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_CPUS_PER_TASK": "16",
           "SLURM_GPUS_PER_NODE": "2", "SLURM_EXPORT_ENV": export}
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "slurm_template.sh"), "--model", "/m", "--input",
                        "/d/in put.jsonl", "--output", "/d/out.jsonl"], env=env, capture_output=True, text=True,
                       timeout=60)
    log = _log(f["log"])
    assert r.returncode == 0, r.stdout + r.stderr
    starts = [l for l in log if l.startswith("ray start")]
    assert len(starts) == 2 and all(l.split("|")[1].split()[:3] == ["0", "1", "1"] for l in starts), log
    driver = [l for l in log if l.startswith("python")]
    assert len(driver) == 1 and driver[0].split("|")[1].split() == ["0", "1", "1", "10.0.0.5:6379"], log
    assert "arg[/d/in put.jsonl]" in log and "arg[--executor]" in log


# --- cluster/client.py ----------------------------------------------------------------------------------------

def test_client_takes_an_openai_style_base_url(server):
    """The OpenAI client's base_url ends in /v1; Client('http://host:8000/v1') asked for /v1/v1/models and failed
    with 'is this an mpk-runtime server?'."""
    from cluster.client import Client
    from mpk_runtime import SamplingParams
    with Client(server[0].url + "/v1/") as c:
        out = c.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))
    assert len(out[0].token_ids) == 2


def test_client_generate_stops_sending_after_a_request_fails(server):
    """Client.generate raised a request's error only after every other prompt had been sent and generated (their
    results thrown away): one bad prompt among a thousand cost the whole batch. The prompts not yet sent are now
    cancelled."""
    from cluster.client import Client
    from mpk_runtime import PromptTooLongError, SamplingParams
    sent = []
    with Client(server[0].url, max_parallel=1) as c:
        real = c._one
        c._one = lambda *a: (sent.append(1), real(*a))[1]
        with pytest.raises(PromptTooLongError):
            c.generate([[1] * 100] + [[1, 2]] * 10, SamplingParams(temperature=0, max_tokens=2))
    assert len(sent) <= 2, len(sent)
