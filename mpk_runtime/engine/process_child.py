"""The child's side of an `EngineProcess` (engine_process.py): a fresh interpreter started with
`python -c "import mpk_runtime.engine.process_child as m; m.child_entry(rx_fd, tx_fd)"` builds the `LLM`, drives it
with an `EngineLoop` and answers the parent's messages (the protocol: engine_process.py's docstring).
"""
from __future__ import annotations

import functools
import logging
import multiprocessing.connection as mpc
import os
import pickle
import queue
import threading

from ..envflags import env_flag
from .process_wire import BEAT_S, pack_output, picklable_error, thread_cpu
from .request import RequestOutput

log = logging.getLogger(__name__)


def child_entry(rx_fd: int, tx_fd: int) -> None:
    """The child interpreter's start (a new process, never a fork: CUDA in a forked child is unsafe)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the parent's: it shuts this process down
    for fd in (rx_fd, tx_fd):   # (pass_fds left them inheritable: a program this one runs must not hold the pipe)
        os.set_inheritable(fd, False)
    rx, tx = mpc.Connection(rx_fd, writable=False), mpc.Connection(tx_fd, readable=False)
    try:
        name, model, llm_kwargs, health_interval, imports = rx.recv()
    except (EOFError, OSError):
        return
    # (its log lines go to the server's stderr, named by the replica they come from)
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s [engine {name}] %(levelname)s %(name)s: %(message)s")
    _child_main(rx, tx, name, model, llm_kwargs, health_interval, imports)


def _child_main(rx, tx, name: str, model: str, llm_kwargs: dict, health_interval: float | None,
                imports: tuple[str, ...] = ()) -> None:
    import importlib

    from .async_engine import EngineLoop
    from .llm import LLM

    send_lock = threading.Lock()

    def send(msg) -> None:
        with send_lock:
            tx.send(msg)

    try:
        for m in imports:
            importlib.import_module(m)
        llm = LLM(model, **llm_kwargs)
    except BaseException as e:   # noqa: BLE001 - the parent raises it
        send(("failed", picklable_error(e)))
        return
    eng = llm.engine
    send(("ready", {"kv_spec": eng.kv_spec, "vocab_size": eng.vocab_size, "device_sampling": eng.device_sampling,
                    "full_sampling": eng.full_sampling, "prefix_caching": eng.prefix_caching}))
    outbox: list[RequestOutput] = []   # filled and emptied on the loop thread only
    sent: dict[str, tuple[int, int]] = {}   # (pack_output's: the sender thread's only)
    told = [None]                      # the engine's dead reason the parent was last sent
    # What the loop thread sends goes through one queue to a sender thread, which packs and writes it in order: a
    # step's 64 streamed outputs are ~0.2-0.6 ms of packing, pickling and pipe writes (session 67: 0.49-0.62 ms a step
    # of the streaming load's loop on an H100) that would otherwise come before the next step; the sender does them
    # while the loop waits on the device. A call's reply queues behind the outputs delivered before it.
    posts: queue.SimpleQueue = queue.SimpleQueue()

    def sender() -> None:
        while (job := posts.get()) is not None:
            try:
                job()
            except (OSError, ValueError):   # the parent is gone (what is posted after this is dropped)
                return
            except Exception:   # noqa: BLE001 - a message that cannot be packed: log it, keep sending the rest
                log.exception("engine process %s: a message it cannot send", name)

    def send_out(batch: list[RequestOutput]) -> None:
        send(("out", [pack_output(o, sent) for o in batch]))

    post = posts.put if env_flag("MPK_PROC_SENDER", True) else (lambda job: job())   # (0: on the loop thread)

    def flush() -> None:   # (on the loop thread)
        if outbox:
            post(functools.partial(send_out, outbox.copy()))   # (snapshots: later steps do not change them)
            outbox.clear()
        if eng.dead != told[0]:
            told[0] = eng.dead
            post(functools.partial(send, ("dead", eng.dead)))

    def reply(cid: int, ok: bool, value) -> None:
        # (the value pickled apart: one the parent cannot unpickle fails that call there, not the whole message)
        try:
            payload = pickle.dumps(value if ok else picklable_error(value), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as pe:   # noqa: BLE001 - a result that does not pickle
            ok, payload = False, pickle.dumps(RuntimeError(f"the call's result cannot cross to the parent: {pe}"))
        send(("reply", cid, ok, payload))

    def run_call(engine, payload: bytes, cid: int) -> None:
        """On the loop thread: fn(engine), then the outputs delivered before it, then its reply (that order)."""
        try:
            ok, value = True, pickle.loads(payload)(engine)
        except BaseException as e:   # noqa: BLE001 - the caller's to handle (a function this child cannot import
            ok, value = False, e     # too; a SystemExit: unanswered, its caller waited for good)
        flush()
        post(functools.partial(reply, cid, ok, value))

    sending = threading.Thread(target=sender, name=f"mpk-{name}-tx", daemon=True)
    sending.start()
    loop = EngineLoop(eng, name=name, health_interval=health_interval, on_delivered=flush)
    beating = threading.Event()

    def beat() -> None:   # the loop's last round, each second (the parent's wedge watch)
        while not beating.wait(BEAT_S):
            try:
                send(("beat", loop.progress))
            except (OSError, ValueError):   # the parent is gone
                return

    threading.Thread(target=beat, name=f"mpk-{name}-beat", daemon=True).start()
    rpcs = {"stats": loop.stats, "idle_log": lambda: list(loop.idle_log), "thread_cpu": thread_cpu}
    try:
        while True:
            try:
                msg = rx.recv()
            except (EOFError, OSError):   # the parent is gone
                break
            except Exception:   # noqa: BLE001 - a message that does not unpickle here: skip it, keep serving
                log.exception("engine process %s: a message from the parent it cannot read", name)
                continue
            tag = msg[0]
            if tag == "add":
                rid = msg[1]
                try:
                    ids, params, prompt, stream = pickle.loads(msg[2])
                except Exception as e:   # noqa: BLE001 - e.g. a SamplingParams subclass this child cannot import
                    send(("out", [pack_output(RequestOutput.failed(rid, None, [], "the request cannot be read in the "
                                                             f"engine process: {e}"), {})]))
                    continue
                try:
                    loop.submit(ids, params, outbox.append, prompt=prompt, request_id=rid, stream=stream,
                                checked=True)   # (the parent did, with the same code and spec)
                except Exception as e:   # noqa: BLE001 - the engine died after the parent validated
                    send(("out", [pack_output(RequestOutput.failed(rid, prompt, ids, str(e)), {})]))
            elif tag == "abort":
                loop.abort(msg[1])
            elif tag == "call":
                loop.call(functools.partial(run_call, payload=msg[2], cid=msg[1]))
            elif tag == "rpc":   # answered on this thread, between the loop's steps or during them
                try:
                    ok, value = True, rpcs[msg[2]]()
                except Exception as e:   # noqa: BLE001 - (a KeyError: an rpc this child does not know)
                    ok, value = False, e
                reply(msg[1], ok, value)
            elif tag == "shutdown":
                break
    finally:
        beating.set()
        loop.shutdown()
        posts.put(None)      # (after what the loop posted last)
        sending.join(10)
        llm.shutdown()
        with send_lock:
            tx.close()
