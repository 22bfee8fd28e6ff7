"""The row pool: which table row holds which compiled configuration, shared between the requests that use it.

Rows are deduplicated by configuration digest (content-addressed: the digest covers every value written) and
reference-counted. A row whose last request finishes keeps its content, *idle*, until a new configuration needs a
row and no never-used row is left (then the least recently released idle row is reused). Traffic drawing on a fixed
catalogue of per-request configurations therefore writes each configuration's tables once, not once per request:
a revived row costs a dictionary lookup, where writing one costs a host-to-device upload and a scatter on the
device (~0.4 ms of host time per configuration on an 8B model's 96 sites).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from dynsteer.request.programs import RowContent


class RowsExhausted(RuntimeError):
    """Every table row holds a live configuration; raise the engine's ``max_rows``."""


@dataclass
class _Row:
    index: int
    refs: int


class RowPool:
    """Rows by configuration digest, reference-counted; row 0 (the empty configuration) is never handed out.

    Args:
        num_rows: rows of the tables, row 0 included.
    """

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, 0, -1))  # never written (or written with nothing live since)
        self._by_digest: dict[bytes, _Row] = {}  # live and idle rows
        self._idle: OrderedDict[bytes, _Row] = OrderedDict()  # refs == 0, least recently released first
        self.revived = 0  # acquisitions served by an idle row's content (no table write)
        # acquisitions that wrote a row (a never-used one, or an idle row evicted): more live configurations in
        # rotation than rows show as this growing at every pass over the catalogue (LRU eviction then rewrites the
        # row each configuration is about to need)
        self.written = 0

    def acquire(self, content: RowContent) -> tuple[int, bool]:
        """The row holding ``content`` and whether it is new (its tables must be written)."""
        if content.empty:
            return 0, False
        row = self._by_digest.get(content.digest)
        if row is not None:
            if row.refs == 0:
                del self._idle[content.digest]
                self.revived += 1
            row.refs += 1
            return row.index, False
        if self._free:
            index = self._free.pop()
        elif self._idle:  # reuse the least recently released configuration's row
            digest, old = self._idle.popitem(last=False)
            del self._by_digest[digest]
            index = old.index
        else:
            raise RowsExhausted(f"no free steering row: all {self.num_rows - 1} rows hold distinct live "
                                f"configurations (raise DynsteerConfig.max_rows)")
        self._by_digest[content.digest] = _Row(index, 1)
        self.written += 1
        return index, True

    def release(self, digest: bytes) -> None:
        """One request (or global setting) no longer uses the configuration ``digest``."""
        if not digest:
            return
        row = self._by_digest[digest]
        row.refs -= 1
        if row.refs == 0:
            self._idle[digest] = row  # keeps its content until a new configuration needs the row

    @property
    def in_use(self) -> int:
        """Rows holding a live configuration (idle rows not counted)."""
        return len(self._by_digest) - len(self._idle)

    @property
    def idle(self) -> int:
        """Rows keeping a released configuration for reuse."""
        return len(self._idle)
