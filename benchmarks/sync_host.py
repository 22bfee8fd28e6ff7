"""Host time of the dynamic tier's per-step driver, by phase, without an engine (CUDA; no vLLM needed).

The engine benchmark (``overhead.py``) reports the dynamic tier's host staging and read-back per step; this splits
them. ``DynamicDriver.plan`` (staged before the forward's launch, the stretch where the device may wait for the
host) and ``after_forward`` (after it) run in a steady decode loop of ``--batch`` requests, each step's forward a
stand-in GEMM chain long enough for the host to run ahead, as vLLM's asynchronous scheduling has it. Phases are
timed with ``perf_counter`` around the driver's own calls (control words' copy, control kernel, update kernel,
read-back kernel and its copy to the host, feeding read-backs to requests).

Modes: ``prdyn`` (per-request dynamic policy, no trace: nothing staged), ``traced`` (the same with a trace kept:
read-backs), ``acts`` (no trace, prefix caching on: every step's gates read back to report where steering acted, as
``overhead.py``'s gate and dynamic modes run), ``sync`` (an EMA-latch controller: the device sync tier, as
``overhead.py``'s sync mode). The driver's kernels replay from CUDA graphs; with the suffix ``_launched``
(``traced_launched``, ``sync_launched``) Triton launches them. The host waits for the forward two steps back
before staging a step (vLLM's asynchronous scheduling keeps it about a step ahead; unbounded, it would fill the
launch queue and time the queue). ``--profile MODE:BATCH`` runs a case again under torch.profiler and lists its
host ops (aten ops, CUDA runtime calls) per step: inside a phase, what the time goes to (the read-back's ~0.1 ms per
step in an engine, of which its launch is ~20 µs).

    python3 benchmarks/sync_host.py --batch 1 16 64 --out benchmarks/results
    python3 benchmarks/sync_host.py --batch 64 --modes traced --profile traced:64 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch

from dynsteer import Action, DynamicSteeringPolicy, ProbeGate, Rule, SyncControllerSpec  # noqa: E402
from dynsteer.config import DynsteerConfig  # noqa: E402
from dynsteer.steering.dynamic.driver import DynamicDriver  # noqa: E402
from dynsteer.steering.dynamic.state import DynState  # noqa: E402
from dynsteer.steering.dynamic.tokens import StepTokens  # noqa: E402
from lib.report import utc_now, write_report

HIDDEN = 4096


def policy(controller: bool, seed: int) -> DynamicSteeringPolicy:
    rng = np.random.default_rng(seed)
    probe = rng.standard_normal(HIDDEN).astype(np.float32)
    mon = ProbeGate(name="m", layer=3, direction=probe / np.linalg.norm(probe), sharpness=4.0, threshold=0.0)
    act = Action(kind="add", layer=5, vector=(rng.standard_normal(HIDDEN) * 0.01).astype(np.float32))
    ctrl = SyncControllerSpec(kind="ema_latch", alpha=0.3, on=0.0, off=-0.5, scale=1.0) if controller else None
    return DynamicSteeringPolicy(monitors=[mon], rules=[Rule(monitor="m", actions=[act])], controller=ctrl)


class Phases:
    """Wraps callables, summing host µs per phase for the current step."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.now[name] = self.now.get(name, 0.0) + (time.perf_counter() - t0) * 1e6
        return timed


def run(mode: str, batch: int, steps: int, forward_ms: float, device: str) -> dict[str, float]:
    cfg = DynsteerConfig()
    G, N = cfg.max_gates, 8192
    dev = torch.device(device)
    bufs = [torch.zeros(G, N, device=dev) for _ in range(4)]
    drv = DynamicDriver(bufs[0], bufs[1], bufs[2], bufs[3], max_slots=256, graphed=not mode.endswith("_launched"))
    states = {}
    for i in range(batch):
        st = DynState.for_policy(policy(mode.startswith("sync"), i))
        st.keep = mode.startswith("traced")
        drv.place(st)
        states[f"r{i}"] = st
    drv.report_acts = mode == "acts"
    ids = tuple(states)
    lookup = states.get
    sts = [states[i] for i in ids]
    slot = np.array([-1 if s.device_slot is None else s.device_slot for s in sts], np.int64)
    record = np.array([-1 if s.record is None else s.record for s in sts], np.int64)
    sync = np.array([s.sync for s in sts])
    host = np.array([s.tier == "host" for s in sts])
    act = np.array([s.act_mask for s in sts], np.int64)
    sig = np.array(["x"] * batch, dtype=object)
    r = np.arange(batch)
    phases = Phases()
    drv.control, drv.update, drv.readback = (phases.wrap("control_kernel", drv.control),
                                             phases.wrap("update_kernel", drv.update),
                                             phases.wrap("readback_kernel", drv.readback))
    if drv.graphed:  # the graph replays (the kernels themselves were launched at capture only)
        drv._control_at = phases.wrap("control_kernel", drv._control_at)
        drv._update_at = phases.wrap("update_kernel", drv._update_at)
        drv._readback_at = phases.wrap("readback_kernel", drv._readback_at)
    drv._words.copy_to = phases.wrap("words_h2d", drv._words.copy_to)
    if getattr(drv, "_ring", None) is not None:  # the read-back's copy to the host (side stream, pinned ring)
        drv._ring.copy = phases.wrap("d2h_copy", drv._ring.copy)
    drv.poll = phases.wrap("poll", drv.poll)
    a = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    reps = max(1, int(forward_ms / 0.012))  # ~12 µs per 2048² bf16 GEMM on an H100/H200
    rows: list[dict[str, float]] = []
    done: list[Any] = []
    for step in range(steps):
        if len(done) >= 2 and dev.type == "cuda":
            done.pop(0).synchronize()  # the forward two steps back: the host stays about a step ahead
        tokens = StepTokens(ids, r, r.copy(), np.full(batch, 100 + step, np.int64), slot, sync, record, host, act,
                            sig)
        phases.now = {}
        t0 = time.perf_counter()
        drv.plan(states, lookup, tokens, batch)
        t1 = time.perf_counter()
        x = a
        for _ in range(reps):  # the forward: the device busy while the host stages the next step
            x = x @ a
        t2 = time.perf_counter()
        drv.after_forward(lookup)
        t3 = time.perf_counter()
        if dev.type == "cuda":
            done.append(torch.cuda.Event())
            done[-1].record()
        row = {"plan": (t1 - t0) * 1e6, "after_forward": (t3 - t2) * 1e6, **phases.now}
        if step >= steps // 4:  # past warm-up
            rows.append(row)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    keys = sorted({k for row in rows for k in row})
    return {k: round(statistics.median(row.get(k, 0.0) for row in rows), 2) for k in keys}


