"""The host side of the fused forward in eager steps: what dynsteer's ``steer_add_rms_norm`` costs to *launch*.

A step whose token count exceeds vLLM's captured sizes (``max_cudagraph_capture_size``, by default twice
``max_num_seqs`` up to 512: e.g. a 388-token mixed prefill at ``max_num_seqs=64``) runs the compiled forward
without a CUDA graph. There every add-norm is launched from the host: inductor's own fused kernel in vLLM, a call
into dynsteer's op (dispatcher, Python, Triton launcher) in a dynsteer engine, 64 times per forward of a 32-layer
model. Where the device is not busy for longer than that (a short prefill while requests arrive), the launches are
the step's time. This measures, per forward of the 64 add-norms at ``--tokens`` tokens (bf16, 4096 wide, the
default engine's tables, every site idle):

* ``vllm``: ``torch.compile`` of vLLM's native add-norm chained 64 times (inductor's kernels, no graph);
* ``ours``: ``torch.compile`` of dynsteer's fused op chained the same way (what an eager step runs);
* per call of the op: through the dispatcher, the Python implementation alone, the plain add-norm launch, the
  bare Triton launch, and the two output allocations;

host microseconds (no synchronisation inside the timed loop) and wall microseconds (synchronised) per forward.

    python3 benchmarks/eager_norm_launch.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fused_norm_kernel import build  # noqa: E402
from static_overhead import write_report  # noqa: E402

from dynsteer.kernels import ops  # noqa: E402
from dynsteer.kernels.fused_reference import add_rms_norm_reference  # noqa: E402
from dynsteer.steering.site import fused_add_rms_norm  # noqa: E402


def host_us(fn: Callable[[], object], calls: int, rounds: int) -> tuple[float, float]:
    """(host µs per call, wall µs per call): medians over ``rounds`` loops of ``calls`` calls."""
    host, wall = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e6 / calls)
        wall.append((t2 - t0) * 1e6 / calls)
    return statistics.median(host), statistics.median(wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tokens", type=int, nargs="+", default=[388, 2048])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    from dynsteer.kernels.triton_fused import _add_rms_norm_kernel, add_rms_norm_triton
    from dynsteer.kernels.triton_steer import _num_warps

    dtype = torch.bfloat16
    tables, pairs = build(args.layers, args.hidden, max(args.tokens))
    weight = (1 + 0.1 * torch.randn(args.hidden, device="cuda")).to(dtype)
    eps = 1e-5

    def chain_native(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        for _ in pairs:
            x, r = add_rms_norm_reference(x, r, weight, eps)
        return x

    def chain_ours(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        for first, second in pairs:
            x, r = fused_add_rms_norm(first, second, x, r, weight, eps)
        return x

    native = torch.compile(chain_native, dynamic=True)
    ours = torch.compile(chain_ours, dynamic=True)
    first, second = pairs[1]  # post_block of layer 0, pre_attn of layer 1: a two-site norm
    rows = {}
    for T in args.tokens:
        h = torch.randn(T, args.hidden, device="cuda", dtype=dtype)
        r = torch.randn(T, args.hidden, device="cuda", dtype=dtype)
        native(h, r), ours(h, r)  # compile (bits are checked by tests/test_kernels_fused.py, not here)
        stage = ops.no_stage(h)
        tabs_a, tabs_b = first.tables(), second.tables()
        bufs = [first.gate_mul, first.gate_add, first.gates, first.scores]
        n_out, r_out = torch.empty_like(h), torch.empty_like(h)
        block = 1 << (args.hidden - 1).bit_length()
        cases: dict[str, Callable[[], object]] = {
            "vllm_forward": lambda: native(h, r),
            "ours_forward": lambda: ours(h, r),
            "op_call": lambda: torch.ops.dynsteer.steer_add_rms_norm(h, r, weight, eps, first.row_index, tabs_a,
                                                                      tabs_b, bufs, stage, stage, None, False),
            "op_impl": lambda: ops._fused_impl(h, r, weight, eps, first.row_index, tabs_a, tabs_b, bufs, stage,
                                               stage, None, False),
            "plain_add_norm": lambda: add_rms_norm_triton(h, r, weight, eps),
            "triton_launch": lambda: _add_rms_norm_kernel[(T,)](h, r, weight, n_out, r_out, args.hidden, eps,
                                                                h.stride(0), r.stride(0), BLOCK_H=block,
                                                                UNIT_OFFSET=False, num_warps=_num_warps(block)),
            "two_empty_like": lambda: (torch.empty_like(h), torch.empty_like(h)),
        }
        row = {}
        for name, fn in cases.items():
            for _ in range(3):
                fn()
            hu, wu = host_us(fn, args.calls, args.rounds)
            row[name] = {"host_us": round(hu, 2), "wall_us": round(wu, 2)}
        rows[str(T)] = row
        print(f"T={T}: {json.dumps(row)}", flush=True)
    report = {"benchmark": "eager_norm_launch", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": "bfloat16",
              "layers": args.layers, "hidden": args.hidden, "norms": len(pairs), "calls": args.calls,
              "rounds": args.rounds, "tokens": rows}
    print(f"report: {write_report(report, args.out)}")


if __name__ == "__main__":
    main()
