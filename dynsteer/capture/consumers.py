"""Where finished captures go: kept in memory for the caller, written to disk, sent over ZeroMQ
(``dynsteer.capture.zmq_consumer``), or handed to third-party consumers.

A consumer that raises marks the record ``partial`` and never aborts generation. Third-party consumers register
under the entry-point group ``dynsteer.capture_consumers`` (a class taking ``**options``). A consumer whose class sets
``background = True`` (``filesystem``, ``zmq``) is called on the worker's consumer thread
(:mod:`dynsteer.capture.consumer_thread`), off the engine's step; others are called on the step path and must be
quick.

Every file lies under the consumer's root: a tag must match :data:`~dynsteer.capture.names.SAFE_TAG` (one path
component) and the resolved path is checked against the root, so a client's tag never names a path elsewhere.

File layouts (all writes are temp + rename, so a reader never sees half a file; a killed writer may leave
``.*.tmp`` files, a ``.bin`` without its index or bytes past a shard's indexed end, which
:class:`~dynsteer.capture.reader.CaptureReader` ignores, lists and cleans):

- ``per_file``: ``<root>/<tag>/<layer>.<site>.<chunk>.npz`` (``positions``, ``values``) written as chunks arrive, so a
  running request is already readable; ``<root>/<tag>/manifest.json`` appears when it is complete.
- ``packed``: ``<root>/<tag>.bin`` (all arrays back to back) + ``<root>/<tag>.json`` (the index), index written last.
- ``sharded``: many requests per ``<root>/shard-NNNNN.bin`` with ``shard-NNNNN.json`` rewritten atomically after
  each append (bytes past the indexed end are invisible); a new shard starts past ``shard_bytes``. Writers (threads
  or processes) sharing a folder take ``<root>/.shards.lock`` around each append, so none loses or mixes records.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from filelock import FileLock

from dynsteer.capture.names import Place, check_tag, place_key
from dynsteer.capture.record import CaptureRecord
from dynsteer.memo import resident_bytes

logger = logging.getLogger("dynsteer")
ENTRY_POINT_GROUP = "dynsteer.capture_consumers"
LAYOUTS = ("per_file", "packed", "sharded")
SHARD_LOCK = ".shards.lock"
SHARD_NAME = re.compile(r"shard-(\d+)\.(json|bin)")
# Tags the reader would take for something else: a shard index, or a pipeline stage's folder.
_RESERVED_TAG = re.compile(r"shard-\d+|pp\d+")


class CaptureConsumer(Protocol):
    """Receives a record when its request finishes (and, optionally, chunks as they arrive). Optional class
    attribute ``background``: True to be called off the engine's step, on the consumer thread."""

    name: str

    def on_finish(self, record: CaptureRecord) -> None: ...


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (a killed writer leaves only a ``.<name>.*.tmp`` file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fsync_dir(path: Path) -> None:
    """Make renames and creations in ``path`` durable (the files' own fsync does not cover their names)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _npz_bytes(**arrays: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _meta(record: CaptureRecord) -> dict[str, Any]:
    return {"tag": record.tag, "status": record.status, "errors": record.errors, "prompt_len": record.prompt_len,
            "spec": record.spec.model_dump(mode="json")}


class MemoryConsumer:
    """Keeps finished records until the caller takes them, within bounds: records nobody takes (e.g. requests sent
    over HTTP) expire after ``ttl_s``, and past ``max_records`` or ``max_bytes`` the oldest are evicted; both are
    counted and logged, never silent.

    Args:
        max_records: records held at most.
        ttl_s: seconds a record waits to be taken before it is dropped.
        max_bytes: bytes held at most: captured data, and what each record keeps of its request (its capture
            spec: a long explicit position list weighs more than the rows it may capture); a record larger than
            this alone is dropped too.
    """

    name = "memory"

    def __init__(self, max_records: int = 4096, ttl_s: float = 600.0, max_bytes: int = 1 << 30) -> None:
        self.max_records, self.ttl_s, self.max_bytes = max_records, ttl_s, max_bytes
        self.records: OrderedDict[str, CaptureRecord] = OrderedDict()
        self._held: dict[str, tuple[float, int]] = {}  # tag -> (monotonic time stored, bytes)
        self.bytes = 0
        self.evicted = self.evicted_bytes = 0
        self.expired = self.expired_bytes = 0
        # the weight of the last specs seen: requests of one batch share theirs (a global spec, or one payload
        # decoded once), and walking one costs tens of microseconds per finishing request; specs are frozen, and
        # each entry holds its spec so that its id is not reused while cached
        self._spec_bytes: OrderedDict[int, tuple[Any, int]] = OrderedDict()

    def _weigh_spec(self, spec: Any) -> int:
        hit = self._spec_bytes.get(id(spec))
        if hit is not None and hit[0] is spec:
            self._spec_bytes.move_to_end(id(spec))
            return hit[1]
        size = resident_bytes(spec)
        self._spec_bytes[id(spec)] = (spec, size)
        if len(self._spec_bytes) > 64:
            self._spec_bytes.popitem(last=False)
        return size

    def on_finish(self, record: CaptureRecord) -> None:
        self._pop(record.tag)  # a repeated tag replaces the old record, which moves to the back
        size = record.nbytes + self._weigh_spec(record.spec)
        self.records[record.tag] = record
        self._held[record.tag] = (time.monotonic(), size)
        self.bytes += size
        self.expire()
        while self.records and (len(self.records) > self.max_records or self.bytes > self.max_bytes):
            tag = next(iter(self.records))
            dropped = self._pop(tag)
            self.evicted += 1
            self.evicted_bytes += dropped
            logger.error("dynsteer capture: memory store over its bounds (max_records=%d, max_bytes=%d); evicted the "
                         "oldest record %s (%d bytes)", self.max_records, self.max_bytes, tag, dropped)
        if self.records.get(record.tag) is record:  # not evicted at once (alone larger than max_bytes)
            record.deliveries[self.name] = "delivered"

    def take(self, tag: str) -> CaptureRecord | None:
        self.expire()
        record = self.records.get(tag)
        self._pop(tag)
        return record

    def expire(self) -> int:
        """Drop records older than ``ttl_s`` (oldest first); returns how many."""
        deadline, n = time.monotonic() - self.ttl_s, 0
        while self.records:
            tag = next(iter(self.records))
            if self._held[tag][0] >= deadline:
                break  # insertion order is age order
            dropped = self._pop(tag)
            self.expired += 1
            self.expired_bytes += dropped
            n += 1
            logger.error("dynsteer capture: record %s (%d bytes) not taken within ttl_s=%.0f s; dropped", tag, dropped,
                         self.ttl_s)
        return n

    def _pop(self, tag: str) -> int:
        """Forget ``tag``'s record; returns its bytes (0 if none)."""
        if self.records.pop(tag, None) is None:
            return 0
        size = self._held.pop(tag)[1]
        self.bytes -= size
        return size


class FilesystemConsumer:
    """Writes records under ``root`` in one of :data:`LAYOUTS`.

    Args:
        root: the capture folder (created if missing).
        layout: ``per_file``, ``packed`` or ``sharded``.
        shard_bytes: ``sharded``: a new shard starts once the current one would grow past this.
    """

    name = "filesystem"
    background = True  # its writes and fsyncs run off the engine's step (dynsteer.capture.consumer_thread)

    def __init__(self, root: str | os.PathLike[str], layout: str = "packed", shard_bytes: int = 256 << 20) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"capture layout must be one of {LAYOUTS}, got {layout!r}")
        self.root, self.layout, self.shard_bytes = Path(root), layout, shard_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._real_root = self.root.resolve()
        self._shard = self._latest_shard()
        self._lock = FileLock(str(self.root / SHARD_LOCK)) if layout == "sharded" else None

    @property
    def streams(self) -> bool:
        """Whether chunks are written as they land (only ``per_file`` does)."""
        return self.layout == "per_file"

    def on_chunk(self, record: CaptureRecord, positions: np.ndarray, values: dict[Place, np.ndarray]) -> None:
        if self.layout != "per_file":
            return
        folder = self._path(record.tag)
        for place, arr in values.items():
            _atomic_write(folder / f"{place_key(place)}.{record.chunks:06d}.npz",
                          _npz_bytes(positions=positions, values=arr))

    def on_finish(self, record: CaptureRecord) -> None:
        if self.layout == "per_file":
            folder = self._path(record.tag)
            _atomic_write(folder / "manifest.json", json.dumps({**_meta(record), "chunks": record.chunks}).encode())
            _fsync_dir(folder)
            _fsync_dir(self.root)
            record.deliveries[self.name] = "written"
            return
        positions, arrays = record.arrays()
        blobs, index, offset = [], {}, 0
        for name, arr in [("positions", positions)] + [(place_key(p), a) for p, a in arrays.items()]:
            raw = np.ascontiguousarray(arr).tobytes()
            index[name] = {"offset": offset, "nbytes": len(raw), "dtype": str(arr.dtype), "shape": list(arr.shape)}
            blobs.append(raw)
            offset += len(raw)
        data = b"".join(blobs)
        if self.layout == "packed":
            _atomic_write(self._path(record.tag, ".bin"), data)
            _atomic_write(self._path(record.tag, ".json"), json.dumps({**_meta(record), "arrays": index}).encode())
        else:
            check_tag(record.tag)  # the reader lists shard tags next to the other layouts' file names
            self._append_shard(record, data, index)
        _fsync_dir(self.root)
        record.deliveries[self.name] = "written"

    def _path(self, tag: str, suffix: str = "") -> Path:
        """``<root>/<tag><suffix>``, refusing any tag that would name a path outside the root (or a reserved name).

        Raises:
            SteeringValidationError: (a ValueError) naming ``tag``.
        """
        check_tag(tag)
        if _RESERVED_TAG.fullmatch(tag):
            raise ValueError(f"tag: {tag!r} is reserved in a capture folder (shard indexes, pipeline stages)")
        path = self.root / f"{tag}{suffix}"
        # Belt and braces: a symlink planted under the root must not lead the write elsewhere either.
        if not path.resolve().is_relative_to(self._real_root):
            raise ValueError(f"tag: {tag!r} resolves outside the capture folder {self.root}")
        return path

    # ---- sharded ----------------------------------------------------------------------------------------------------
    def _latest_shard(self) -> int:
        numbers = [int(m.group(1)) for p in self.root.glob("shard-*.json") if (m := SHARD_NAME.fullmatch(p.name))]
        return max(numbers, default=0)

    def _append_shard(self, record: CaptureRecord, data: bytes, index: dict[str, Any]) -> None:
        assert self._lock is not None
        with self._lock:  # reading the index, appending and publishing it are one step for all writers
            while (self.root / f"shard-{self._shard + 1:05d}.json").exists():
                self._shard += 1  # another writer started a newer shard meanwhile
            idx_path = self.root / f"shard-{self._shard:05d}.json"
            shard = json.loads(idx_path.read_text()) if idx_path.exists() else {"end": 0, "requests": {}}
            if shard["end"] and shard["end"] + len(data) > self.shard_bytes:
                self._shard += 1
                idx_path, shard = self.root / f"shard-{self._shard:05d}.json", {"end": 0, "requests": {}}
            bin_path = idx_path.with_suffix(".bin")
            with open(bin_path, "ab") as f:
                f.truncate(shard["end"])  # drop bytes a killed writer left past the published end
                f.seek(shard["end"])
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            base = shard["end"]
            shard["requests"][record.tag] = {
                **_meta(record), "arrays": {k: {**v, "offset": v["offset"] + base} for k, v in index.items()}}
            shard["end"] = base + len(data)
            _atomic_write(idx_path, json.dumps(shard).encode())


