"""Triton kernel for ``steer_add_rms_norm``: up to two steering sites, then the fused add + RMS norm that follows them.

vLLM's decoder layers end each residual step in a fused add-norm (``norm(hidden, residual)`` returns the normed
branch input and the new residual). A steering site placed just before it costs a kernel launch of its own, tiny
at decode sizes but one per site and step (96 on an 8B model). This kernel takes the norm's place: one program per
token loads ``h`` and ``r`` once, applies site A and then site B exactly as ``steer_site`` / ``steer_site_dyn`` would
(each site's result rounded to ``h``'s dtype, as the separate op stores it), then computes vLLM's
``fused_add_rms_norm`` (fp32 add, residual rounded to the input dtype, fp32 variance, ``normed.to(w.dtype) * w``, or
with ``unit_offset`` Gemma's ``normed * (1 + w)`` in fp32).
Every load an idle token needs is issued at the top, with ``h``, ``r`` and the weight: the row index and each
site's summary (``row_live[0]``); its row's flags (``row_live[row]``) follow as soon as the row index is in, and
only where the summary says some row steers here and the token is not on row 0. At decode sizes the kernel is one
program per token and its time is the chain of memory round trips (its operands evicted by the GEMMs between
norms), so an idle token pays one round trip, as vLLM's own add-norm does; a steered token two (row index, row
flags) before its row's vector; at a site where its own row holds nothing (``row_live`` 0: a spec steering other
layers) it pays the row flags, not the row's vector and strengths. An idle token's add-norm is the code right after
the flags' branch (steered tokens jump to a copy of it after the sites): the instruction stream it runs is straight.
Semantics: ``dynsteer.kernels.fused_reference``.

Tables are the per-site tensors of :class:`dynsteer.steering.tables.SteeringTables`, which are standalone
contiguous allocations: strides are derived from the shapes instead of passed (fewer launch arguments).
Graph safe: metadata checks only, no device sync, outputs from ``torch.empty_like``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dynsteer.kernels.site_tables import ROW_LIVE, SITE_FIELDS, STATIC_FIELDS
from dynsteer.kernels.triton_steer import _check_stage, _clamp_slots, _dyn_terms, _monitor_slots, _num_warps, _stash

__all__ = ["add_rms_norm_triton", "steer_add_rms_norm_triton"]

STATIC_TABLES = len(STATIC_FIELDS)  # a static site's tables, in SiteTables order
DYN_TABLES = len(SITE_FIELDS)  # a dynamic site's own tables (the gate buffers come once, as gate_bufs)
_DIR, _PROBE = SITE_FIELDS.index("clamp_dir"), SITE_FIELDS.index("mon_probe")  # [R, K, H] and [R, G, H]


@triton.jit
def _site_flags(live_ptr, row):
    """A site's summary ``row_live[0]`` (0: no row of the batch holds anything here this step) and the token's row
    flags ``row_live[row]`` (0 for row 0, whose entry is the summary). Both are loaded at the top of the kernel, with
    the token's inputs: loaded where they are used, each site's was a memory round trip of its own after the previous
    site's branch, and at decode sizes (one program per token, tables evicted by the GEMMs between norms) the
    kernel's time is its chain of round trips. The row flags' load depends on the row index's; it is predicated off
    where the summary is 0 or the token is on row 0, so an idle token has no load in flight when it ends (a program
    cannot retire before its loads land, used or not: unpredicated, that was a second round trip per idle token)."""
    on = tl.load(live_ptr)
    return on, tl.load(live_ptr + row, mask=(on != 0) & (row != 0), other=0)


@triton.jit
def _site(x, res, row, on, live, t, offs, mask, H, K, G, N,
          vec_ptr, dir_ptr, lo_ptr, hi_ptr, s_ptr, cg_ptr, mm_ptr, probe_ptr, sharp_ptr, thresh_ptr,
          floor_ptr, dm_ptr, dvec_ptr, gmul_ptr, gadd_ptr, gates_ptr, scores_ptr,
          stage_ptr, slot_ptr, n_stage,
          DYN: tl.constexpr, STASH: tl.constexpr, SLOTTED: tl.constexpr):
    """One site on token t (x: the branch in fp32, res: the carried residual in fp32; ``on``, ``live``: the site's
    flags from :func:`_site_flags`); returns the steered x."""
    if STASH:
        _stash(x, res, t, stage_ptr, slot_ptr, H, n_stage, offs, mask, HAS_R=True, SLOTTED=SLOTTED)
    # Summary 0: the identity for every token. Else the row's flags (steer_site_triton's kernels): 0 is the
    # identity; else only the groups the row has here are loaded / run (scalar branches, uniform per program).
    if (row != 0) & (on != 0):
        if live != 0:
            # predicated off without a vector here, and still added, as 0, exactly as before
            v = tl.load(vec_ptr + row * H + offs, mask=mask & ((live & 1) != 0), other=0.0)
            if DYN:
                if (live & 4) != 0:
                    mon = tl.load(mm_ptr + row)
                    _monitor_slots(x + res, row, t, offs, mask, G, mon, probe_ptr, sharp_ptr, thresh_ptr, floor_ptr,
                                   gmul_ptr, gadd_ptr, gates_ptr, scores_ptr, G * H, H, G, 1, G, 1, G, 1, N, 1, N, 1,
                                   N, 1, N, 1)
                x = x + v
                if (live & 8) != 0:
                    dyn = tl.load(dm_ptr + row)
                    x = _dyn_terms(x, row, t, offs, mask, G, dyn, gates_ptr, dvec_ptr, N, 1, G * H, H)
            else:
                x = x + v
            if (live & 2) != 0:
                x = _clamp_slots(x, res, row, t, offs, mask, K, dir_ptr, lo_ptr, hi_ptr, s_ptr, cg_ptr, gates_ptr,
                                 K * H, H, K, 1, K, 1, K, 1, K, 1, N, 1, HAS_R=True, GATED=DYN)
    return x


@triton.jit
def _steer_add_rms_norm_kernel(
    h_ptr, r_ptr, w_ptr, normed_ptr, resout_ptr, idx_ptr,
    a_vec, a_dir, a_lo, a_hi, a_s, a_live, a_cg, a_mm, a_probe, a_sharp, a_thresh, a_floor, a_dm, a_dvec,
    b_vec, b_dir, b_lo, b_hi, b_s, b_live, b_cg, b_mm, b_probe, b_sharp, b_thresh, b_floor, b_dm, b_dvec,
    gmul_ptr, gadd_ptr, gates_ptr, scores_ptr, a_stage, b_stage, slot_ptr,
    H, K, G, N, n_stage_a, n_stage_b, eps, stride_h, stride_r,
    HAS_A: tl.constexpr, HAS_B: tl.constexpr, DYN: tl.constexpr, STASH_A: tl.constexpr, STASH_B: tl.constexpr,
    SLOTTED: tl.constexpr, BLOCK_H: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    row = tl.load(idx_ptr + t).to(tl.int64)
    x, res = _load_rows(h_ptr, r_ptr, t, offs, mask, stride_h, stride_r)
    w = _load_weight(w_ptr, offs, mask)
    on_a, live_a, on_b, live_b = 0, 0, 0, 0
    if HAS_A:
        on_a, live_a = _site_flags(a_live, row)
    if HAS_B:
        on_b, live_b = _site_flags(b_live, row)
    # A token no site acts on (its row flags 0 at both: row 0, a summary of 0 or nothing on its row here) takes the
    # add-norm right after the branch, so its instructions follow one another: behind a jump over the sites' code
    # the norm's first instructions were a cold fetch after the flags landed (the GEMMs between norms evict the
    # instruction caches), ~0.3 µs per call on an H200 at decode sizes (benchmarks/fused_norm_kernel.py
    # --launch-probe). Steered tokens jump instead.
    if (live_a | live_b) == 0:
        if STASH_A:
            _stash(x, res, t, a_stage, slot_ptr, H, n_stage_a, offs, mask, HAS_R=True, SLOTTED=SLOTTED)
        if STASH_B:  # site A left x as it was
            _stash(x, res, t, b_stage, slot_ptr, H, n_stage_b, offs, mask, HAS_R=True, SLOTTED=SLOTTED)
        _add_norm_store(x, res, w, t, offs, mask, H, eps, w_ptr, normed_ptr, resout_ptr, UNIT_OFFSET=UNIT_OFFSET)
    else:
        if HAS_A:
            x = _site(x, res, row, on_a, live_a, t, offs, mask, H, K, G, N,
                      a_vec, a_dir, a_lo, a_hi, a_s, a_cg, a_mm, a_probe, a_sharp, a_thresh, a_floor, a_dm,
                      a_dvec, gmul_ptr, gadd_ptr, gates_ptr, scores_ptr, a_stage, slot_ptr, n_stage_a,
                      DYN=DYN, STASH=STASH_A, SLOTTED=SLOTTED)
            # The separate op stores each site's output in h's dtype; rounding here keeps the two forwards equal
            # (exact for unsteered tokens, whose x still holds h).
            x = x.to(h_ptr.dtype.element_ty).to(tl.float32)
        if HAS_B:
            x = _site(x, res, row, on_b, live_b, t, offs, mask, H, K, G, N,
                      b_vec, b_dir, b_lo, b_hi, b_s, b_cg, b_mm, b_probe, b_sharp, b_thresh, b_floor, b_dm,
                      b_dvec, gmul_ptr, gadd_ptr, gates_ptr, scores_ptr, b_stage, slot_ptr, n_stage_b,
                      DYN=DYN, STASH=STASH_B, SLOTTED=SLOTTED)
            x = x.to(h_ptr.dtype.element_ty).to(tl.float32)
        _add_norm_store(x, res, w, t, offs, mask, H, eps, w_ptr, normed_ptr, resout_ptr, UNIT_OFFSET=UNIT_OFFSET)


@triton.jit
def _load_rows(h_ptr, r_ptr, t, offs, mask, stride_h, stride_r):
    """Token t's layer output and residual in fp32, loaded evict-last as inductor's add-norm loads them: with the
    default policy the GEMM that reads the normed row ran ~1.2 µs slower per ``gate_up`` call at 64 tokens on an
    H100 (81 µs a call), and this kernel itself 0.2 µs slower (``benchmarks/norm_gemm.py``, variants plain and
    triton, 2026-11-27). Hints only: the bits are the same."""
    x = tl.load(h_ptr + t * stride_h + offs, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    res = tl.load(r_ptr + t * stride_r + offs, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    return x, res


@triton.jit
def _load_weight(w_ptr, offs, mask):
    """The norm's weight, loaded with the token's inputs: issued after the variance's reduction it was a memory
    round trip of its own per program (at decode sizes the weight is evicted by the GEMMs between norms)."""
    return tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _add_norm_store(x, res, w, t, offs, mask, H, eps, w_ptr, normed_ptr, resout_ptr, UNIT_OFFSET: tl.constexpr):
    """vLLM's fused_add_rms_norm on token t: fp32 sum, the new residual rounded to the input dtype, fp32 variance of
    the sum (``w``: the weight in fp32, from :func:`_load_weight`; ``w_ptr`` gives its dtype). Shared by both
    kernels, so an unsteered token gets the same bits from either."""
    s = x + res
    tl.store(resout_ptr + t * H + offs, s.to(resout_ptr.dtype.element_ty), mask=mask)
    var = tl.sum(s * s, axis=0) / H
    # eps arrives as fp32 from Triton's own launcher but as fp64 from inductor's (the traced op): fp32 either way
    normed = s * tl.rsqrt(var + tl.cast(eps, tl.float32))
    if UNIT_OFFSET:  # Gemma: normed * (1 + w), all in fp32
        normed = normed * (w + 1.0)
    else:  # normed.to(w.dtype) * w, the product in fp32: exact for 16-bit operands, so one rounding as in torch
        normed = normed.to(w_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(normed_ptr + t * H + offs, normed.to(normed_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(h_ptr, r_ptr, w_ptr, normed_ptr, resout_ptr, H, eps, stride_h, stride_r,
                         BLOCK_H: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """The add-norm alone: what ``_steer_add_rms_norm_kernel`` computes when no site does anything."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x, res = _load_rows(h_ptr, r_ptr, t, offs, mask, stride_h, stride_r)
    w = _load_weight(w_ptr, offs, mask)
    _add_norm_store(x, res, w, t, offs, mask, H, eps, w_ptr, normed_ptr, resout_ptr, UNIT_OFFSET=UNIT_OFFSET)


