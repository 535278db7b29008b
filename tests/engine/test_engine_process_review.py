"""EngineProcess (engine/engine_process.py) failure paths: a child that dies while it builds its engine, a child whose
pipe outlives it, a shutdown while a wedged child's pipe is full, a parent whose reader lags, child_env's PYTHONPATH."""
import os
import signal
import sys
import textwrap
import threading
import time

import pytest

from mpk_runtime.engine import RequestFailedError, SamplingParams
from mpk_runtime.engine.engine_process import EngineProcess

KW = dict(backend="torch", dtype="float32", max_seq_len=64, max_batch=8, health_interval=None)
LONG = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


def _module(tmp_path, monkeypatch, name: str, body: str) -> str:
    """A module the child imports (child_imports): the child's PYTHONPATH is this process's sys.path."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:   # (a zombie of ours counts as gone)
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return False


class _Outputs(list):
    """A request's callback: its outputs in order; `first` is set at the first one, `done` at the finished one."""
    def __init__(self):
        super().__init__()
        self.first, self.done = threading.Event(), threading.Event()

    def __call__(self, o):
        self.append(o)
        self.first.set()
        if o.finished:
            self.done.set()


def test_child_that_exits_while_building_raises_a_clear_error(tmp_path, monkeypatch):
    """The child exits before it answers: its pipe closes, so poll() says there is something to read and recv()
    raised a bare EOFError; the caller should get the RequestFailedError that names the exit code."""
    mod = _module(tmp_path, monkeypatch, "review_exit7", "import os\nos._exit(7)\n")
    with pytest.raises(RequestFailedError, match="exited with code 7 before its engine was built"):
        EngineProcess("tiny-llama", name="exit7", child_imports=(mod,), **KW)


def test_child_env_may_set_pythonpath(tmp_path):
    (tmp_path / "review_only_here.py").write_text("X = 1\n")
    path = os.pathsep.join([str(tmp_path)] + [p for p in sys.path if p])
    proc = EngineProcess("tiny-llama", name="pp", child_env={"PYTHONPATH": path},
                         child_imports=("review_only_here",), **KW)
    proc.shutdown()


def test_killed_child_whose_pipe_a_forked_process_holds_is_noticed(tmp_path, monkeypatch):
    """A process the child forked holds the child's end of the pipe, so killing the child closes nothing: the reader
    must still notice the child is gone, fail its request and start another."""
    pids = tmp_path / "forked.pids"
    mod = _module(tmp_path, monkeypatch, "review_forks", f"""
        import os, time
        pid = os.fork()
        if pid == 0:   # (holds every descriptor of the child, its pipe to the parent among them)
            time.sleep(60)
            os._exit(0)
        with open({str(pids)!r}, "a") as f:
            f.write(f"{{pid}}\\n")
    """)
    proc = EngineProcess("tiny-llama", name="fk", max_restarts=1, child_imports=(mod,), **KW)
    try:
        outs = _Outputs()
        done = outs.done
        first = proc.pid
        proc.submit([1, 2, 3], LONG, outs)
        os.kill(first, signal.SIGKILL)
        assert done.wait(15), "the killed child's request never ended"
        assert outs[-1].finish_reason == "error" and "exited" in outs[-1].error
        end = time.monotonic() + 60
        while time.monotonic() < end and not (proc.dead is None and proc.alive):
            time.sleep(0.1)
        assert proc.pid != first and proc.restarts == 1 and proc.dead is None
    finally:
        proc.shutdown()
        for line in pids.read_text().split():
            try:
                os.kill(int(line), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_shutdown_returns_though_a_wedged_childs_pipe_is_full():
    """A stopped child reads nothing: submits fill its pipe and the next write blocks (holding the send lock).
    shutdown() must still kill the child and return, and the blocked submit must fail."""
    proc = EngineProcess("tiny-llama", name="full", wedge_timeout=None, **KW)
    pid = proc.pid
    os.kill(pid, signal.SIGSTOP)
    sent, errors = [0], []

    def fill():
        try:
            while True:
                proc.submit(list(range(1, 60)), SamplingParams(temperature=0, max_tokens=2), lambda o: None)
                sent[0] += 1
        except Exception as e:   # noqa: BLE001
            errors.append(e)
    filler = threading.Thread(target=fill, daemon=True)
    filler.start()
    try:
        last, end = -1, time.monotonic() + 10
        while sent[0] != last and time.monotonic() < end:   # (until a write blocks: the pipe is full)
            last = sent[0]
            time.sleep(0.5)
        assert sent[0] == last and not errors and filler.is_alive()
        stopper = threading.Thread(target=proc.shutdown, kwargs=dict(timeout=2.0), daemon=True)
        stopper.start()
        stopper.join(20)
        assert not stopper.is_alive(), "shutdown() hung on the full pipe"
        filler.join(10)
        assert not filler.is_alive() and isinstance(errors[0], RequestFailedError)
        assert _gone(pid)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_stats_do_not_call_a_busy_child_dead_where_this_side_lags():
    """A consumer's callback holds the parent's reader for a few seconds: the child's heartbeats wait in the pipe,
    unread. The child is healthy, so stats() (and /health) must not report it down."""
    proc = EngineProcess("tiny-llama", name="lag", **KW)
    try:
        holding, done = threading.Event(), threading.Event()

        def slow(o):
            if not holding.is_set():
                holding.set()
                time.sleep(5.0)
            if o.finished:
                done.set()
        proc.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), slow)
        assert holding.wait(30)
        time.sleep(3.8)   # (the last heartbeat the reader saw is 3.8 s old or more; more are in the pipe)
        st = proc.stats()
        assert st["dead"] is None, st["dead"]
        assert done.wait(30) and proc.dead is None
    finally:
        proc.shutdown()


