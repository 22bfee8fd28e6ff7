"""Where an engine's processes spend their CPU per decode step, mode against mode: one dynsteer engine (Llama-3-8B
shape, dummy weights, CUDA graphs), ``overhead.py``'s workloads, py-spy attached to every process over ``--calls``
timed calls of each mode in turn. Raw stacks (gzipped, one file per process and mode round) land in ``--out``; read
them with ``scripts/dev/spy_diff.py``. A diagnostic that fits a short device call (one engine's start-up, no A/A).

    python3 scripts/dev/engine_spy.py --py-spy .gpu-carry/py-spy --modes idle prdyn --batch 256 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--py-spy", required=True)
    ap.add_argument("--modes", nargs="+", default=["idle", "prdyn"])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--calls", type=int, default=3, help="timed calls per mode and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate", type=int, default=400)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpu-smoke", action="store_true", help="the tiny Llama on CPU (checks the script, no figures)")
    args = ap.parse_args()

    from vllm import LLM

    from lib.engines import shape_config
    from lib.overhead.workload import Workload, llm_kwargs
    from lib.pyspy import Sampler

    if args.cpu_smoke:
        from dynsteer.testing.tiny_models import tiny_model

        model_dir, fmt, dtype, kv = tiny_model("llama"), "auto", "float32", 256 << 20
    else:
        model_dir, fmt, dtype, kv = Path(tempfile.mkdtemp(prefix="spy-model-")) / "llama3-8b-shape", "dummy", \
            "bfloat16", 16 << 30
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(shape_config("llama3-8b")))
    cfg = dict(model_dir=str(model_dir), load_format=fmt, dtype=dtype, eager=args.cpu_smoke, batches=[args.batch],
               tokens=args.tokens, prompt_len=32, max_model_len=256, kind="dynsteer", engine="dynsteer",
               max_num_batched_tokens=max(args.batch * 32, 512), gpu_util=0.92, kv_bytes=kv,
               dynsteer={"max_rows": args.batch + 34})
    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs(cfg))
    work = Workload(llm, cfg)
    print(f"engine up in {time.perf_counter() - t0:.0f} s", flush=True)
    for mode in args.modes:  # warm-up: first payloads, memos, graphs
        call, teardown = work.prepare(mode, args.batch)
        call()
        if teardown:
            teardown()
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


if __name__ == "__main__":
    main()
