"""Captures as the caller receives them, and their wire form.

Records cross vLLM's RPC hop from the worker to the user's process. When both run on one host (always so for
``vllm.LLM``) the arrays travel through files in ``/dev/shm``: a record that spooled its rows as they landed
(``dynsteer.capture.spool``) hands its files over as they are (renamed, nothing copied); any other is written into
one file per reply, once. The caller maps each file and unlinks it at once, and its arrays are views of that mapping
(no copy, freed with them). Across hosts, or when ``/dev/shm`` lacks room, the arrays go inline as bytes in the RPC
reply.

A caller that dies between the worker's write and its own unlink would leak the file, so its name carries the
caller's pid (and pid namespace): every pack and unpack removes delivery files whose caller no longer exists.
"""

from __future__ import annotations

import functools
import mmap
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dynsteer.capture import spool as spool_mod
from dynsteer.capture.names import Place, place_from_key, place_key
from dynsteer.capture.record import CaptureRecord
from dynsteer.capture.spool import SHM_PREFIX, pid_namespace as _pid_namespace, shm_name

SHM_DIR = spool_mod.SHM_DIR
_ALIGN = 64

__all__ = ["Capture", "SHM_DIR", "SHM_PREFIX", "host_id", "merge_captures", "pack_records", "sweep_shared",
           "unpack_records"]


@functools.lru_cache(maxsize=64)
def dtype_name(dtype: np.dtype) -> str:
    """``str(dtype)``, which numpy builds anew on every call (~6 µs: twice per record, hundreds of records a take)."""
    return str(dtype)


@dataclass
class Capture:
    """One request's captured residuals: ``capture[(layer, site)]`` is ``[len(positions), hidden]``.

    Attributes:
        tag: the request's correlation tag.
        positions: absolute token positions of the rows, ascending.
        arrays: ``{(layer, site): array}``.
        status: ``ok``, ``partial`` (a consumer failed; data here is complete) or ``error``.
        errors: what went wrong, if anything.
        deliveries: consumer name -> how far it got: ``delivered`` (``memory``: this object), ``written``
            (``filesystem``: fsynced), ``queued`` (``zmq``: handed to ZeroMQ, receipt unconfirmed); a consumer that
            failed has no entry.
    """

    tag: str
    positions: np.ndarray
    arrays: dict[Place, np.ndarray]
    status: str = "ok"
    errors: list[str] = field(default_factory=list)
    deliveries: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, place: Place) -> np.ndarray:
        return self.arrays[place]


