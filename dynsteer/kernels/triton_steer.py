"""Fused Triton kernel for the per-site steering op (semantics: see ``dynsteer.kernels.reference``).

One program per token: load the row index, gather the vec row, add it, apply the K clamps
(skipped by a scalar branch when the strength is 0), all in fp32, and write a new output.

The launcher is CUDA-graph safe: it never syncs with the device, allocates nothing but the
output (``torch.empty_like``), and its grid depends only on shapes.

Note: ``triton.jit`` decides between compiled and interpreted mode when this module is
imported, so ``TRITON_INTERPRET=1`` must be in the environment before the first import of this
module (not merely before ``import triton``) for the kernel to run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["steer_site_triton"]


@triton.jit
def _steer_site_kernel(
    h_ptr,
    r_ptr,
    idx_ptr,
    vec_ptr,
    dir_ptr,
    lo_ptr,
    hi_ptr,
    s_ptr,
    out_ptr,
    H,
    K,
    stride_h,
    stride_r,
    stride_out,
    stride_vec,
    stride_dir_row,
    stride_dir_k,
    stride_lo_row,
    stride_lo_k,
    stride_hi_row,
    stride_hi_k,
    stride_s_row,
    stride_s_k,
    HAS_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # int64 offsets: T * H and R * K * H can exceed 2**31 for large batches / tables.
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    row = tl.load(idx_ptr + t).to(tl.int64)

    x = tl.load(h_ptr + t * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    x = x + tl.load(vec_ptr + row * stride_vec + offs, mask=mask, other=0.0)
    if HAS_R:
        res = tl.load(r_ptr + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32)

    # Runtime loop over K (not constexpr): one compiled kernel serves every table width.
    for k in range(K):
        s = tl.load(s_ptr + row * stride_s_row + k * stride_s_k)
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

    tl.store(out_ptr + t * stride_out + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block_h: int) -> int:
    # One row per program: more warps for wide rows keeps the per-thread register footprint sane.
    if block_h >= 8192:
        return 16
    if block_h >= 2048:
        return 8
    return 4


def steer_site_triton(
    h: torch.Tensor,
    r: torch.Tensor | None,
    row_index: torch.Tensor,
    vec: torch.Tensor,
    clamp_dir: torch.Tensor,
    clamp_lo: torch.Tensor,
    clamp_hi: torch.Tensor,
    clamp_strength: torch.Tensor,
) -> torch.Tensor:
    """Launch the fused steering kernel (same contract as ``steer_site_reference``).

    Only shape/stride metadata is inspected on the host, so this is safe under CUDA graph
    capture. Rows may be strided, but the hidden dimension of h, r, vec and clamp_dir must be
    contiguous.

    Arguments and result: see ``steer_site_reference``.
    """
    num_tokens, hidden = h.shape
    num_k = clamp_dir.shape[1]
    # Metadata-only checks (no device sync); cheap enough to keep on the hot path.
    if h.stride(1) != 1 or vec.stride(1) != 1 or clamp_dir.stride(2) != 1:
        raise ValueError("steer_site_triton: the hidden dimension must be contiguous")
    if r is not None and (r.shape != h.shape or r.dtype != h.dtype or r.stride(1) != 1):
        raise ValueError("steer_site_triton: r must match h in shape and dtype, with contiguous rows")
    if vec.shape[1] != hidden or clamp_dir.shape[2] != hidden:
        raise ValueError("steer_site_triton: vec / clamp_dir hidden size does not match h")

    out = torch.empty_like(h)
    if num_tokens == 0:
        return out
    block_h = triton.next_power_of_2(hidden)
    # r_ptr must be a valid pointer even when unused; HAS_R=False compiles the load away.
    r_arg = r if r is not None else h
    _steer_site_kernel[(num_tokens,)](
        h,
        r_arg,
        row_index,
        vec,
        clamp_dir,
        clamp_lo,
        clamp_hi,
        clamp_strength,
        out,
        hidden,
        num_k,
        h.stride(0),
        r_arg.stride(0),
        out.stride(0),
        vec.stride(0),
        clamp_dir.stride(0),
        clamp_dir.stride(1),
        clamp_lo.stride(0),
        clamp_lo.stride(1),
        clamp_hi.stride(0),
        clamp_hi.stride(1),
        clamp_strength.stride(0),
        clamp_strength.stride(1),
        HAS_R=r is not None,
        BLOCK_H=block_h,
        num_warps=_num_warps(block_h),
    )
    return out
