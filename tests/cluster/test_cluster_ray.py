"""Ray executor on a local cluster with logical GPUs: equality with in-process, TP=2 rendezvous, replicas and
least-loaded routing, and faults (a killed or hung worker fails in-flight requests fast, the replica returns)."""
import threading
import time

import pytest

from mpk_runtime.engine import LLM, RequestFailedError, SamplingParams

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [9], [20, 21, 22]]


def test_device_selection_with_and_without_narrowing():
    from cluster.ray_utils import local_device_index
    assert local_device_index(["3"], "3") == 0            # Ray narrowed CUDA_VISIBLE_DEVICES
    assert local_device_index([3], "0,1,2,3") == 3         # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
    assert local_device_index(["1"], "4,1") == 1
    assert local_device_index(["2"], None) == 2
    with pytest.raises(ValueError, match="no GPU"):
        local_device_index([], "0")


def test_tp1_ray_equals_inprocess(ray_local, ref_greedy):
    import cluster  # registers executor="ray"
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=64, executor="ray") as llm:
        info = llm.executor.collective_rpc("node_info")
        assert info[0]["gpu_ids"] == ["0"] or len(info[0]["gpu_ids"]) == 1  # one logical GPU per actor
        t0 = time.perf_counter()
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        wall = time.perf_counter() - t0
        s = dict(llm.engine.stats)
        runner_s = llm.executor.collective_rpc("health")[0]["runner_s"]
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == ref_greedy("tiny-qwen3", p, 8)
    # step phase accounting through Ray: every step timed by its actor, the phases nest inside the step
    assert s["timed_steps"] == s["steps"] == 8 and (s["prefill_steps"], s["decode_steps"]) == (1, 7)
    assert s["t_exec_worker_s"] == pytest.approx(runner_s)  # the actor's own total of its runner calls
    assert 0 < s["t_exec_worker_s"] <= s["t_exec_dispatch_s"] + s["t_exec_wait_s"] <= s["t_execute_s"]
    assert s["t_schedule_s"] + s["t_execute_s"] + s["t_output_s"] + s["t_free_s"] <= s["t_step_s"] <= wall
    assert s["t_exec_to_worker_s"] > 0 and s["t_exec_from_worker_s"] > 0  # a real process hop either way


def test_plan_book_shipped_to_ray_workers(ray_local, ref_greedy):
    """plan="auto" on a Ray replica: the controller plans (cluster/plan.make_plan), the actor decodes through the
    shipped book's plan and gives the reference tokens; a book of conventional plans too. (Placed before the
    ray_server tests: their replicas hold both logical GPUs until the module ends.)"""
    import cluster  # noqa: F401 - registers executor="ray"
    from mpk_runtime.models import PRESETS
    from mpk_runtime.planner import plan_book
    conv = plan_book(PRESETS["tiny-qwen3"], 1, (1, 4), context=32, families=("conventional",))
    for plan, family in (("auto", None), (conv, "conventional")):
        with LLM("tiny-qwen3", backend="pyvm", dtype="float32", max_seq_len=64, max_batch=4, executor="ray",
                 plan=plan) as llm:
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            used = llm.executor.collective_rpc("health")[0]["plans_used"]
        for p, o in zip(PROMPTS, outs):
            assert o.token_ids == ref_greedy("tiny-qwen3", p, 8)
        assert used, "the worker decoded without the shipped plan"
        if family:
            assert set(used.values()) == {family}


def test_decode_steps_through_ray(ray_local, ref_greedy):
    """LLM(decode_steps=4) over a Ray worker: the steps' count travels with the execute call (execute_timed), one
    actor call returns the burst's tokens, and they are the reference's."""
    import cluster  # noqa: F401 - registers executor="ray"
    with LLM("tiny-qwen3", backend="pyvm", dtype="float32", max_seq_len=64, max_batch=4, executor="ray",
             decode_steps=4) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.engine.stats["multi_steps"] >= 2
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == ref_greedy("tiny-qwen3", p, 8)


