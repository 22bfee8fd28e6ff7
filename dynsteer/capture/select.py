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
    """Positions already captured for one request (shared by all its places: they are captured together).

    Decode steps take one position above ``high`` at a time; those form a run ``[run_lo, high]`` that is folded into
    ``seen`` only when a step asks about positions at or below ``high`` (a recompute after preemption), so a decode
    step costs one integer write (the collector's batched path writes ``high`` for many requests at once).
    """

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.high = -1  # every seen position is <= high; positions only go back after a preemption
        self.run_lo: int | None = None  # positions [run_lo, high] are taken and not yet in ``seen``

    def mark(self, pos: int) -> None:
        """Take one position above ``high`` (the decode path: no set update per step)."""
        if self.run_lo is None or pos != self.high + 1:
            self.fold()
            self.run_lo = pos
        self.high = pos

    def start_run(self) -> None:
        """Let the next positions ``high + 1, high + 2, ...`` be taken by writing ``high`` alone."""
        if self.run_lo is None:
            self.run_lo = self.high + 1

    def fold(self) -> None:
        """Move the current run into ``seen``."""
        if self.run_lo is not None:
            self.seen.update(range(self.run_lo, self.high + 1))
            self.run_lo = None

    def take(self, candidates: np.ndarray) -> np.ndarray:
        """The candidates (ascending) not taken before, which are now taken."""
        if not candidates.size:
            return candidates
        self.fold()
        if int(candidates[0]) > self.high:  # candidates ascend: all fresh (the common case, no per-position work)
            fresh = candidates
        else:
            fresh = np.array([p for p in candidates.tolist() if p not in self.seen], dtype=np.int64)
        if fresh.size:
            self.seen.update(fresh.tolist())
            self.high = max(self.high, int(fresh[-1]))
        return fresh
