"""Per-request arrays of one batch composition, gathered once and reused while the composition and the runtime's
request state are unchanged: a steady decode step does no per-request Python. When only the composition changes
(requests finish and join, as in serving), each request's values come from a per-request cache (:class:`Columns`),
so a new composition costs one tuple per request and a few array builds."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from dynsteer.steering.requests import RequestEntry

if TYPE_CHECKING:
    from dynsteer.config import StreamSpec


@dataclass
class BatchArrays:
    ids: tuple[str, ...]
    version: int
    rows: np.ndarray  # [n, 2] prefill and decode row
    prompt_lens: np.ndarray
    steered: bool  # any row is not 0
    dyn: np.ndarray  # a dynamic policy steers its decode tokens
    slot: np.ndarray  # device sync-tier slot (-1: none)
    sync: np.ndarray
    record: np.ndarray  # read-back record slot (-1: none)
    host: np.ndarray  # host sync tier
    act: np.ndarray  # bitmask of gate slots that steer (rules with actions)
    signature: np.ndarray  # object: decode configuration digest (hex)
    prompt: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # prompt-level gates (held per request)
    streams: dict[str, np.ndarray] = field(default_factory=dict)  # stream -> which requests it publishes


#: one request's integer values in a batch's arrays, packed once (a batch's are joined and viewed as an array):
#: prefill row, decode row, prompt length, dynamic, device slot, sync tier, record slot, host tier, act mask,
#: prompt-level gates
_PACK = struct.Struct("=10q")


def request_columns(e: RequestEntry) -> tuple[bytes, str]:
    """One request's values in a batch's arrays (packed as :data:`_PACK`) and its decode signature."""
    st = e.dyn if e.dyn is not None and e.rows[1] != 0 else None
    r0, r1 = e.rows
    if st is None:
        nums = (r0, r1, e.prompt_len, 0, -1, 0, -1, 0, 0, 0)
    else:
        nums = (r0, r1, e.prompt_len, 1, -1 if st.device_slot is None else st.device_slot, int(bool(st.sync)),
                -1 if st.record is None else st.record, int(st.tier == "host"), st.act_mask, int(st.prompt_level))
    return _PACK.pack(*nums), e.decode.digest.hex()


class Columns:
    """Each live request's :func:`request_columns`, valid while the runtime's request state is at one ``stamp``.

    The runtime bumps its state stamp on every change of a request's rows or dynamic state (then every request's
    values are made again), except for changes that concern only requests whose values are not kept: one admitted
    while a batch is gathered, one released (its values are forgotten; a resumed request is admitted again)."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[bytes, str]] = {}
        self.stamp = -1

    def begin(self, stamp: int) -> None:
        """Before a batch's admissions: drop every request's values if the state changed since they were made."""
        if stamp != self.stamp:
            self.values.clear()
            self.stamp = stamp

    def forget(self, req_id: str) -> None:
        self.values.pop(req_id, None)

    def gather(self, ids: tuple[str, ...], entries: list[RequestEntry], stamp: int, version: int,
               stream_specs: dict[str, StreamSpec]) -> BatchArrays:
        """The batch's arrays (``entries``: its requests in order, all admitted; ``stamp``: the state stamp after
        their admission, which changed only the admitted requests' values)."""
        self.stamp = stamp
        values, n = self.values, len(ids)
        got = [values.get(r) for r in ids]
        for i in [i for i, v in enumerate(got) if v is None]:  # the requests admitted since
            got[i] = values[ids[i]] = request_columns(entries[i])
        nums = np.frombuffer(b"".join([v[0] for v in got]), np.int64).reshape(n, _PACK.size // 8).T
        rows = np.ascontiguousarray(nums[:2].T, np.int32)
        return BatchArrays(
            ids=ids, version=version, rows=rows, prompt_lens=nums[2].copy(), steered=bool(rows.any()),
            dyn=nums[3] != 0, slot=nums[4].copy(), sync=nums[5] != 0, record=nums[6].copy(), host=nums[7] != 0,
            act=nums[8].copy(), signature=np.array([v[1] for v in got] + [None], object)[:n], prompt=nums[9] != 0,
            streams={name: _stream_mask(spec, entries) for name, spec in stream_specs.items()})


def _stream_mask(spec: StreamSpec, entries: list[RequestEntry]) -> np.ndarray:
    """Which of a batch's requests a stream publishes (its ``requests`` filter)."""
    if spec.requests == "all":
        return np.ones(len(entries), bool)
    if spec.requests == "dynamic":
        return np.array([e.dyn is not None for e in entries], bool).reshape(len(entries))
    prefix = spec.tag_prefix or ""
    return np.array([e.tag is not None and e.tag.startswith(prefix) for e in entries], bool).reshape(len(entries))
