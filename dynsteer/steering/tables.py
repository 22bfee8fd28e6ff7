"""Persistent device tables for every hooked (layer, site) and the row pool that shares them between requests.

Layout (n = hooked sites, R = rows, K = clamp slots, H = hidden): ``vec[n, R, H]``, ``clamp_dir[n, R, K, H]``,
``clamp_lo/hi/strength[n, R, K]`` in float32, and one ``row_index[max_tokens]`` int32 shared by all sites. Row 0 is
all zeros and is what padding and unsteered tokens read. Tensors are allocated once, before vLLM profiles memory,
and only ever written in place, so CUDA graphs captured over them stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dynsteer.spec import Site
from dynsteer.steering.compile import RowContent, SiteKey


class RowsExhausted(RuntimeError):
    """Every table row holds a live configuration; raise the engine's ``max_rows``."""


@dataclass
class _Row:
    index: int
    refs: int


class RowPool:
    """Rows deduplicated by configuration digest and reference-counted; row 0 (empty config) is never handed out."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, 0, -1))
        self._by_digest: dict[bytes, _Row] = {}

    def acquire(self, content: RowContent) -> tuple[int, bool]:
        """The row holding ``content`` and whether it is new (its tables must be written)."""
        if content.empty:
            return 0, False
        row = self._by_digest.get(content.digest)
        if row is not None:
            row.refs += 1
            return row.index, False
        if not self._free:
            raise RowsExhausted(f"all {self.num_rows - 1} steering rows are in use by distinct configurations")
        row = _Row(self._free.pop(), 1)
        self._by_digest[content.digest] = row
        return row.index, True

    def release(self, digest: bytes) -> None:
        if not digest:
            return
        row = self._by_digest[digest]
        row.refs -= 1
        if row.refs == 0:
            del self._by_digest[digest]
            self._free.append(row.index)

    @property
    def in_use(self) -> int:
        return len(self._by_digest)


class SteeringTables:
    """The device tensors; views per site are handed to the hooks installed in decoder layers."""

    def __init__(self, sites: list[SiteKey], hidden_size: int, num_rows: int, max_clamps: int, max_tokens: int,
                 device: torch.device | str | None = None) -> None:
        self.sites = list(sites)
        self.slot = {key: i for i, key in enumerate(self.sites)}
        self.hidden_size, self.num_rows, self.max_clamps = hidden_size, num_rows, max_clamps
        n, R, K, H = len(self.sites), num_rows, max_clamps, hidden_size
        f32 = dict(dtype=torch.float32, device=device)
        self.vec = torch.zeros(n, R, H, **f32)
        self.clamp_dir = torch.zeros(n, R, K, H, **f32)
        self.clamp_lo = torch.full((n, R, K), -float("inf"), **f32)
        self.clamp_hi = torch.full((n, R, K), float("inf"), **f32)
        self.clamp_strength = torch.zeros(n, R, K, **f32)
        self.row_index = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.device = self.vec.device

    def views(self, layer: int, site: Site) -> dict[str, torch.Tensor]:
        i = self.slot[(layer, site)]
        return {"vec": self.vec[i], "clamp_dir": self.clamp_dir[i], "clamp_lo": self.clamp_lo[i],
                "clamp_hi": self.clamp_hi[i], "clamp_strength": self.clamp_strength[i]}

    def write_row(self, row: int, content: RowContent) -> None:
        """Write one row at every hooked site (sites the config does not touch get zeros)."""
        n, K, H = len(self.sites), self.max_clamps, self.hidden_size
        vec = np.zeros((n, H), np.float32)
        cdir = np.zeros((n, K, H), np.float32)
        lo = np.full((n, K), -np.inf, np.float32)
        hi = np.full((n, K), np.inf, np.float32)
        strength = np.zeros((n, K), np.float32)
        for key, prog in content.sites.items():
            i = self.slot[key]
            if prog.vec is not None:
                vec[i] = prog.vec
            for k, c in enumerate(prog.clamps):
                cdir[i, k], lo[i, k], hi[i, k], strength[i, k] = c.direction, c.lo, c.hi, c.strength
        for dst, src in ((self.vec, vec), (self.clamp_dir, cdir), (self.clamp_lo, lo), (self.clamp_hi, hi),
                         (self.clamp_strength, strength)):
            dst[:, row].copy_(torch.from_numpy(src), non_blocking=False)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.vec, self.clamp_dir, self.clamp_lo, self.clamp_hi,
                                                          self.clamp_strength, self.row_index))
