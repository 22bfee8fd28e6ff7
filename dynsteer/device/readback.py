"""Per-request records of the dynamic tier's read-backs, appended a whole step at a time.

Each step's read-back is one ``[W, m]`` block (scores, applied gates, gate multipliers and the controller scale of the
step's ``m`` dynamic tokens, ``W = 4G+1``). Requests that keep a record (a trace was asked for, or the device sync
tier may replay its multipliers after a preemption) own a *record slot*: a row of a dense ``[S, T, W]`` array into
which a step's tokens are scattered with one vectorised assignment, so the host does no per-token or per-request
Python for them. A request's record is one slice when it finishes. Positions computed again after a preemption are
not appended a second time (the first computation is the one the request continued from).
"""

from __future__ import annotations

import numpy as np


class ReadbackStore:
    """Dense, growable per-request records of read-back columns (host memory)."""

    def __init__(self, width: int, slots: int = 16, length: int = 64) -> None:
        self.width = width
        self.values = np.zeros((slots, length, width), np.float32)
        self.positions = np.zeros((slots, length), np.int64)
        self.count = np.zeros(slots, np.int64)
        self.last = np.full(slots, -1, np.int64)  # last position appended (recomputed positions are not)
        self._free = list(range(slots - 1, -1, -1))
        self._retired: list[tuple[int, int]] = []  # (read-back sequence, slot): free once that read-back landed

    # ---- slots -------------------------------------------------------------------------------------------------------
    def acquire(self) -> int:
        if not self._free:
            self._grow(slots=2 * len(self.count))
        s = self._free.pop()
        self.count[s], self.last[s] = 0, -1
        return s

    def retire(self, slot: int, after: int) -> None:
        """Free ``slot`` once read-back ``after`` (a sequence number) has been appended: read-backs still in flight
        name it and must not land in a new owner's record."""
        self._retired.append((after, slot))

    def reclaim(self, completed: int) -> None:
        """Free the retired slots whose last read-back has landed (``completed`` read-backs appended)."""
        if self._retired:
            done = [s for seq, s in self._retired if seq <= completed]
            if done:
                self._retired = [(seq, s) for seq, s in self._retired if seq > completed]
                self._free.extend(done)

    # ---- data --------------------------------------------------------------------------------------------------------
    def append(self, slot: np.ndarray, position: np.ndarray, block: np.ndarray) -> np.ndarray:
        """Append read-back columns: token ``k`` (``slot[k] >= 0``) at ``position[k]`` with values ``block[:, k]``.

        A request's tokens are contiguous and in position order within a step. Returns the mask of tokens appended
        (fresh positions of recorded requests).
        """
        fresh = slot >= 0
        if not len(fresh):
            return fresh
        if fresh.all():
            fresh = position > self.last[slot]
        elif not fresh.any():
            return fresh
        else:
            fresh[fresh] = position[fresh] > self.last[slot[fresh]]
        if fresh.all():  # the usual decode step: every token recorded, each at a new position (no gathers)
            s, pos, cols = slot, position, block
        else:
            k = np.flatnonzero(fresh)
            if not len(k):
                return fresh
            s, pos, cols = slot[k], position[k], block[:, k]
        n = len(s)
        change = s[1:] != s[:-1]
        at = self.count[s]
        single = change.all()  # one token per request (a decode step)
        if not single:  # several tokens of one request (a resumed request, speculative tokens): ranks in its run
            first = np.ones(n, bool)
            first[1:] = change
            at = at + (np.arange(n) - np.maximum.accumulate(np.where(first, np.arange(n), 0)))
        top = int(at.max())
        if top >= self.values.shape[1]:
            self._grow(length=max(2 * self.values.shape[1], top + 1))
        self.values[s, at] = cols.T
        self.positions[s, at] = pos
        if not single:  # each run's last token only (numpy leaves repeated-index writes unordered)
            end = np.ones(n, bool)
            end[:-1] = change
            s, at, pos = s[end], at[end], pos[end]
        self.count[s] = at + 1
        self.last[s] = pos
        return fresh

    def record(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """``(positions [T], values [T, W])`` appended for ``slot`` (copies)."""
        n = int(self.count[slot])
        return self.positions[slot, :n].copy(), self.values[slot, :n].copy()

    def at(self, slot: int, position: int) -> np.ndarray | None:
        """The values appended for ``position`` (``None`` if it was not)."""
        n = int(self.count[slot])
        hit = np.flatnonzero(self.positions[slot, :n] == position)
        return self.values[slot, hit[0]] if len(hit) else None

    def _grow(self, slots: int | None = None, length: int | None = None) -> None:
        S, T, W = self.values.shape
        S2, T2 = slots or S, length or T
        values = np.zeros((S2, T2, W), np.float32)
        positions = np.zeros((S2, T2), np.int64)
        values[:S, :T], positions[:S, :T] = self.values, self.positions
        self.values, self.positions = values, positions
        if S2 > S:
            self.count = np.r_[self.count, np.zeros(S2 - S, np.int64)]
            self.last = np.r_[self.last, np.full(S2 - S, -1, np.int64)]
            self._free.extend(range(S2 - 1, S - 1, -1))