def _check_norm_args(h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, who: str) -> None:
    hidden = h.shape[1]
    if r.shape != h.shape or r.dtype != h.dtype or h.stride(1) != 1 or r.stride(1) != 1:
        raise ValueError(f"{who}: h and r need the same shape and dtype, with contiguous rows")
    if weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError(f"{who}: weight must be a contiguous [{hidden}] tensor")


def add_rms_norm_triton(h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float,
                        unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The add-norm alone (``fused_reference.add_rms_norm_reference``), bit for bit what
    :func:`steer_add_rms_norm_triton` gives a token no site steers; a launch with 9 arguments instead of 50 (the op
    takes it in eager steps whose sites are all idle: the launch's host cost is what those steps wait for)."""
    _check_norm_args(h, r, weight, "add_rms_norm_triton")
    normed, resout = torch.empty_like(h), torch.empty_like(h)
    num_tokens, hidden = h.shape
    if num_tokens:
        block_h = triton.next_power_of_2(hidden)
        _add_rms_norm_kernel[(num_tokens,)](h, r, weight, normed, resout, hidden, float(eps), h.stride(0),
                                            r.stride(0), BLOCK_H=block_h, UNIT_OFFSET=bool(unit_offset),
                                            num_warps=_num_warps(block_h))
    return normed, resout


def _site_args(tabs: list[torch.Tensor], dyn: bool, dummy: torch.Tensor) -> list[torch.Tensor]:
    if not tabs:
        return [dummy] * DYN_TABLES
    return list(tabs) if dyn else list(tabs) + [dummy] * (DYN_TABLES - STATIC_TABLES)


def steer_add_rms_norm_triton(
    h: torch.Tensor,
    r: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    row_index: torch.Tensor,
    tabs_a: list[torch.Tensor],
    tabs_b: list[torch.Tensor],
    gate_bufs: list[torch.Tensor],
    stage_a: torch.Tensor | None = None,
    stage_b: torch.Tensor | None = None,
    stage_slot: torch.Tensor | None = None,
    unit_offset: bool = False,
    traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the fused kernel (contract: ``dynsteer.kernels.fused_reference.steer_add_rms_norm_reference``).

    ``traced``: called from the body of ``torch.ops.dynsteer.steer_add_rms_norm_traced`` (a ``triton_op``), whose
    launch torch.compile lowers into its own generated code: the kernel goes through ``wrap_triton`` and the token
    count may be symbolic (vLLM never runs a forward of 0 tokens, so no branch on it)."""
    num_tokens, hidden = h.shape
    dyn = len(tabs_a or tabs_b) == DYN_TABLES
    for name, tabs in (("tabs_a", tabs_a), ("tabs_b", tabs_b)):
        if tabs and len(tabs) != (DYN_TABLES if dyn else STATIC_TABLES):
            raise ValueError(f"steer_add_rms_norm_triton: {name} must hold {STATIC_TABLES} (static) or "
                             f"{DYN_TABLES} (dynamic) tables, the same kind for both sites; got {len(tabs)}")
        if any(not t.is_contiguous() or t.device != h.device for t in tabs):
            raise ValueError(f"steer_add_rms_norm_triton: {name} tables must be contiguous and on {h.device}")
        if tabs and tabs[0].shape[1] != hidden:
            raise ValueError(f"steer_add_rms_norm_triton: {name} vec has hidden size {tabs[0].shape[1]}, h {hidden}")
        if tabs and (tabs[ROW_LIVE].dtype != torch.int32 or tabs[ROW_LIVE].shape != tabs[0].shape[:1]):
            raise ValueError(f"steer_add_rms_norm_triton: {name}[{ROW_LIVE}] (row_live) must be int32 "
                             f"[{tabs[0].shape[0]}]")
    _check_norm_args(h, r, weight, "steer_add_rms_norm_triton")
    if dyn and (len(gate_bufs) != 4 or any(not g.is_contiguous() or g.dtype != torch.float32 for g in gate_bufs)):
        raise ValueError("steer_add_rms_norm_triton: a dynamic site needs the 4 contiguous float32 gate buffers "
                         "[G, N] (gate_mul, gate_add, gates, scores)")
    stash_a = bool(tabs_a) and _check_stage(stage_a, stage_slot, h, "steer_add_rms_norm_triton")
    stash_b = bool(tabs_b) and _check_stage(stage_b, stage_slot, h, "steer_add_rms_norm_triton")
    if (stash_a and not stage_a.is_contiguous()) or (stash_b and not stage_b.is_contiguous()):
        raise ValueError("steer_add_rms_norm_triton: capture buffers must be contiguous")
    normed, resout = torch.empty_like(h), torch.empty_like(h)
    if not traced and num_tokens == 0:
        return normed, resout
    tabs = tabs_a or tabs_b
    num_k = tabs[_DIR].shape[1] if tabs else 0
    num_g = tabs[_PROBE].shape[1] if dyn else 0
    n_buf = gate_bufs[0].shape[1] if dyn else 0
    dummy = row_index  # a valid pointer for every argument a constexpr flag compiles away
    bufs = list(gate_bufs) if dyn else [dummy] * 4
    block_h = triton.next_power_of_2(hidden)
    kernel = torch.library.wrap_triton(_steer_add_rms_norm_kernel) if traced else _steer_add_rms_norm_kernel
    kernel[(num_tokens,)](
        h, r, weight, normed, resout, row_index,
        *_site_args(tabs_a, dyn, dummy), *_site_args(tabs_b, dyn, dummy),
        *bufs, stage_a if stash_a else dummy, stage_b if stash_b else dummy,
        stage_slot if (stash_a or stash_b) and stage_slot is not None else dummy,
        hidden, num_k, num_g, n_buf, stage_a.shape[0] if stash_a else 0, stage_b.shape[0] if stash_b else 0,
        float(eps), h.stride(0), r.stride(0),
        HAS_A=bool(tabs_a), HAS_B=bool(tabs_b), DYN=dyn, STASH_A=stash_a, STASH_B=stash_b,
        SLOTTED=stage_slot is not None, BLOCK_H=block_h, UNIT_OFFSET=bool(unit_offset),
        num_warps=_num_warps(block_h),
    )
    return normed, resout
