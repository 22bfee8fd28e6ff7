"""Per-request arrays of one batch composition, gathered once and reused while the composition and the runtime's
request state are unchanged: a steady decode step does no per-request Python."""

from __future__ import annotations

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

    @classmethod
    def gather(cls, ids: tuple[str, ...], entries: list[RequestEntry], version: int, rows: np.ndarray,
               stream_specs: dict[str, StreamSpec]) -> BatchArrays:
        """The arrays of ``entries`` (the batch's requests in order, holding ``rows``) at runtime ``version``."""
        n = len(ids)
        dyn = [e.dyn if e.dyn is not None and e.rows[1] != 0 else None for e in entries]
        return cls(
            ids=ids, version=version, rows=rows,
            prompt_lens=np.fromiter((e.prompt_len for e in entries), np.int64, n), steered=bool(rows.any()),
            dyn=np.array([st is not None for st in dyn], bool).reshape(n),
            slot=np.array([-1 if st is None or st.device_slot is None else st.device_slot for st in dyn], np.int64),
            sync=np.array([st is not None and st.sync for st in dyn], bool).reshape(n),
            record=np.array([-1 if st is None or st.record is None else st.record for st in dyn], np.int64),
            host=np.array([st is not None and st.tier == "host" for st in dyn], bool).reshape(n),
            act=np.array([0 if st is None else st.act_mask for st in dyn], np.int64),
            signature=np.array([e.decode.digest.hex() for e in entries] + [None], object)[:n],
            prompt=np.array([st is not None and st.prompt_level for st in dyn], bool).reshape(n),
            streams={name: _stream_mask(spec, entries) for name, spec in stream_specs.items()})


def _stream_mask(spec: StreamSpec, entries: list[RequestEntry]) -> np.ndarray:
    """Which of a batch's requests a stream publishes (its ``requests`` filter)."""
    if spec.requests == "all":
        return np.ones(len(entries), bool)
    if spec.requests == "dynamic":
        return np.array([e.dyn is not None for e in entries], bool).reshape(len(entries))
    prefix = spec.tag_prefix or ""
    return np.array([e.tag is not None and e.tag.startswith(prefix) for e in entries], bool).reshape(len(entries))
