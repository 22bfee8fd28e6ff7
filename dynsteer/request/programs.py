"""What a compiled configuration holds: per (layer, site), an additive vector, ordered clamps, and the monitors and
gated vectors of a dynamic policy by gate slot; and the magnitude budget every additive entry spends.

Pure values: the steering tables (``dynsteer.steering.tables``) write them into a row, and a configuration's digest
identifies it for deduplication.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dynsteer.spec import Site, SteeringValidationError

SiteKey = tuple[int, Site]


@dataclass(frozen=True)
class Clamp:
    """One compiled clamp: unit direction, bounds (±inf for open sides), strength and the gate slot scaling the
    strength (-1: static)."""

    direction: np.ndarray
    lo: float
    hi: float
    strength: float
    gate: int = -1


@dataclass(frozen=True)
class MonitorProgram:
    """A probe gate computed at a site into one gate slot: ``σ(sharpness·(x·probe − threshold))``, 0 below floor."""

    probe: np.ndarray
    sharpness: float
    threshold: float
    floor: float


@dataclass
class SiteProgram:
    """What a row holds at one (layer, site): static vector and clamps, monitors and gated vectors by slot."""

    vec: np.ndarray | None = None
    clamps: list[Clamp] = field(default_factory=list)
    monitors: dict[int, MonitorProgram] = field(default_factory=dict)
    dyn: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return bool(self.clamps or self.monitors or self.dyn or (self.vec is not None and np.any(self.vec)))


@dataclass(frozen=True)
class RowContent:
    """A compiled configuration for one phase; ``digest`` identifies it for deduplication."""

    sites: dict[SiteKey, SiteProgram]
    digest: bytes

    @property
    def empty(self) -> bool:
        return not self.sites


EMPTY = RowContent(sites={}, digest=b"")


class MagnitudeBudget:
    """What one configuration may add to a residual element, summed over its entries (``Limits.max_abs_value``).

    Each additive entry spends ``|scale|·max|vector|`` (gated entries at the largest scale their controller can
    output); the entry that overspends is named in the error. Summing over sites is conservative: the residual at
    the last layer carries every earlier site's addition.
    """

    def __init__(self, limit: float) -> None:
        self.limit, self.spent = limit, 0.0

    def add(self, amount: float, field: str) -> None:
        self.spent += amount
        if not np.isfinite(amount) or amount > self.limit:
            raise SteeringValidationError(f"{field}: the entry adds up to {amount:.4g} to a residual element, over "
                                          f"the engine's limit max_abs_value = {self.limit:g}")
        if self.spent > self.limit:
            raise SteeringValidationError(f"{field}: with this entry the configuration adds up to {self.spent:.4g} "
                                          f"to a residual element (all its sites together), over the engine's "
                                          f"limit max_abs_value = {self.limit:g}")


def max_abs(v: np.ndarray) -> float:
    """``max|v|`` in float64 (0 for an empty vector): what an additive entry spends of a :class:`MagnitudeBudget`."""
    return float(np.max(np.abs(v.astype(np.float64)))) if v.size else 0.0
