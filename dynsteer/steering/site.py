"""The module installed at each hooked residual site of a decoder layer.

It holds views of the shared tables as (non-persistent) buffers, so torch.compile sees them as graph inputs and CUDA
graphs capture their addresses; its forward is one opaque custom op with no host synchronisation.

Where the site is followed by a fused add + RMS norm, the engine adapter may instead hand the site to that norm
(:func:`fused_add_rms_norm`): one kernel runs up to two sites and the norm, so the site costs no launch of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from dynsteer.kernels import ops  # registers torch.ops.dynsteer.*
from dynsteer.kernels.dynamic_reference import steer_site_dyn_reference
from dynsteer.kernels.reference import steer_site_reference
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
        self.dynamic = tables.max_gates > 0
        self.register_buffer("row_index", tables.row_index, persistent=False)
        for name, view in (tables.views(layer, site) | tables.gate_buffers).items():
            self.register_buffer(name, view, persistent=False)
        # The op writes the unsteered residual into the capture buffer in the same launch, at the rows the host
        # gave this step's captured tokens in ``stage_slot`` (shared by every place; -1 everywhere when nothing is
        # captured, so an idle step stores nothing). A place without a buffer passes an empty tensor (the op's
        # mutable buffer argument cannot be None under torch.compile).
        if stage is None:
            stage = tables.row_index.new_empty((0, tables.hidden_size), dtype=torch.get_default_dtype())
        self.register_buffer("stage", stage, persistent=False)
        self.register_buffer("stage_slot", stage_slot if self.capturing else None, persistent=False)

    def forward(self, h: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
        static = (h, r, self.row_index, self.vec, self.clamp_dir, self.clamp_lo, self.clamp_hi, self.clamp_strength,
                  self.row_live)
        dyn = ()
        if self.dynamic:  # monitors write gates/scores in place; later sites of the same forward read them
            dyn = (self.clamp_gate, self.mon_mask, self.mon_probe, self.mon_sharp, self.mon_thresh, self.mon_floor,
                   self.dyn_mask, self.dyn_vec, self.gate_mul, self.gate_add, self.gates, self.scores)
        if self.inline:  # plain torch ops: traced into the graph, fusable by torch.compile
            if self.capturing:  # the unsteered residual, read before this site's steering
                torch.ops.dynsteer.stash_residual(h, r, self.stage, self.stage_slot)
            return steer_site_dyn_reference(*static, *dyn) if self.dynamic else steer_site_reference(*static)
        if self.dynamic:
            return torch.ops.dynsteer.steer_site_dyn(*static, *dyn, self.stage, self.stage_slot)
        return torch.ops.dynsteer.steer_site(*static, self.stage, self.stage_slot)

    def tables(self) -> list[torch.Tensor]:
        """This site's tables in ``SteeringTables`` order (the fused op's ``tabs_a`` / ``tabs_b``)."""
        names = SteeringTables.FIELDS + (SteeringTables.DYN_FIELDS if self.dynamic else ())
        return [getattr(self, name) for name in names]

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
    gate_bufs = [lead.gate_mul, lead.gate_add, lead.gates, lead.scores] if lead.dynamic else []
    slot = next((h.stage_slot for h in hooks if h.capturing), None)
    return ops.steer_add_rms_norm(  # an absent site: no tables, the op's empty capture buffer
        x, residual, weight, eps, lead.row_index, first.tables() if first is not None else [],
        second.tables() if second is not None else [], gate_bufs, first.stage if first is not None else None,
        second.stage if second is not None else None, slot, unit_offset)
