"""Review of the Ray executor, the batch job and the launch scripts as a user meets them: a driver's own
`ray.init()`, a TP group no node can hold, a rank dying mid-generate (its node named; the LLM shut down and a new one
made), calls after shutdown; the job's input / output checks; the launch scripts' usage and Slurm's GPU count.
Shell scripts run against fake `ray`, `srun`, `hostname` ... on PATH (no cluster starts)."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from mpk_runtime.engine import LLM, RequestFailedError, SamplingParams, ShutDownError
from mpk_runtime.runtime.executor import WorkerError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


# --- Ray: first, before this module's ray_local fixture starts its cluster (two local clusters on 2 cores) ------

@pytest.mark.slow
def test_llm_over_a_drivers_own_ray_init(tmp_path):
    """After a plain `ray.init()` (not cluster.ensure_ray) in a script outside the checkout, LLM(executor="ray")
    reuses that Ray, but every actor died at start ("No module named 'cluster'": only ensure_ray put the checkout on
    the workers' PYTHONPATH), reported as a bare "rank 0 died during 'init_model' (ActorDiedError)"; nor did the
    actors get NVLink multicast turned off. Both now come with every actor."""
    pytest.importorskip("ray")
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys
        sys.path.insert(0, {ROOT!r})          # the driver finds the checkout; nothing tells the workers
        import ray
        ray.init(num_cpus=1, num_gpus=1, include_dashboard=False, object_store_memory=100 * 2**20)
        gcs = ray.get_runtime_context().gcs_address
        import cluster
        from mpk_runtime import LLM, SamplingParams
        with LLM("tiny-qwen3", dtype="float32", max_seq_len=32, executor="ray") as llm:
            out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                               use_tqdm=False)[0]
            env = ray.get(llm.executor.actors[0].__ray_call__.remote(lambda self: {{
                k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS")}}))
        print(json.dumps({{"tokens": out.token_ids, "env": env,
                           "same_ray": ray.get_runtime_context().gcs_address == gcs}}))
        ray.shutdown()
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["same_ray"] and len(got["tokens"]) == 4
    assert got["env"] == {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.mark.slow
def test_tp_no_node_can_hold_is_refused_at_once(ray_local):
    """tp=4 on a cluster whose only node has 2 GPUs: the STRICT_PACK placement group can never be ready, and LLM
    waited the whole placement timeout (60 s) for a RuntimeError; a CPU-only group likewise. Refused at once now,
    naming what the group needs and what the nodes have."""
    import cluster  # noqa: F401 - registers executor="ray"
    from cluster.ray_executor import PlacementError, RayExecutor
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"needs \{'GPU': 4\} on one node.*GPU 2"):
        LLM("tiny-qwen3", tp=4, dtype="float32", max_seq_len=32, executor="ray")
    with pytest.raises(PlacementError, match=r"\{'CPU': 3\}.*CPU 2"):
        RayExecutor(3, num_gpus_per_worker=0, num_cpus_per_worker=1, name="too-many-cpus")
    assert time.monotonic() - t0 < 20
    assert ray_local.available_resources().get("GPU") == 2   # nothing held by the refused groups


@pytest.mark.slow
def test_job_with_a_tp_no_node_can_hold_is_a_message(ray_local, tmp_path, capsys):
    """The batch job on that cluster ended in a RuntimeError traceback (exit 1) after the placement timeout; it is
    the user's to fix (--tp), so now a message and exit 2, and no output file."""
    from cluster.jobs.generate import main
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"prompt_token_ids": [1, 2]}) + "\n")
    t0 = time.monotonic()
    rc = main(["--model", "tiny-qwen3", "--tp", "4", "--executor", "ray", "--input", str(inp), "--output", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "no node of this Ray cluster" in err and "Traceback" not in err, err
    assert time.monotonic() - t0 < 20 and not out.exists()


@pytest.mark.slow
def test_rank_dying_mid_generate_names_its_node_then_shutdown_and_a_new_llm(ray_local, ref_greedy):
    """A tp=2 rank whose process exits during a step: the error named the rank but not where it ran (which node's
    logs to read). Then shutdown (twice), and a call after it: the executor tried to rebuild its workers in a
    placement group it had removed ('rebuilding 1 workers', then AttributeError) and the message said "retry it";
    now it says the executor is shut down, recover() declines, and a new LLM in the same Ray session serves."""
    import ray

    import cluster  # noqa: F401
    ip = ray.util.get_node_ip_address()
    llm = LLM("tiny-qwen3", backend="torch", tp=2, dtype="float32", max_seq_len=32, executor="ray")
    ray.get(llm.executor.actors[1].inject_fault.remote("crash"))
    with pytest.raises(RequestFailedError, match=rf"rank 1 on node {ip} \(\w+\) died during 'execute'"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    llm.shutdown()
    llm.shutdown()   # a second shutdown is a no-op
    assert llm.executor.recover() is False
    with pytest.raises(ShutDownError, match="create a new LLM"):   # refused before any worker call
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    with pytest.raises(WorkerError, match="shut down; create a new LLM"):   # the executor itself, called directly
        llm.executor.collective_rpc("health")
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=32, executor="ray") as again:
        assert again.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids == ref_greedy("tiny-qwen3",
                                                                                               [1, 2, 3], 4)


# --- cluster/jobs/generate.py ---------------------------------------------------------------------------------

def test_job_input_that_is_not_utf8_names_the_line(tmp_path, capsys):
    """A stray non-UTF-8 byte (a Latin-1 prompt) ended the job in a UnicodeDecodeError traceback, no line named."""
    from cluster.jobs.generate import main
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(json.dumps({"prompt_token_ids": [1, 2]}).encode() + b'\n{"prompt": "caf\xe9"}\n')
    rc = main(["--model", "tiny-qwen3", "--executor", "inprocess", "--input", str(inp),
               "--output", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and f"{inp}:2" in err and "UTF-8" in err, err


def test_job_output_that_is_a_directory_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """`--output /shared/results` (a directory) passed the directory check and failed only after the model was
    loaded and every request checked ("Is a directory")."""
    from cluster.jobs import generate as job
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt_token_ids": [1, 2]}) + "\n")
    monkeypatch.setattr(job, "LLM", lambda *a, **k: pytest.fail("model loaded"))
    rc = job.main(["--model", "tiny-qwen3", "--executor", "inprocess", "--input", str(inp),
                   "--output", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "is a directory" in err, err


# --- launch scripts -------------------------------------------------------------------------------------------

def _fake_bin(tmp_path) -> tuple[dict, object]:
    """ray / python / hostname / srun / scontrol / sleep that log their arguments and the NVLS variables."""
    b, log = tmp_path / "bin", tmp_path / "log"
    b.mkdir()
    rec = f'echo "$(basename "$0") $* | ${{NCCL_NVLS_ENABLE:-}} ${{NVSHMEM_DISABLE_NVLS:-}}" >> {log}\n'
    srun = 'while [[ $# -gt 0 && $1 == -* ]]; do [[ $1 == -w ]] && shift; shift; done; exec "$@"\n'  # runs the command
    for name, body in {"ray": rec, "python": rec, "hostname": "echo 10.0.0.5\n", "sleep": "exit 0\n",
                       "scontrol": "echo n1; echo n2\n", "srun": srun}.items():
        (b / name).write_text("#!/bin/bash\n" + body)
        (b / name).chmod(0o755)
    return {"PATH": f"{b}:/usr/bin:/bin", "HOME": str(tmp_path), "RAY_AUTH_TOKEN": "t"}, log


def _lines(log) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _run(script, args, env):
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", script), *args], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("script", ["launch_head.sh", "launch_worker.sh"])
def test_launch_scripts_help_prints_usage_and_starts_nothing(tmp_path, script):
    """`launch_head.sh --help` went on to `ray start --head ... --help` and then printed "head at ...: workers:
    ..." as if a head had started; `launch_worker.sh --help` took --help for the head address (usage on stderr, exit
    2). Both print their usage, with the environment variables they read, and start nothing."""
    assert subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts", script)]).returncode == 0
    env, log = _fake_bin(tmp_path)
    r = _run(script, ["--help"], env)
    assert r.returncode == 0 and "NODE_IP" in r.stdout and "NCCL_NVLS_ENABLE=0" in r.stdout, r.stdout + r.stderr
    assert "head at" not in r.stdout and not _lines(log)


def test_launch_worker_wants_the_heads_port(tmp_path):
    """`launch_worker.sh 10.0.0.1` (no port) ran `ray start --address=10.0.0.1`, which Ray refuses with a traceback;
    the usage now says to give HEAD_IP:PORT. With the port, ray start runs with the NVLS switches off."""
    env, log = _fake_bin(tmp_path)
    r = _run("launch_worker.sh", ["10.0.0.1", "--num-gpus", "2"], env)
    assert r.returncode == 2 and "HEAD_IP:PORT" in r.stderr and not _lines(log)
    r = _run("launch_worker.sh", ["10.0.0.1:6379", "--num-gpus", "2"], dict(env, NCCL_NVLS_ENABLE="1"))
    (line,) = _lines(log)
    assert r.returncode == 0 and "--address=10.0.0.1:6379" in line and line.endswith("| 0 1"), line


SLURM_ENV = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_CPUS_PER_TASK": "16"}


def test_slurm_template_takes_a_typed_gpu_count(tmp_path):
    """`#SBATCH --gpus-per-node=h100:2` sets SLURM_GPUS_PER_NODE=h100:2, and every node ran
    `ray start --num-gpus=h100:2` (refused by ray start): the count is what Ray takes."""
    env, log = _fake_bin(tmp_path)
    r = _run("slurm_template.sh", ["--model", "/m", "--input", "/d/in.jsonl", "--output", "/d/out.jsonl"],
             dict(env, **SLURM_ENV, SLURM_GPUS_PER_NODE="h100:2"))
    starts = [l for l in _lines(log) if l.startswith("ray start")]
    assert r.returncode == 0 and len(starts) == 2, r.stderr + "\n".join(_lines(log))
    assert all("--num-gpus=2 " in l and l.endswith("| 0 1") for l in starts), starts


def test_slurm_template_without_job_arguments_starts_nothing(tmp_path):
    """`sbatch scripts/slurm_template.sh` with no job arguments started Ray on every node and waited 30 s before the
    job said --model is required; it says so at once now, starting nothing."""
    env, log = _fake_bin(tmp_path)
    r = _run("slurm_template.sh", [], dict(env, **SLURM_ENV))
    assert r.returncode == 2 and "--model" in r.stderr and not _lines(log), r.stderr
