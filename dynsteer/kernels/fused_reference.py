"""Plain-torch reference of ``steer_add_rms_norm`` (the twin of ``dynsteer.kernels.triton_fused``).

Contract::

    steer_add_rms_norm(h, r, weight, eps, row_index, tabs_a, tabs_b, gate_bufs, stage_a, stage_b, stage_slot,
                       unit_offset=False) -> (normed, residual)
      h, r:         [T, H] the branch and the carried residual entering a fused add-norm
      weight, eps:  the RMS norm's weight [H] and epsilon (``unit_offset``: Gemma's norm, ``normed * (1 + w)`` in fp32)
      tabs_a/b:     the tables of the site applied first / second, in ``SiteTables`` order: the static six
                    (``STATIC_FIELDS``) or, with a dynamic tier, the site's fourteen (``SITE_FIELDS``); an empty
                    list: no site
      gate_bufs:    the shared gate buffers ``[gate_mul, gate_add, gates, scores]`` (``GATE_FIELDS``) with a
                    dynamic tier (gates / scores updated in place), else empty
      stage_a/b:    capture buffers of the two sites (empty: not captured), rows given by ``stage_slot``

    x = h
    x = steer_site(_dyn)(x, r, row_index, SiteTables(*tabs_a, *gate_bufs), stage_a, stage_slot)   if tabs_a
    x = steer_site(_dyn)(x, r, row_index, SiteTables(*tabs_b, *gate_bufs), stage_b, stage_slot)   if tabs_b
    normed, residual = vLLM's fused_add_rms_norm(x, r, weight, eps)

i.e. exactly the separate site ops followed by the layer's own norm, in one step.
"""

from __future__ import annotations

import torch

from dynsteer.kernels.dynamic_reference import steer_site_dyn_reference
from dynsteer.kernels.reference import steer_site_reference
from dynsteer.kernels.site_tables import STATIC_FIELDS, SiteTables

__all__ = ["add_rms_norm_reference", "steer_add_rms_norm_reference"]


def add_rms_norm_reference(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float,
                           unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.26's ``fused_add_rms_norm`` (``vllm.ir.ops.layernorm``), without a variance-size override; with
    ``unit_offset`` as ``GemmaRMSNorm`` calls it (weight ``w.float() + 1``)."""
    if unit_offset:
        weight = weight.float() + 1.0
    orig = x.dtype
    s = x.to(torch.float32) + r.to(torch.float32)
    residual = s.to(orig)
    normed = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed.to(weight.dtype) * weight).to(orig), residual


def steer_add_rms_norm_reference(h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float,
                                 row_index: torch.Tensor, tabs_a: list[torch.Tensor], tabs_b: list[torch.Tensor],
                                 gate_bufs: list[torch.Tensor], stage_a: torch.Tensor | None = None,
                                 stage_b: torch.Tensor | None = None, stage_slot: torch.Tensor | None = None,
                                 unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The two sites (see the module docstring), then the add-norm (``unit_offset``: Gemma's ``1 + w``)."""
    x = h
    for tabs, stage in ((tabs_a, stage_a), (tabs_b, stage_b)):
        if not tabs:
            continue
        if len(tabs) == len(STATIC_FIELDS):  # the gate buffers belong to a dynamic tier's sites only
            x = steer_site_reference(x, r, row_index, SiteTables(*tabs), stage, stage_slot)
        else:
            x = steer_site_dyn_reference(x, r, row_index, SiteTables(*tabs, *gate_bufs), stage, stage_slot)
    return add_rms_norm_reference(x, r, weight, eps, unit_offset)
