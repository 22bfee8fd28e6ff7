"""Fused Triton kernels for the per-site steering ops.

``steer_site_triton`` (semantics: ``dynsteer.kernels.reference``): one program per token loads the row
index and, for a steered row, that row's ``row_live`` flags at this site, gathers the vec row, adds it,
applies the K clamps (skipped by a scalar branch when the strength is 0), all in fp32, and writes a new
output. The flags say which of the row's tables hold anything here: a row with none (steered at other
sites only) costs one flag load more than row 0 (the index), not its vector (4H bytes) and strengths,
and a row's vector / clamp loop are loaded / run only where it has one. ``row_live[0]`` (row 0 holds
nothing) is the site's summary for the step, loaded alongside the index: 0 means no row of the batch
holds anything here, and every token is copied without that dependent flag load.

``steer_site_dyn_triton`` (semantics: ``dynsteer.kernels.dynamic_reference``) does the same after
the row's monitors (probe score -> sigmoid gate, stored to ``gates``/``scores``) and gated dyn
vectors; its clamps may be scaled by a gate. It is a second kernel rather than a constexpr flag on
the first, so the static launch keeps its short argument list (host launch cost grows with it);
the clamp loop is one shared ``@triton.jit`` helper, inlined into both.

Given a capture buffer (``stage``), either kernel also stores the unsteered residual stream of each token
that ``stage_slot`` gives a row (``stage[stage_slot[t]]``; -1: not captured) before steering it: capture
rides the steering launch instead of adding a kernel per captured place, so an engine with capture
enabled runs as many kernels per step as one without, and a step that captures nothing stores nothing.
``stash_triton`` is the same store on its own (the ``inline`` forward mode's capture op).

Both launchers take the site's tables as one :class:`~dynsteer.kernels.site_tables.SiteTables` and share their
host side (:func:`_launch`): the kernels take the tables in its field order, and the checks and stride arguments
follow from its layout. Both are CUDA-graph safe: they never sync with the device, allocate nothing but the output
(``torch.empty_like``), and their grids depend only on shapes.

Note: ``triton.jit`` decides between compiled and interpreted mode when this module is
imported, so ``TRITON_INTERPRET=1`` must be in the environment before the first import of this
module (not merely before ``import triton``) for the kernel to run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dynsteer.kernels.site_tables import DYNAMIC_FIELDS, LAYOUT, ROW_LIVE, SITE_FIELDS, STATIC_FIELDS, SiteTables

__all__ = ["stash_triton", "steer_site_dyn_triton", "steer_site_triton"]


@triton.jit
def _clamp_slots(
    x, res, row, t, offs, mask, K, dir_ptr, lo_ptr, hi_ptr, s_ptr, cgate_ptr, gates_ptr, stride_dir_row,
    stride_dir_k, stride_lo_row, stride_lo_k, stride_hi_row, stride_hi_k, stride_s_row, stride_s_k, stride_cg_row,
    stride_cg_k, stride_gates_g, stride_gates_t, HAS_R: tl.constexpr, GATED: tl.constexpr,
):
    """The K sequential clamps of one token (x: fp32 [BLOCK_H]); GATED scales strengths by gates."""
    # Runtime loop over K (not constexpr): one compiled kernel serves every table width.
    for k in range(K):
        s = tl.load(s_ptr + row * stride_s_row + k * stride_s_k)
        if GATED:
            if s != 0.0:  # unsteered rows (strength 0) skip the gate-slot load too
                slot = tl.load(cgate_ptr + row * stride_cg_row + k * stride_cg_k)
                if slot >= 0:
                    s = s * tl.load(gates_ptr + slot * stride_gates_g + t * stride_gates_t)
        # Scalar branch: unsteered tokens skip the direction load and the reduction entirely,
        # which also keeps them bit-identical to h.
        if s != 0.0:
            u = tl.load(dir_ptr + row * stride_dir_row + k * stride_dir_k + offs, mask=mask, other=0.0)
            if HAS_R:
                p = tl.sum((x + res) * u, axis=0)
            else:
                p = tl.sum(x * u, axis=0)
            lo = tl.load(lo_ptr + row * stride_lo_row + k * stride_lo_k)
            hi = tl.load(hi_ptr + row * stride_hi_row + k * stride_hi_k)
            clipped = tl.minimum(tl.maximum(p, lo), hi)
            x = x + (s * (clipped - p)) * u
    return x


@triton.jit
def _monitor_slots(full, row, t, offs, mask, G, mon, probe_ptr, sharp_ptr, thresh_ptr, floor_ptr, gmul_ptr, gadd_ptr,
                   gates_ptr, scores_ptr, stride_probe_row, stride_probe_g, stride_sharp_row, stride_sharp_g,
                   stride_thresh_row, stride_thresh_g, stride_floor_row, stride_floor_g, stride_gmul_g, stride_gmul_t,
                   stride_gadd_g, stride_gadd_t, stride_gates_g, stride_gates_t, stride_scores_g, stride_scores_t):
    """The row's monitors (bitmask ``mon``) on token t's residual ``full``: score = full . probe, gate =
    sigmoid(sharpness * (score - threshold)), zeroed below the floor, then ``gate * gate_mul + gate_add`` (the host's
    per-token staging) stored to ``gates`` and the raw score to ``scores``."""
    for g_slot in range(G):
        if ((mon >> g_slot) & 1) != 0:
            probe = tl.load(probe_ptr + row * stride_probe_row + g_slot * stride_probe_g + offs, mask=mask, other=0.0)
            score = tl.sum(full * probe, axis=0)
            sharp = tl.load(sharp_ptr + row * stride_sharp_row + g_slot * stride_sharp_g)
            thresh = tl.load(thresh_ptr + row * stride_thresh_row + g_slot * stride_thresh_g)
            floor = tl.load(floor_ptr + row * stride_floor_row + g_slot * stride_floor_g)
            gate = tl.sigmoid(sharp * (score - thresh))
            gate = tl.where(gate >= floor, gate, 0.0)
            gmul = tl.load(gmul_ptr + g_slot * stride_gmul_g + t * stride_gmul_t)
            gadd = tl.load(gadd_ptr + g_slot * stride_gadd_g + t * stride_gadd_t)
            tl.store(scores_ptr + g_slot * stride_scores_g + t * stride_scores_t, score)
            tl.store(gates_ptr + g_slot * stride_gates_g + t * stride_gates_t, gate * gmul + gadd)
    # A scalar store is issued by one thread; every thread re-reads gates afterwards (dyn terms, gated clamps, later
    # sites in the same program), so order those reads after the stores. Uniform branch: no divergent barrier.
    tl.debug_barrier()


@triton.jit
def _dyn_terms(x, row, t, offs, mask, G, dyn, gates_ptr, dvec_ptr, stride_gates_g, stride_gates_t, stride_dvec_row,
               stride_dvec_g):
    """x + sum over the row's dyn slots (bitmask ``dyn``) of gate[slot, t] * dyn_vec[row, slot]."""
    for g_slot in range(G):
        if ((dyn >> g_slot) & 1) != 0:
            gate = tl.load(gates_ptr + g_slot * stride_gates_g + t * stride_gates_t)
            dv = tl.load(dvec_ptr + row * stride_dvec_row + g_slot * stride_dvec_g + offs, mask=mask, other=0.0)
            x = x + gate * dv
    return x


