"""The tables a steering site's kernels read, defined once: :class:`SiteTables`.

Each hooked (layer, site) owns device tables indexed by row (R rows, K clamp slots, G gate slots, H hidden); with a
dynamic tier (G > 0) a site's kernels also read four per-token gate buffers [G, N] (N tokens of capacity) that every
site shares. :class:`SiteTables` names them all, in the kernels' argument order, and each field's annotation carries
its :class:`Table` layout (shape, dtype, initial value), so ``dynsteer.steering.tables.SteeringTables`` allocates
them from it, the launchers derive their checks and stride arguments from it, and the custom ops
(``dynsteer.kernels.ops``, which need flat tensor arguments) derive their schemas from the field list. Adding a table
is a field here plus its use in the kernels, their torch twins and ``SteeringTables.write_row``.

One :class:`SiteTables` is built per site where its tables are allocated, never per step; a static engine's leaves
the dynamic fields ``None``. Semantics of every field: ``dynsteer.kernels.reference`` (static) and
``dynsteer.kernels.dynamic_reference`` (dynamic).
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import Annotated, NamedTuple, Optional

import torch

__all__ = ["DYNAMIC_FIELDS", "GATE_FIELDS", "LAYOUT", "ROW_LIVE", "SITE_FIELDS", "STATIC_FIELDS", "SiteTables",
           "Table"]


@dataclass(frozen=True)
class Table:
    """One table's layout: ``dims`` names its dimensions (``R`` rows, ``K`` clamp slots, ``G`` gate slots, ``H``
    hidden, ``N`` tokens of capacity), allocated as ``dtype`` filled with ``fill``."""

    dims: str
    dtype: torch.dtype = torch.float32
    fill: float = 0.0

    def shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        return tuple(sizes[d] for d in self.dims)

    @property
    def per_site(self) -> bool:
        """Indexed by row: each site owns one (the gate buffers, indexed by gate slot, are shared)."""
        return self.dims[0] == "R"

    @property
    def hidden(self) -> bool:
        """Rows of H values (vectors, directions): the kernels need that last dimension contiguous and equal to h's."""
        return self.dims.endswith("H")

    @property
    def strides(self) -> int:
        """How many strides the per-site kernels take for it: every dimension but a hidden one."""
        return len(self.dims) - self.hidden


_T = torch.Tensor
_OptT = Optional[torch.Tensor]
_I32 = torch.int32


class SiteTables(NamedTuple):
    """One site's tables, in the kernels' order: the static six, then (dynamic tier only) the site's monitor and
    dyn-term tables and the shared gate buffers. Row 0 holds nothing except ``row_live[0]``, the site's summary (the
    OR of the flags of the rows a step reads)."""

    vec: Annotated[_T, Table("RH")]  # additive vectors
    clamp_dir: Annotated[_T, Table("RKH")]  # unit clamp directions
    clamp_lo: Annotated[_T, Table("RK", fill=-math.inf)]  # lower bounds
    clamp_hi: Annotated[_T, Table("RK", fill=math.inf)]  # upper bounds
    clamp_strength: Annotated[_T, Table("RK")]  # 0 = slot off
    row_live: Annotated[_T, Table("R", _I32)]  # flags of what the row holds here: 1 vec, 2 clamp, 4 monitors, 8 dyn
    clamp_gate: Annotated[_OptT, Table("RK", _I32, -1)] = None  # gate slot scaling each clamp; -1 = ungated
    mon_mask: Annotated[_OptT, Table("R", _I32)] = None  # bit s: this site computes gate slot s
    mon_probe: Annotated[_OptT, Table("RGH")] = None  # probe directions
    mon_sharp: Annotated[_OptT, Table("RG")] = None  # sigmoid slopes
    mon_thresh: Annotated[_OptT, Table("RG")] = None  # sigmoid thresholds (score units)
    mon_floor: Annotated[_OptT, Table("RG")] = None  # gates below it become 0
    dyn_mask: Annotated[_OptT, Table("R", _I32)] = None  # bit s: add gates[s] * dyn_vec[s] here
    dyn_vec: Annotated[_OptT, Table("RGH")] = None  # gated vectors
    gate_mul: Annotated[_OptT, Table("GN")] = None  # per-token gate multipliers (staged by the host)
    gate_add: Annotated[_OptT, Table("GN")] = None  # per-token gate offsets (staged by the host)
    gates: Annotated[_OptT, Table("GN")] = None  # gates, written by monitors, read by later sites
    scores: Annotated[_OptT, Table("GN")] = None  # raw probe scores

    @property
    def dynamic(self) -> bool:
        """Whether these are a dynamic tier's tables (every field set) rather than the static six."""
        return self.clamp_gate is not None


LAYOUT: dict[str, Table] = {
    name: hint.__metadata__[0]
    for name, hint in typing.get_type_hints(SiteTables, include_extras=True).items()}
"""Every field's :class:`Table`, in field order."""

DYNAMIC_FIELDS: tuple[str, ...] = SiteTables._fields
"""What ``steer_site_dyn`` takes: every field."""
STATIC_FIELDS: tuple[str, ...] = tuple(f for f in DYNAMIC_FIELDS if f not in SiteTables._field_defaults)
"""What ``steer_site`` takes: the fields every site has (a prefix of the field list)."""
SITE_FIELDS: tuple[str, ...] = tuple(f for f in DYNAMIC_FIELDS if LAYOUT[f].per_site)
"""A dynamic site's own tables (the fused op's ``tabs_a`` / ``tabs_b``): every field but the shared gate buffers."""
GATE_FIELDS: tuple[str, ...] = tuple(f for f in DYNAMIC_FIELDS if not LAYOUT[f].per_site)
"""The gate buffers every site of a dynamic tier shares (the fused op's ``gate_bufs``)."""
ROW_LIVE = DYNAMIC_FIELDS.index("row_live")
"""The index of ``row_live`` in a site's table list."""
