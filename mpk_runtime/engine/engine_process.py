"""`EngineProcess`: an `LLM` and the `EngineLoop` that drives it, in a child process of their own, behind the caller
side of `EngineLoop` (`submit`, `abort`, `call`, `stats`, `load`, `alive`, `idle_log`, `shutdown`, `engine`).

Why: in one process the HTTP handlers and the engine loop share one GIL, and every CUDA call the loop makes lets
go of it; getting it back while a handler runs Python costs up to the switch interval (5 ms). Session 65 measured
an admission step of 64 prompts at ~30 ms in the server against ~7 ms alone (docs/serving.md). Here the engine's
threads share a GIL only with the pipe reader of their own process.

    proc = EngineProcess("llama-3.2-1b", name="replica-0", backend="megakernel", max_batch=64)
    proc.submit(ids, SamplingParams(max_tokens=16), on_output=print)

The wire: two one-way pipes (multiprocessing.connection). Parent -> child: ("add", id, prompt ids, params, prompt
text, stream), ("abort", id), ("call", call id, fn), ("rpc", call id, name), ("shutdown",). Child -> parent:
("ready", spec) or ("failed", exception) once, then ("out", [RequestOutput, ...]) one message for each round of
outputs (an engine step's), ("dead", reason) when the engine's state changes, ("reply", call id, ok, pickled value),
("beat", the loop's last round) each second.
The parent validates and tokenises locally (`EngineView`, from the spec the child declares), so a bad request is
refused before it is queued, as in process. A child that exits fails its outstanding requests with an error
output and is started again (up to `max_restarts` times), and so is one whose engine loop stops going round for
`wedge_timeout` seconds (killed first); `call(fn)` takes picklable functions only (module-level
functions or methods named by their class, e.g. `LLMEngine.reset_prefix_cache`, never a lambda).
"""
from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import itertools
import logging
import multiprocessing.connection as mpc
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Callable

from .async_engine import _one_completion
from .checks import RequestChecks
from .errors import InvalidRequestError, RequestFailedError
from .prefix_cache import block_key
from .process_wire import BEAT_S, OutputCallback, PendingRequest, thread_cpu, workers_health
from .request import RequestOutput
from .sampling import SamplingParams
from .tokenizer import LazyTokenizer

__all__ = ["EngineProcess", "EngineView", "thread_cpu", "workers_health"]
log = logging.getLogger(__name__)
_LIVE: "weakref.WeakSet[EngineProcess]" = weakref.WeakSet()


