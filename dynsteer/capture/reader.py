"""NumPy reader for captures on disk, in any of the three layouts (see ``dynsteer.capture.consumers``).

A writer killed mid-write leaves leftovers: ``.*.tmp`` files, a packed ``.bin`` without its ``.json``, bytes past a
shard's indexed end. The reader never lists or reads them; :meth:`CaptureReader.leftovers` reports them and
:meth:`CaptureReader.clean` removes those old enough that no live writer can still own them.

Example:
    >>> reader = CaptureReader("captures/")          # doctest: +SKIP
    >>> for tag in reader.tags():                     # doctest: +SKIP
    ...     positions, arrays, meta = reader.read(tag)
    ...     arrays[(15, "post_block")].shape          # (n_positions, hidden)
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from filelock import FileLock

from dynsteer.capture.consumers import SHARD_LOCK, SHARD_NAME
from dynsteer.capture.names import Place, place_from_key

LeftoverKind = Literal["temp", "unindexed_bin", "shard_tail"]


@dataclass(frozen=True)
class Leftover:
    """What a killed writer left behind.

    Attributes:
        path: the file.
        kind: ``temp`` (an unfinished atomic write), ``unindexed_bin`` (a ``.bin`` whose index was never written) or
            ``shard_tail`` (bytes of a shard's ``.bin`` past its indexed end).
        size: bytes it wastes (``shard_tail``: only those past the end).
        mtime: last modification (seconds since the epoch).
    """

    path: Path
    kind: LeftoverKind
    size: int
    mtime: float


class CaptureReader:
    """Reads published captures under ``root``; the layout is detected from the files.

    An engine with pipeline parallelism publishes each stage's layers under ``<root>/pp<rank>``; the reader merges
    them, so a request reads back as one capture with every layer.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def _roots(self) -> list[Path]:
        stages = sorted(p for p in self.root.glob("pp*") if p.is_dir() and p.name[2:].isdigit())
        return stages or [self.root]

    def tags(self) -> list[str]:
        """Completed requests (per_file requests still running are readable with :meth:`read_partial`)."""
        tags: set[str] = set()
        for root in self._roots:
            tags.update(p.stem for p in root.glob("*.json") if _is_packed_index(p) and p.with_suffix(".bin").is_file())
            tags.update(p.parent.name for p in root.glob("*/manifest.json") if not p.parent.name.startswith("."))
            for shard in _shard_indexes(root):
                tags.update(_load_json(shard).get("requests", {}))
        return sorted(tags)

    def read(self, tag: str) -> tuple[np.ndarray, dict[Place, np.ndarray], dict[str, Any]]:
        """``(positions, {(layer, site): [n, hidden]}, metadata)`` of one completed request."""
        parts = [got for root in self._roots if (got := self._read_one(root, tag)) is not None]
        if not parts:
            raise KeyError(f"no published capture {tag!r} under {self.root}")
        positions, arrays, meta = parts[0]
        for pos, more, _ in parts[1:]:  # other pipeline stages: their layers, the same positions
            if not np.array_equal(pos, positions):
                raise ValueError(f"capture {tag!r}: pipeline stages hold different positions")
            arrays.update(more)
        return positions, arrays, meta

    def read_partial(self, tag: str) -> tuple[np.ndarray, dict[Place, np.ndarray]]:
        """What a ``per_file`` request has published so far (works while it is still running)."""
        arrays: dict[Place, np.ndarray] = {}
        positions = np.zeros(0, np.int64)
        if not _is_name(tag):
            return positions, arrays
        for root in self._roots:
            pos, more = self._read_chunks(root / tag)
            arrays.update(more)
            positions = pos if len(pos) > len(positions) else positions
        return positions, arrays

    def leftovers(self) -> list[Leftover]:
        """Files (or parts of files) a killed writer left behind, which :meth:`tags` and :meth:`read` ignore."""
        found: list[Leftover] = []
        for root in {self.root, *self._roots}:
            found.extend(_leftovers_in(root))
        return sorted(found, key=lambda lo: str(lo.path))

    def clean(self, min_age_s: float = 60.0) -> list[Path]:
        """Remove leftovers unchanged for ``min_age_s`` seconds (a live writer's fresh temp file is kept); shard
        tails are cut off under the writers' lock. Returns the files removed or cut.

        Args:
            min_age_s: how long a leftover must have been left untouched.
        """
        now, done = time.time(), []
        for lo in self.leftovers():
            if now - lo.mtime < min_age_s:
                continue
            if SHARD_NAME.fullmatch(lo.path.name):
                if _trim_shard(lo.path):
                    done.append(lo.path)
                continue
            try:
                lo.path.unlink()
                done.append(lo.path)
            except FileNotFoundError:
                pass  # its writer finished (renamed it) or another clean ran
        return done

    def _read_one(self, root: Path, tag: str) -> tuple[np.ndarray, dict[Place, np.ndarray], dict[str, Any]] | None:
        if _is_name(tag):  # a tag that is no single file name can only be a key in a shard index
            if (root / tag / "manifest.json").is_file():
                meta = _load_json(root / tag / "manifest.json")
                return (*self._read_chunks(root / tag), meta)
            if _is_packed_index(root / f"{tag}.json") and (root / f"{tag}.json").is_file() \
                    and (root / f"{tag}.bin").is_file():
                meta = _load_json(root / f"{tag}.json")
                return (*self._unpack(root / f"{tag}.bin", meta["arrays"]), meta)
        for shard in _shard_indexes(root):
            requests = _load_json(shard).get("requests", {})
            if tag in requests:
                return (*self._unpack(shard.with_suffix(".bin"), requests[tag]["arrays"]), requests[tag])
        return None

    @staticmethod
    def _read_chunks(directory: Path) -> tuple[np.ndarray, dict[Place, np.ndarray]]:
        chunks: dict[Place, list[tuple[int, np.ndarray, np.ndarray]]] = {}
        for f in sorted(directory.glob("*.npz")):
            if f.name.startswith("."):
                continue
            layer, site, chunk = f.name[: -len(".npz")].split(".")
            with np.load(f) as z:
                chunks.setdefault((int(layer), site), []).append((int(chunk), z["positions"], z["values"]))  # type: ignore[arg-type]
        arrays, positions = {}, np.zeros(0, np.int64)
        for place, parts in chunks.items():
            parts.sort(key=lambda t: t[0])
            pos = np.concatenate([p for _, p, _ in parts])
            order = np.argsort(pos, kind="stable")
            arrays[place] = np.concatenate([v for _, _, v in parts])[order]
            positions = pos[order]
        return positions, arrays

    @staticmethod
    def _unpack(path: Path, index: dict[str, Any]) -> tuple[np.ndarray, dict[Place, np.ndarray]]:
        size = path.stat().st_size
        # np.memmap refuses an empty file (a capture of no rows)
        raw = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        out = {}
        for name, spec in index.items():
            if spec["offset"] + spec["nbytes"] > size:
                raise ValueError(f"{path}: index points past the end of the file ({spec['offset']} + "
                                 f"{spec['nbytes']} > {size}); the file was cut after it was published")
            chunk = raw[spec["offset"]: spec["offset"] + spec["nbytes"]]
            out[name] = np.frombuffer(chunk.tobytes(), dtype=spec["dtype"]).reshape(spec["shape"])
        positions = out.pop("positions")
        return positions, {place_from_key(k): v for k, v in out.items()}


def _is_name(tag: str) -> bool:
    """Whether ``tag`` is one plain file name (it is joined to a path)."""
    return bool(tag) and tag not in (".", "..") and "/" not in tag and "\0" not in tag and os.sep not in tag


def _is_packed_index(path: Path) -> bool:
    return not path.name.startswith(".") and not SHARD_NAME.fullmatch(path.name)


def _shard_indexes(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("shard-*.json") if SHARD_NAME.fullmatch(p.name))


def _load_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _leftovers_in(root: Path) -> list[Leftover]:
    """Leftovers directly under ``root`` and in its per_file request folders."""
    out: list[Leftover] = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return out
    for entry in entries:
        name = entry.name
        if entry.is_dir(follow_symlinks=False):
            if not (name.startswith("pp") and name[2:].isdigit()):  # stages are scanned as roots of their own
                out.extend(_temps_in(Path(entry.path)))
            continue
        if not entry.is_file(follow_symlinks=False):
            continue
        st = entry.stat(follow_symlinks=False)
        path = Path(entry.path)
        if name.startswith(".") and name.endswith(".tmp"):
            out.append(Leftover(path, "temp", st.st_size, st.st_mtime))
        elif name.endswith(".bin") and not name.startswith("."):
            index = path.with_suffix(".json")
            if not index.is_file():
                out.append(Leftover(path, "unindexed_bin", st.st_size, st.st_mtime))
            elif SHARD_NAME.fullmatch(name):
                end = int(_load_json(index).get("end", 0))
                if st.st_size > end:
                    out.append(Leftover(path, "shard_tail", st.st_size - end, st.st_mtime))
    return out


def _temps_in(directory: Path) -> list[Leftover]:
    out = []
    for entry in os.scandir(directory):
        if entry.name.startswith(".") and entry.name.endswith(".tmp") and entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            out.append(Leftover(Path(entry.path), "temp", st.st_size, st.st_mtime))
    return out


def _trim_shard(bin_path: Path) -> bool:
    """Cut a shard's ``.bin`` to its indexed end, or remove it if it has no index; whether anything changed.

    Runs under the writers' lock: no append is in flight then, so whatever lies past the index is dead.
    """
    with FileLock(str(bin_path.parent / SHARD_LOCK)):
        index = bin_path.with_suffix(".json")
        try:
            size = bin_path.stat().st_size
        except FileNotFoundError:
            return False
        if not index.is_file():
            bin_path.unlink()
            return True
        end = int(_load_json(index).get("end", 0))
        if size <= end:
            return False
        os.truncate(bin_path, end)
        return True
