"""Host time per decode step of the worker-side steering runtime, without a model.

The runtime's per-step work (``plan``: row index, gate words, capture slots; ``after_forward``: read-backs; the
next ``plan``'s poll of finished read-backs) runs on the host while the GPU runs earlier steps. This benchmark drives a
:class:`dynsteer.steering.runtime.SteeringRuntime` through a steady decode (every request one token per step, batch
composition fixed, then one request replaced every ``--churn`` steps) on tables of an 8B-like shape, and reports
microseconds of host time per step for each mode and batch size. On a CPU box the torch ops of the read-back and the
controller kernels would run synchronously (their torch references loop over tokens in Python), so they are skipped
unless ``--kernels run``; on CUDA they are launches, always run.

    .venv/bin/python benchmarks/host_step.py --batches 1 16 64 --steps 400

Modes: ``idle`` (nothing set), ``per-request static`` (every request its own vector), ``per-request dynamic`` (four
policies spread over the batch; HTTP-like: nobody keeps the trace), ``per-request dynamic cached`` (the same in an
engine with prefix caching, vLLM's default: every dynamic token is read back and where steering acted is reported
to the engine core), ``per-request dynamic traced`` (the same, each request's trace kept, as the offline API does),
``sync`` (per-request + EMA-latch controller, device tier), ``capture`` (every generated token at one place).
``after`` is ``after_forward`` plus the runner glue's ``take_acts`` of the step's output; ``release`` (a mean: most
steps release nothing) is the start of a step, where ``--churn``'s finished request leaves; ``other threads`` is the CPU
time per step of the process's other threads (the capture spool's writer), which competes with the host path for the
GIL and the memory bus.

    .venv/bin/python benchmarks/host_step.py --batches 128 256 --churn 1 --modes idle "per-request dynamic cached"
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dynsteer import Action, DynamicSteeringPolicy, ProbeGate, Rule, SyncControllerSpec  # noqa: E402
from dynsteer.capture.consumers import MemoryConsumer  # noqa: E402
from dynsteer.capture.spec import CaptureSpec  # noqa: E402
from dynsteer.capture.spool import WRITER  # noqa: E402
from dynsteer.capture.store import CaptureCollector  # noqa: E402
from dynsteer.request.payload import encode_payload  # noqa: E402
from dynsteer.spec import ModelShape, SteeringSpec  # noqa: E402
from dynsteer.steering.runtime import BatchView, SteeringRuntime  # noqa: E402
from dynsteer.steering.tables import SteeringTables  # noqa: E402

MODES = ["idle", "per-request static", "per-request dynamic", "per-request dynamic cached",
         "per-request dynamic traced", "sync", "capture"]


def build(layers: int, hidden: int, max_tokens: int, device: str, kernels: str, report_acts: bool = False
          ) -> SteeringRuntime:
    shape = ModelShape(num_layers=layers, hidden_size=hidden, sites=("post_block",), max_gates=2)
    tables = SteeringTables([(l, "post_block") for l in range(layers)], hidden, num_rows=80, max_clamps=1,
                            max_tokens=max_tokens, device=device, max_gates=2)
    rt = SteeringRuntime(shape, tables, sync_slots=256)
    if device == "cpu" and kernels == "skip":  # the CPU references are per-token Python; on CUDA they are launches
        rt.dynamic.control = rt.dynamic.update = lambda *a: None
    rt.dynamic.report_acts = report_acts  # as engine.build sets it from vLLM's prefix caching
    place = (layers // 2, "post_block")
    buf = torch.zeros(max_tokens, hidden, device=device)
    rt.attach_capture(CaptureCollector({place: buf}, engine_places={place}), {"memory": MemoryConsumer()})
    return rt


def payloads(mode: str, batch: int, layers: int, hidden: int, rng: np.random.Generator) -> list[str | None]:
    def unit() -> np.ndarray:
        v = rng.standard_normal(hidden)
        return (v / np.linalg.norm(v)).astype(np.float32)

    if mode == "idle":
        return [None] * batch
    if mode == "per-request static":
        return [encode_payload(SteeringSpec.model_validate({"vectors": [
            {"layer": layers // 2, "site": "post_block", "vector": unit() * 0.01, "tier": "decode"}]}))
            for _ in range(batch)]
    if mode == "capture":
        cap = CaptureSpec(layers=(layers // 2,), positions="all_generated")
        return [encode_payload(capture=cap) for _ in range(batch)]
    ctrl = (SyncControllerSpec(kind="ema_latch", alpha=0.3, on=0.2, off=0.0, scale=1.5, monitor="m")
            if mode == "sync" else None)
    pols = [DynamicSteeringPolicy(
        monitors=[ProbeGate(name="m", layer=layers // 2, direction=unit(), sharpness=4.0, threshold=0.1 * k)],
        rules=[Rule(monitor="m", actions=[Action(kind="add", layer=layers // 2 + 2, vector=unit() * 0.01)])],
        controller=ctrl) for k in range(4)]
    return [encode_payload(policy=pols[i % 4], trace=mode.endswith("traced")) for i in range(batch)]


def run(rt: SteeringRuntime, mode: str, batch: int, steps: int, churn: int, layers: int, hidden: int,
        prompt_len: int = 32, clock: str = "wall", pace_ms: float = 0.0) -> dict[str, float]:
    now = time.perf_counter if clock == "wall" else time.thread_time  # cpu: this thread's CPU time
    rng = np.random.default_rng(0)
    pool = payloads(mode, batch, layers, hidden, rng)
    serial = iter(range(10**9))
    live = [f"r{next(serial)}" for _ in range(batch)]
    payload = {r: pool[i] for i, r in enumerate(live)}
    computed = {r: prompt_len for r in live}
    # the prefill step (not timed)
    qsl = np.arange(batch + 1, dtype=np.int64) * prompt_len
    rt.plan(BatchView(live, qsl, np.zeros(batch, np.int64), np.full(batch, prompt_len), batch * prompt_len,
                      batch * prompt_len), payload.__getitem__)
    rt.after_forward()
    times, fwd, releases = [], [], []
    qsl = np.arange(batch + 1, dtype=np.int64)
    proc0, own0 = time.process_time(), time.thread_time()
    for step in range(steps):
        start = time.perf_counter()
        r0 = now()
        if churn and step and step % churn == 0:  # one request finishes, a new one takes its place (decoding)
            done = live.pop(0)
            rt.release([done])  # the runner's start of a step: finished requests leave (timed with the step)
            new = f"r{next(serial)}"
            live.append(new)
            payload[new], computed[new] = payload.pop(done), prompt_len
            computed.pop(done)
        releases.append(now() - r0)
        view = BatchView(list(live), qsl, np.array([computed[r] for r in live], np.int64),
                         np.full(batch, prompt_len), batch, batch)
        t0 = now()
        rt.plan(view, payload.__getitem__)
        t1 = now()
        rt.after_forward()
        rt.take_acts()
        t2 = now()
        times.append(t1 - t0)
        fwd.append(t2 - t1)
        for r in live:
            computed[r] += 1
        if pace_ms:  # the device's step: the host waits without the GIL, as a runner waiting for its step does
            time.sleep(max(0.0, start + pace_ms / 1e3 - time.perf_counter()))
    WRITER.drain()  # the capture spool's writes of these steps, before its CPU time is read
    others = (time.process_time() - proc0) - (time.thread_time() - own0)
    rt.release(live)
    if rt.dynamic is not None:
        rt.dynamic.poll(rt.dynamic_tier.state_of, block=True)
    skip = steps // 10
    total = sorted(a + b + c for a, b, c in zip(times[skip:], fwd[skip:], releases[skip:]))
    return {"plan_us": statistics.median(times[skip:]) * 1e6, "after_forward_us": statistics.median(fwd[skip:]) * 1e6,
            "release_us": statistics.mean(releases[skip:]) * 1e6,
            "mean_total_us": sum(total) / len(total) * 1e6,
            "p90_total_us": total[int(0.9 * (len(total) - 1))] * 1e6, "max_total_us": total[-1] * 1e6,
            "other_threads_cpu_us": others / steps * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--churn", type=int, default=0, help="replace one request every N steps (0: fixed batch)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kernels", choices=["skip", "run"], default="skip",
                    help="on CPU, skip the sync tier's controller kernels (their torch references loop in Python; "
                         "on CUDA they are single launches, always run)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="time by the wall clock, or by this thread's CPU time (steadier on a busy box)")
    ap.add_argument("--pace-ms", type=float, default=0.0,
                    help="start a step every PACE ms (the device's decode step; the host sleeps out the rest, as a "
                         "runner waiting for its step does), so background threads see an engine's pace rather "
                         "than back-to-back steps (0: back to back)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results: dict[str, dict[str, dict[str, float]]] = {}
    print("| mode | " + " | ".join(f"batch {b}: plan / after / mean release / mean total / p90 total / other threads µs"
                                   for b in args.batches)
          + " |")
    print("|---" * (len(args.batches) + 1) + "|")
    for mode in args.modes:
        results[mode] = {}
        for batch in args.batches:
            rt = build(args.layers, args.hidden, max(512, batch * 32), args.device, args.kernels,
                       report_acts=mode.endswith("cached"))
            results[mode][str(batch)] = run(rt, mode, batch, args.steps, args.churn, args.layers, args.hidden,
                                            clock=args.clock, pace_ms=args.pace_ms)
        cells = [f"{r['plan_us']:.0f} / {r['after_forward_us']:.0f} / {r['release_us']:.0f} / {r['mean_total_us']:.0f} / "
                 f"{r['p90_total_us']:.0f} / {r['other_threads_cpu_us']:.0f}"
                 for r in results[mode].values()]
        print(f"| {mode} | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
