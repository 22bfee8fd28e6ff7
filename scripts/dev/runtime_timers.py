"""The worker-side steering runtime's per-step calls, timed inside a real engine: an in-process CPU engine (the tiny
Llama, eager, float32) runs ``overhead.py``'s workload of one mode, with a timer around each of the runtime's step
methods (plan, after_forward, take_acts and the dynamic tier's parts). Unlike ``benchmarks/host_step.py``, which
drives the runtime alone, the calls here run between vLLM's own code and the model's forward, with the caches that
leaves (on a CPU box the read-back's torch reference runs eagerly: ``_launch_readback`` is compute there, launches on
a GPU). Medians and means per call, in µs, over ``--calls`` calls after a warm-up call.

    .venv/bin/python scripts/dev/runtime_timers.py --batch 256 --mode prdyn
    .venv/bin/python scripts/dev/runtime_timers.py --pythonpath /tmp/old-checkout   # another checkout's dynsteer
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

TIMED = {  # module: {class: [methods]}
    "dynsteer.steering.runtime": {"SteeringRuntime": ["plan", "after_forward", "take_acts"]},
    "dynsteer.steering.dynamic.tier": {"DynamicTier": ["plan"]},
    "dynsteer.steering.dynamic.driver": {"DynamicDriver": ["plan", "_launch_readback", "poll"]},
    "dynsteer.device.readback": {"ReadbackStore": ["append"]},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--mode", default="prdyn", help="an overhead.py mode of the dynsteer engine (prdyn, sync, ...)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--pythonpath", help="import dynsteer from this checkout instead")
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core's calls are this interpreter's
    sys.path[:0] = [args.pythonpath or str(REPO), str(REPO / "benchmarks")]

    import importlib

    import torch

    torch.set_num_threads(1)
    times: dict[str, list[float]] = defaultdict(list)

    def timed(cls: type, name: str) -> None:
        fn = getattr(cls, name)

        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times[f"{cls.__name__}.{name}"].append(time.perf_counter() - t)

        setattr(cls, name, wrapper)

    for module, classes in TIMED.items():
        mod = importlib.import_module(module)
        for cls_name, names in classes.items():
            for name in names:
                timed(getattr(mod, cls_name), name)

    from vllm import LLM

    from dynsteer.testing.tiny_models import tiny_model
    from lib.overhead.workload import Workload, llm_kwargs, single_engine_cfg

    cfg = single_engine_cfg(str(tiny_model("llama")), "auto", "float32", 256 << 20, args.batch, args.tokens,
                            eager=True)
    work = Workload(LLM(**llm_kwargs(cfg)), cfg)
    for repeat in range(args.calls + 1):
        if repeat == 1:
            times.clear()  # the warm-up call (admission, first payloads) is not counted
        call, teardown = work.prepare(args.mode, args.batch, repeat=repeat)
        call()
        if teardown:
            teardown()
    import dynsteer

    print(f"dynsteer from {Path(dynsteer.__file__).parent}; mode {args.mode}, batch {args.batch}, "
          f"{args.calls} calls of {args.tokens} tokens")
    print("| call | calls | median µs | mean µs |\n|---|---|---|---|")
    for name, values in sorted(times.items()):
        print(f"| {name} | {len(values)} | {statistics.median(values) * 1e6:.1f} | "
              f"{statistics.mean(values) * 1e6:.1f} |")


if __name__ == "__main__":
    main()
