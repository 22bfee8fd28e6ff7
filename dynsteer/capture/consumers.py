"""Where finished captures go: kept in memory for the caller, written to disk, sent over ZeroMQ
(``dynsteer.capture.zmq_consumer``), or handed to third-party consumers.

A consumer that raises marks the record ``partial`` and never aborts generation. Third-party consumers register
under the entry-point group ``dynsteer.capture_consumers`` (a class taking ``**options``).

File layouts (all writes are temp + rename, so a reader never sees half a file):

- ``per_file``: ``<root>/<tag>/<layer>.<site>.<chunk>.npz`` (``positions``, ``values``) written as chunks arrive, so a
  running request is already readable; ``<root>/<tag>/manifest.json`` appears when it is complete.
- ``packed``: ``<root>/<tag>.bin`` (all arrays back to back) + ``<root>/<tag>.json`` (the index), index written last.
- ``sharded``: many requests per ``<root>/shard-NNNNN.bin`` with ``shard-NNNNN.json`` rewritten atomically after
  each append (bytes past the indexed end are invisible); a new shard starts past ``shard_bytes``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from dynsteer.capture.store import CaptureRecord, Place, place_key

logger = logging.getLogger("dynsteer")
ENTRY_POINT_GROUP = "dynsteer.capture_consumers"
LAYOUTS = ("per_file", "packed", "sharded")


class CaptureConsumer(Protocol):
    """Receives a record when its request finishes (and, optionally, chunks as they arrive)."""

    name: str

    def on_finish(self, record: CaptureRecord) -> None: ...


def _atomic_write(path: Path, data: bytes) -> None:
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


def _npz_bytes(**arrays: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _meta(record: CaptureRecord) -> dict[str, Any]:
    return {"tag": record.tag, "status": record.status, "errors": record.errors, "prompt_len": record.prompt_len,
            "spec": record.spec.model_dump(mode="json")}


class MemoryConsumer:
    """Keeps finished records until the caller takes them; a full store evicts the oldest and says so."""

    name = "memory"

    def __init__(self, max_records: int = 4096) -> None:
        self.max_records = max_records
        self.records: OrderedDict[str, CaptureRecord] = OrderedDict()
        self.evicted = 0

    def on_finish(self, record: CaptureRecord) -> None:
        self.records[record.tag] = record
        while len(self.records) > self.max_records:
            tag, _ = self.records.popitem(last=False)
            self.evicted += 1
            logger.error("dynsteer capture: memory store full (%d); evicted the oldest record %s",
                         self.max_records, tag)

    def take(self, tag: str) -> CaptureRecord | None:
        return self.records.pop(tag, None)


class FilesystemConsumer:
    """Writes records under ``root`` in one of :data:`LAYOUTS`."""

    name = "filesystem"

    def __init__(self, root: str | os.PathLike[str], layout: str = "packed", shard_bytes: int = 256 << 20) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"capture layout must be one of {LAYOUTS}, got {layout!r}")
        self.root, self.layout, self.shard_bytes = Path(root), layout, shard_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._shard = self._next_shard_index()

    @property
    def streams(self) -> bool:
        """Whether chunks are written as they land (only ``per_file`` does)."""
        return self.layout == "per_file"

    def on_chunk(self, record: CaptureRecord, positions: np.ndarray, values: dict[Place, np.ndarray]) -> None:
        if self.layout != "per_file":
            return
        for place, arr in values.items():
            _atomic_write(self.root / record.tag / f"{place_key(place)}.{record.chunks:06d}.npz",
                          _npz_bytes(positions=positions, values=arr))

    def on_finish(self, record: CaptureRecord) -> None:
        if self.layout == "per_file":
            _atomic_write(self.root / record.tag / "manifest.json",
                          json.dumps({**_meta(record), "chunks": record.chunks}).encode())
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
            _atomic_write(self.root / f"{record.tag}.bin", data)
            _atomic_write(self.root / f"{record.tag}.json", json.dumps({**_meta(record), "arrays": index}).encode())
            return
        self._append_shard(record, data, index)

    # ---- sharded ----------------------------------------------------------------------------------------------------
    def _next_shard_index(self) -> int:
        existing = sorted(self.root.glob("shard-*.json"))
        return int(existing[-1].stem.split("-")[1]) if existing else 0

    def _append_shard(self, record: CaptureRecord, data: bytes, index: dict[str, Any]) -> None:
        idx_path = self.root / f"shard-{self._shard:05d}.json"
        shard = json.loads(idx_path.read_text()) if idx_path.exists() else {"end": 0, "requests": {}}
        if shard["end"] and shard["end"] + len(data) > self.shard_bytes:
            self._shard += 1
            idx_path, shard = self.root / f"shard-{self._shard:05d}.json", {"end": 0, "requests": {}}
        bin_path = idx_path.with_suffix(".bin")
        with open(bin_path, "ab") as f:
            f.truncate(shard["end"])  # drop bytes a crashed writer left past the published end
            f.seek(shard["end"])
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        base = shard["end"]
        shard["requests"][record.tag] = {**_meta(record),
                                         "arrays": {k: {**v, "offset": v["offset"] + base} for k, v in index.items()}}
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
    return consumer_class(options.pop("kind", name))(**options)
