"""Stop strings over a request's detokenized output: where one first occurs, and how much of a running request's
tail to hold back from streaming because it could still grow into one."""
from __future__ import annotations


def first_stop(text: str, stops: tuple[str, ...], start: int = 0, floor: int = 0) -> tuple[int, str] | None:
    """(index, stop string) of the earliest occurrence of any stop string in `text` (the longer one on a tie), or
    None; only occurrences that start at `start` or later and end after `floor` characters."""
    best = None
    for s in stops:
        i = text.find(s, max(start, floor - len(s) + 1))
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
            best = (i, s)
    return best


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that are a proper prefix of some stop string (not yet safe to stream)."""
    h = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), h, -1):
            if text.endswith(s[:k]):
                h = k
                break
    return h


def visible_text(full: str, stops: tuple[str, ...], include_stop: bool, final: bool) -> tuple[str, bool]:
    """The text a request shows for its detokenized output `full`, and whether a stop string ended it: cut at the
    first stop string (kept with include_stop), else all of it when `final`, else all but the held-back tail."""
    hit = first_stop(full, stops)
    if hit is not None:
        i, s = hit
        return full[:i + len(s)] if include_stop else full[:i], True
    if final or not stops:
        return full, False
    return full[:len(full) - held_back(full, stops)], False
