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
    """The device tensors; each hooked site owns its own tensors, handed to the hook installed in its layer.

    Each site's tensors are standalone allocations, not views of one big table: compiled graphs have been seen
    to snapshot module buffers that are views (steering then stops working under torch.compile on GPU), while
    standalone buffers are read live.
    """

    FIELDS = ("vec", "clamp_dir", "clamp_lo", "clamp_hi", "clamp_strength")

    def __init__(self, sites: list[SiteKey], hidden_size: int, num_rows: int, max_clamps: int, max_tokens: int,
                 device: torch.device | str | None = None) -> None:
        self.sites = list(sites)
        self.slot = {key: i for i, key in enumerate(self.sites)}
        self.hidden_size, self.num_rows, self.max_clamps = hidden_size, num_rows, max_clamps
        R, K, H = num_rows, max_clamps, hidden_size
        f32 = dict(dtype=torch.float32, device=device)
        self._site: dict[SiteKey, dict[str, torch.Tensor]] = {
            key: {"vec": torch.zeros(R, H, **f32), "clamp_dir": torch.zeros(R, K, H, **f32),
                  "clamp_lo": torch.full((R, K), -float("inf"), **f32),
                  "clamp_hi": torch.full((R, K), float("inf"), **f32), "clamp_strength": torch.zeros(R, K, **f32)}
            for key in self.sites}
        self.row_index = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.device = self.row_index.device

    def views(self, layer: int, site: Site) -> dict[str, torch.Tensor]:
        return self._site[(layer, site)]

    def vec_at(self, key: SiteKey, row: int) -> torch.Tensor:
        """The additive vector a row holds at one site (for inspection and tests)."""
        return self._site[key]["vec"][row]

    def write_row(self, row: int, content: RowContent) -> None:
        """Write one row at every hooked site (sites the config does not touch get zeros)."""
        K, H = self.max_clamps, self.hidden_size
        zeros_vec = np.zeros(H, np.float32)
        for key, tensors in self._site.items():
            prog = content.sites.get(key)
            cdir = np.zeros((K, H), np.float32)
            lo, hi = np.full(K, -np.inf, np.float32), np.full(K, np.inf, np.float32)
            strength = np.zeros(K, np.float32)
            if prog is not None:
                for k, c in enumerate(prog.clamps):
                    cdir[k], lo[k], hi[k], strength[k] = c.direction, c.lo, c.hi, c.strength
            vec = prog.vec if prog is not None and prog.vec is not None else zeros_vec
            for name, src in (("vec", vec), ("clamp_dir", cdir), ("clamp_lo", lo), ("clamp_hi", hi),
                              ("clamp_strength", strength)):
                tensors[name][row].copy_(torch.from_numpy(src), non_blocking=False)

    def nbytes(self) -> int:
        per_site = sum(t.numel() * t.element_size() for t in next(iter(self._site.values()), {}).values())
        return per_site * len(self._site) + self.row_index.numel() * self.row_index.element_size()
