"""A step's dynamic decode tokens, as the runtime gathers them for the driver, and what a read-back of them says
about where steering acted (the engine core folds it into prefix-cache block hashes)."""

from __future__ import annotations

from dataclasses import dataclass

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

    def __len__(self) -> int:
        return len(self.index)

    def subset(self, k: np.ndarray) -> StepTokens:
        return StepTokens(self.req_ids, self.req[k], self.index[k], self.position[k], self.slot[k], self.sync[k],
                          self.record[k], self.host[k], self.act[k], self.signature[k])

    @classmethod
    def empty(cls) -> StepTokens:
        i, b = np.zeros(0, np.int64), np.zeros(0, bool)
        return cls((), i, i, i, i, b, i, b, i, np.zeros(0, object))


def acted_report(tok: StepTokens, host: np.ndarray, G: int) -> tuple[list[str], list[int], list[int], list[str]]:
    """Per request of one read-back: ``(ids, upto, acted_at, signature)``: every position ``< upto`` is reported;
    ``acted_at`` is the first position at which a steering gate was applied non-zero (``-1``: none). Vectorised
    over the step's tokens (a request's tokens are contiguous)."""
    acted = ((host[G:2 * G] != 0) & _gate_bits(tok.act, G)).any(axis=0)
    req, position = tok.req, tok.position
    if len(req) < 2 or (req[1:] != req[:-1]).all():  # one token per request (a decode step): no grouping
        ids = [tok.req_ids[i] for i in req.tolist()]
        return ids, (position + 1).tolist(), np.where(acted, position, -1).tolist(), tok.signature.tolist()
    starts = np.flatnonzero(np.r_[True, req[1:] != req[:-1]])
    upto = np.maximum.reduceat(position, starts) + 1
    never = np.iinfo(np.int64).max
    first = np.minimum.reduceat(np.where(acted, position, never), starts)
    first[first == never] = -1
    ids = [tok.req_ids[i] for i in req[starts].tolist()]
    return ids, upto.tolist(), first.tolist(), tok.signature[starts].tolist()


def _gate_bits(act: np.ndarray, G: int) -> np.ndarray:
    """``[G, n]`` bool: gate slot ``g`` of token ``k`` steers (bit ``g`` of ``act[k]``)."""
    return (act[None, :] >> np.arange(G, dtype=np.int64)[:, None]) & 1 != 0
