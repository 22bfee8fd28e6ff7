"""NumPy reader for captures on disk, in any of the three layouts (see ``dynsteer.capture.consumers``).

Example:
    >>> reader = CaptureReader("captures/")          # doctest: +SKIP
    >>> for tag in reader.tags():                     # doctest: +SKIP
    ...     positions, arrays, meta = reader.read(tag)
    ...     arrays[(15, "post_block")].shape          # (n_positions, hidden)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from dynsteer.capture.store import Place, place_from_key


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
            tags.update(p.stem for p in root.glob("*.json") if not p.name.startswith("shard-"))
            tags.update(p.parent.name for p in root.glob("*/manifest.json"))
            for shard in sorted(root.glob("shard-*.json")):
                tags.update(json.loads(shard.read_text())["requests"])
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
        for root in self._roots:
            pos, more = self._read_chunks(root / tag)
            arrays.update(more)
            positions = pos if len(pos) > len(positions) else positions
        return positions, arrays

    def _read_one(self, root: Path, tag: str) -> tuple[np.ndarray, dict[Place, np.ndarray], dict[str, Any]] | None:
        if (root / tag / "manifest.json").exists():
            meta = json.loads((root / tag / "manifest.json").read_text())
            return (*self._read_chunks(root / tag), meta)
        if (root / f"{tag}.json").exists():
            meta = json.loads((root / f"{tag}.json").read_text())
            return (*self._unpack(root / f"{tag}.bin", meta["arrays"]), meta)
        for shard in sorted(root.glob("shard-*.json")):
            requests = json.loads(shard.read_text())["requests"]
            if tag in requests:
                return (*self._unpack(shard.with_suffix(".bin"), requests[tag]["arrays"]), requests[tag])
        return None

    @staticmethod
    def _read_chunks(directory: Path) -> tuple[np.ndarray, dict[Place, np.ndarray]]:
        chunks: dict[Place, list[tuple[int, np.ndarray, np.ndarray]]] = {}
        for f in sorted(directory.glob("*.npz")):
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
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        out = {}
        for name, spec in index.items():
            chunk = raw[spec["offset"]: spec["offset"] + spec["nbytes"]]
            out[name] = np.frombuffer(chunk.tobytes(), dtype=spec["dtype"]).reshape(spec["shape"])
        positions = out.pop("positions")
        return positions, {place_from_key(k): v for k, v in out.items()}