def test_async_bursts_through_ray(ray_local, ref_greedy):
    """LLM(async_bursts=True) over a Ray worker: the next burst is an actor call in flight while the engine reads the
    last one's tokens, resumed from the tokens the worker drew (execute_timed's resume flag)."""
    import cluster  # noqa: F401 - registers executor="ray"
    sp = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)
    with LLM("tiny-qwen3", backend="pyvm", dtype="float32", max_seq_len=64, max_batch=4, executor="ray",
             decode_steps=4, async_bursts=True) as llm:
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert llm.engine.stats["async_bursts"] >= 2
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == ref_greedy("tiny-qwen3", p, 21)


def test_tp2_gloo_rendezvous_through_ray(ray_local):
    from cluster.ray_executor import RayExecutor
    ex = RayExecutor(2, name="tp2-comm")
    try:
        spec = ex.comm_spec()
        assert spec["init_method"].startswith("tcp://")
        ex.collective_rpc("init_comm_only", (spec,))
        assert ex.collective_rpc("check_comm") == [2.0, 2.0]  # gloo all-reduce across two actor processes
        assert len(set(ex.node_ids())) == 1  # STRICT_PACK: one TP group, one node
    finally:
        ex.shutdown()


def test_tp2_backend_through_ray(ray_local, ref_greedy):
    from cluster.ray_executor import RayExecutor
    ex = RayExecutor(2, name="tp2-torch")
    llm = LLM("tiny-qwen3", backend="torch", tp=2, dtype="float32", max_seq_len=64, executor=ex)
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == [ref_greedy("tiny-qwen3", p, 8) for p in PROMPTS]
    finally:
        llm.shutdown()


def test_prefix_caching_over_tp2_ray_ranks(ray_local, ref_greedy):
    """Two ranks in two actor processes, each with its own K/V pages: a prompt that shares the first's head takes
    its cached pages on both ranks (the engine's page table is every rank's) and follows the reference."""
    from cluster.ray_executor import RayExecutor
    ex = RayExecutor(2, name="tp2-prefix")
    head = list(range(20, 60))
    prompts = [head + [1, 2], head + [3]]
    llm = LLM("tiny-qwen3", backend="torch", tp=2, dtype="float32", max_seq_len=64, executor=ex,
              enable_prefix_caching=True)
    try:
        outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
        assert [o.num_cached_tokens for o in outs] == [0, 32]
        assert [o.token_ids for o in outs] == [ref_greedy("tiny-qwen3", p, 8) for p in prompts]
    finally:
        llm.shutdown()


def test_engine_processes_drive_ray_replicas(ray_local, ref_greedy):
    """executor="ray" with engine_process: each replica's engine runs in a child that joins this cluster as a driver
    and places its actors there; a child killed with a request in flight fails it, and its restart gets the GPU its
    actors held back (the cluster has two logical GPUs, both in use), with the same tokens. (Before ray_server's
    tests: that fixture holds both GPUs until the module ends.)"""
    import os
    import signal

    from cluster.client import Client
    from cluster.router import build_router
    from cluster.server import ServerThread, create_app
    router = build_router("tiny-qwen3", backend="reference", tp=1, num_replicas=2, executor="ray", engine_process=True,
                          step_timeout=10.0, health_interval=None, dtype="float32", max_seq_len=128)
    srv = ServerThread(create_app(router))
    try:
        assert all(r.llm is None and r.loop.pid != os.getpid() for r in router.replicas)
        with Client(srv.url) as c:
            outs = c.generate(PROMPTS * 2, GREEDY)
            assert [o.token_ids for o in outs] == [ref_greedy("tiny-qwen3", p, 8) for p in PROMPTS * 2]
            assert all(s["steps"] > 0 for s in router.stats().values())
            assert ray_local.available_resources().get("GPU", 0) == 0   # (the children's actors hold both)
            rep = router.replicas[0]
            done, got = threading.Event(), []

            def cb(o):
                got.append(o)
                if o.finished:
                    done.set()
            first = rep.loop.pid
            rep.loop.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), cb)
            os.kill(first, signal.SIGKILL)
            assert done.wait(30) and got[-1].finish_reason == "error" and "exited" in got[-1].error
            deadline = time.monotonic() + 120
            while (rep.loop.dead is not None or rep.loop.pid == first) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert rep.loop.dead is None and rep.loop.pid != first and rep.loop.restarts == 1
            outs = c.generate([[4, 5, 6]] * 4, GREEDY)
            assert all(o.token_ids == ref_greedy("tiny-qwen3", [4, 5, 6], 8) for o in outs)
    finally:
        srv.stop()
        router.shutdown()


