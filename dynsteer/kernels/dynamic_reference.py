"""Plain-torch reference of the dynamic per-site steering op: in-graph monitors plus gated steering terms.

Contract (shared by every implementation of ``steer_site_dyn``)::

    steer_site_dyn(h, r, row_index, tables, stage=None, stage_slot=None) -> out
                                                              (mutates tables.gates, tables.scores, stage)
      h, r, row_index, stage, stage_slot and the tables' vec, clamp_*, row_live: exactly as steer_site
                   (dynsteer.kernels.reference); row_live also flags monitors (4: mon_mask[i] != 0) and dyn terms
                   (8: dyn_mask[i] != 0); every field of tables (a SiteTables of a dynamic tier) is read:
      R rows, K clamp slots, G gate slots (G >= 1, small), N >= T tokens of capacity
      clamp_gate:  int32 [R, K]     gate slot scaling that clamp's strength; -1 = static (ungated)
      mon_mask:    int32 [R]        bit s set => this site computes gate slot s for tokens of that row
      mon_probe:   float32 [R, G, H];  mon_sharp, mon_thresh, mon_floor: float32 [R, G]
      dyn_mask:    int32 [R]        bit s set => add gates[s, t] * dyn_vec[i, s] at this site
      dyn_vec:     float32 [R, G, H]
      gate_mul, gate_add: float32 [G, N]   per-token multipliers staged by the host each step
      gates, scores:      float32 [G, N]   persistent buffers carried across sites/layers within one forward

    for every token t < T:  i = row_index[t]
      res = float32(h[t]) + float32(r[t])  (float32(h[t]) when r is None)   # residual BEFORE this site's steering
      for s in 0..G-1 with bit s of mon_mask[i]:
        score = dot(res, mon_probe[i, s])                                   (float32 accumulation)
        g = sigmoid(mon_sharp[i, s] * (score - mon_thresh[i, s]))
        g = g if g >= mon_floor[i, s] else 0
        scores[s, t] = score
        gates[s, t]  = g * gate_mul[s, t] + gate_add[s, t]
      x = float32(h[t]) + vec[i]
      for s in 0..G-1 with bit s of dyn_mask[i]:  x = x + gates[s, t] * dyn_vec[i, s]
      for k in 0..K-1 (sequentially):
        gs = clamp_strength[i, k] * (1 if clamp_gate[i, k] < 0 else gates[clamp_gate[i, k], t])
        if gs != 0:   (steer_site's clamp, with strength gs)
          u = clamp_dir[i, k];  p = dot(x + float32(r[t]) (or x), u);  x = x + gs * (clip(p, lo, hi) - p) * u
      out[t] = x cast to h.dtype

Entries ``gates[s, t]`` / ``scores[s, t]`` of tokens whose row does not compute slot ``s`` here, and every entry with
``t >= T``, are left untouched: they may hold a gate written at an earlier site of this forward, which later sites
read (the gate is carried forward). Slots read by ``dyn_mask`` or ``clamp_gate`` see the value computed at this site
when this site computes it. A row with ``mon_mask == 0``, ``dyn_mask == 0`` and every ``clamp_gate`` -1 gives
exactly ``steer_site``'s result, bit for bit (row 0, all zeros / -1, is what unsteered tokens read). The host keeps
prefill tokens ungated by staging ``gate_mul = gate_add = 0`` for them; ``clamp_gate`` entries must lie in [-1, G).
"""

from __future__ import annotations

import torch

from dynsteer.kernels.reference import apply_clamps, stash_residual
from dynsteer.kernels.site_tables import SiteTables

__all__ = ["steer_site_dyn_reference"]