def host_id() -> str:
    """Identifies this process's shared memory: ``hostname/boot id/pid namespace/pid``.

    Hostname plus boot id name the host (containers sharing a hostname differ in it); the pid, within its namespace,
    lets delivery files be swept once this process is gone.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}/{_pid_namespace()}/{os.getpid()}"


def _split_host(host: str) -> tuple[str, str | None, int | None]:
    """``(host, pid namespace, pid)`` of a :func:`host_id` (an older two-part id carries no pid)."""
    parts = host.split("/")
    if len(parts) == 4 and parts[2].isdigit() and parts[3].isdigit():  # they name a file: digits only
        return f"{parts[0]}/{parts[1]}", parts[2], int(parts[3])
    return host, None, None


def pack_records(records: list[CaptureRecord], host: str | None = None,
                 caller_pid: int | None = None) -> list[dict[str, Any]]:
    """Wire form of finished records; through one shared-memory file when the caller's ``host`` is this one.

    Args:
        records: finished records.
        host: the caller's :func:`host_id` (None: send inline).
        caller_pid: the caller's pid, when ``host`` does not carry it; it names the delivery file, which is
            swept once that process is gone (without one, the file is tied to this process instead).
    """
    sweep_shared()
    if not records:
        return []
    this_host, _, _ = _split_host(host_id())
    caller_host, namespace, pid = _split_host(host) if host is not None else (None, None, None)
    if caller_host is not None and caller_host == this_host and SHM_DIR.is_dir():
        if caller_pid is not None:
            pid, namespace = caller_pid, namespace or _pid_namespace()
        elif pid is None:
            pid, namespace = os.getpid(), _pid_namespace()
        out: list[dict[str, Any] | None] = [_pack_spooled(rec, namespace, pid) for rec in records]
        rest = [rec for rec, packed in zip(records, out) if packed is None]
        try:
            shared = iter(_pack_shared(rest, namespace, pid) if rest else [])
        except OSError:  # no room in /dev/shm (a small container default): send the bytes inline
            shared = iter([_pack_inline(rec) for rec in rest])
        return [packed if packed is not None else next(shared) for packed in out]
    return [_pack_inline(rec) for rec in records]


def _pack_spooled(rec: CaptureRecord, namespace: str, caller_pid: int) -> dict[str, Any] | None:
    """A record whose rows all lie in its spool, in position order: its files renamed for the caller (None: it
    needs the general path)."""
    rec.settle()
    if not rec.spooled or not rec.spool.rows:
        return None
    positions = np.concatenate(rec.positions)
    if not bool((positions[1:] > positions[:-1]).all()):
        return None  # rows landed out of order (cannot happen with the ledger; kept general)
    n, layout = rec.layout()
    try:
        paths = rec.spool.hand_over(namespace, caller_pid)
    except OSError:
        return None
    rec.spool = None
    arrays = {place_key(p): {"dtype": dtype_name(dtype), "shape": list(shape), "shm": paths[p], "offset": 0}
              for p, (shape, dtype) in layout.items()}
    pos = {"dtype": dtype_name(positions.dtype), "shape": [n], "data": positions.tobytes()}
    return {**_meta(rec), "positions": pos, "arrays": arrays}


def sweep_shared() -> list[Path]:
    """Remove delivery files in :data:`SHM_DIR` whose caller no longer exists; returns them.

    Only files of this pid namespace are judged (a pid from another one says nothing here).
    """
    namespace, gone = _pid_namespace(), []
    try:
        entries = [e.name for e in os.scandir(SHM_DIR) if e.name.startswith(SHM_PREFIX)]
    except OSError:
        return gone
    alive: dict[str, bool] = {}  # per pid: a take's hundreds of files name a handful of processes
    for name in entries:
        parts = name[len(SHM_PREFIX):].split("-")  # <namespace>-<caller pid>-<unique>
        if len(parts) != 3 or parts[0] != namespace or not parts[1].isdigit():
            continue
        pid = parts[1]
        if pid not in alive:
            alive[pid] = _alive(int(pid))
        if alive[pid]:
            continue
        path = SHM_DIR / name
        try:
            path.unlink()
            gone.append(path)
        except OSError:
            pass  # another sweep got there first, or another user's file
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _meta(rec: CaptureRecord) -> dict[str, Any]:
    return {"tag": rec.tag, "status": rec.status, "errors": list(rec.errors), "deliveries": dict(rec.deliveries)}


def _pack_inline(rec: CaptureRecord) -> dict[str, Any]:
    def pack(arr: np.ndarray) -> dict[str, Any]:
        return {"dtype": dtype_name(arr.dtype), "shape": list(arr.shape), "data": arr.tobytes()}

    positions, arrays = rec.arrays()
    return {**_meta(rec), "positions": pack(positions), "arrays": {place_key(p): pack(a) for p, a in arrays.items()}}


def _pack_shared(records: list[CaptureRecord], namespace: str, caller_pid: int) -> list[dict[str, Any]]:
    specs, total = [], 0
    for rec in records:  # offsets first, so the file is sized (and its space reserved) before any write
        n, places = rec.layout()
        entries = [("positions", (n,), np.dtype(np.int64))] + [(place_key(p), sh, dt) for p, (sh, dt) in places.items()]
        offsets = {}
        for key, shape, dtype in entries:
            offsets[key] = total
            total += -(-int(np.prod(shape)) * dtype.itemsize // _ALIGN) * _ALIGN
        specs.append(offsets)
    path = SHM_DIR / shm_name(namespace, caller_pid)
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
                    fields[key] = {"dtype": dtype_name(np.dtype(dtype)), "shape": list(shape), "offset": offsets[key]}
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
    sweep_shared()
    maps: dict[str, mmap.mmap] = {}
    fields = [f for obj in packed for f in (obj["positions"], *obj["arrays"].values())]
    for path in [obj.get("shm") for obj in packed] + [f.get("shm") for f in fields]:
        if path is not None and path not in maps:
            fd = os.open(path, os.O_RDONLY)
            try:
                # Private copy-on-write mapping: the caller gets writable arrays that never touch the file.
                maps[path] = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            finally:
                os.close(fd)
            os.unlink(path)
    out = []
    for obj in packed:
        def unpack(field_: dict[str, Any], default=obj.get("shm")) -> np.ndarray:
            mm = maps.get(field_.get("shm", default))  # a field in a file of its own, or in the record's file
            if mm is None:
                return np.frombuffer(field_["data"], dtype=field_["dtype"]).reshape(field_["shape"]).copy()
            return np.ndarray(field_["shape"], dtype=field_["dtype"], buffer=mm, offset=field_["offset"])

        out.append(Capture(tag=obj["tag"], positions=unpack(obj["positions"]),
                           arrays={place_from_key(k): unpack(v) for k, v in obj["arrays"].items()}, status=obj["status"],
                           errors=list(obj["errors"]), deliveries=dict(obj.get("deliveries", {}))))
    return out


_STATUS_RANK = {"ok": 0, "partial": 1, "error": 2}
_DELIVERY_RANK = {"incomplete": 0, "queued": 1, "written": 2, "delivered": 3}


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
        # A consumer reached the whole capture only as far as it reached every stage's part.
        seen.deliveries = {name: min(state, cap.deliveries[name], key=lambda s: _DELIVERY_RANK.get(s, -1))
                           for name, state in seen.deliveries.items() if name in cap.deliveries}
        if _STATUS_RANK.get(cap.status, 2) > _STATUS_RANK.get(seen.status, 2):
            seen.status = cap.status
        if not np.array_equal(seen.positions, cap.positions):
            seen.status = "error"
            seen.errors.append(f"pipeline stages captured different positions ({len(seen.positions)} vs "
                               f"{len(cap.positions)})")
    return out
