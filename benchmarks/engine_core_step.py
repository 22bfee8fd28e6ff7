"""Engine-core host time per decode step: vLLM's ``Scheduler.schedule`` and ``update_from_output`` with dynsteer
absent, loaded with nothing hooked, and loaded as by default, on unsteered traffic (in-process CPU engine, tiny Llama).

The scheduler's host work per step is what an idle dynsteer engine adds to vLLM's at large batch (on a GPU the
forward runs on the device, and this work is the host's share of every step). ``bare`` hooks no layer, so its model
forward is vLLM's own and its timings differ from ``absent`` only by the engine-core code; ``idle`` also runs
dynsteer's sites (on CPU the reference ops, which slow everything around them through the caches: compare it with
care); ``dynamic`` gives every request its own dynamic policy (a probe gate acting on some tokens, prefix caching
on: the workers report where it acted and the engine core holds back and folds block hashing; what it adds over
``idle`` is the per-request host work of dynamic steering); ``reports`` is ``dynamic`` with a per-token report asked
by every request (``update`` then includes the engine core's relay of the values, and ``take_reports`` times the
worker's collection of each step's landed values, the runtime's ``take_reports``). Each (mode, batch) runs in a fresh
process, the modes alternating, ``--rounds`` times; a process times ``--calls`` generate calls after one warm-up call
and reports the median over its decode steps (the first 4 and the last step of a call left out). ``--clock cpu``
times by the engine thread's CPU time instead of the wall clock (steadier on a shared box).

    .venv/bin/python benchmarks/engine_core_step.py --batch 1 16 64 --rounds 3
    .venv/bin/python benchmarks/engine_core_step.py --pythonpath /tmp/old   # another checkout's dynsteer (A/B)
    .venv/bin/python benchmarks/engine_core_step.py --modes idle dynamic --batch 128 256
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("absent", "bare", "idle", "dynamic", "reports")


def worker(mode: str, batch: int, calls: int, tokens: int, clock: str = "wall") -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from dynsteer.testing.tiny_models import tiny_model

    extra = {}
    if mode != "absent":
        import dynsteer

        cfg = dynsteer.DynsteerConfig(layers=[], require=False) if mode == "bare" else dynsteer.DynsteerConfig()
        extra = cfg.engine_kwargs()
    llm = LLM(model=str(tiny_model("llama")), dtype="float32", enforce_eager=True, max_model_len=256,
              max_num_seqs=max(batch, 1), seed=0, kv_cache_memory_bytes=256 << 20, **extra)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    times: dict[str, list[float]] = {"schedule": [], "update": [], "take_reports": []}
    now = time.perf_counter if clock == "wall" else time.thread_time  # cpu: this thread's CPU time (a shared box)
    orig_schedule, orig_update = sched.schedule, sched.update_from_output

    def schedule(*a, **k):
        t = now()
        out = orig_schedule(*a, **k)
        times["schedule"].append(now() - t)
        return out

    def update(*a, **k):
        t = now()
        out = orig_update(*a, **k)
        times["update"].append(now() - t)
        return out

    sched.schedule, sched.update_from_output = schedule, update
    if mode == "reports":  # the worker's part: in this in-process engine, the runtime's take_reports of each step
        from dynsteer.steering.runtime import SteeringRuntime

        orig_take = SteeringRuntime.take_reports

        def take_reports(self, *a, **k):
            t = now()
            out = orig_take(self, *a, **k)
            times["take_reports"].append(now() - t)
            return out

        SteeringRuntime.take_reports = take_reports
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    generate, kwargs = llm.generate, {}
    if mode in ("dynamic", "reports"):
        generate, kwargs = dynsteer.attach(llm).generate, {"policy": _policy(llm)}
        if mode == "reports":
            kwargs["report"] = "tokens"
    per_call = []
    for c in range(calls + 1):
        for v in times.values():
            v.clear()
        # fresh prompts every call: no prefix-cache hit changes the work between modes
        prompts = [{"prompt_token_ids": [5 + (i * 7 + j + c * 13) % 700 for j in range(32)]} for i in range(batch)]
        generate(prompts, params, use_tqdm=False, **kwargs)
        if c:
            per_call.append({k: statistics.median(v[4:-1]) * 1e6 for k, v in times.items() if len(v) > 5})
    return {k: round(statistics.median(x[k] for x in per_call), 1) for k in per_call[0]}


def _policy(llm):
    """A dynamic policy on the tiny model: a probe gate at layer 1 whose threshold lets it act on some tokens only,
    adding a vector at layer 2."""
    import numpy as np

    from dynsteer import Action, DynamicSteeringPolicy, ProbeGate, Rule

    hidden = llm.llm_engine.model_config.get_hidden_size()
    rng = np.random.default_rng(0)
    unit = rng.standard_normal(hidden)
    unit /= np.linalg.norm(unit)
    gate = ProbeGate(name="m", layer=1, direction=unit.astype(np.float32), sharpness=4.0, threshold=0.0)
    return DynamicSteeringPolicy(monitors=[gate], rules=[Rule(monitor="m", actions=[
        Action(kind="add", layer=2, vector=(0.01 * unit).astype(np.float32))])])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="time calls by the wall clock, or by the engine thread's CPU time (steadier on a busy box)")
    ap.add_argument("--pythonpath", help="import dynsteer from this checkout instead (an A/B against other code)")
    ap.add_argument("--out", help="JSON report (default: print only)")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        mode, batch = args.worker[0], int(args.worker[1])
        print(json.dumps(worker(mode, batch, args.calls, args.tokens, args.clock)))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    runs: dict[str, dict[str, list[dict]]] = {m: {str(b): [] for b in args.batch} for m in args.modes}
    for r in range(args.rounds):
        for b in args.batch:
            for mode in args.modes:
                e = dict(env, DYNSTEER_DISABLE="1") if mode == "absent" else env
                proc = subprocess.run([sys.executable, __file__, "--worker", mode, str(b), "--calls", str(args.calls),
                                       "--tokens", str(args.tokens), "--clock", args.clock], env=e,
                                      capture_output=True, text=True, cwd="/tmp")
                if proc.returncode:
                    sys.exit(f"{mode} batch {b} failed:\n{proc.stderr[-3000:]}")
                runs[mode][str(b)].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1} batch {b} {mode}: {runs[mode][str(b)][-1]}", flush=True)
    summary = {m: {b: {k: round(statistics.median(x[k] for x in v), 1) for k in v[0]}
                   for b, v in per.items()} for m, per in runs.items()}
    print("\nµs per decode step, median over rounds: schedule / update_from_output (difference from absent)")
    for m, per in summary.items():
        cells = []
        for b, s in per.items():
            base = summary.get("absent", {}).get(b)
            diff = f" ({s['schedule'] - base['schedule']:+.1f} / {s['update'] - base['update']:+.1f})" if base else ""
            take = f", take_reports {s['take_reports']:.1f}" if "take_reports" in s else ""
            cells.append(f"batch {b}: {s['schedule']:.1f} / {s['update']:.1f}{diff}{take}")
        print(f"{m:7s} " + "; ".join(cells))
    if args.out:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.pythonpath or REPO,
                             capture_output=True, text=True).stdout.strip()
        from lib.report import host_facts

        report = {"benchmark": "engine_core_step", "date": dt.date.today().isoformat(), "git_sha": sha,
                  "cpu": host_facts()["cpu_model"] or platform.machine(), "python": platform.python_version(),
                  "args": {k: v for k, v in vars(args).items() if k != "worker"}, "summary_us": summary,
                  "runs_us": runs}
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