def steer_site_dyn_reference(h: torch.Tensor, r: torch.Tensor | None, row_index: torch.Tensor, tables: SiteTables,
                             stage: torch.Tensor | None = None, stage_slot: torch.Tensor | None = None) -> torch.Tensor:
    """Monitor gates, then gated steering (additive vector, gated dyn vectors, gated clamps), per token.

    Free of data-dependent Python control flow, so it traces into ``torch.compile(fullgraph=True)`` graphs and is
    CUDA-graph safe: every slot is computed for every token and kept with ``torch.where`` where the row's mask says
    so; the G and K loops unroll at trace time. ``gates`` and ``scores`` are written in place, only on ``[:, :T]``.

    Args:
        h: [T, H] branch activations (float32 / bfloat16 / float16).
        r: [T, H] carried residual in h's dtype, or None.
        row_index: int32 [N >= T] table row per token; entries past T are ignored.
        tables: the site's tables with every dynamic field set: ``vec``, ``clamp_*`` and ``row_live`` as in
            ``steer_site_reference``; ``clamp_gate`` (int32 [R, K] gate slot scaling each clamp's strength, -1 =
            ungated); ``mon_mask`` (int32 [R] bitmask of gate slots this site computes); ``mon_probe`` (float32
            [R, G, H] probe directions); ``mon_sharp`` / ``mon_thresh`` (float32 [R, G] sigmoid slopes and
            thresholds, in score units); ``mon_floor`` (float32 [R, G]: gates below it become 0, before gate_mul /
            gate_add); ``dyn_mask`` (int32 [R] bitmask of gate slots whose dyn vector is added here); ``dyn_vec``
            (float32 [R, G, H] gated vectors); ``gate_mul`` / ``gate_add`` (float32 [G, N] per-token multipliers and
            offsets); ``gates`` / ``scores`` (float32 [G, N] gate buffer and raw probe scores, updated in place).
        stage, stage_slot: capture, as in ``steer_site_reference``.

    Returns:
        New [T, H] tensor in h's dtype.

    Example:
        >>> import torch
        >>> from dynsteer.kernels.site_tables import SiteTables
        >>> h, row = torch.tensor([[3.0, 4.0]]), torch.tensor([1], dtype=torch.int32)
        >>> zeros = lambda *s: torch.zeros(2, *s)
        >>> probe, dvec = zeros(1, 2), zeros(1, 2)
        >>> probe[1, 0], dvec[1, 0] = torch.tensor([0.6, 0.8]), torch.tensor([10.0, 0.0])
        >>> gates, scores = torch.zeros(1, 4), torch.zeros(1, 4)
        >>> one = torch.ones(1, 4)
        >>> tables = SiteTables(
        ...     zeros(2), zeros(0, 2), zeros(0), zeros(0), zeros(0), torch.tensor([0, 12], dtype=torch.int32),
        ...     torch.zeros(2, 0, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), probe,
        ...     torch.tensor([[0.0], [2.0]]), torch.tensor([[0.0], [5.0]]), zeros(1),
        ...     torch.tensor([0, 1], dtype=torch.int32), dvec, one, 0 * one, gates, scores)
        >>> out = steer_site_dyn_reference(h, None, row, tables)
        >>> scores[0, 0].item(), gates[0, 0].item(), out.tolist()
        (5.0, 0.5, [[8.0, 4.0]])
    """
    stash_residual(h, r, stage, stage_slot)
    gates, scores, gate_mul, gate_add = tables.gates, tables.scores, tables.gate_mul, tables.gate_add
    num_tokens, num_slots = h.shape[0], gates.shape[0]
    idx = row_index[:num_tokens].long()
    h32 = h.float()
    r32 = r.float() if r is not None else None
    res = h32 + r32 if r32 is not None else h32
    mon_rows = tables.mon_mask.index_select(0, idx)
    dyn_rows = tables.dyn_mask.index_select(0, idx)

    # Gate value per slot as later terms see it: computed here where the row monitors the slot, carried otherwise.
    gate_now: list[torch.Tensor] = []
    for s in range(num_slots):
        on = (mon_rows & (1 << s)) != 0
        score = (res * tables.mon_probe[:, s].index_select(0, idx)).sum(dim=-1)
        sharp, thresh = tables.mon_sharp[:, s].index_select(0, idx), tables.mon_thresh[:, s].index_select(0, idx)
        g = torch.sigmoid(sharp * (score - thresh))
        g = torch.where(g >= tables.mon_floor[:, s].index_select(0, idx), g, torch.zeros_like(g))
        g = g * gate_mul[s, :num_tokens] + gate_add[s, :num_tokens]
        g = torch.where(on, g, gates[s, :num_tokens])
        scores[s, :num_tokens].copy_(torch.where(on, score, scores[s, :num_tokens]))
        gates[s, :num_tokens].copy_(g)
        gate_now.append(g)

    # h.float() + 0.0 is exact and where() drops untaken terms, so static rows stay bit-identical to steer_site.
    x = h32 + tables.vec.index_select(0, idx)
    for s in range(num_slots):
        on = (dyn_rows & (1 << s)) != 0
        term = gate_now[s].unsqueeze(-1) * tables.dyn_vec[:, s].index_select(0, idx)
        x = torch.where(on.unsqueeze(-1), x + term, x)

    slot = tables.clamp_gate.index_select(0, idx).long()  # [T, K]
    picked = torch.stack(gate_now, dim=1).gather(1, slot.clamp(min=0))  # [T, K]
    # strength * 1.0 is exact for ungated clamps; a gate of 0 turns the clamp off like strength 0 does.
    scale = torch.where(slot < 0, torch.ones_like(picked), picked)
    strength = tables.clamp_strength.index_select(0, idx) * scale
    x = apply_clamps(x, r32, idx, tables, strength)
    return x.to(h.dtype)
