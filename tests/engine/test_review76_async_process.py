"""Review 76: the caller side of EngineLoop (engine/async_engine.py) and EngineProcess (engine/engine_process.py) as
an application drives them: calls that raise a BaseException, shutdown from an output callback, a duplicate id queued
at shutdown, n > 1, and an engine process's construction errors (the child's traceback, a child that lingers after
its error, arguments that cannot cross the pipe)."""
import threading
import time

import pytest

from mpk_runtime.engine import InvalidRequestError, SamplingParams
from mpk_runtime.engine.async_engine import EngineLoop
from mpk_runtime.engine.engine_process import EngineProcess
from tests.engine.test_engine_process_review import KW, LONG, _module   # (the same rig)


class _Outputs(list):
    def __init__(self):
        super().__init__()
        self.done = threading.Event()

    def __call__(self, o):
        self.append(o)
        if o.finished:
            self.done.set()


@pytest.fixture(scope="module")
def llm():
    from mpk_runtime.engine import LLM
    llm = LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=64, max_batch=8)
    yield llm
    llm.shutdown()


def _exit(engine):
    raise SystemExit(3)


def test_loop_call_that_raises_system_exit_answers_and_the_loop_goes_on(llm):
    """call(fn) whose fn raised a BaseException (SystemExit) left its future unanswered for good and ended the loop
    thread: every request of the replica failed with it."""
    loop = EngineLoop(llm.engine, name="sx", health_interval=None)
    try:
        with pytest.raises(SystemExit):
            loop.call(_exit).result(10)
        assert loop.alive
        outs = _Outputs()
        loop.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=4), outs)
        assert outs.done.wait(30) and outs[-1].finish_reason == "length"
    finally:
        loop.shutdown()


def test_process_call_that_raises_system_exit_answers(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "review76_sysexit", """
        def bye(engine):
            raise SystemExit(3)
    """)
    import importlib
    fn = importlib.import_module(mod).bye
    proc = EngineProcess("tiny-llama", name="sxp", **KW)
    try:
        with pytest.raises(SystemExit):
            proc.call(fn).result(10)
        outs = _Outputs()
        proc.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=4), outs)
        assert outs.done.wait(30) and outs[-1].finish_reason == "length"
    finally:
        proc.shutdown()


def test_build_error_keeps_the_childs_traceback():
    """LLM(max_batch=0) in the child: InvalidRequestError from the runner's ValueError. The parent got the message
    alone (pickling drops the traceback and the cause, and the child logged nothing)."""
    with pytest.raises(InvalidRequestError, match="max_batch") as ei:
        EngineProcess("tiny-llama", name="tb", **{**KW, "max_batch": 0})
    notes = "\n".join(getattr(ei.value, "__notes__", []))
    assert "in the engine process" in notes and "Traceback" in notes and "ValueError" in notes, notes


def test_a_child_that_lingers_after_its_error_raises_that_error_quickly(tmp_path, monkeypatch):
    """The child answers ("failed", error) but does not exit (a thread it started keeps it): the parent waited 30 s
    and raised subprocess.TimeoutExpired in place of the error."""
    mod = _module(tmp_path, monkeypatch, "review76_linger", """
        import threading, time
        threading.Thread(target=time.sleep, args=(120,)).start()   # (not a daemon: the interpreter waits for it)
    """)
    got = []

    def build():
        try:
            EngineProcess("tiny-llama", name="ling", child_imports=(mod,), **{**KW, "bogus_kw": 1})
        except BaseException as e:   # noqa: BLE001
            got.append(e)
    t = threading.Thread(target=build, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(20)
    assert not t.is_alive(), f"EngineProcess() still waiting after {time.monotonic() - t0:.0f} s"
    assert isinstance(got[0], InvalidRequestError) and "bogus_kw" in str(got[0]), got


class _LockedTokenizer:   # (a tokenizer object, as LLM takes in process; its lock does not pickle)
    def __init__(self):
        self.lock = threading.Lock()

    def encode(self, text):
        return [1]

    def decode(self, ids):
        return "x"


def test_arguments_that_cannot_cross_to_the_child_are_named():
    """It was a bare TypeError("cannot pickle '_thread.lock' object"), naming neither the argument nor the pipe."""
    Tok = _LockedTokenizer
    with pytest.raises(InvalidRequestError, match=r"\['tokenizer'\].*engine process"):
        EngineProcess("tiny-llama", name="pk", tokenizer=Tok(), **KW)


def test_n_above_one_is_refused_in_the_caller(llm):
    """submit() raises its typed errors in the caller; n=2 came back later as an error output instead."""
    loop = EngineLoop(llm.engine, name="n2", health_interval=None)
    try:
        with pytest.raises(InvalidRequestError, match="n=2"):
            loop.submit([1, 2], SamplingParams(n=2, max_tokens=2), lambda o: None)
        assert loop.load == 0
    finally:
        loop.shutdown()
    proc = EngineProcess("tiny-llama", name="n2p", **KW)
    try:
        with pytest.raises(InvalidRequestError, match="n=2"):
            proc.submit([1, 2], SamplingParams(n=2, max_tokens=2), lambda o: None)
        assert proc.load == 0
    finally:
        proc.shutdown()


def _shutdown_from_callback(eng):
    """A request whose callback shuts its engine down at its first output (an application stopping on an output):
    shutdown() raised RuntimeError("cannot join current thread") there."""
    outs, errors = _Outputs(), []

    def cb(o):
        outs(o)
        if len(outs) == 1:
            try:
                eng.shutdown(timeout=5)
            except BaseException as e:   # noqa: BLE001
                errors.append(e)
    eng.submit([1, 2, 3], LONG, cb)
    assert outs.done.wait(30)
    assert errors == []
    assert outs[-1].finish_reason == "error" and "shut down" in outs[-1].error
    assert eng.load == 0


def test_loop_shutdown_from_an_output_callback(llm):
    _shutdown_from_callback(EngineLoop(llm.engine, name="cbs", health_interval=None))


def test_process_shutdown_from_an_output_callback():
    proc = EngineProcess("tiny-llama", name="cbsp", **KW)
    try:
        _shutdown_from_callback(proc)
        proc._reader.join(10)
        assert not proc._reader.is_alive() and proc._proc.poll() is not None
    finally:
        proc.shutdown()


def test_loop_shutdown_with_a_duplicate_id_queued_ends_both(llm):
    """A second request under a running one's id, still queued when the loop shuts down, took the running one's
    callback: the running request never heard its end and load stayed at 1."""
    loop = EngineLoop(llm.engine, name="dup", health_interval=None)
    held, release = threading.Event(), threading.Event()
    first, second = _Outputs(), _Outputs()

    def cb_first(o):
        first(o)
        if not held.is_set():
            held.set()
            release.wait(10)   # (holds the loop thread until the duplicate is queued and shutdown() called)
    loop.submit([1, 2, 3], LONG, cb_first, request_id="a")
    assert held.wait(30)
    loop.submit([4, 5], LONG, second, request_id="a")   # (queued behind the held round)
    stopper = threading.Thread(target=loop.shutdown, daemon=True)
    stopper.start()
    time.sleep(0.2)
    release.set()
    stopper.join(20)
    assert first.done.wait(5), "the running request never got its final output"
    assert second.done.wait(5)
    assert first[-1].finish_reason == "error" and "shut down" in first[-1].error
    assert second[-1].finish_reason == "error"
    assert loop.load == 0
