"""What crosses between an `EngineProcess` (engine_process.py) and its child (process_child.py): the outputs' wire
form, the heartbeat period, and the helpers both sides call by name (`thread_cpu`, `workers_health`).
"""
from __future__ import annotations

import os
import pickle
import threading
import traceback
import time
from typing import Callable

from .request import RequestMetrics, RequestOutput

OutputCallback = Callable[[RequestOutput], None]
BEAT_S = 1.0   # the child's heartbeat period (s): its loop's last round, for the parent's wedge watch


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of each live thread of this process, by name (Linux; {} where the clock is missing)."""
    out: dict[str, float] = {}
    for t in threading.enumerate():
        try:
            out[t.name] = out.get(t.name, 0.0) + time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (AttributeError, OSError, TypeError):   # (a thread that just ended, or no such clock here)
            pass
    return out


def workers_health(engine) -> list[dict]:
    """Every worker's health report (the runner's graph counts among it): a picklable `call` for either kind of
    replica."""
    return engine.executor.collective_rpc("health", timeout=30)


# --- outputs on the wire --------------------------------------------------------------------------------------
# A RequestOutput carries every token so far, the prompt and a metrics object; pickled whole, 64 streamed outputs
# were ~18 KB and most of a step's delivery in the child (session 66: 1.07 ms a step of the streaming load's loop).
# On the wire an output is a tuple of what the parent does not know yet: the tokens (and logprobs) past those it was
# sent, the text, the delta, the ending and the metrics' times; the parent keeps the prompt and the tokens so far
# (PendingRequest) and rebuilds the same RequestOutput.
def pack_output(o: RequestOutput, sent: dict[str, tuple[int, int]]) -> tuple:
    """o in its wire form; sent: request id -> (tokens, logprobs) the parent has of it (the loop thread's own)."""
    n, m = sent.pop(o.request_id, (0, 0)) if o.finished else sent.get(o.request_id, (0, 0))
    toks, lps = o.token_ids, o.logprobs
    reset = len(toks) < n or (lps is not None and len(lps) < m)   # (never seen: a snapshot shorter than the last)
    if reset:
        n = m = 0
    if not o.finished:
        sent[o.request_id] = (len(toks), 0 if lps is None else len(lps))
    new = toks[n:]
    mt = o.metrics
    return (o.request_id, reset, new, None if o.delta_token_ids == new else o.delta_token_ids, o.text, o.finished,
            o.delta_text, o.finish_reason, o.error, (mt.arrival_time, mt.first_token_time, mt.finish_time),
            None if lps is None else lps[m:], o.num_cached_tokens, o.stop_reason)


class PendingRequest:
    """A request the parent sent and has not seen finish: its callback, its prompt, its tokens so far."""
    __slots__ = ("on_output", "prompt", "prompt_token_ids", "tokens", "logprobs")

    def __init__(self, on_output: OutputCallback, prompt: str | None, prompt_token_ids: list[int]):
        self.on_output, self.prompt, self.prompt_token_ids = on_output, prompt, prompt_token_ids
        self.tokens: list[int] = []
        self.logprobs: list | None = None

    def unpack(self, rid: str, it: tuple) -> RequestOutput:
        _, reset, new, delta, text, finished, delta_text, reason, error, times, lps, cached, stop_reason = it
        toks = (new if reset else self.tokens + new)
        self.tokens = toks
        if lps is not None:
            self.logprobs = lps if reset or self.logprobs is None else self.logprobs + lps
        return RequestOutput(rid, self.prompt, self.prompt_token_ids, list(toks), text,
                             new if delta is None else delta, delta_text, finished, reason, error,
                             RequestMetrics(times[0], times[1], times[2], len(self.prompt_token_ids), len(toks)),
                             None if self.logprobs is None else list(self.logprobs), cached,
                             stop_reason=stop_reason)


def picklable_error(e: BaseException) -> BaseException:
    """e if it survives pickling (to cross the pipe), else a RuntimeError that names it; with a note holding its
    traceback in this process and the errors it came from (pickling keeps neither, and nothing else kept them: a
    failed engine build or call was its message alone in the parent)."""
    note = None
    if e.__traceback__ is not None or e.__cause__ is not None or e.__context__ is not None:
        try:
            note = "in the engine process (pid %d):\n%s" % (os.getpid(), "".join(traceback.format_exception(e)).rstrip())
        except Exception:   # noqa: BLE001 - a diagnostic
            note = None
    try:
        pickle.loads(pickle.dumps(e))
        out = e
    except Exception:   # noqa: BLE001
        out = RuntimeError(f"{type(e).__name__}: {e}")
    if note is not None:
        out.add_note(note)
    return out
