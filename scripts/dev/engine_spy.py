"""Where an engine's processes spend their CPU per decode step, mode against mode: one dynsteer engine (Llama-3-8B
shape, dummy weights, CUDA graphs), ``overhead.py``'s workloads, py-spy attached to every process over ``--calls``
timed calls of each mode in turn. Raw stacks (gzipped, one file per process and mode round) land in ``--out``; read
them with ``scripts/dev/spy_diff.py``. A diagnostic that fits a short device call (one engine's start-up, no A/A).

    python3 scripts/dev/engine_spy.py --py-spy .gpu-carry/py-spy --modes idle prdyn --batch 256 --out $OUT

``--sync-check`` instead runs the engine core in this process and counts, per mode over one call, the torch calls
that synchronise the host with the device (``torch.cuda.set_sync_debug_mode``), by the Python line that made them
(vLLM's and dynsteer's): a call in dynsteer's per-step path, or one more in vLLM's with dynsteer's requests, stalls
asynchronous scheduling. The counts land in ``sync_check.json``.

    python3 scripts/dev/engine_spy.py --sync-check --modes idle pr64 gate prdyn sync --batch 64 --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--py-spy", help="py-spy's executable (the profile run)")
    ap.add_argument("--sync-check", action="store_true", help="count host-device synchronisations instead")
    ap.add_argument("--modes", nargs="+", default=["idle", "prdyn"])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--calls", type=int, default=3, help="timed calls per mode and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate", type=int, default=400)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpu-smoke", action="store_true", help="the tiny Llama on CPU (checks the script, no figures)")
    args = ap.parse_args()
    if not (args.sync_check or args.py_spy):
        ap.error("give --py-spy EXE (a profile) or --sync-check")
    if args.sync_check:  # the engine core in this process: its torch calls are this interpreter's
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from vllm import LLM

    from lib.engines import shape_config
    from lib.overhead.workload import Workload, llm_kwargs, single_engine_cfg
    from lib.pyspy import Sampler

    if args.cpu_smoke:
        from dynsteer.testing.tiny_models import tiny_model

        model_dir, fmt, dtype, kv = tiny_model("llama"), "auto", "float32", 256 << 20
    else:
        model_dir, fmt, dtype, kv = Path(tempfile.mkdtemp(prefix="spy-model-")) / "llama3-8b-shape", "dummy", \
            "bfloat16", 16 << 30
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(shape_config("llama3-8b")))
    cfg = single_engine_cfg(str(model_dir), fmt, dtype, kv, args.batch, args.tokens, eager=args.cpu_smoke)
    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs(cfg))
    work = Workload(llm, cfg)
    print(f"engine up in {time.perf_counter() - t0:.0f} s", flush=True)
    for mode in args.modes:  # warm-up: first payloads, memos, graphs
        call, teardown = work.prepare(mode, args.batch)
        call()
        if teardown:
            teardown()
    if args.sync_check:
        report = {"batch": args.batch, "tokens": args.tokens, "modes": {}}
        for mode in args.modes:
            call, teardown = work.prepare(mode, args.batch, repeat=1)
            with sync_counting(not args.cpu_smoke) as counts:
                call()
            if teardown:
                teardown()
            report["modes"][mode] = dict(counts.most_common())
            print(f"{mode}: {sum(counts.values())} synchronising calls over one call of {args.tokens} tokens",
                  flush=True)
            for where, n in counts.most_common(8):
                print(f"  {n:6d}  {where}", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sync_check.json").write_text(json.dumps(report, indent=1))
        return
    sampler = Sampler(args.py_spy, args.out, rate=args.rate, mode="busy")
    report = {"batch": args.batch, "tokens": args.tokens, "calls": args.calls, "rate": args.rate, "runs": []}
    for r in range(args.rounds):
        for mode in args.modes:
            sampler.start(os.getpid(), f"{mode}-r{r}")
            times = []
            for c in range(args.calls):
                call, teardown = work.prepare(mode, args.batch, repeat=100 * r + c)
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
                if teardown:
                    teardown()
            sampler.stop(summarise=False)
            report["runs"].append({"mode": mode, "round": r, "seconds": times})
            print(f"{mode} round {r}: {[round(x, 3) for x in times]} s per call", flush=True)
    (args.out / "engine_spy.json").write_text(json.dumps(report, indent=1))


@contextlib.contextmanager
def sync_counting(cuda: bool) -> Iterator[Counter]:
    """Count every torch call in the block that synchronises with the device (torch warns for each while its sync
    debug mode is "warn"; off CUDA nothing is counted), by the innermost line of vLLM's or dynsteer's code that led
    to it, and by the innermost dynsteer line where one lies on the stack."""
    import torch

    counts: Counter = Counter()

    def note(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()]
        ours = [f for f in frames if "vllm/" in f or "dynsteer/" in f]
        mine = [f for f in ours if "dynsteer/" in f]
        key = ours[-1] if ours else f"{filename}:{lineno}"
        counts[key + (f"  (under {mine[-1]})" if mine and mine[-1] != key else "")] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")


if __name__ == "__main__":
    main()