def consumer_class(name: str) -> Any:
    """The class a consumer name stands for: a built-in (``memory``, ``filesystem``, ``zmq``) or the entry point of
    :data:`ENTRY_POINT_GROUP` with that name."""
    if name == "zmq":
        from dynsteer.capture.zmq_consumer import ZmqConsumer

        return ZmqConsumer
    builtin = {"memory": MemoryConsumer, "filesystem": FilesystemConsumer}
    if name in builtin:
        return builtin[name]
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.load()
    raise ValueError(f"unknown capture consumer {name!r} (built-in: memory, filesystem, zmq; "
                     f"or register one under the entry-point group {ENTRY_POINT_GROUP!r})")


def build_consumer(name: str, options: dict[str, Any]) -> Any:
    """A built-in consumer (``memory``, ``filesystem``, ``zmq``) or one registered under :data:`ENTRY_POINT_GROUP`.

    ``name`` is also the kind unless the options say ``kind``: ``{"archive": {"kind": "filesystem", ...}}`` gives a
    second filesystem consumer, named ``archive`` in capture specs.
    """
    options = dict(options)
    consumer = consumer_class(options.pop("kind", name))(**options)
    try:
        consumer.name = name  # what it records in ``CaptureRecord.deliveries``: the name specs use
    except AttributeError:
        pass  # a third-party consumer that does not allow it keeps its own
    return consumer
