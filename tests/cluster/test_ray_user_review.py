"""The Ray paths as a demanding user meets them on a CPU machine (two logical GPUs): a RAY_ADDRESS nobody answers, a
bad model given to a Ray router, two routers in one driver, more replicas than the cluster holds, a placement timeout's
message, a rank's Python error as requests and LLM's start report it."""
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from mpk_runtime.engine import LLM, InvalidRequestError, RequestFailedError, SamplingParams, UnknownModelError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SMALL = dict(dtype="float32", max_seq_len=32, health_interval=None)


def _gpus_free(ray, timeout: float = 10.0) -> float:
    """The cluster's free GPUs once both are back (a removed placement group frees them a moment later)."""
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("GPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    return ray.available_resources().get("GPU", 0)


def test_ray_address_nobody_answers_fails_at_once(tmp_path):
    """`--ray-address 127.0.0.1:PORT` (or RAY_ADDRESS) where no head listens: ray.init retried "Failed to connect to
    GCS ... within 5 seconds" for minutes (still retrying after 4), so the job, the server and LLM(executor="ray")
    hung. Now a message naming the address and what to give, at once (the job: exit 2)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt_token_ids": [1, 2]}\n')
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = ROOT
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "cluster.jobs.generate", "--model", "tiny-qwen3", "--executor", "ray",
                        "--ray-address", f"127.0.0.1:{port}", "--input", str(inp), "--output",
                        str(tmp_path / "out.jsonl")], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=90)
    assert r.returncode == 2 and f"no Ray cluster answers at 127.0.0.1:{port}" in r.stderr, r.stderr[-2000:]
    assert "HEAD_IP:6379" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 60


def test_bad_model_given_to_a_ray_router_holds_nothing(ray_local):
    """build_router(<missing directory>, executor="ray") made each replica's RayExecutor (a placement group, an actor)
    before LLM checked the model, and nothing shut it down when LLM raised: a GPU stayed held for the driver's life,
    and the next build_router failed with RaySystemError "name 'mpk-replica-0' already exists". Likewise an
    unknown LLM keyword. Now refused before anything is placed."""
    from cluster.router import build_router
    with pytest.raises(UnknownModelError, match="no such directory"):
        build_router("/nonexistent/model-dir", executor="ray", **SMALL)
    with pytest.raises(InvalidRequestError, match="max_seqlen"):
        build_router("tiny-qwen3", executor="ray", max_seqlen=32, **SMALL)
    assert _gpus_free(ray_local) == 2


def test_more_replicas_than_the_cluster_holds_is_refused_at_once(ray_local):
    """--replicas 3 on a cluster of 2 GPUs (or tp=2 x 2 replicas of CPU actors on 2 CPUs): each group alone fits a
    node, so the first replicas started and the last waited placement_timeout (60 s) for a PlacementError that
    blamed the cluster's free resources (held by its own siblings). Refused before anything starts now, saying how many
    replicas fit."""
    from cluster.ray_executor import PlacementError
    from cluster.router import build_router
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"3 replicas of tp=1 .* at most 2 such groups .*--replicas 2 or fewer"):
        build_router("tiny-qwen3", executor="ray", num_replicas=3, **SMALL)
    with pytest.raises(PlacementError, match=r"\{'CPU': 2\}.* at most 1 such group .*--replicas 1 or fewer"):
        build_router("tiny-qwen3", executor="ray", tp=2, num_replicas=2, ray_executor_kwargs={"num_gpus_per_worker": 0},
                     **SMALL)
    assert time.monotonic() - t0 < 10
    assert _gpus_free(ray_local) == 2


def test_two_ray_routers_in_one_driver(ray_local, ref_greedy):
    """Two routers in one process (two models, or a second one built while the first serves): every router names its
    replicas replica-0, ..., and the placement groups were named after them, so the second died in RaySystemError
    "Failed to create placement group ... because name 'mpk-replica-0' already exists"."""
    from cluster.router import build_router
    first = build_router("tiny-qwen3", executor="ray", **SMALL)
    try:
        second = build_router("tiny-qwen3", executor="ray", **SMALL)
        try:
            out = second.replicas[0].llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]
            assert out.token_ids == ref_greedy("tiny-qwen3", [1, 2, 3], 4)
        finally:
            second.shutdown()
    finally:
        first.shutdown()


def test_placement_timeout_message_shows_plain_resources(ray_local):
    """A group that waits for GPUs others hold: the PlacementError listed the cluster's resources with Ray's
    per-group entries ('GPU_group_0_3578aff4...', 'bundle_group_...'), a dozen ids per placement group burying CPU
    and GPU. Plain resources now, and who holds the rest."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from cluster.ray_executor import PlacementError, RayExecutor
    pg = placement_group([{"GPU": 2}])
    ray_local.get(pg.ready(), timeout=60)
    try:
        with pytest.raises(PlacementError, match="not ready within 2 s") as ei:
            RayExecutor(1, placement_timeout=2, name="waits")
    finally:
        remove_placement_group(pg)
    msg = str(ei.value)
    assert "_group_" not in msg and "'node:" not in msg and "'GPU': 2.0" in msg and "held by other" in msg, msg


def test_a_ranks_python_error_reads_as_type_and_message(ray_local, tmp_path, demo_dir):
    """A rank whose call raises: the error (LLM's start error; every failed request's error, an HTTP client's JSON)
    carried Ray's whole remote traceback in terminal colours ('\\x1b[36mray::RayWorker.init_model()\\x1b[39m (pid=...,
    actor_id=..., repr=<cluster.ray_executor.RayWorker object at 0x...>)' and every frame); the in-process executor
    says 'rank 0 failed in ...: Type: message'. So does Ray now (the traceback stays chained)."""
    bad = tmp_path / "bad"
    shutil.copytree(demo_dir, bad)
    with open(bad / "model.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(InvalidRequestError, match=r"rank 0 on node .* failed in 'init_model': \w+Error: [^\n]*model\.safetensors") as ei:
        LLM(str(bad), dtype="float32", max_seq_len=32, executor="ray")
    assert "\x1b[" not in str(ei.value) and "actor_id" not in str(ei.value), str(ei.value)
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=32, executor="ray") as llm:
        llm.executor.collective_rpc("inject_fault", ("raise",))
        with pytest.raises(RequestFailedError) as ei:
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        msg = str(ei.value)
        assert "failed in 'execute': RuntimeError: injected fault on rank 0" in msg and "\x1b[" not in msg, msg
        assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids) == 4   # still serves
    assert _gpus_free(ray_local) == 2
