"""Per-step phase accounting (engine/step_stats.py): counts follow the schedule, the phases nest inside the measured
step time, the model's time lands in the worker phase and time spent before the runner in the dispatch phase, and
the engine loop accounts its idle time."""
import threading
import time

import pytest

from mpk_runtime.engine import LLM, SamplingParams
from mpk_runtime.engine.async_engine import EngineLoop
from mpk_runtime.engine.step_stats import (LOOP_TIMES, STEP_COUNTERS, STEP_TIMES, breakdown, diff_stats,
                                           format_breakdown, sum_stats)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
P0, P1 = [1, 2, 3, 4, 5], [7, 8, 9]
# the prefill sleep exceeds a decode step's compute plus its sleep with margin (torch tp=2 decode steps took up to
# 33 ms on the 2-core CI machine: 37.3 ms of decode worker time per step against 37.1 of prefill with a 20 ms sleep)
PREFILL_SLEEP, DECODE_SLEEP = 0.06, 0.004


def _slow_runners(llm):
    """Every rank's runner sleeps a known time inside runner.step: longer when the step holds a prompt chunk."""
    for w in llm.executor.workers:
        step = w.runner.step

        def slow(chunks, step=step):
            time.sleep(PREFILL_SLEEP if any(c.start_pos == 0 for c in chunks) else DECODE_SLEEP)
            return step(chunks)
        w.runner.step = slow


def _run(engine, arrivals):
    """Step until done, adding arrivals[i] before step i; returns the summed wall time of the step() calls."""
    wall, i = 0.0, 0
    arrivals = dict(arrivals)
    while engine.has_unfinished() or arrivals:
        for p in arrivals.pop(i, []):
            engine.add_request(p, GREEDY)
        t = time.perf_counter()
        engine.step()
        wall += time.perf_counter() - t
        i += 1
    return wall


@pytest.mark.parametrize("backend,tp", [("reference", 1), ("torch", 2)])
def test_step_phases_counts_and_nesting(backend, tp):
    # decode_steps=1: one decode step per engine step (bursts would fold the 13 decode steps into a few calls)
    with LLM("tiny-qwen3", backend=backend, tp=tp, dtype="float32", max_seq_len=64, max_batch=4,
             decode_steps=1) as llm:
        _slow_runners(llm)
        eng = llm.engine
        before = dict(eng.stats)
        # P0 alone for 3 steps, then P1's prompt joins P0's decode row; P0 ends at step 11, P1 at step 14
        wall = _run(eng, {0: [P0], 3: [P1]})
        s = diff_stats(eng.stats, before)
    assert s["steps"] == 15
    assert (s["prefill_steps"], s["decode_steps"]) == (2, 13)
    assert (s["prompt_chunks"], s["decode_rows"], s["decode_rows_in_prefill_steps"]) == (2, 22, 1)
    assert s["prompt_chunks"] + s["decode_rows"] == s["sequences_scheduled"]
    assert s["free_calls"] == 2 and s["timed_steps"] == s["steps"]
    assert all(s[k] >= 0 for k in STEP_TIMES), {k: s[k] for k in STEP_TIMES if s[k] < 0}
    # the phases are disjoint parts of the step, the steps part of the caller's measured wall time
    parts = s["t_schedule_s"] + s["t_execute_s"] + s["t_output_s"] + s["t_free_s"]
    assert parts <= s["t_step_s"] <= wall
    assert s["t_step_s"] - parts < 5e-3 * s["steps"]  # nothing big unaccounted between the phases (loose: CI load)
    assert s["t_step_prefill_s"] + s["t_step_decode_s"] == pytest.approx(s["t_step_s"])
    assert s["t_execute_prefill_s"] + s["t_execute_decode_s"] == pytest.approx(s["t_execute_s"])
    assert s["t_exec_worker_prefill_s"] + s["t_exec_worker_decode_s"] == pytest.approx(s["t_exec_worker_s"])
    assert s["t_exec_dispatch_s"] + s["t_exec_wait_s"] <= s["t_execute_s"]
    # along the critical rank: to_worker + worker + from_worker is the call's span (two clocks, same host)
    span = s["t_exec_to_worker_s"] + s["t_exec_worker_s"] + s["t_exec_from_worker_s"]
    assert abs(span - (s["t_exec_dispatch_s"] + s["t_exec_wait_s"])) < 5e-3 * s["steps"]
    # the runners' sleeps are inside the worker phase, split by step type; the engine thread slept through them
    assert s["t_exec_worker_prefill_s"] >= PREFILL_SLEEP * 2
    assert s["t_exec_worker_decode_s"] >= DECODE_SLEEP * 13
    assert s["t_exec_worker_s"] <= s["t_execute_s"]
    assert s["t_step_cpu_s"] < s["t_step_s"] - PREFILL_SLEEP * 2 - DECODE_SLEEP * 13 + 1e-3
    b = breakdown(s, wall)
    assert b["steps"] == 15 and b["prefill_steps"] == 2 and b["decode_steps"] == 13
    assert b["ms_per_step"]["step"] == pytest.approx(1e3 * s["t_step_s"] / 15, abs=1e-3)
    # (decode steps are not bounded above by the prefill sleep: at tp=2 on a 2-core machine their compute alone
    # is ~14-22 ms, which made `PREFILL_SLEEP > decode` flaky; the sleeps bound each type from below)
    assert b["prefill_ms_per_step"]["worker"] >= 1e3 * PREFILL_SLEEP
    assert b["decode_ms_per_step"]["worker"] >= 1e3 * DECODE_SLEEP
    assert b["prefill_ms_per_step"]["worker"] > b["decode_ms_per_step"]["worker"]
    assert b["execute_ms_per_step"]["overhead"] >= 0
    assert "where the time went: 15 steps (2 with prefill" in format_breakdown(b)


