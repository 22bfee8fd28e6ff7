"""Which batch rows of a step to keep for one request: position selectors, with deduplication across steps.

A request's tokens arrive in chunks (chunked prefill, then one per decode step); after a preemption it recomputes
positions it already had. Keeping a set of positions already taken makes each position land exactly once.
"""

from __future__ import annotations

import numpy as np

from dynsteer.capture.spec import Positions


def select_positions(positions: Positions, first_pos: int, count: int, prompt_len: int) -> np.ndarray:
    """Absolute positions in ``[first_pos, first_pos + count)`` that ``positions`` selects."""
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
        self._marked: list[int] = []  # decode positions taken by mark(), folded into ``seen`` only when needed

    def mark(self, pos: int) -> None:
        """Take one position above ``high`` (the decode fast path: no set update per step)."""
        self._marked.append(pos)
        self.high = pos

    def take(self, candidates: np.ndarray) -> np.ndarray:
        """The candidates (ascending) not taken before, which are now taken."""
        if not candidates.size:
            return candidates
        if int(candidates[0]) > self.high:  # candidates ascend: all fresh (the common case, no per-position work)
            fresh = candidates
        else:
            if self._marked:
                self.seen.update(self._marked)
                self._marked.clear()
            fresh = np.array([p for p in candidates.tolist() if p not in self.seen], dtype=np.int64)
        if fresh.size:
            self.seen.update(fresh.tolist())
            self.high = max(self.high, int(fresh[-1]))
        return fresh
