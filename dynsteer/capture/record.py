"""A request's capture record: the rows landed for it, in worker memory or in a shared-memory spool, and how they
are read back in position order."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dynsteer.capture.names import Place
from dynsteer.capture.select import PositionLedger
from dynsteer.capture.spec import CaptureSpec
from dynsteer.capture.spool import WRITER, Spool, SpoolError

logger = logging.getLogger("dynsteer")


@dataclass
class CaptureRecord:
    """Everything captured for one request. ``status`` is ``ok``, ``partial`` (a consumer failed) or ``error``.

    Rows arrive in chunks (one per step that computed selected positions). With a ``spool`` (records the ``memory``
    consumer delivers, when ``/dev/shm`` is usable) each chunk is appended to the spool's files at once, so the
    finished record is already in the layout the caller maps; otherwise a chunk references the step's arrays,
    which several requests share (one append whatever the number of places). A spool that fails (``/dev/shm``
    full) is read back into memory and the record goes on without one.
    """

    tag: str
    req_id: str
    spec: CaptureSpec
    prompt_len: int
    positions: list[np.ndarray] = field(default_factory=list)
    status: str = "ok"
    errors: list[str] = field(default_factory=list)
    ledger: PositionLedger = field(default_factory=PositionLedger)
    chunks: int = 0
    streaming: bool = False  # a consumer of this record wants chunks as they land
    # Its chunks are counted and written by the spool's writer thread, from a step's rows as a whole (a spool, no
    # streaming consumer); fixed at begin, so a spool is never reserved from two threads.
    split_off: bool = False
    # consumer name -> how far it got: "delivered" (held for the caller), "written" (fsynced to disk), "queued"
    # (handed to ZeroMQ; not confirmed by a receiver). A consumer that failed has no entry.
    deliveries: dict[str, str] = field(default_factory=dict)
    spool: Spool | None = field(default=None, repr=False)
    _parts: list[tuple[Mapping[Place, np.ndarray], int, int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.places = tuple(self.spec.places())
        self.selector = self.spec.positions
        self.explicit = None if isinstance(self.selector, str) else frozenset(self.selector)

    def add_chunk(self, positions: np.ndarray, arrays: Mapping[Place, np.ndarray], start: int = 0,
                  end: int | None = None, batch: list | None = None) -> None:
        """Land rows ``[start, end)`` of ``arrays`` (one ``[rows, hidden]`` array per place) at ``positions``.
        With a spool, ``batch`` collects the writer's entry (the caller submits a step's entries at once);
        without one, the chunk is queued here."""
        end = start + len(positions) if end is None else end
        if self.spool is not None:
            try:
                entry = self.spool.reserve(arrays, start, end, self.places)
            except (OSError, ValueError) as exc:
                self._unspool(exc)
            else:
                if batch is not None:
                    batch.append(entry)
                elif entry is not None:
                    WRITER.submit([entry])
                self.positions.append(positions)
                self.chunks += 1
                return
        self.positions.append(positions)
        self._parts.append((arrays, start, end))
        self.chunks += 1

    def settle(self) -> None:
        """Wait for the spool's queued writes; if one failed, its rows move to worker memory (nothing is lost)."""
        if self.spool is not None:
            try:
                self.spool.flush()
            except SpoolError as exc:
                self._unspool(exc)

    def _unspool(self, exc: BaseException) -> None:
        """The spool failed: the rows it wrote and the chunks it did not become in-memory parts, ahead of any
        other (the spool held every chunk before this), and the record goes on without it."""
        spool, self.spool = self.spool, None
        try:
            spool.flush()
            written, unwritten = spool.rows, []
        except SpoolError as err:
            exc, written, unwritten = err.cause, err.written, err.unwritten
        logger.warning("dynsteer capture %s: spooling to shared memory failed (%s); keeping rows in worker memory",
                       self.tag, exc)
        head = [({place: spool.read(place, written) for place in self.places}, 0, written)] if written else []
        head += [(chunk, 0, len(next(iter(chunk.values())))) for chunk in unwritten]
        self._parts[:0] = head
        spool.discard()

    @property
    def spooled(self) -> bool:
        """Whether every row goes to the spool (none is held in worker memory)."""
        return self.spool is not None and not self._parts

    def _rows(self, place: Place) -> list[np.ndarray]:
        """One place's rows, chunk runs in landing order (the spool's first: a failed spool precedes memory)."""
        self.settle()
        head = [self.spool.read(place)] if self.spool is not None and self.spool.rows else []
        return head + [arrays[place][s:e] for arrays, s, e in self._parts]

    @property
    def nbytes(self) -> int:
        """Bytes of the captured data (positions and every place's rows; shared step arrays count their rows only)."""
        rows = sum(arrays[place][s:e].nbytes for arrays, s, e in self._parts for place in self.places)
        if self.spool is not None:
            for place in self.places:
                dtype, hidden = self.spool.layout(place) or (np.dtype(np.float32), 0)
                rows += self.spool.rows * hidden * dtype.itemsize
        return rows + sum(p.nbytes for p in self.positions)

    def layout(self) -> tuple[int, dict[Place, tuple[tuple[int, ...], np.dtype]]]:
        """Rows captured so far, and the shape and dtype of each place's array (for callers that allocate)."""
        n = sum(e - s for _, s, e in self._parts) + (self.spool.rows if self.spool is not None else 0)
        out = {}
        for place in self.places:
            known = self.spool.layout(place) if self.spool is not None else None
            if known is None:
                first = next((arrays[place] for arrays, _, _ in self._parts), None)
                known = (first.dtype, first.shape[1]) if first is not None else None
            out[place] = ((n, known[1]), known[0]) if known is not None else ((0, 0), np.dtype(np.float32))
        return n, out

    def arrays(self, into: Callable[[tuple[int, ...], np.dtype], np.ndarray] = np.empty
               ) -> tuple[np.ndarray, dict[Place, np.ndarray]]:
        """Positions (sorted) and one ``[n, hidden]`` array per place, rows in position order.

        Args:
            into: allocates each result (``(shape, dtype) -> array``), e.g. views of a shared-memory file; rows
                that landed in order (the usual case) are copied straight into it, once.
        """
        pos = np.concatenate(self.positions) if self.positions else np.zeros(0, np.int64)
        in_order = bool((pos[1:] > pos[:-1]).all())
        order = None if in_order else np.argsort(pos, kind="stable")
        positions = into(pos.shape, pos.dtype)
        positions[:] = pos if in_order else pos[order]
        out = {}
        for place, (shape, dtype) in self.layout()[1].items():
            dst = out[place] = into(shape, dtype)
            parts = self._rows(place)
            if parts and in_order:
                np.concatenate(parts, out=dst)
            elif parts:
                dst[:] = np.concatenate(parts)[order]
        return positions, out

    def fail(self, message: str, status: str = "partial") -> None:
        self.status = status if self.status == "ok" else self.status
        self.errors.append(message)
        logger.error("dynsteer capture %s: %s", self.tag, message)


def split_step(positions: np.ndarray, by_dtype: dict[str, dict[Place, np.ndarray]], recs: list[CaptureRecord],
               starts: list[int], ends: list[int]) -> Iterator[tuple]:
    """Spool writer thread: land each record's rows ``[start, end)`` of a step (their positions, and their spool's
    next chunk, whose write entry is yielded, to be written before the next record is landed: each write releases
    the GIL). A spool that cannot take a chunk keeps it, and every later one, in memory; the record's owner finds
    them at ``settle``."""
    for rec, start, end in zip(recs, starts, ends):
        arrays = by_dtype[rec.spec.dtype]
        rec.positions.append(positions[start:end])
        rec.chunks += 1
        entry = rec.spool.take(arrays, start, end, rec.places)
        if entry is not None:
            yield entry
