"""The megakernel's trace buffer layout, host side (no GPU): start/end words of every traced step first, then a
stage-stamp build's K words per task (megakernel.cu writes them at trace + steps * tasks * 2)."""
from types import SimpleNamespace

import pytest
import torch

from mpk_runtime.runtime.megakernel import Megakernel


def _mk(steps, ntasks, k):
    mk = object.__new__(Megakernel)   # the accessors only need tg, trace_steps, stage_words and the buffer
    mk.tg = SimpleNamespace(tasks=[SimpleNamespace(id=i) for i in range(ntasks)])
    mk.trace_steps, mk.stage_words = steps, k
    mk.trace = torch.arange(max(steps, 1) * ntasks * (2 + k), dtype=torch.int64)
    return mk


@pytest.mark.parametrize("k", [0, 3, 12])
def test_trace_times_and_stage_stamps_split_the_buffer(k):
    steps, nt = 4, 5
    mk = _mk(steps, nt, k)
    tt = mk.trace_times()
    assert tt.shape == (steps, nt, 2)
    assert int(tt[2, 3, 1]) == (2 * nt + 3) * 2 + 1            # device: trace[(ls * tasks + tid) * 2 + 1]
    if k == 0:
        with pytest.raises(ValueError, match="MPK_STAGE_WORDS"):
            mk.stage_stamps()
        return
    st = mk.stage_stamps()
    assert st.shape == (steps, nt, k)
    assert int(st[2, 3, 1]) == steps * nt * 2 + (2 * nt + 3) * k + 1   # device: base + (ls * tasks + tid) * K + k
    assert int(st[-1, -1, -1]) == int(mk.trace[-1])                     # the stamps end the buffer


def test_trace_times_with_tracing_off_is_empty():
    assert _mk(0, 5, 0).trace_times().shape == (0, 5, 2)
