"""TP ranks as threads for CPU tests: each thread holds one rank (its shard, its KV store) and a communicator of one
ThreadGroup, as Ray workers hold an NCCL group."""
import threading

from mpk_runtime.runtime.comm import ThreadGroup


def run_ranks(fn, world: int = 2, timeout: float = 120.0) -> dict:
    """{rank: fn(rank, comm)} for every rank, run concurrently; an exception in any rank fails the caller."""
    group = ThreadGroup(world)
    out, errs = {}, []

    def rank(r):
        try:
            out[r] = fn(r, group.comm(r))
        except Exception as e:  # noqa: BLE001
            errs.append(e)
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    assert not errs, errs
    assert len(out) == world, "a rank did not finish in time"
    return out
