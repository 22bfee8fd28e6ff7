"""Plain-torch reference of the per-site steering op (the "twin" of the Triton kernel).

Contract (shared by every implementation of ``steer_site``)::

    steer_site(h, r, row_index, tables, stage=None, stage_slot=None) -> out
      h:              [T, H] float32 | bfloat16 | float16, the branch tensor we may modify
      r:              [T, H] same dtype, or None (carried residual; the residual stream is h + r, or h)
      row_index:      int32 [N >= T]; only the first T entries are used
      tables:         the site's SiteTables (dynsteer.kernels.site_tables); steer_site reads the static six:
      vec:            float32 [R, H]     additive vector per table row (row 0 is the identity: zeros, and the
                                         Triton kernels copy its tokens without reading the tables)
      clamp_dir:      float32 [R, K, H]  unit directions (zeros where unused)
      clamp_lo/hi:    float32 [R, K]     bounds (-inf / +inf for an open side)
      clamp_strength: float32 [R, K]     0 = clamp slot off
      row_live:       int32 [R]          what row i holds here: bit 0 (1) vec[i] != 0, bit 1 (2) some strength
                                         != 0 (bits 2 / 4 / 3 / 8: monitors / dyn terms, see dynamic_reference);
                                         A pure function of the other tables, so it changes no result: the
                                         Triton kernels use it to skip the loads of a row that holds nothing (or
                                         only some groups) here; the references ignore it. Row 0 holds nothing;
                                         its entry is the site's summary: a superset of the OR of the flags of
                                         every row row_index names (0 lets the kernels skip the site for every
                                         token without loading a row's flags).
      stage:          [N, H] or empty, optional: receives the unsteered residual (capture), see below
      stage_slot:     int32 [M >= T], optional: the stage row of each token (-1: none); None: row t

    for every token t:  i = row_index[t]
      x = float32(h[t]) + vec[i]
      for k in 0..K-1 (sequentially):
        if clamp_strength[i, k] != 0:
          u = clamp_dir[i, k];  p = dot(x + float32(r[t]) (or x), u)
          x = x + clamp_strength[i, k] * (clip(p, lo[i, k], hi[i, k]) - p) * u
      out[t] = x cast to h.dtype

``clip(p, lo, hi)`` is ``min(max(p, lo), hi)`` (so ``hi`` wins if ``lo > hi``). The clamp acts on the
full residual stream ``h + r + v`` but only ``h`` is modified; ablation is the clamp to ``[0, 0]``.
A row whose vec is zero and whose strengths are all zero returns ``h`` bit-for-bit. ``out`` is
always a new tensor.

Capture rides the same op (no extra kernel per captured place): when ``stage`` is given and not empty,
``stage[j] = cast(float32(h[t]) + float32(r[t]))`` (or ``h[t]``), read before any steering, for every token
``t < T`` with ``j = stage_slot[t]`` in ``[0, N)`` (``j = t`` without ``stage_slot``, which then needs
``N >= T``); every other row is left untouched. The host gives slots only to the tokens it captures this step, in
the order it wants them: a step that captures nothing stores nothing, and ``stage[:n]`` is the step's capture.
"""

from __future__ import annotations

import torch

from dynsteer.kernels.site_tables import SiteTables

__all__ = ["apply_clamps", "stash_residual", "steer_site_reference"]


def steer_site_reference(h: torch.Tensor, r: torch.Tensor | None, row_index: torch.Tensor, tables: SiteTables,
                         stage: torch.Tensor | None = None, stage_slot: torch.Tensor | None = None) -> torch.Tensor:
    """Apply per-token steering (additive vector, then sequential projection clamps).

    Free of data-dependent Python control flow so it traces into torch.compile graphs: every
    clamp is computed for every token and discarded with ``torch.where`` where the strength is 0,
    which keeps unsteered tokens bit-identical to ``h``.

    Args:
        h: [T, H] branch activations (float32 / bfloat16 / float16).
        r: [T, H] carried residual in h's dtype, or None.
        row_index: int32 [N >= T] table row per token; entries past T are ignored.
        tables: the site's tables; this reads ``vec`` (float32 [R, H] additive vectors), ``clamp_dir`` (float32
            [R, K, H] unit clamp directions), ``clamp_lo`` / ``clamp_hi`` (float32 [R, K] bounds) and
            ``clamp_strength`` (float32 [R, K], 0 = off); ``row_live`` (int32 [R] per-row flags, derived from the
            tables) is unused here, and so are a dynamic tier's fields.
        stage: capture buffer [N, H] written in place with the unsteered residual (None / empty: none).
        stage_slot: int32 [M >= T] stage row per token (-1: not captured); None: token t to row t.

    Returns:
        New [T, H] tensor in h's dtype.
    """
    stash_residual(h, r, stage, stage_slot)
    num_tokens = h.shape[0]
    idx = row_index[:num_tokens].long()
    # h.float() + 0.0 is exact, so rows with vec == 0 stay bit-identical after the final cast.
    x = h.float() + tables.vec.index_select(0, idx)
    r32 = r.float() if r is not None else None
    x = apply_clamps(x, r32, idx, tables, tables.clamp_strength.index_select(0, idx))
    return x.to(h.dtype)


