"""An on-disk FIFO of messages, for subscribers whose overload policy is ``spill``.

Messages (each a sequence number and a list of byte frames) are appended to segment files of about
:data:`SEGMENT_BYTES`; a record is ``<seq u64><n u32>``, ``n`` frame lengths (u64) and the frames. The queue's order
is exactly the order of :meth:`SpillRing.push`. A segment is deleted once every record in it was popped, and all files
go when the ring empties, so the disk holds at most ``max_bytes`` of queued records plus one partly consumed segment.
Rings may share a :class:`SpillBudget`, which bounds their queued records together. Nothing survives
:meth:`SpillRing.close` (or a crash: the files are scratch space, not a journal).

Not thread-safe: one thread (the hub's I/O thread) owns a ring and its budget.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

logger = logging.getLogger("dynsteer")
SEGMENT_BYTES = 4 << 20
_RECORD = struct.Struct("<QI")
_LENGTH = struct.Struct("<Q")


class _Entry(NamedTuple):
    seq: int
    segment: int
    offset: int
    size: int


class SpillBudget:
    """Bytes of queued records that several rings may hold together (a hub's ``spill_total_bytes``)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("spill budget: max_bytes must be >= 0")
        self.max_bytes, self.used = max_bytes, 0


class SpillRing:
    """Append-only FIFO of ``(seq, frames)`` records on disk under ``directory`` (created ``0700``).

    Args:
        directory: a folder for this ring alone (its segment files are ``seg-<n>``).
        max_bytes: most bytes of queued records; :meth:`push` refuses a record that would pass it.
        segment_bytes: a new segment file is started once the current one holds this much.
        budget: shared with other rings; :meth:`push` also refuses a record that would pass it.
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int,
                 segment_bytes: int = SEGMENT_BYTES, budget: SpillBudget | None = None) -> None:
        if max_bytes < 1 or segment_bytes < 1:
            raise ValueError("spill ring: max_bytes and segment_bytes must be >= 1")
        self.directory, self.max_bytes, self.segment_bytes = os.fspath(directory), max_bytes, segment_bytes
        self.budget = budget
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        os.chmod(self.directory, 0o700)  # activations on disk: ours alone, whatever the umask
        self._index: deque[_Entry] = deque()
        self._fds: dict[int, int] = {}  # open segment files, oldest first
        self._write_segment, self._write_offset = -1, 0
        self._nbytes = 0
        self._peeked: tuple[int, list[memoryview]] | None = None

    def __len__(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        """Bytes of the queued records (what ``max_bytes`` bounds)."""
        return self._nbytes

    @property
    def head_seq(self) -> int | None:
        """Seq of the oldest queued record, without reading it."""
        return self._index[0].seq if self._index else None

    def seqs(self) -> Iterator[int]:
        """The queued records' seqs, oldest first."""
        return (e.seq for e in self._index)

    def push(self, seq: int, frames: Sequence[Any]) -> bool:
        """Append a record; False (nothing stored) if it would pass ``max_bytes`` or the budget, or the disk refuses
        it."""
        views = [memoryview(f).cast("B") if not isinstance(f, bytes) else f for f in frames]
        head = _RECORD.pack(seq, len(views)) + b"".join(_LENGTH.pack(len(v)) for v in views)
        size = len(head) + sum(len(v) for v in views)
        if self._nbytes + size > self.max_bytes:
            return False
        if self.budget is not None and self.budget.used + size > self.budget.max_bytes:
            return False
        if self._write_segment < 0 or self._write_offset >= self.segment_bytes:
            self._open_segment()
        fd = self._fds[self._write_segment]
        try:
            _pwrite_all(fd, [head, *views], self._write_offset)
        except OSError as exc:  # a full disk loses this record, not the hub: the caller counts it dropped
            logger.warning("spill ring %s: write failed (%s); record %d not stored", self.directory, exc, seq)
            return False
        self._index.append(_Entry(seq, self._write_segment, self._write_offset, size))
        self._write_offset += size
        self._charge(size)
        return True

    def peek(self) -> tuple[int, list[memoryview]] | None:
        """The oldest record as ``(seq, frames)`` (frames view one buffer read from disk), or None when empty."""
        if not self._index:
            return None
        if self._peeked is None:
            entry = self._index[0]
            data = memoryview(_pread_all(self._fds[entry.segment], entry.size, entry.offset))
            seq, count = _RECORD.unpack_from(data)
            pos = _RECORD.size + count * _LENGTH.size
            frames = []
            for i in range(count):
                (length,) = _LENGTH.unpack_from(data, _RECORD.size + i * _LENGTH.size)
                frames.append(data[pos:pos + length])
                pos += length
            self._peeked = (seq, frames)
        return self._peeked

    def pop(self) -> None:
        """Drop the oldest record (deleting its segment once nothing in it is queued)."""
        entry = self._index.popleft()
        self._charge(-entry.size)
        self._peeked = None
        next_segment = self._index[0].segment if self._index else None
        if next_segment != entry.segment and (entry.segment != self._write_segment or next_segment is None):
            self._remove_segment(entry.segment)
            if entry.segment == self._write_segment:
                self._write_segment = -1  # empty: the next push starts a fresh segment

    def close(self) -> None:
        """Delete every segment file, and the directory if nothing else is in it."""
        for segment in list(self._fds):
            self._remove_segment(segment)
        self._index.clear()
        self._charge(-self._nbytes)
        self._peeked, self._write_segment = None, -1
        try:
            os.rmdir(self.directory)
        except OSError:
            pass

    def _charge(self, size: int) -> None:
        self._nbytes += size
        if self.budget is not None:
            self.budget.used += size

    def _path(self, segment: int) -> str:
        return os.path.join(self.directory, f"seg-{segment:08d}")

    def _open_segment(self) -> None:
        segment = max(self._fds, default=self._write_segment) + 1
        self._fds[segment] = os.open(self._path(segment), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._write_segment, self._write_offset = segment, 0

    def _remove_segment(self, segment: int) -> None:
        os.close(self._fds.pop(segment))
        try:
            os.unlink(self._path(segment))
        except FileNotFoundError:
            pass


def _pwrite_all(fd: int, buffers: list[Any], offset: int) -> None:
    pending = [memoryview(b).cast("B") for b in buffers if len(b)]
    while pending:
        written = os.pwritev(fd, pending[:64], offset)  # IOV_MAX bounds one call
        if written == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += written
        while written:
            if written >= len(pending[0]):
                written -= len(pending.pop(0))
            else:
                pending[0], written = pending[0][written:], 0


def _pread_all(fd: int, size: int, offset: int) -> bytearray:
    data = bytearray(size)
    view, done = memoryview(data), 0
    while done < size:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise OSError(errno.EIO, f"spill segment ended early at offset {offset + done}")
        done += got
    return data