MODES = ("prdyn", "traced", "traced_launched", "acts", "sync", "sync_launched")


def profile_case(case: str, steps: int, device: str, top: int = 25) -> dict[str, float]:
    """``run`` of ``case`` (``MODE:BATCH``) under torch.profiler (CPU activity): the ``top`` host ops by self CPU
    time, in µs per step (printed as a table and returned). The forward is one GEMM here (``forward_ms`` 0), so
    the table holds the driver's ops, not the stand-in forward's launches."""
    from torch.profiler import ProfilerActivity, profile

    mode, _, b = case.partition(":")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(mode, int(b), steps, 0.0, device)
    events = sorted(prof.key_averages(), key=lambda ev: -ev.self_cpu_time_total)[:top]
    out = {ev.key: round(ev.self_cpu_time_total / steps, 2) for ev in events}
    print(f"profile {case}, host µs per step by self CPU time (calls per step):")
    for ev in events:
        print(f"  {ev.key[:60]:60s} {ev.self_cpu_time_total / steps:9.2f}  ({ev.count / steps:.1f})")
    return out


def launch_cost(calls: int, span: int) -> dict[str, float]:
    """Host µs per launch of the control kernel three ways: Triton's JIT launcher (as the driver launches it), the
    compiled kernel's own launcher (binding and cache lookup skipped), a CUDA graph replay."""
    from dynsteer.kernels.controller_reference import Layout
    from dynsteer.kernels.triton_controller import _control_kernel, _gb, control_triton

    G, N = DynsteerConfig().max_gates, 8192
    dev = torch.device("cuda")
    lay = Layout(G)
    ctl = torch.full((N,), -1, dtype=torch.int32, device=dev)
    state = torch.zeros(256, lay.width, dtype=torch.float64, device=dev)
    replay = torch.zeros(N, 2 * G + 1, device=dev)
    mul, add, scale = torch.ones(G, N, device=dev), torch.zeros(G, N, device=dev), torch.ones(N, device=dev)
    args = (ctl, state, replay, mul, add, scale, state.shape[1], replay.shape[1], N, G, _gb(G), lay.SCALE_NOW,
            lay.FIXED)

    def jit() -> None:
        control_triton(ctl, state, replay, mul, add, scale, span)

    compiled = _control_kernel[(span,)](*args[:9], G=G, GB=_gb(G), SCALE_NOW=lay.SCALE_NOW, FIXED=lay.FIXED)
    runner = compiled[(span, 1, 1)]

    def direct() -> None:
        runner(*args)

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        jit()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        jit()
    out = {}
    for name, fn in (("jit", jit), ("compiled_runner", direct), ("graph_replay", graph.replay)):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = round((time.perf_counter() - t0) / calls * 1e6, 2)
        torch.cuda.synchronize()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--forward-ms", type=float, default=2.0)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (reference kernels)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--launch-calls", type=int, default=2000, help="launch-cost section (CUDA; 0: skip)")
    ap.add_argument("--profile", nargs="*", default=[], metavar="MODE:BATCH",
                    help="also run these cases under torch.profiler and print their host ops (aten ops, CUDA runtime "
                         "calls) by self CPU time per step: where a phase's time goes")
    args = ap.parse_args()
    for case in args.profile:
        mode, _, b = case.partition(":")
        if mode not in MODES:
            ap.error(f"--profile: unknown mode {mode!r} in {case!r}")
        if not b.isdigit() or int(b) < 1:
            ap.error(f"--profile: {case!r} must be MODE:BATCH with a batch of at least 1")
    launch = launch_cost(args.launch_calls, max(args.batch)) if args.launch_calls and args.device == "cuda" else {}
    print(f"control kernel, host µs per launch: {json.dumps(launch)}", flush=True)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for mode in args.modes:
        for b in args.batch:
            res = run(mode, b, args.steps, args.forward_ms, args.device)
            results.setdefault(mode, {})[str(b)] = res
            print(f"{mode} b{b}: {json.dumps(res)}", flush=True)
    profiles = {case: profile_case(case, args.steps, args.device) for case in args.profile}
    report = {"benchmark": "sync_host", "date": utc_now(),
              "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "commit": os.environ.get("DYNSTEER_GIT_SHA"), "steps": args.steps, "forward_ms": args.forward_ms,
              "unit": "host µs per step, median", "results": results,
              "control_launch_host_us": launch, "profiles": profiles}
    print(f"report: {write_report(report, args.out)}")


if __name__ == "__main__":
    main()