def _child_only_value(engine):   # (a call: module level, so it crosses the pipe)
    import review_child_only
    return review_child_only.Thing()


def test_a_reply_this_side_cannot_unpickle_fails_that_call_only(tmp_path):
    """The child can import a module this process cannot: a call's result of a class from it used to stop the
    parent's reader at recv() (only EOFError/OSError were caught there), which failed every request in flight and
    killed and restarted the child. It must fail that call alone."""
    (tmp_path / "review_child_only.py").write_text("class Thing:\n    pass\n")
    path = os.pathsep.join([str(tmp_path)] + [p for p in sys.path if p])
    proc = EngineProcess("tiny-llama", name="uc", child_env={"PYTHONPATH": path}, **KW)
    try:
        outs = _Outputs()
        done = outs.done
        pid = proc.pid
        proc.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), outs)
        with pytest.raises(RequestFailedError, match="cannot be read in this process.*review_child_only"):
            proc.call(_child_only_value).result(timeout=30)
        assert done.wait(30) and outs[-1].finish_reason == "length", outs[-1].error
        assert proc.pid == pid and proc.restarts == 0 and proc.dead is None and proc.alive
    finally:
        proc.shutdown()


def test_shutdown_ends_the_requests_it_holds_with_an_error():
    """shutdown() with a request mid-generation (the child stopped, so it cannot finish): the caller gets a finished
    output whose error says the engine was shut down, not silence."""
    proc = EngineProcess("tiny-llama", name="stop", **KW)
    pid = proc.pid
    outs = _Outputs()
    first, done = outs.first, outs.done
    try:
        proc.submit([1, 2, 3], LONG, outs)
        assert first.wait(30)
        os.kill(pid, signal.SIGSTOP)
        assert not done.is_set()
        proc.shutdown(timeout=2.0)
        assert done.wait(10), "shutdown() left the request waiting"
        assert outs[-1].finish_reason == "error" and "shut down" in outs[-1].error
        assert proc.load == 0
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_engine_loop_shutdown_ends_running_and_queued_requests():
    """In process: a request running when EngineLoop.shutdown() is called keeps the tokens it has and ends with the
    error; one still queued ends the same way; a queued call fails."""
    from mpk_runtime.engine import LLM
    from mpk_runtime.engine.async_engine import EngineLoop
    llm = LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=64, max_batch=8)
    loop = EngineLoop(llm.engine, name="t", health_interval=None)
    started, release = threading.Event(), threading.Event()
    outs: dict[str, list] = {"a": [], "b": []}

    def cb_a(o):
        outs["a"].append(o)
        if not started.is_set():
            started.set()
            release.wait(10)   # (holds the loop thread until shutdown() has been called)
    loop.submit([1, 2, 3], LONG, cb_a, request_id="a")
    assert started.wait(30)
    loop.submit([4, 5], LONG, outs["b"].append, request_id="b")   # (queued behind the held round)
    call = loop.call(lambda eng: 1)
    stopper = threading.Thread(target=loop.shutdown, daemon=True)
    stopper.start()
    time.sleep(0.2)
    release.set()
    stopper.join(20)
    assert not stopper.is_alive()
    for rid in ("a", "b"):
        last = outs[rid][-1]
        assert last.finished and last.finish_reason == "error" and "shut down" in last.error, (rid, last)
    assert len(outs["a"][-1].token_ids) >= 1 and outs["b"][-1].token_ids == []
    assert loop.load == 0
    with pytest.raises(RequestFailedError, match="shut down"):
        call.result(5)
    llm.shutdown()