def stash_residual(h: torch.Tensor, r: torch.Tensor | None, stage: torch.Tensor | None,
                   stage_slot: torch.Tensor | None = None) -> None:
    """Write the residual stream ``h + r`` (or ``h``) of token ``t`` into ``stage[stage_slot[t]]`` for the tokens
    with a slot in range (None: ``stage[:T]``; empty / None stage: no-op).

    The sum is taken in float32 and rounded once to the stage's dtype, as the kernels do (for equal dtypes this is
    exactly ``torch.add(h, r)``). With slots this selects rows on the host's view of the data (``nonzero``): it is
    the reference, not a graph-safe path on GPU (there ``stash_triton`` runs).
    """
    if stage is None or stage.numel() == 0:
        return
    n = h.shape[0]
    if stage_slot is None:
        if stage.shape[0] < n:
            raise ValueError(f"stash_residual: stage has {stage.shape[0]} rows for {n} tokens and no stage_slot")
        dst, src_rows = stage[:n], None
    else:
        slot = stage_slot[:n].long()
        src_rows = torch.nonzero((slot >= 0) & (slot < stage.shape[0])).flatten()
        if not src_rows.numel():
            return
        dst = torch.empty((src_rows.numel(), stage.shape[1]), dtype=stage.dtype, device=stage.device)
        h, r = h.index_select(0, src_rows), None if r is None else r.index_select(0, src_rows)
    if r is None:
        dst.copy_(h)
    elif stage.dtype == h.dtype:
        torch.add(h, r, out=dst)
    else:
        dst.copy_(h.float() + r.float())
    if src_rows is not None:
        stage.index_copy_(0, slot.index_select(0, src_rows), dst)


def apply_clamps(
    x: torch.Tensor,
    r32: torch.Tensor | None,
    idx: torch.Tensor,
    tables: SiteTables,
    strength: torch.Tensor,
) -> torch.Tensor:
    """The K sequential projection clamps of the contract, given per-token strengths.

    Shared with the dynamic op (``dynamic_reference``), whose gated clamps only change the strength.

    Args:
        x: float32 [T, H] branch values so far (h + vec, ...).
        r32: float32 [T, H] carried residual, or None.
        idx: int64 [T] table row per token.
        tables: the site's tables (``clamp_dir``, ``clamp_lo``, ``clamp_hi`` are read).
        strength: float32 [T, K] per-token strengths (0 = slot off for that token).

    Returns:
        New float32 [T, H] tensor.
    """
    clamp_dir = tables.clamp_dir
    lo = tables.clamp_lo.index_select(0, idx)
    hi = tables.clamp_hi.index_select(0, idx)
    # K is a static shape, so this loop unrolls at trace time (no value-dependent branching).
    for k in range(clamp_dir.shape[1]):
        u = clamp_dir[:, k].index_select(0, idx)  # [T, H]
        full = x + r32 if r32 is not None else x
        p = (full * u).sum(dim=-1)  # [T]
        # min(max(p, lo), hi): same operation order as the kernel; finite for finite p even with
        # infinite bounds, so a zero direction contributes 0 * finite = 0, never nan.
        clipped = torch.minimum(torch.maximum(p, lo[:, k]), hi[:, k])
        s = strength[:, k]
        coef = s * (clipped - p)
        # where(), not multiplication by a mask: strength 0 must be an exact no-op even if the
        # unused slot holds garbage (inf bounds, nan directions).
        x = torch.where((s != 0).unsqueeze(-1), x + coef.unsqueeze(-1) * u, x)
    return x
