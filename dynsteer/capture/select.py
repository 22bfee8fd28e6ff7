"""Which batch rows of a step to keep for one request: position selectors, with deduplication across steps.

A request's tokens arrive in chunks (chunked prefill, then one per decode step); after a preemption it recomputes
positions it already had. Keeping a set of positions already taken makes each position land exactly once.
"""

from __future__ import annotations

import numpy as np

from dynsteer.capture.spec import Positions


def select_positions(positions: Positions, first_pos: int, count: int, prompt_len: int) -> np.ndarray:
    """Absolute positions in ``[first_pos, first_pos + count)`` that ``positions`` selects."""
    if count == 1 and positions in ("all", "all_generated", "all_prompt", "last_prompt"):  # decode: skip numpy work
        keep = (positions == "all" or (positions == "all_generated" and first_pos >= prompt_len)
                or (positions == "all_prompt" and first_pos < prompt_len)
                or (positions == "last_prompt" and first_pos == prompt_len - 1))
        return np.array([first_pos] if keep else [], dtype=np.int64)
    pos = np.arange(first_pos, first_pos + count)
    if positions == "all":
        return pos
    if positions == "all_prompt":
        return pos[pos < prompt_len]
    if positions == "all_generated":
        return pos[pos >= prompt_len]
    if positions == "last_prompt":
        return pos[pos == prompt_len - 1]
    return pos[np.isin(pos, np.asarray(positions, dtype=np.int64))]


class PositionLedger:
    """Positions already captured for one request (shared by all its places: they are captured together)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.high = -1  # every seen position is <= high; positions only go back after a preemption

    def take(self, candidates: np.ndarray) -> np.ndarray:
        if not candidates.size:
            return candidates
        if int(candidates[0]) > self.high:  # candidates ascend: all fresh (the common case, no per-position work)
            fresh = candidates
        else:
            fresh = np.array([p for p in candidates.tolist() if p not in self.seen], dtype=np.int64)
        if fresh.size:
            self.seen.update(fresh.tolist())
            self.high = max(self.high, int(fresh[-1]))
        return fresh
