"""Captures as the caller receives them, and their wire form.

Records cross vLLM's RPC hop from the worker to the user's process. When both run on one host (always so for
``vllm.LLM``) the arrays travel through one file in ``/dev/shm``: the worker writes each array into it once, the
caller maps it and unlinks it at once, and its arrays are views of that mapping (no copy, freed with them). Across
hosts, or when ``/dev/shm`` lacks room, the arrays go inline as bytes in the RPC reply.
"""

from __future__ import annotations

import mmap
import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dynsteer.capture.store import CaptureRecord, Place, place_from_key, place_key

SHM_DIR = Path("/dev/shm")
_ALIGN = 64


@dataclass
class Capture:
    """One request's captured residuals: ``capture[(layer, site)]`` is ``[len(positions), hidden]``.

    Attributes:
        tag: the request's correlation tag.
        positions: absolute token positions of the rows, ascending.
        arrays: ``{(layer, site): array}``.
        status: ``ok``, ``partial`` (a consumer failed; data here is complete) or ``error``.
        errors: what went wrong, if anything.
    """

    tag: str
    positions: np.ndarray
    arrays: dict[Place, np.ndarray]
    status: str = "ok"
    errors: list[str] = field(default_factory=list)

    def __getitem__(self, place: Place) -> np.ndarray:
        return self.arrays[place]


def host_id() -> str:
    """Identifies this host's shared memory: hostname plus boot id (containers sharing a hostname differ in it)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def pack_records(records: list[CaptureRecord], host: str | None = None) -> list[dict[str, Any]]:
    """Wire form of finished records; through one shared-memory file when the caller's ``host`` is this one."""
    if not records:
        return []
    if host is not None and host == host_id() and SHM_DIR.is_dir():
        try:
            return _pack_shared(records)
        except OSError:
            pass  # no room in /dev/shm (a small container default): send the bytes inline
    return [_pack_inline(rec) for rec in records]


def _meta(rec: CaptureRecord) -> dict[str, Any]:
    return {"tag": rec.tag, "status": rec.status, "errors": list(rec.errors)}


def _pack_inline(rec: CaptureRecord) -> dict[str, Any]:
    def pack(arr: np.ndarray) -> dict[str, Any]:
        return {"dtype": str(arr.dtype), "shape": list(arr.shape), "data": arr.tobytes()}

    positions, arrays = rec.arrays()
    return {**_meta(rec), "positions": pack(positions), "arrays": {place_key(p): pack(a) for p, a in arrays.items()}}


def _pack_shared(records: list[CaptureRecord]) -> list[dict[str, Any]]:
    specs, total = [], 0
    for rec in records:  # offsets first, so the file is sized (and its space reserved) before any write
        n, places = rec.layout()
        entries = [("positions", (n,), np.dtype(np.int64))] + [(place_key(p), sh, dt) for p, (sh, dt) in places.items()]
        offsets = {}
        for key, shape, dtype in entries:
            offsets[key] = total
            total += -(-int(np.prod(shape)) * dtype.itemsize // _ALIGN) * _ALIGN
        specs.append(offsets)
    path = SHM_DIR / f"dynsteer-capture-{os.getpid()}-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # Reserve the space now: writing through a mapping past a full tmpfs would be a SIGBUS, not an error.
        os.posix_fallocate(fd, 0, max(total, 1))
        with mmap.mmap(fd, max(total, 1)) as mm:
            out = []
            for rec, offsets in zip(records, specs):
                fields: dict[str, Any] = {}

                def into(shape: tuple[int, ...], dtype: np.dtype, keys=iter(offsets), fields=fields) -> np.ndarray:
                    key = next(keys)  # rec.arrays() asks for positions, then the places in layout order
                    fields[key] = {"dtype": str(np.dtype(dtype)), "shape": list(shape), "offset": offsets[key]}
                    return np.ndarray(shape, dtype=dtype, buffer=mm, offset=offsets[key])

                rec.arrays(into)
                positions = fields.pop("positions")
                out.append({**_meta(rec), "shm": str(path), "positions": positions, "arrays": fields})
        return out
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def unpack_records(packed: list[dict[str, Any]]) -> list[Capture]:
    """Captures from their wire form (shared-memory files are mapped once and unlinked at once)."""
    maps: dict[str, mmap.mmap] = {}
    for obj in packed:
        path = obj.get("shm")
        if path is not None and path not in maps:
            with open(path, "rb") as f:
                # Private copy-on-write mapping: the caller gets writable arrays that never touch the file.
                maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            os.unlink(path)
    out = []
    for obj in packed:
        mm = maps.get(obj.get("shm"))

        def unpack(field_: dict[str, Any], mm=mm) -> np.ndarray:
            if mm is None:
                return np.frombuffer(field_["data"], dtype=field_["dtype"]).reshape(field_["shape"]).copy()
            return np.ndarray(field_["shape"], dtype=field_["dtype"], buffer=mm, offset=field_["offset"])

        out.append(Capture(tag=obj["tag"], positions=unpack(obj["positions"]),
                           arrays={place_from_key(k): unpack(v) for k, v in obj["arrays"].items()}, status=obj["status"],
                           errors=list(obj["errors"])))
    return out


_STATUS_RANK = {"ok": 0, "partial": 1, "error": 2}


def merge_captures(captures: list[Capture]) -> dict[str, Capture]:
    """One capture per tag: under pipeline parallelism each stage returns the places of its own layers, for the same
    positions; their arrays are joined (positions that disagree make the capture ``error``)."""
    out: dict[str, Capture] = {}
    for cap in captures:
        seen = out.get(cap.tag)
        if seen is None:
            out[cap.tag] = cap
            continue
        seen.arrays.update(cap.arrays)
        seen.errors.extend(cap.errors)
        if _STATUS_RANK.get(cap.status, 2) > _STATUS_RANK.get(seen.status, 2):
            seen.status = cap.status
        if not np.array_equal(seen.positions, cap.positions):
            seen.status = "error"
            seen.errors.append(f"pipeline stages captured different positions ({len(seen.positions)} vs "
                               f"{len(cap.positions)})")
    return out
