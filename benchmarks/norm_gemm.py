"""Why is a GEMM slower after dynsteer's add-norm than after inductor's? The same add-norm written a dozen ways, each
followed by a Llama-3-8B layer's projections in a CUDA graph, with every kernel's time per call.

In an H100 engine at batch 64 (2026-11-27, 9a07e65; ``benchmarks/trace_kernels.py`` on ``overhead.py --profile``'s
traces) the ``gate_up`` GEMM ran 86.53 µs per call after dynsteer's add-norm against 85.22 and 85.12 after
inductor's in the two engines without dynsteer, and the ``qkv`` GEMM +0.16 µs; dynsteer's add-norms themselves were
0.4-0.9 µs faster. ``fused_norm_kernel.py --llama --kernel-times`` shows the same on its own (+0.4-0.6 µs per
``gate_up`` call, H100 and H200), also with dynsteer's plain add-norm kernel (no site code), and with 4, 8 or 16
warps. What differs between the kernels is how they touch memory, so each variant changes one thing:

* ``inductor``: vLLM's add-norm compiled by torch.compile (``fused_reference.add_rms_norm_reference``): a reduction
  looping over the row in chunks, the new residual stored in the first pass, the normed row in the second;
* ``triton``: dynsteer's plain add-norm (``add_rms_norm_triton``): the whole row in registers, both rows stored at
  the end (the residual first), into fresh outputs; its loads are evict-last since 14baedc (as are those of
  ``inplace``, ``pingpong`` and ``gap``, which launch it);
* ``plain``: that kernel with default loads (dynsteer's before 14baedc);
* ``inplace``: that kernel writing its outputs over its inputs (the normed row over the GEMM output it read, the
  residual over the old residual), as vLLM's CUDA op does: no fresh lines become dirty in L2;
* ``looped``: two passes over the row in chunks of ``--chunk``, as inductor's kernel does (the residual stored in
  the first pass, the inputs loaded again in the second);
* ``evict``: the ``triton`` kernel with its loads marked ``evict_first`` (inductor marks the loads of its last pass
  so), leaving L2 to the data the GEMM reads;
* ``pingpong``: the ``triton`` kernel writing into two pairs of buffers taken in turn, the same addresses every
  forward (as a compiled graph's memory plan reuses its buffers), instead of whatever the allocator hands out;
* ``looped-plain``: ``looped`` without eviction hints; ``looped-row``: ``looped`` in one chunk of the whole row (two
  passes, the same sum as ``triton``); ``reload``: one pass over the inputs, the second over the stored residual;
* ``gap``: the ``triton`` kernel followed by an empty kernel, so the GEMM does not start right after the stores;
* ``late-row``: ``looped-row`` storing both rows in pass 2, as inductor's kernel does.

A variant whose GEMMs run as fast as after ``inductor``'s names the cause; dynsteer's kernel can then be changed
the same way (its steering sites run before the norm, so any of these applies to it).

On an H100 (2026-11-27, before 14baedc: that run's ``triton``, ``inplace``, ``pingpong`` and ``gap`` had default
loads, and its ``evict-last`` variant was today's ``triton``) the hint decided it: evict-last loads left ``gate_up``
at 81.0 µs against 79.8-80.6 after inductor's and 81.1-81.6 after default loads, the kernel itself 1.81 µs against
2.0, so the chain ran 15 µs faster than inductor's; two passes with inductor's hints matched inductor's GEMM, without
them they did not. dynsteer's add-norm kernels load evict-last since (benchmarks/RESULTS.md; results in
``benchmarks/results/gpu-2026-11-27/norm-gemm-variants``).

    python3 benchmarks/norm_gemm.py --tokens 1 64 --out benchmarks/results     # GPU

``tests/test_norm_gemm.py`` checks every variant against the reference in Triton's interpreter on CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dynsteer.kernels.fused_reference import add_rms_norm_reference  # noqa: E402
from dynsteer.kernels.triton_fused import _add_rms_norm_kernel, _num_warps, add_rms_norm_triton  # noqa: E402

VARIANTS = ("inductor", "triton", "inplace", "looped", "evict", "pingpong", "looped-plain", "looped-row", "reload",
            "gap", "plain", "late-row")
# two-pass variants: (chunk: 0 for --chunk, None for the whole row; pass 1 policy; pass 2 policy; pass 2 reads the
# residual; both rows stored in pass 2)
TWO_PASS = {"looped": (0, "evict_last", "evict_first", False, False), "looped-plain": (0, "", "", False, False),
            "looped-row": (None, "evict_last", "evict_first", False, False),
            "reload": (None, "", "evict_first", True, False),
            "late-row": (None, "evict_last", "evict_first", False, True)}


@triton.jit
def _two_pass_kernel(h_ptr, r_ptr, w_ptr, normed_ptr, resout_ptr, H, eps, CHUNK: tl.constexpr, EV1: tl.constexpr,
                     EV2: tl.constexpr, RELOAD: tl.constexpr, LATE: tl.constexpr):
    """Inductor's shape of the add-norm: pass 1 stores each chunk's sum (rounded; ``LATE``: pass 2 does, as
    inductor's kernel) and accumulates its squares (in fp32), pass 2 loads the inputs again (``RELOAD``: the stored
    residual instead) and stores the normed row. ``EV1``/``EV2``: the passes' eviction policies ("" for none)."""
    t = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, H, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < H
        s = (tl.load(h_ptr + t * H + offs, mask=mask, other=0.0, eviction_policy=EV1).to(tl.float32)
             + tl.load(r_ptr + t * H + offs, mask=mask, other=0.0, eviction_policy=EV1).to(tl.float32))
        if not LATE:
            tl.store(resout_ptr + t * H + offs, s.to(resout_ptr.dtype.element_ty), mask=mask)
        acc += s * s
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / H + tl.cast(eps, tl.float32))
    for start in range(0, H, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < H
        if RELOAD:
            s = tl.load(resout_ptr + t * H + offs, mask=mask, other=0.0, eviction_policy=EV2).to(tl.float32)
        else:
            s = (tl.load(h_ptr + t * H + offs, mask=mask, other=0.0, eviction_policy=EV2).to(tl.float32)
                 + tl.load(r_ptr + t * H + offs, mask=mask, other=0.0, eviction_policy=EV2).to(tl.float32))
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (s * rstd).to(w_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(normed_ptr + t * H + offs, y.to(normed_ptr.dtype.element_ty), mask=mask)
        if LATE:
            tl.store(resout_ptr + t * H + offs, s.to(resout_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _noop_kernel(p):
    """Nothing: launched between the add-norm and the GEMM by the ``gap`` variant."""
    pass


@triton.jit
def _hinted_kernel(h_ptr, r_ptr, w_ptr, normed_ptr, resout_ptr, H, eps, BLOCK_H: tl.constexpr, EV: tl.constexpr):
    """dynsteer's plain add-norm with its row loads marked ``EV`` ("" for none)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(h_ptr + t * H + offs, mask=mask, other=0.0, eviction_policy=EV).to(tl.float32)
    res = tl.load(r_ptr + t * H + offs, mask=mask, other=0.0, eviction_policy=EV).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = x + res
    tl.store(resout_ptr + t * H + offs, s.to(resout_ptr.dtype.element_ty), mask=mask)
    var = tl.sum(s * s, axis=0) / H
    y = (s * tl.rsqrt(var + tl.cast(eps, tl.float32))).to(w_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(normed_ptr + t * H + offs, y.to(normed_ptr.dtype.element_ty), mask=mask)


def _launch(kernel, h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float, normed: torch.Tensor,
            resout: torch.Tensor, **meta) -> tuple[torch.Tensor, torch.Tensor]:
    if h.shape[0]:
        kernel[(h.shape[0],)](h, r, weight, normed, resout, h.shape[1], float(eps), **meta)
    return normed, resout


def _check(h: torch.Tensor, r: torch.Tensor) -> None:
    if not (h.is_contiguous() and r.is_contiguous() and h.shape == r.shape):
        raise ValueError("norm_gemm variants take contiguous h and r of one shape")


def add_norm(variant: str, chunk: int = 1024):
    """``(h, r, weight, eps) -> (normed, new residual)`` for one variant; ``inductor`` compiles on first call."""
    if variant == "inductor":
        return torch.compile(add_rms_norm_reference, dynamic=False)
    if variant == "triton":
        return add_rms_norm_triton
    pairs: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # pingpong's buffers, by shape and dtype
    turn = [0]

    def run(h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        _check(h, r)
        block_h = triton.next_power_of_2(h.shape[1])
        if variant == "inplace":  # the normed row over h, the residual over r
            return _launch(_add_rms_norm_kernel, h, r, weight, eps, h, r, stride_h=h.shape[1], stride_r=h.shape[1],
                           BLOCK_H=block_h, UNIT_OFFSET=False, num_warps=_num_warps(block_h))
        if variant == "pingpong":
            bufs = pairs.setdefault((tuple(h.shape), h.dtype, h.device),
                                    [(torch.empty_like(h), torch.empty_like(h)) for _ in range(2)])
            turn[0] ^= 1
            normed, resout = bufs[turn[0]]
            return _launch(_add_rms_norm_kernel, h, r, weight, eps, normed, resout, stride_h=h.shape[1],
                           stride_r=h.shape[1], BLOCK_H=block_h, UNIT_OFFSET=False, num_warps=_num_warps(block_h))
        normed, resout = torch.empty_like(h), torch.empty_like(h)
        if variant in TWO_PASS:
            size, ev1, ev2, reload, late = TWO_PASS[variant]
            return _launch(_two_pass_kernel, h, r, weight, eps, normed, resout,
                           CHUNK=block_h if size is None else min(chunk, block_h), EV1=ev1, EV2=ev2, RELOAD=reload,
                           LATE=late, num_warps=_num_warps(block_h))
        if variant == "gap":
            out = add_rms_norm_triton(h, r, weight, eps)
            _noop_kernel[(1,)](out[0])
            return out
        if variant in ("evict", "plain"):
            return _launch(_hinted_kernel, h, r, weight, eps, normed, resout, BLOCK_H=block_h,
                           EV="evict_first" if variant == "evict" else "", num_warps=_num_warps(block_h))
        raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=1024, help="the looped variant's chunk (elements)")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from lib.graphs import alternate, capture_graph, kernel_times, time_replays
    from lib.report import utc_now, write_report

    dtype, H, norms = torch.bfloat16, args.hidden, 2 * args.layers - 1

    def dense(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, device="cuda") / rows ** 0.5).to(dtype)
    # Llama-3-8B's projections between norms, one set shared by every layer (each larger than L2)
    w_q, w_o, w_gu, w_down = dense(H, H), dense(H, H), dense(H, 2 * 14336), dense(14336, H)
    weight = (1 + 0.1 * torch.randn(H, device="cuda")).to(dtype)

    def project(x: torch.Tensor, i: int) -> torch.Tensor:
        if i % 2 == 0:  # a mid norm: after attention's projections
            return torch.mm(torch.mm(x, w_q), w_o)
        g, u = torch.mm(x, w_gu).chunk(2, dim=-1)  # an input norm: after the MLP
        return torch.mm(torch.nn.functional.silu(g) * u, w_down)

    rows = {}
    for T in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(T)
        h0 = torch.randn(T, H, device="cuda", dtype=dtype, generator=gen)
        r0 = torch.randn(T, H, device="cuda", dtype=dtype, generator=gen)
        graphs = {}
        for name in args.variants:
            norm = add_norm(name, args.chunk)

            def chain(norm=norm) -> torch.Tensor:
                x, res = norm(h0.clone(), r0.clone(), weight, 1e-5)  # clones: the in-place variant keeps h0, r0
                for i in range(1, norms):
                    x, res = norm(project(x, i), res, weight, 1e-5)
                return x
            graphs[name] = capture_graph(chain)
        us = alternate(list(graphs), args.rounds, lambda name: time_replays(graphs[name], args.replays))
        row = {"chain_us": {name: round(statistics.median(v), 2) for name, v in us.items()},
               "kernel_us_per_call": {name: kernel_times(g, lambda: None) for name, g in graphs.items()}}
        rows[str(T)] = row
        print(f"T={T}: {json.dumps(row)}", flush=True)
    report = {"benchmark": "norm_gemm", "date": utc_now(),
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "dtype": "bfloat16", "layers": args.layers, "hidden": H, "norms": norms, "chunk": args.chunk,
              "replays": args.replays, "rounds": args.rounds, "tokens": rows}
    print(f"report: {write_report(report, args.out)}")


if __name__ == "__main__":
    main()