def test_time_before_the_runner_is_not_model_time():
    """A rank that stalls before its runner (here an injected 0.2 s hang) shows up as to_worker, not worker."""
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=64, max_batch=4) as llm:
        eng = llm.engine
        eng.add_request(P0, GREEDY)
        eng.step()
        before = dict(eng.stats)
        llm.executor.collective_rpc("inject_fault", ("hang", 0.2))
        eng.step()
        s = diff_stats(eng.stats, before)
        health = llm.executor.collective_rpc("health")[0]
        total_worker = eng.stats["t_exec_worker_s"]
    assert s["steps"] == 1 and s["decode_steps"] == 1
    assert s["t_exec_to_worker_s"] >= 0.19 and s["t_execute_s"] >= 0.2
    assert s["t_exec_worker_s"] < 0.1
    assert health["runner_s"] == pytest.approx(total_worker)  # the worker's own total: same runner calls


def test_engine_loop_accounts_idle_and_steps():
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=64, max_batch=4) as llm:
        t0, m0 = time.perf_counter(), time.monotonic()
        loop = EngineLoop(llm.engine, health_interval=None)
        try:
            time.sleep(0.3)  # nothing to do: idle
            m1 = time.monotonic()
            done = threading.Event()
            left = [2]

            def on_output(out):
                if out.finished:
                    left[0] -= 1
                    if not left[0]:
                        done.set()
            loop.submit(P0, GREEDY, on_output)
            loop.submit(P1, GREEDY, on_output)
            assert done.wait(30)
            time.sleep(0.1)
            s = loop.stats()
            elapsed = time.perf_counter() - t0
        finally:
            loop.shutdown()
    assert s["steps"] >= 12 and s["prefill_steps"] >= 1
    assert all(s[k] >= 0 for k in LOOP_TIMES)
    assert s["loop_idle_s"] >= 0.25  # the 0.3 s before the requests (and the 0.1 s after)
    # the idle stretch before the requests, placed in time (load_test's idle_stretches_ms)
    a, d = loop.idle_log[0]
    assert m0 <= a < m1 and 0.25 <= d and a + d >= m1
    assert s["t_step_s"] <= s["loop_step_s"]
    assert sum(s[k] for k in LOOP_TIMES) <= elapsed
    b = breakdown(s, elapsed)
    assert set(b["loop_ms_per_step"]) == {"idle", "apply", "step", "deliver", "health", "other"}
    assert b["loop_ms_per_step"]["other"] >= 0  # the loop's phases do not claim more than the wall time


def test_stats_helpers():
    a = {"steps": 10, "t_step_s": 1.0, "max_batch_size_seen": 4, "dead": None, "last_batch_size": 2}
    b = {"steps": 4, "t_step_s": 0.25, "max_batch_size_seen": 3, "dead": None, "last_batch_size": 1}
    d = diff_stats(a, b)
    assert d == {"steps": 6, "t_step_s": 0.75, "max_batch_size_seen": 4, "dead": None, "last_batch_size": 2}
    tot = sum_stats([d, {"steps": 1, "t_step_s": 0.5, "max_batch_size_seen": 7, "dead": "x"}])
    assert tot["steps"] == 7 and tot["t_step_s"] == 1.25 and tot["max_batch_size_seen"] == 7 and "dead" not in tot
    assert breakdown({})["steps"] == 0  # no steps: no division by zero


def test_fresh_engine_has_every_counter_at_zero():
    with LLM("tiny-qwen3", dtype="float32", max_seq_len=64, max_batch=4) as llm:
        assert all(llm.engine.stats[k] == 0 for k in STEP_COUNTERS + STEP_TIMES)
