"""What a capturing step carries from its plan to its landing: the streams' selections, the batch composition of a
steady decode step, and the step's copy to host in flight."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dynsteer.capture.names import Place
from dynsteer.capture.record import CaptureRecord

if TYPE_CHECKING:
    import torch


# numpy has no bfloat16: a bfloat16 stream's rows are rounded on the device and travel as their 16 bits (half the
# bytes of float32); the monitor client widens them back to float32 (``dynsteer.monitor.client.StreamFrame``).
BF16_BITS = "bfloat16-bits"


def stream_wire_dtype(dtype: str) -> str:
    """The collector's key for a stream of ``dtype`` (``StreamSpec.dtype``): what its rows are copied out as."""
    return BF16_BITS if dtype == "bfloat16" else dtype


def stream_spec_dtype(wire: str) -> str:
    """``StreamSpec.dtype`` of a collector key (what a frame's header names)."""
    return "bfloat16" if wire == BF16_BITS else wire


@dataclass
class StreamSelection:
    """One stream's rows of one step (the async tier): batch tokens ``tokens`` of requests ``req_ids[req]``."""

    name: str
    step: int
    places: tuple[Place, ...]
    dtype: str  # the collector's key: :func:`stream_wire_dtype` of the stream's dtype
    tokens: np.ndarray  # batch token indices (int64)
    req: np.ndarray  # int32 index into req_ids, per token
    positions: np.ndarray  # int64 absolute positions
    req_ids: list[str]
    rows: np.ndarray | None = None  # capture rows of the step, set by the collector


@dataclass
class PendingCopy:
    """A step's captured rows on their way to host memory, landed once ``event`` has completed (``None``: already
    on the host)."""

    event: Any
    host: dict[tuple[Place, str], torch.Tensor]  # (place, spec dtype) -> rows of this step (pinned on GPU)
    positions: np.ndarray
    segments: list[tuple[CaptureRecord, int, int]]  # (record, start, end) into the step's rows
    streams: list[StreamSelection] = field(default_factory=list)
    batch: BatchCapture | None = None  # a batched decode step: its records own rows batch_base + 0, 1, ...
    batch_base: int = 0


@dataclass
class BatchCapture:
    """The capturing requests of one batch composition, as arrays, for decode steps without per-request Python:
    request ``idx[i]`` of the batch is ``recs[i]``, whose next position is ``high[i] + 1``."""

    ids: tuple[str, ...]
    version: int
    idx: np.ndarray  # batch indices of the capturing requests (int64)
    recs: list[CaptureRecord]
    high: np.ndarray  # each record's ledger high, advanced here by batched steps, written back by sync()
    generated_only: np.ndarray  # the record selects generated positions only (else every position)
    prompt_len: np.ndarray
    batched: bool  # every record's selector is "all" or "all_generated" (others take the per-request path)
    split: np.ndarray  # indices into recs of records the writer thread splits (split_off)
    split_recs: list[CaptureRecord]
    main: list[tuple[int, CaptureRecord]]  # the others, handled on the host path
    wanted: set[tuple[Place, str]]
    dirty: bool = False  # high moved since the ledgers were written

    def sync(self) -> None:
        """Write the batched steps' positions back into the records' ledgers."""
        if self.dirty:
            for rec, high in zip(self.recs, self.high.tolist()):
                rec.ledger.high = high
            self.dirty = False