@pytest.fixture(scope="module")
def ray_server(ray_local):
    from cluster.router import build_router
    from cluster.server import ServerThread, create_app
    router = build_router("tiny-qwen3", backend="reference", tp=1, num_replicas=2, executor="ray",
                          step_timeout=3.0, health_interval=1.0, dtype="float32", max_seq_len=128)
    srv = ServerThread(create_app(router))
    yield srv, router
    srv.stop()
    router.shutdown()


def test_client_over_ray_replicas_equals_llm(ray_server, ref_greedy):
    from cluster.client import Client
    srv, router = ray_server
    with Client(srv.url) as c:
        outs = c.generate(PROMPTS * 2, GREEDY)
    assert [o.token_ids for o in outs] == [ref_greedy("tiny-qwen3", p, 8) for p in PROMPTS * 2]
    steps = [s["steps"] for s in router.stats().values()]
    assert all(n > 0 for n in steps), f"least-loaded dispatch should use both replicas: {steps}"


def _wait_replicas_up(router, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(not s["dead"] for s in router.stats().values()):
            return
        time.sleep(0.2)


def test_killed_worker_fails_stream_then_replica_recovers(ray_server, ref_greedy):
    import ray

    from cluster.client import Client
    srv, router = ray_server
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    with Client(srv.url) as c:
        stream = c.stream([[1, 2, 3]], long)
        first = next(stream)
        assert first.delta_token_ids
        # find the replica that runs it and kill its worker actor mid-generation
        rep = max(router.replicas, key=lambda r: r.loop.load)
        t0 = time.monotonic()
        ray.kill(rep.llm.executor.actors[0])
        with pytest.raises(RequestFailedError, match="died|failed"):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 10
        _wait_replicas_up(router)
        outs = c.generate([[1, 2, 3]] * 4, GREEDY)  # both replicas, including the rebuilt one
        assert all(o.token_ids == ref_greedy("tiny-qwen3", [1, 2, 3], 8) for o in outs)
    assert rep.loop.stats()["recoveries"] >= 1


def test_hung_worker_times_out_and_recovers(ray_server, ref_greedy):
    from cluster.client import Client
    srv, router = ray_server
    rep = router.replicas[0]
    with Client(srv.url) as c:
        rep.llm.executor.collective_rpc("inject_fault", ("hang", 120.0))
        before = rep.loop.stats()["recoveries"]
        # send to replica 0 directly via its loop: the router could pick the other one
        done = threading.Event()
        result = {}

        def cb(out):
            if out.finished:
                result["out"] = out
                done.set()
        t0 = time.monotonic()
        rep.loop.submit([4, 5, 6], GREEDY, cb)
        assert done.wait(30)
        assert result["out"].finish_reason == "error" and "did not finish" in result["out"].error
        assert time.monotonic() - t0 < 15  # step_timeout is 3 s; the error goes out before the rebuild
        deadline = time.monotonic() + 60   # the rebuild goes on in the replica's loop after the error went out
        while rep.loop.stats()["recoveries"] == before and time.monotonic() < deadline:
            time.sleep(0.2)
        _wait_replicas_up(router)
        assert rep.loop.stats()["recoveries"] == before + 1
        assert c.generate([[4, 5, 6]], GREEDY)[0].token_ids == ref_greedy("tiny-qwen3", [4, 5, 6], 8)


def test_health_check_notices_dead_idle_worker(ray_server):
    import ray
    srv, router = ray_server
    rep = router.replicas[1]
    before = rep.loop.stats()["recoveries"]
    ray.kill(rep.llm.executor.actors[0])
    deadline = time.monotonic() + 60   # (the rebuild took over 30 s on a loaded 2-core CI host once: session 74)
    while rep.loop.stats()["recoveries"] == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rep.loop.stats()["recoveries"] == before + 1  # rebuilt with no request in flight