def test_a_program_the_child_runs_does_not_inherit_its_pipe(tmp_path, monkeypatch):
    """A program the child starts with close_fds=False (or os.system) must not hold the child's pipe ends: a killed
    child's pipe would stay open, and with it the parent's writes once it fills."""
    seen = tmp_path / "fds.txt"
    mod = _module(tmp_path, monkeypatch, "review_spawns", f"""
        import re, subprocess, sys
        cmd = open("/proc/self/cmdline", "rb").read().decode()
        fds = re.search(r"child_entry\\((\\d+), (\\d+)\\)", cmd).groups()
        code = "import os; print(' '.join(os.listdir('/proc/self/fd')))"
        got = subprocess.run([sys.executable, "-c", code], close_fds=False, capture_output=True, text=True).stdout
        open({str(seen)!r}, "w").write(" ".join(fds) + "\\n" + got)
    """)
    proc = EngineProcess("tiny-llama", name="inh", child_imports=(mod,), **KW)
    proc.shutdown()
    pipe, held = (line.split() for line in seen.read_text().splitlines())
    assert pipe and not set(pipe) & set(held), (pipe, held)


def test_a_lagging_reader_does_not_kill_a_healthy_child_as_wedged():
    """A callback holds the parent's reader past wedge_timeout while the child keeps stepping: the heartbeats it then
    reads are old, but newer ones wait behind them, so the child is not wedged and must not be killed."""
    proc = EngineProcess("tiny-llama", name="lagw", wedge_timeout=6.0, **KW)
    first = proc.pid
    try:
        held, done, outs = threading.Event(), threading.Event(), []

        def slow(o):
            outs.append(o)
            if not held.is_set():
                held.set()
                time.sleep(10.0)
            if o.finished:
                done.set()
        proc.submit([1, 2, 3], LONG, slow)
        assert done.wait(60)
        assert outs[-1].finish_reason == "length" and outs[-1].error is None, outs[-1]
        time.sleep(1.5)
        assert proc.pid == first and proc.restarts == 0 and proc.dead is None
    finally:
        proc.shutdown()


def test_engine_loop_refuses_a_duplicate_request_id_without_orphaning_the_first():
    """A second submit under the id of a running request ends with an error naming the id; the first request keeps
    its callback and finishes normally (the refusal used to take the first one's callback with it)."""
    from mpk_runtime.engine import LLM
    from mpk_runtime.engine.async_engine import EngineLoop
    llm = LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=64, max_batch=8)
    loop = EngineLoop(llm.engine, name="dup", health_interval=None)
    try:
        first, second = _Outputs(), []
        done = first.done
        loop.submit([1, 2, 3], LONG, first, request_id="x")
        loop.submit([4, 5], LONG, second.append, request_id="x")
        assert done.wait(60), "the first request lost its callback"
        assert first[-1].finish_reason == "length" and len(first[-1].token_ids) == LONG.max_tokens
        assert second[-1].finished and second[-1].finish_reason == "error" and "already in use" in second[-1].error
        assert loop.load == 0
    finally:
        loop.shutdown()
        llm.shutdown()


def test_engine_process_refuses_a_duplicate_request_id():
    from mpk_runtime.engine import InvalidRequestError
    proc = EngineProcess("tiny-llama", name="dupp", **KW)
    try:
        outs = _Outputs()
        done = outs.done
        proc.submit([1, 2, 3], LONG, outs, request_id="x")
        with pytest.raises(InvalidRequestError, match="already in use"):
            proc.submit([4, 5], LONG, lambda o: None, request_id="x")
        assert done.wait(60) and outs[-1].finish_reason == "length"
    finally:
        proc.shutdown()