@triton.jit
def _stash(x, res, t, stage_ptr, slot_ptr, stride_stage, n_stage, offs, mask, HAS_R: tl.constexpr,
           SLOTTED: tl.constexpr):
    """Capture: token t's unsteered residual stream, summed in fp32 and rounded once to the buffer's dtype, into
    row ``slot[t]`` of the buffer (row t when not SLOTTED); tokens without a row (slot < 0) store nothing."""
    if SLOTTED:
        dst = tl.load(slot_ptr + t).to(tl.int64)
    else:
        dst = t
    if (dst >= 0) & (dst < n_stage):  # uniform per program: one scalar branch
        if HAS_R:
            full = x + res
        else:
            full = x
        tl.store(stage_ptr + dst * stride_stage + offs, full.to(stage_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _stash_kernel(h_ptr, r_ptr, stage_ptr, slot_ptr, H, n_stage, stride_h, stride_r, stride_stage,
                  HAS_R: tl.constexpr, SLOTTED: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(h_ptr + t * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        res = tl.load(r_ptr + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        res = x
    _stash(x, res, t, stage_ptr, slot_ptr, stride_stage, n_stage, offs, mask, HAS_R=HAS_R, SLOTTED=SLOTTED)


@triton.jit
def _steer_site_kernel(
    h_ptr, r_ptr, idx_ptr, vec_ptr, dir_ptr, lo_ptr, hi_ptr, s_ptr, live_ptr, out_ptr, stage_ptr, slot_ptr, H, K,
    n_stage, stride_h, stride_r, stride_out, stride_stage, stride_vec, stride_dir_row, stride_dir_k, stride_lo_row,
    stride_lo_k, stride_hi_row, stride_hi_k, stride_s_row, stride_s_k, stride_live, HAS_R: tl.constexpr,
    STASH: tl.constexpr, SLOTTED: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # int64 offsets: T * H and R * K * H can exceed 2**31 for large batches / tables.
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    row = tl.load(idx_ptr + t).to(tl.int64)

    x = tl.load(h_ptr + t * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        res = tl.load(r_ptr + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        res = x  # unused placeholder: _clamp_slots reads res only when HAS_R
    if STASH:
        _stash(x, res, t, stage_ptr, slot_ptr, stride_stage, n_stage, offs, mask, HAS_R=HAS_R, SLOTTED=SLOTTED)
    on = tl.load(live_ptr)  # row_live[0]: the site's summary this step (0: no row of the batch holds anything here)
    if (row != 0) & (on != 0):
        # What the row holds at this site: nothing (steered at other sites only) is the identity, as row 0 is.
        live = tl.load(live_ptr + row * stride_live)
        if live != 0:
            # Predicated off without a vector here (no traffic); still added, as 0, exactly as before.
            v = tl.load(vec_ptr + row * stride_vec + offs, mask=mask & ((live & 1) != 0), other=0.0)
            x = x + v
            if (live & 2) != 0:  # some strength is non-zero: else the clamp loop and its K loads are skipped
                # GATED=False: the gate arguments are dead placeholders (s_ptr, 0) and compile away.
                x = _clamp_slots(
                    x, res, row, t, offs, mask, K,
                    dir_ptr, lo_ptr, hi_ptr, s_ptr, s_ptr, s_ptr,
                    stride_dir_row, stride_dir_k, stride_lo_row, stride_lo_k, stride_hi_row, stride_hi_k,
                    stride_s_row, stride_s_k, 0, 0, 0, 0,
                    HAS_R=HAS_R, GATED=False,
                )
    # Row 0 (unsteered, padding) is the identity: a copy whose only dependent load is the row index.
    tl.store(out_ptr + t * stride_out + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _steer_site_dyn_kernel(
    h_ptr, r_ptr, idx_ptr, vec_ptr, dir_ptr, lo_ptr, hi_ptr, s_ptr, live_ptr, cgate_ptr, mmask_ptr, probe_ptr,
    sharp_ptr, thresh_ptr, floor_ptr, dmask_ptr, dvec_ptr, gmul_ptr, gadd_ptr, gates_ptr, scores_ptr, out_ptr,
    stage_ptr, slot_ptr, H, K, G, n_stage, stride_h, stride_r, stride_out, stride_stage, stride_vec, stride_dir_row,
    stride_dir_k, stride_lo_row, stride_lo_k, stride_hi_row, stride_hi_k, stride_s_row, stride_s_k, stride_live,
    stride_cg_row, stride_cg_k, stride_mmask, stride_probe_row, stride_probe_g, stride_sharp_row, stride_sharp_g,
    stride_thresh_row, stride_thresh_g, stride_floor_row, stride_floor_g, stride_dmask, stride_dvec_row,
    stride_dvec_g, stride_gmul_g, stride_gmul_t, stride_gadd_g, stride_gadd_t, stride_gates_g, stride_gates_t,
    stride_scores_g, stride_scores_t, HAS_R: tl.constexpr, STASH: tl.constexpr, SLOTTED: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    row = tl.load(idx_ptr + t).to(tl.int64)

    x = tl.load(h_ptr + t * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        res = tl.load(r_ptr + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        res = x
    if STASH:
        _stash(x, res, t, stage_ptr, slot_ptr, stride_stage, n_stage, offs, mask, HAS_R=HAS_R, SLOTTED=SLOTTED)

    # Row 0 (unsteered, padding) is the identity with no monitors: a copy whose only dependent load is the row
    # index (the idle engine's whole cost per site), instead of a chain of dependent table loads. So is every token
    # at a site whose summary (row_live[0], loaded alongside) says no row of the batch holds anything here.
    on = tl.load(live_ptr)
    if (row != 0) & (on != 0):
        # The row's flags at this site; 0 (steered at other sites only) is the identity too, for one more load.
        # Otherwise each group (vector, monitors, dyn terms, clamps) is loaded / run only where the row has it: the
        # flags are uniform per program, so these are scalar branches. Monitors read the residual before this
        # site's steering.
        live = tl.load(live_ptr + row * stride_live)
        if live != 0:
            # Issued before the monitors (it does not depend on them); predicated off without a vector here, and
            # still added, as 0, exactly as before.
            v = tl.load(vec_ptr + row * stride_vec + offs, mask=mask & ((live & 1) != 0), other=0.0)
            if (live & 4) != 0:
                mon = tl.load(mmask_ptr + row * stride_mmask)
                if HAS_R:
                    full = x + res
                else:
                    full = x
                _monitor_slots(
                    full, row, t, offs, mask, G, mon, probe_ptr, sharp_ptr, thresh_ptr, floor_ptr, gmul_ptr,
                    gadd_ptr, gates_ptr, scores_ptr, stride_probe_row, stride_probe_g, stride_sharp_row,
                    stride_sharp_g, stride_thresh_row, stride_thresh_g, stride_floor_row, stride_floor_g,
                    stride_gmul_g, stride_gmul_t, stride_gadd_g, stride_gadd_t, stride_gates_g, stride_gates_t,
                    stride_scores_g, stride_scores_t,
                )
            x = x + v
            if (live & 8) != 0:
                dyn = tl.load(dmask_ptr + row * stride_dmask)
                x = _dyn_terms(x, row, t, offs, mask, G, dyn, gates_ptr, dvec_ptr, stride_gates_g, stride_gates_t,
                               stride_dvec_row, stride_dvec_g)
            if (live & 2) != 0:
                x = _clamp_slots(
                    x, res, row, t, offs, mask, K,
                    dir_ptr, lo_ptr, hi_ptr, s_ptr, cgate_ptr, gates_ptr,
                    stride_dir_row, stride_dir_k, stride_lo_row, stride_lo_k, stride_hi_row, stride_hi_k,
                    stride_s_row, stride_s_k, stride_cg_row, stride_cg_k, stride_gates_g, stride_gates_t,
                    HAS_R=HAS_R, GATED=True,
                )
    tl.store(out_ptr + t * stride_out + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def _check_stage(stage: torch.Tensor | None, slot: torch.Tensor | None, h: torch.Tensor, who: str) -> bool:
    """Whether to capture into ``stage`` (metadata checks only: no device sync)."""
    if stage is None or stage.numel() == 0:
        return False
    if stage.dim() != 2 or stage.shape[1] != h.shape[1] or stage.stride(1) != 1:
        raise ValueError(f"{who}: stage must be [N, H] with contiguous rows, got {tuple(stage.shape)}")
    if slot is None and stage.shape[0] < h.shape[0]:
        raise ValueError(f"{who}: stage has {stage.shape[0]} rows for {h.shape[0]} tokens and no stage_slot")
    if slot is not None and (slot.dtype != torch.int32 or slot.dim() != 1 or slot.shape[0] < h.shape[0]
                             or slot.stride(0) != 1):
        raise ValueError(f"{who}: stage_slot must be a contiguous int32 [N >= T], got {slot.dtype} "
                         f"{tuple(slot.shape)}")
    if stage.device != h.device or (slot is not None and slot.device != h.device):
        raise ValueError(f"{who}: stage / stage_slot must be on h's device {h.device}")
    return True


def stash_triton(h: torch.Tensor, r: torch.Tensor | None, stage: torch.Tensor,
                 stage_slot: torch.Tensor | None = None) -> None:
    """Store the residual stream of the tokens ``stage_slot`` gives a row into ``stage`` (contract:
    ``dynsteer.kernels.reference.stash_residual``); graph safe, no device sync."""
    if not _check_stage(stage, stage_slot, h, "stash_triton") or h.shape[0] == 0:
        return
    if h.stride(1) != 1 or (r is not None and (r.shape != h.shape or r.stride(1) != 1)):
        raise ValueError("stash_triton: h / r need matching shapes with contiguous rows")
    block_h = triton.next_power_of_2(h.shape[1])
    r_arg = r if r is not None else h
    slot_arg = stage_slot if stage_slot is not None else stage
    _stash_kernel[(h.shape[0],)](
        h, r_arg, stage, slot_arg, h.shape[1], stage.shape[0], h.stride(0), r_arg.stride(0), stage.stride(0),
        HAS_R=r is not None, SLOTTED=stage_slot is not None, BLOCK_H=block_h, num_warps=_num_warps(block_h),
    )


def _num_warps(block_h: int) -> int:
    # One row per program: more warps for wide rows keeps the per-thread register footprint sane.
    if block_h >= 8192:
        return 16
    if block_h >= 2048:
        return 8
    return 4


def _layout(fields: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """For a kernel taking the tables ``fields``: the positions of those with a hidden dimension and how many strides
    each takes (both from the tables' :data:`~dynsteer.kernels.site_tables.LAYOUT`)."""
    return tuple(i for i, f in enumerate(fields) if LAYOUT[f].hidden), tuple(LAYOUT[f].strides for f in fields)


_STATIC, _DYNAMIC = _layout(STATIC_FIELDS), _layout(DYNAMIC_FIELDS)
_N_STATIC, _N_SITE = len(STATIC_FIELDS), len(SITE_FIELDS)


def _launch(kernel: triton.JITFunction, who: str, layout: tuple[tuple[int, ...], tuple[int, ...]], h: torch.Tensor,
            r: torch.Tensor | None, row_index: torch.Tensor, tables: tuple[torch.Tensor, ...],
            sizes: tuple[int, ...], stage: torch.Tensor | None, stage_slot: torch.Tensor | None) -> torch.Tensor:
    """What both site launchers share: the metadata checks (no device sync; cheap enough for the hot path), then one
    program per token of ``kernel(h, r, row_index, *tables, out, stage, stage_slot, H, *sizes, n_stage, stride_h,
    stride_r, stride_out, stride_stage, *tables' strides)``, the tables in ``SiteTables`` order."""
    hidden_at, stride_counts = layout
    num_tokens, hidden = h.shape
    if r is not None and (r.shape != h.shape or r.dtype != h.dtype or r.stride(1) != 1):
        raise ValueError(f"{who}: r must match h in shape and dtype, with contiguous rows")
    if h.stride(1) != 1:
        raise ValueError(f"{who}: the hidden dimension must be contiguous")
    for i in hidden_at:
        if tables[i].stride(-1) != 1:
            raise ValueError(f"{who}: the hidden dimension must be contiguous")
        if tables[i].shape[-1] != hidden:
            raise ValueError(f"{who}: table hidden size does not match h")
    row_live, num_rows = tables[ROW_LIVE], tables[0].shape[0]
    if row_live.dtype != torch.int32 or row_live.shape != (num_rows,):
        raise ValueError(f"{who}: row_live must be int32 [{num_rows}]")

    stash = _check_stage(stage, stage_slot, h, who)
    out = torch.empty_like(h)
    if num_tokens == 0:
        return out
    block_h = triton.next_power_of_2(hidden)
    # r_ptr / stage_ptr / slot_ptr must be valid pointers even when unused; HAS_R / STASH=False compile their
    # accesses away.
    r_arg = r if r is not None else h
    stage_arg = stage if stash else h
    slot_arg = stage_slot if stash and stage_slot is not None else row_index
    strides = [s for t, n in zip(tables, stride_counts) for s in t.stride()[:n]]
    kernel[(num_tokens,)](
        h, r_arg, row_index, *tables, out, stage_arg, slot_arg, hidden, *sizes,
        stage_arg.shape[0] if stash else 0,  # a constant when unused: no extra specialisations by T
        h.stride(0), r_arg.stride(0), out.stride(0), stage_arg.stride(0), *strides,
        HAS_R=r is not None, STASH=stash, SLOTTED=stage_slot is not None, BLOCK_H=block_h,
        num_warps=_num_warps(block_h),
    )
    return out


def steer_site_triton(h: torch.Tensor, r: torch.Tensor | None, row_index: torch.Tensor, tables: SiteTables,
                      stage: torch.Tensor | None = None, stage_slot: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the fused steering kernel on the static six of ``tables`` (same contract as ``steer_site_reference``).

    Only shape/stride metadata is inspected on the host, so this is safe under CUDA graph
    capture. Rows may be strided, but the hidden dimension of h, r, vec and clamp_dir must be
    contiguous.

    Arguments and result: see ``steer_site_reference``.
    """
    return _launch(_steer_site_kernel, "steer_site_triton", _STATIC, h, r, row_index, tables[:_N_STATIC],
                   (tables.clamp_dir.shape[1],), stage, stage_slot)


def steer_site_dyn_triton(h: torch.Tensor, r: torch.Tensor | None, row_index: torch.Tensor, tables: SiteTables,
                          stage: torch.Tensor | None = None, stage_slot: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the fused dynamic steering kernel (same contract as ``steer_site_dyn_reference``).

    Writes ``tables.gates`` / ``tables.scores`` in place for the monitored slots of the first T tokens. Only
    shape/stride metadata is inspected on the host, so this is safe under CUDA graph capture. Any
    strides are accepted except that the hidden dimension of h, r, vec, clamp_dir, mon_probe and
    dyn_vec must be contiguous.

    Arguments and result: see ``steer_site_dyn_reference``.
    """
    num_k, num_g = tables.clamp_dir.shape[1], tables.gates.shape[0]
    if tables.mon_probe.shape[1] != num_g or tables.dyn_vec.shape[1] != num_g or tables.clamp_gate.shape[1] != num_k:
        raise ValueError("steer_site_dyn_triton: gate slots / clamp slots differ between tables and buffers")
    for buf in tables[_N_SITE:]:
        if buf.dtype != torch.float32 or buf.shape[0] != num_g or buf.shape[1] < h.shape[0]:
            raise ValueError("steer_site_dyn_triton: gate buffers must be float32 [G, N >= T]")
    return _launch(_steer_site_dyn_kernel, "steer_site_dyn_triton", _DYNAMIC, h, r, row_index, tables,
                   (num_k, num_g), stage, stage_slot)
