"""A step's dynamic decode tokens, as the runtime gathers them for the driver, and what a read-back of them says
about where steering acted (the engine core folds it into prefix-cache block hashes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass
class StepTokens:
    """This step's dynamic decode tokens, one array entry per token: owning request (index into ``req_ids``),
    batch index, position, and the request's device slot (-1: none), sync tier, record slot (-1: none) and host
    tier (the runtime keeps these per request and gathers them for the batch)."""

    req_ids: tuple[str, ...]
    req: np.ndarray
    index: np.ndarray
    position: np.ndarray
    slot: np.ndarray
    sync: np.ndarray
    record: np.ndarray
    host: np.ndarray
    act: np.ndarray  # bitmask of the gate slots whose gate steers (rules with actions)
    signature: np.ndarray  # object: the request's decode configuration digest (what acts, for prefix caching)
    steers: np.ndarray | None = None  # [G, n] bool, bit g of ``act``, when the caller computed it (see gate_bits)

    def __len__(self) -> int:
        return len(self.index)

    def subset(self, k: np.ndarray) -> StepTokens:
        return StepTokens(self.req_ids, self.req[k], self.index[k], self.position[k], self.slot[k], self.sync[k],
                          self.record[k], self.host[k], self.act[k], self.signature[k],
                          None if self.steers is None else self.steers[:, k])

    def moved(self, position: np.ndarray) -> StepTokens:
        """The same tokens at ``position`` (a steady decode's next step); every other array shared."""
        return StepTokens(self.req_ids, self.req, self.index, position, self.slot, self.sync, self.record, self.host,
                          self.act, self.signature, self.steers)

    def gate_bits(self, G: int) -> np.ndarray:
        """``[G, n]`` bool: gate slot ``g`` of token ``k`` steers (``steers`` when it was computed for ``G``)."""
        if self.steers is not None and self.steers.shape[0] == G:
            return self.steers
        return gate_bits(self.act, G)

    @classmethod
    def empty(cls) -> StepTokens:
        i, b = np.zeros(0, np.int64), np.zeros(0, bool)
        return cls((), i, i, i, i, b, i, b, i, np.zeros(0, object))


class ActedReport(NamedTuple):
    """One read-back's report of where dynamic steering acted, a column per request (numpy, built without a Python
    loop; pickles as a few arrays between processes).

    ``ids[req[i]]`` read back positions ``lo[i] .. upto[i] - 1`` (contiguous); steering first acted at
    ``acted_at[i]`` (``-1``: nowhere in them) under ``signature[i]``. ``ids`` is the step's id tuple, shared, not
    copied.
    """

    ids: tuple[str, ...]
    req: np.ndarray
    lo: np.ndarray
    upto: np.ndarray
    acted_at: np.ndarray
    signature: np.ndarray

    def __len__(self) -> int:
        return len(self.req)

    def to_fold(self, block: int) -> list[int]:
        """The columns that can change what the engine core hashes with blocks of ``block`` tokens: steering acted,
        or the read-back reached the end of a block (``upto`` a multiple of ``block`` in ``lo + 1 .. upto``). A
        column that does neither only moves ``reported`` within a block that is not complete: no block's hash
        changes or becomes due."""
        return np.flatnonzero((self.acted_at >= 0) | (self.upto // block > self.lo // block)).tolist()

    def rows(self, cols: list[int]) -> list[tuple[str, int, int, str]]:
        """``(request id, upto, acted_at, signature)`` of ``cols``, as Python values."""
        ids, req, upto, at, sig = self.ids, self.req, self.upto, self.acted_at, self.signature
        return [(ids[req[k]], int(upto[k]), int(at[k]), str(sig[k])) for k in cols]


def acted_report(tok: StepTokens, host: np.ndarray, G: int) -> ActedReport:
    """What a read-back of ``tok`` (``host``: its values) says about where steering acted: one column per request
    (``acted_at``: the first position at which a steering gate was applied non-zero). Vectorised over the step's
    tokens (a request's tokens are contiguous, in position order)."""
    acted = ((host[G:2 * G] != 0) & tok.gate_bits(G)).any(axis=0)
    req, position = tok.req, tok.position
    if len(req) < 2 or (req[1:] != req[:-1]).all():  # one token per request (a decode step): no grouping
        return ActedReport(tok.req_ids, req, position, position + 1, np.where(acted, position, -1), tok.signature)
    starts = np.flatnonzero(np.r_[True, req[1:] != req[:-1]])
    upto = np.maximum.reduceat(position, starts) + 1
    never = np.iinfo(np.int64).max
    first = np.minimum.reduceat(np.where(acted, position, never), starts)
    first[first == never] = -1
    return ActedReport(tok.req_ids, req[starts], np.minimum.reduceat(position, starts), upto, first,
                       tok.signature[starts])


def gate_bits(act: np.ndarray, G: int) -> np.ndarray:
    """``[G, n]`` bool: gate slot ``g`` of token ``k`` steers (bit ``g`` of ``act[k]``)."""
    return (act[None, :] >> np.arange(G, dtype=np.int64)[:, None]) & 1 != 0
