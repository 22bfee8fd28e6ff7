"""The module installed at each hooked residual site of a decoder layer.

It holds views of the shared tables as (non-persistent) buffers, so torch.compile sees them as graph inputs and CUDA
graphs capture their addresses; its forward is one opaque custom op with no host synchronisation.

Where the site is followed by a fused add + RMS norm, the engine adapter may instead hand the site to that norm
(:func:`fused_add_rms_norm`): one kernel runs up to two sites and the norm, so the site costs no launch of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from dynsteer.kernels import ops, site_summary  # ops registers torch.ops.dynsteer.*
from dynsteer.kernels.dynamic_reference import steer_site_dyn_reference
from dynsteer.kernels.reference import steer_site_reference
from dynsteer.kernels.site_tables import DYNAMIC_FIELDS, SITE_FIELDS, STATIC_FIELDS, SiteTables
from dynsteer.spec import Site
from dynsteer.steering.tables import SteeringTables

# vLLM's compile cache hashes the source files Dynamo traces (this one) but not tables.py; a cached graph built for
# another buffer layout can read stale snapshots. Bump this when the tables' tensors change shape or ownership.
TABLE_LAYOUT = 6


class SiteHook(nn.Module):
    """Applies the row-selected additive vector and clamps to the branch tensor ``h`` given the residual ``r``."""

    def __init__(self, tables: SteeringTables, layer: int, site: Site, inline: bool = False,
                 stage: torch.Tensor | None = None, stage_slot: torch.Tensor | None = None) -> None:
        super().__init__()
        self.layer, self.site, self.inline = layer, site, inline
        # True once the add-norm that follows this site runs it (fused_add_rms_norm); the layer then calls forward
        # only where that norm is not reached with a residual (a model's first layer)
        self.fused = False
        self.capturing = stage is not None
        # the site's tables as the kernels take them, built once with the tables (never per step)
        self.site_tables: SiteTables = tables.site_tables(layer, site)
        self.dynamic = self.site_tables.dynamic
        self._fields = DYNAMIC_FIELDS if self.dynamic else STATIC_FIELDS
        self._own = len(SITE_FIELDS if self.dynamic else STATIC_FIELDS)  # then the shared gate buffers
        self._op = ops.steer_site_dyn if self.dynamic else ops.steer_site
        self._reference = steer_site_dyn_reference if self.dynamic else steer_site_reference
        self.register_buffer("row_index", tables.row_index, persistent=False)
        for name in self._fields:
            self.register_buffer(name, getattr(self.site_tables, name), persistent=False)
        # The op writes the unsteered residual into the capture buffer in the same launch, at the rows the host
        # gave this step's captured tokens in ``stage_slot`` (shared by every place; -1 everywhere when nothing is
        # captured, so an idle step stores nothing). A place without a buffer passes an empty tensor (the op's
        # mutable buffer argument cannot be None under torch.compile).
        if stage is None:
            stage = tables.row_index.new_empty((0, tables.hidden_size), dtype=torch.get_default_dtype())
        self.register_buffer("stage", stage, persistent=False)
        self.register_buffer("stage_slot", stage_slot if self.capturing else None, persistent=False)

    def live_tables(self) -> SiteTables:
        """The site's tables for this call: :attr:`site_tables` itself when called eagerly; while Dynamo traces, the
        same tensors read as this module's buffers, so compiled graphs keep taking them as the module's inputs (as
        vLLM's compile cache expects). Eager calls skip nn.Module's attribute lookup, ~1 µs per table."""
        if torch.compiler.is_compiling():
            return SiteTables(*[getattr(self, name) for name in self._fields])
        return self.site_tables

    def forward(self, h: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
        if self._idle_now(h):
            return h
        # dynamic: monitors write gates/scores in place; later sites of the same forward read them
        row_index, tables = self.row_index, self.live_tables()
        if self.inline:  # plain torch ops: traced into the graph, fusable by torch.compile
            if self.capturing:  # the unsteered residual, read before this site's steering
                torch.ops.dynsteer.stash_residual(h, r, self.stage, self.stage_slot)
            return self._reference(h, r, row_index, tables)
        return self._op(h, r, row_index, tables, self.stage, self.stage_slot)

    def _idle_now(self, h: torch.Tensor) -> bool:
        """An eager call at a site no row of this step's batch touches (its summary is 0, :mod:`site_summary`) and
        with no capture buffer: the op would return ``h``'s values and write nothing (a monitor's gates and scores
        stay as they are; only a site whose rows hold a monitor writes them), so ``h`` itself is the result, without
        the op's dispatch and per-token gathers. Never while Dynamo traces or a CUDA graph is captured: a graph must
        hold the op."""
        return (not self.capturing and not torch.compiler.is_compiling()
                and not (h.is_cuda and torch.cuda.is_current_stream_capturing())
                and site_summary.idle(self.site_tables))

    def tables(self) -> list[torch.Tensor]:
        """This site's own tables in ``SiteTables`` order (the fused op's ``tabs_a`` / ``tabs_b``)."""
        return list(self.live_tables()[:self._own])

    def gate_buffers(self) -> list[torch.Tensor]:
        """The shared gate buffers in ``SiteTables`` order (the fused op's ``gate_bufs``); empty without a dynamic
        tier."""
        return list(self.live_tables()[self._own:]) if self.dynamic else []

    def extra_repr(self) -> str:
        return (f"layer={self.layer}, site={self.site}, inline={self.inline}, capturing={self.capturing}, "
                f"dynamic={self.dynamic}, fused={self.fused}")


def fused_add_rms_norm(first: SiteHook | None, second: SiteHook | None, x: torch.Tensor, residual: torch.Tensor,
                       weight: torch.Tensor, eps: float,
                       unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Sites ``first`` then ``second`` (either may be None) on the pair ``(x, residual)``, then the fused add + RMS
    norm with ``weight`` / ``eps`` (``unit_offset``: Gemma's ``1 + weight``), as one ``dynsteer::steer_add_rms_norm``
    op: ``(normed, new residual)``, equal to the separate site ops followed by vLLM's own norm
    (``dynsteer.kernels.fused_reference``)."""
    hooks = [h for h in (first, second) if h is not None]
    lead = hooks[0]
    slot = next((h.stage_slot for h in hooks if h.capturing), None)
    return ops.steer_add_rms_norm(  # an absent site: no tables, the op's empty capture buffer
        x, residual, weight, eps, lead.row_index, first.tables() if first is not None else [],
        second.tables() if second is not None else [], lead.gate_buffers(), first.stage if first is not None else None,
        second.stage if second is not None else None, slot, unit_offset)