# --- what the parent knows of the child's engine ---------------------------------------------------------------
class PrefixShadow:
    """The pages this parent sent to one engine process, by content key, newest last (at most the engine's page
    count): a router's estimate of what that engine's prefix cache holds, without a round trip per request.
    `pages_for` as BlockAllocator's (RequestChecks uses it)."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self._keys: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _chain(self, tokens, stop_at_miss: bool) -> list[bytes]:
        ps, keys = self.page_size, []
        for i in range((len(tokens) - 1) // ps):
            k = block_key(keys[-1] if keys else b"", tokens[i * ps:(i + 1) * ps])
            if stop_at_miss and k not in self._keys:
                break
            keys.append(k)
        return keys

    def match(self, tokens) -> tuple[list[bytes], list[bytes]]:
        """(the keys of tokens' leading full pages this engine was sent, the same keys): the shape of
        PrefixCachingAllocator.match's answer, whose first item's length is all a router reads."""
        with self._lock:
            keys = self._chain(tokens, True)
        return keys, keys

    def note(self, tokens) -> None:
        keys = self._chain(tokens, False)
        with self._lock:
            for k in keys:
                self._keys[k] = None
                self._keys.move_to_end(k)
            while len(self._keys) > self.num_pages:
                self._keys.popitem(last=False)


class EngineView(RequestChecks):
    """The parent's stand-in for the child's `LLMEngine` where the server and router read one: validate,
    tokenize, tokenizer, kv_spec, vocab_size, prefix_caching, dead, allocator (a `PrefixShadow`)."""

    def __init__(self, spec: dict, tokenizer_source, proc: "EngineProcess"):
        self.kv_spec = spec["kv_spec"]
        self.vocab_size = spec["vocab_size"]
        self.device_sampling = spec["device_sampling"]
        self.full_sampling = spec["full_sampling"]
        self.prefix_caching = spec["prefix_caching"]
        self.tokenizer = LazyTokenizer(tokenizer_source)
        self.allocator = PrefixShadow(self.kv_spec.num_pages, self.kv_spec.page_size)
        self._proc = proc

    @property
    def dead(self) -> str | None:
        return self._proc.dead


# --- the parent's side ----------------------------------------------------------------------------------------
def _check_picklable(model, llm_kwargs: dict, imports) -> None:
    """The child's arguments cross a pipe pickled: one that does not pickle (a tokenizer or executor object holding a
    lock, a lambda) is named here, before a child starts (it was a bare "cannot pickle '_thread.lock' object")."""
    try:
        pickle.dumps((model, llm_kwargs, tuple(imports)), protocol=pickle.HIGHEST_PROTOCOL)
        return
    except Exception as e:   # noqa: BLE001 - which one, below
        err = e
    bad = []
    for k, v in [("model", model), ("child_imports", tuple(imports)), *llm_kwargs.items()]:
        try:
            pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:   # noqa: BLE001
            bad.append(k)
    raise InvalidRequestError(
        f"LLM argument(s) {bad or sorted(llm_kwargs)} cannot cross to the engine process ({type(err).__name__}: "
        f"{err}): pass picklable values there (a tokenizer by its directory, an executor by its name), or build "
        "the LLM in this process (--no-engine-process)") from err


class EngineProcess:
    def __init__(self, model: str, name: str = "engine", health_interval: float | None = 5.0,
                 max_restarts: int = 2, rpc_timeout: float = 30.0, start_timeout: float = 1800.0,
                 wedge_timeout: float | None = 300.0, child_env: dict[str, str] | None = None,
                 child_imports: tuple[str, ...] = (), **llm_kwargs: Any):
        """Start the child and wait until its `LLM(model, **llm_kwargs)` is built; its construction error (an
        unknown model, a bad argument, no GPU) is raised here, as LLM's own. max_restarts: times a child that
        exited is started again (its requests fail; later ones run on the new one). start_timeout: seconds a
        child may take to build its engine (weights, kernels compiled on first use, graphs captured).
        wedge_timeout: seconds the child's engine loop may go without going round (it does at least every 0.5 s
        idle, every step busy; the child tells each second) before the child is deemed wedged, killed and restarted
        as one that exited (None: never). The router stops picking a replica long before (Router.stall_after).
        child_env: environment variables the child gets beyond this process's; child_imports: modules it imports
        before building the LLM (e.g. executor="ray": `cluster`, which registers that name, with RAY_ADDRESS set to
        this process's cluster, so the child's workers are actors of the same cluster: cluster.build_router)."""
        self.name = name
        self.max_restarts = max_restarts
        self.rpc_timeout = rpc_timeout
        self.start_timeout = start_timeout
        self.wedge_timeout = wedge_timeout
        self.restarts = 0
        self._args = (model, dict(llm_kwargs), health_interval, tuple(child_imports))
        self._child_env = dict(child_env or {})
        tok = llm_kwargs.get("tokenizer")
        self._tokenizer_source = tok if tok is not None else model
        self._lock = threading.Lock()        # the request table and the counters
        self._send_lock = threading.Lock()   # one writer at a time on the pipe
        self._calls = itertools.count()
        self._callbacks: dict[str, PendingRequest] = {}
        self._replies: dict[int, cf.Future] = {}
        self._ids = 0
        self._outstanding = 0
        self._dead: str | None = None        # this replica is down (the child's engine, or the child itself)
        self._stopping = False
        self._starting: subprocess.Popen | None = None   # a child being built (shutdown kills it)
        self._last_stats: dict = {}
        self._wedged: str | None = None      # why this side killed the child (its engine loop stopped going round)
        _check_picklable(model, llm_kwargs, child_imports)
        self._start()
        _LIVE.add(self)

    def _start(self) -> None:
        """A fresh interpreter (not multiprocessing's spawn, which would run the caller's main script again in
        the child), the pipes' ends passed by descriptor, the arguments as the first message."""
        model, kw, health, imports = self._args
        rx, child_tx = mpc.Pipe(duplex=False)   # child -> parent
        child_rx, tx = mpc.Pipe(duplex=False)   # parent -> child
        fds = (child_rx.fileno(), child_tx.fileno())
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),   # (as spawn does)
               **self._child_env}   # (child_env's own PYTHONPATH, if any, wins)
        proc = self._starting = subprocess.Popen(
            [sys.executable, "-c", f"import mpk_runtime.engine.process_child as m; m.child_entry({fds[0]}, {fds[1]})"],
            pass_fds=fds, env=env)
        child_rx.close()
        child_tx.close()
        deadline = time.monotonic() + self.start_timeout
        try:
            try:
                tx.send((self.name, model, kw, health, imports))
                while not rx.poll(0.5):
                    if proc.poll() is not None:
                        raise EOFError
                    if self._stopping:
                        raise RequestFailedError(f"the engine process of {self.name} was shut down while it started")
                    if time.monotonic() > deadline:
                        raise RequestFailedError(f"the engine process of {self.name} did not build its engine in "
                                                 f"{self.start_timeout:.0f} s (start_timeout)")
                msg = rx.recv()
            except (EOFError, OSError):   # its pipe closed (poll answers True at once then) or it exited: it is gone
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
                raise RequestFailedError(f"the engine process of {self.name} exited with code {proc.returncode} "
                                         "before its engine was built (see its log above)") from None
            if msg[0] == "failed":
                try:   # (it exits now; one that lingers - a thread it started - is killed below: its error is the
                    proc.wait(5)   # caller's answer, where a TimeoutExpired 30 s later took its place)
                except subprocess.TimeoutExpired:
                    pass
                raise msg[1]
            if self._stopping:
                raise RequestFailedError(f"the engine process of {self.name} was shut down while it started")
        except BaseException:
            proc.kill()
            proc.wait()
            rx.close()
            tx.close()
            raise
        finally:
            self._starting = None
        self.engine = EngineView(msg[1], self._tokenizer_source, self)
        self._proc, self._rx, self._tx = proc, rx, tx
        self._dead = self._wedged = None
        self._progress = time.monotonic()   # the child's loop's last round, as its last heartbeat told
        self._heard = time.monotonic()      # when that heartbeat arrived (its beat thread runs beside the loop)
        self._reader = threading.Thread(target=self._read, name=f"mpk-{self.name}-rx", daemon=True)
        self._reader.start()

    # --- caller side (any thread), as EngineLoop's ---------------------------------------------------------
    @property
    def load(self) -> int:
        return self._outstanding

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None and self._reader.is_alive()

    @property
    def dead(self) -> str | None:
        return self._dead

    @property
    def stalled_s(self) -> float:
        """Seconds since the child's engine loop was last seen going round (EngineLoop.stalled_s, as its heartbeat
        tells here each second): it grows where the loop or the whole child is wedged, or stopped."""
        return max(0.0, time.monotonic() - self._progress)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, on_output: OutputCallback,
               prompt: str | None = None, request_id: str | None = None, stream: bool = True) -> str:
        if self._dead or not self.alive:
            raise RequestFailedError(f"replica {self.name} is down: {self._dead or 'its engine process exited'}")
        self.engine.validate(prompt_token_ids, params)
        _one_completion(params)
        ids = list(prompt_token_ids)
        with self._lock:
            self._ids += 1
            rid = request_id or f"{self.name}-{self._ids}"
            if rid in self._callbacks:   # (the one running under it keeps its callback)
                raise InvalidRequestError(f"request id {rid!r} is already in use")
            self._callbacks[rid] = PendingRequest(on_output, prompt, ids)
            self._outstanding += 1
        try:   # (the request apart: the child answers a payload it cannot read with an error output, by id)
            self._send(("add", rid, pickle.dumps((ids, params, prompt, stream), protocol=pickle.HIGHEST_PROTOCOL)))
        except Exception as e:   # noqa: BLE001 - the child is gone (OSError), or params that do not pickle
            with self._lock:
                entry = self._callbacks.pop(rid, None)
                if entry is not None:
                    self._outstanding -= 1
            if entry is None:   # the reader failed it already (the child exited meanwhile): that is its end
                return rid
            if isinstance(e, (OSError, ValueError)):
                raise RequestFailedError(f"replica {self.name} is down: {e}") from e
            raise InvalidRequestError(f"the request cannot cross to the engine process of {self.name}: {e} (pass "
                                      "a SamplingParams of mpk_runtime, prompt token ids as ints)") from e
        if self.engine.prefix_caching:
            self.engine.allocator.note(ids)
        return rid

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except (OSError, ValueError):
            pass   # the child is gone; its requests are failed by the reader

    def call(self, fn: Callable[[Any], object]) -> cf.Future:
        """fn(engine) on the child's engine loop between steps; its result (picklable) or error in the future,
        after every output the child delivered before it (as EngineLoop.call's)."""
        if getattr(fn, "__module__", None) == "__main__":
            fut: cf.Future = cf.Future()
            fut.set_exception(RequestFailedError(
                f"call({getattr(fn, '__qualname__', fn)}) runs in the engine process, which cannot import this "
                "program's __main__: define the function in an importable module"))
            return fut
        try:
            payload = pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:   # noqa: BLE001 - a lambda, a closure
            fut = cf.Future()
            fut.set_exception(RequestFailedError(
                f"call() to the engine process of {self.name} failed: {e}; pass a module-level function or a method "
                "named by its class (not a lambda or a closure): it runs in the engine process"))
            return fut
        return self._request("call", payload)

    def rpc(self, what: str, timeout: float | None = None):
        """What the child's reader thread answers at once: "stats", "idle_log", "thread_cpu"."""
        return self._request("rpc", what).result(timeout=timeout or self.rpc_timeout)

    def stats(self) -> dict:
        """The child's EngineLoop.stats(); the last ones seen, with `dead` set, when it cannot answer."""
        silent = time.monotonic() - self._heard
        if not self._dead and self.alive and silent > 3 * BEAT_S and not self._unread():   # (its heartbeat is late
            # and nothing waits in the pipe, where this process's reader may lag behind a busy child: no rpc would
            # answer)
            reason = (f"the engine process of {self.name} has sent nothing for {silent:.1f} s (a heartbeat is due each "
                      f"{BEAT_S:g} s)")
        elif not self._dead and self.alive:
            try:
                self._last_stats = self.rpc("stats", timeout=10.0)
                return self._last_stats
            except Exception as e:   # noqa: BLE001 - a busy or dying child: report what is known
                reason = f"the engine process of {self.name} did not answer stats: {e}"
        else:
            reason = self._dead or f"the engine process of {self.name} exited"
        return {**self._last_stats, "dead": reason, "outstanding": self._outstanding,
                "stalled_s": round(self.stalled_s, 3)}

    @property
    def idle_log(self) -> list:
        """The child's EngineLoop.idle_log (time.monotonic() is one clock for every process of the machine)."""
        try:
            return self.rpc("idle_log")
        except Exception:   # noqa: BLE001 - a diagnostic
            return []

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        _LIVE.discard(self)
        starting = self._starting
        if starting is not None:   # a restart in progress: its child goes too (_start sees _stopping)
            starting.kill()
        # (from a thread of its own: a child that stopped reading - wedged - with its pipe full would block this
        # write, and every submit's, for good; they fail once it is killed below)
        teller = threading.Thread(target=self._tell_shutdown, name=f"mpk-{self.name}-stop", daemon=True)
        teller.start()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        teller.join(5)
        if threading.current_thread() is not self._reader:   # (from an output callback: it ends after it)
            self._reader.join(5)
        with self._send_lock:
            self._tx.close()

    # --- parent internals ------------------------------------------------------------------------------------
    def _unread(self) -> bool:
        """Whether the child's pipe holds what the reader has not read yet (its heartbeats among it)."""
        try:
            return self._rx.poll(0)
        except (OSError, ValueError, EOFError):   # (the reader closed it: the child is gone)
            return False

    def _tell_shutdown(self) -> None:
        try:
            self._send(("shutdown",))
        except (OSError, ValueError):
            pass

    def _send(self, msg) -> None:
        with self._send_lock:
            self._tx.send(msg)

    def _request(self, kind: str, arg) -> cf.Future:
        fut: cf.Future = cf.Future()
        cid = next(self._calls)
        with self._lock:   # (as _fail_pending swaps the dict: a future put into the old one would never be answered)
            self._replies[cid] = fut
        try:
            self._send((kind, cid, arg))
        except Exception as e:   # noqa: BLE001 - the child is gone
            if self._replies.pop(cid, None) is not None:
                fut.set_exception(RequestFailedError(f"{kind} to the engine process of {self.name} failed: {e}"))
        return fut

    def _read(self) -> None:
        rx = self._rx
        try:
            while True:
                try:
                    if not rx.poll(BEAT_S):   # (silence: the child's heartbeat is late)
                        if self._proc.poll() is not None:   # it exited, though its pipe may not close: a process
                            break                           # it forked (or one that inherited the pipe) holds it
                        self._watch()
                        continue
                    msg = rx.recv()
                except (EOFError, OSError):
                    break
                except Exception:   # noqa: BLE001 - read whole, but it does not unpickle here: skip it
                    log.exception("engine process %s: a message this process cannot read", self.name)
                    continue
                try:
                    self._handle(msg)
                except Exception:   # noqa: BLE001 - a message that does not unpickle or apply: skip it, keep reading
                    log.exception("engine process %s: a message this process cannot apply", self.name)
        finally:
            rx.close()
            self._child_exited()

    def _handle(self, msg) -> None:
        tag = msg[0]
        if tag == "out":
            self._dispatch(msg[1])
        elif tag == "beat":
            self._heard, self._progress = time.monotonic(), msg[1]   # (one monotonic clock for the whole machine)
            self._watch()
        elif tag == "reply":
            fut = self._replies.pop(msg[1], None)
            if fut is not None and fut.set_running_or_notify_cancel():   # (a caller may have cancelled it)
                ok = msg[2]
                try:
                    value = pickle.loads(msg[3])
                except Exception as e:   # noqa: BLE001 - e.g. a class this process cannot import
                    ok, value = False, RequestFailedError(f"the reply of the engine process of {self.name} cannot be "
                                                          f"read in this process: {type(e).__name__}: {e}")
                (fut.set_result if ok else fut.set_exception)(value)
        elif tag == "dead":
            self._dead = msg[1]

    def _dispatch(self, items: list[tuple]) -> None:
        """A step's outputs in their wire form (process_wire.pack_output): each rebuilt as the RequestOutput the
        child's engine made,
        from what this side kept of the request, and handed to its callback."""
        for it in items:
            rid, finished = it[0], it[5]
            if finished:
                with self._lock:
                    entry = self._callbacks.pop(rid, None)
                    if entry is not None:
                        self._outstanding -= 1
            else:
                entry = self._callbacks.get(rid)
            if entry is None:   # (a request failed here already: its child exited and this is a late output)
                continue
            try:
                out = entry.unpack(rid, it)
            except Exception:   # noqa: BLE001 - never leave the reader on a malformed item
                log.exception("engine process %s: an output this process cannot read (%s)", self.name, rid)
                continue
            try:
                entry.on_output(out)
            except Exception:   # a consumer's bug must not stop the reader
                log.exception("output callback failed for %s", rid)

    def _fail_pending(self, reason: str) -> None:
        """End every request and call the child held with reason (their outputs can no longer come)."""
        with self._lock:
            pending, self._callbacks, self._outstanding = self._callbacks, {}, 0
            replies, self._replies = self._replies, {}
        for rid, p in pending.items():
            try:
                p.on_output(RequestOutput.failed(rid, p.prompt, p.prompt_token_ids, reason))
            except Exception:   # noqa: BLE001
                log.exception("output callback failed for %s", rid)
        for fut in replies.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RequestFailedError(reason))

    def _watch(self) -> None:
        """Kill a child whose engine loop has not gone round for wedge_timeout s: its pipe closes, and
        _child_exited fails its requests and starts another, as for a child that exited by itself."""
        stalled = self.stalled_s
        if self.wedge_timeout is None or stalled <= self.wedge_timeout or self._stopping or self._wedged:
            return
        if self._unread():   # (this side lags: a later heartbeat may wait in the pipe; judge on the newest)
            return
        self._wedged = (f"its engine loop made no progress for {stalled:.0f} s (wedge_timeout "
                        f"{self.wedge_timeout:g} s), so it was killed")
        log.error("engine process %s (pid %d): %s", self.name, self._proc.pid, self._wedged)
        self._proc.kill()

    def _child_exited(self) -> None:
        """The pipe closed: fail what the child held; start a new child unless this is a shutdown."""
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:   # the pipe closed but the process lingers: it is no use any more
            self._proc.kill()
            self._proc.wait(5)
        if self._stopping:   # (what the child did not end itself before it exited)
            self._fail_pending(f"the engine process of {self.name} was shut down")
            return
        with self._send_lock:   # (a submit racing this one gets an OSError there: a RequestFailedError to its caller)
            self._tx.close()
        code = self._proc.returncode
        reason = (f"the engine process of {self.name} was wedged: {self._wedged}" if self._wedged else
                  f"the engine process of {self.name} exited (code {code})")
        log.error("%s; failing its %d requests", reason, len(self._callbacks))
        self._dead = reason
        self._fail_pending(reason)
        if self.restarts >= self.max_restarts:
            self._dead = f"{reason}; not restarted (max_restarts={self.max_restarts})"
            return
        self.restarts += 1
        self._dead = f"{reason}; restarting (restart {self.restarts} of {self.max_restarts})"
        try:
            self._start()
            log.warning("engine process of %s restarted", self.name)
        except Exception as e:   # noqa: BLE001
            self._dead = f"{reason}; " + ("shut down during its restart" if self._stopping else
                                          f"the restart failed: {type(e).__name__}: {e}")


@atexit.register
def _stop_children() -> None:
    for p in list(_LIVE):
        try:
            p.shutdown(timeout=5.0)
        except Exception:   # noqa: BLE001 - exiting anyway
            pass
