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
    """Reads published captures under ``root``; the layout is detected from the files."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def tags(self) -> list[str]:
        """Completed requests (per_file requests still running are readable with :meth:`read_partial`)."""
        tags = [p.stem for p in self.root.glob("*.json") if not p.name.startswith("shard-")]
        tags += [p.parent.name for p in self.root.glob("*/manifest.json")]
        for shard in sorted(self.root.glob("shard-*.json")):
            tags += list(json.loads(shard.read_text())["requests"])
        return sorted(tags)

    def read(self, tag: str) -> tuple[np.ndarray, dict[Place, np.ndarray], dict[str, Any]]:
        """``(positions, {(layer, site): [n, hidden]}, metadata)`` of one completed request."""
        if (self.root / tag / "manifest.json").exists():
            meta = json.loads((self.root / tag / "manifest.json").read_text())
            positions, arrays = self.read_partial(tag)
            return positions, arrays, meta
        if (self.root / f"{tag}.json").exists():
            meta = json.loads((self.root / f"{tag}.json").read_text())
            return (*self._unpack(self.root / f"{tag}.bin", meta["arrays"]), meta)
        for shard in sorted(self.root.glob("shard-*.json")):
            requests = json.loads(shard.read_text())["requests"]
            if tag in requests:
                return (*self._unpack(shard.with_suffix(".bin"), requests[tag]["arrays"]), requests[tag])
        raise KeyError(f"no published capture {tag!r} under {self.root}")

    def read_partial(self, tag: str) -> tuple[np.ndarray, dict[Place, np.ndarray]]:
        """What a ``per_file`` request has published so far (works while it is still running)."""
        chunks: dict[Place, list[tuple[int, np.ndarray, np.ndarray]]] = {}
        for f in sorted((self.root / tag).glob("*.npz")):
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
