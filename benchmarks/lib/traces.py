"""torch-profiler chrome traces (``.json`` or ``.json.gz``, as vLLM's profiler writes them): reading them, and a
call's summary per step (top host ops by self time, top device kernels, the device's busy and idle time, and the
steady second half's every kernel)."""

from __future__ import annotations

import gzip
import json
from collections import Counter, defaultdict
from pathlib import Path

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(path: Path) -> list[dict]:
    """A chrome trace's ``traceEvents``."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def summarize_trace(path: Path, steps: int, top: int = 15) -> dict:
    """Top CPU ops by self time and top device kernels by time, per step, from a chrome trace of torch.profiler; the
    device's busy / idle time, idle time by tenth of the call, and the batch of the first steps (a batch prefilled in
    more steps than vLLM alone takes shows requests reaching the engine core late)."""
    events = load_events(path)
    kernels: Counter = Counter()
    host_self: Counter = Counter()
    threads: dict = defaultdict(list)
    spans: list = []  # device intervals, for the time the device sat idle waiting for work
    device_events: list = []  # (start, duration, name) of every kernel / copy, for the steady-state window
    batches: list = []  # vLLM's per-step annotations ("execute_context_<reqs>(<tokens>)_generation_<reqs>(<tokens>)")
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = e.get("cat", "")
        if cat == "user_annotation" and str(e.get("name", "")).startswith("execute_context_"):
            batches.append((e["ts"], e["name"]))
        if cat in DEVICE_CATS:
            kernels[e["name"]] += e["dur"]
            spans.append((e["ts"], e["ts"] + e["dur"]))
            device_events.append((e["ts"], e["dur"], e["name"]))
        elif cat in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function"):
            threads[(e.get("pid"), e.get("tid"))].append(e)
    for evs in threads.values():  # self time: an event's duration less that of the events nested in it
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list = []

        def pop() -> None:
            _, ev, child = stack.pop()
            if ev.get("cat") != "user_annotation":
                host_self[ev["name"]] += ev["dur"] - child

        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                pop()
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e["ts"] + e["dur"], e, 0.0])
        while stack:
            pop()
    per = lambda c: [[name, round(us / steps, 2)] for name, us in c.most_common(top)]  # noqa: E731
    # Device idle between its first and last kernel: gaps where it waited for the host (a host-bound step shows
    # here, not in kernel time). Gaps over 20 µs are counted separately: launch latency is a few µs.
    spans.sort()
    busy, idle, big, end = 0.0, 0.0, 0.0, None
    tenths = [0.0] * 10  # idle time by tenth of the call: the first tenths hold admission (requests trickling in)
    first, last = (spans[0][0], max(b for _, b in spans)) if spans else (0.0, 1.0)
    for a, b in spans:
        if end is not None and a > end:
            idle += a - end
            big += a - end if a - end > 20 else 0.0
            tenths[min(9, int((end - first) / max(last - first, 1e-9) * 10))] += a - end
        busy += max(0.0, b - max(a, end if end is not None else a))
        end = b if end is None else max(end, b)
    # the batch of each of the first steps (one annotation per step and thread: deduplicated by name in order)
    seen: list = []
    for _, name in sorted(batches):
        short = name.removeprefix("execute_context_").replace("_generation_", " + decode ")
        if not seen or seen[-1] != short:
            seen.append(short)
    return {"steps": steps, "first_steps": seen[:4], "device_idle_ms_by_tenth": [round(x / 1e3, 2) for x in tenths],
            "host_self_us_per_step_total": round(sum(host_self.values()) / steps, 1),
            "device_us_per_step_total": round(sum(kernels.values()) / steps, 1),
            "device_busy_us_per_step": round(busy / steps, 1), "device_idle_us_per_step": round(idle / steps, 1),
            "device_idle_gaps_over_20us_per_step": round(big / steps, 1),
            "top_host_ops_self_us_per_step": per(host_self), "top_device_kernels_us_per_step": per(kernels),
            "steady": steady_window(device_events, batches)}


def steady_window(device_events: list, batches: list) -> dict:
    """The second half of the call's device time (pure decode at every batch size here): the steps vLLM annotated
    there, the device's period per step, its busy and idle time per step, and every kernel with its launches and
    time per step (the whole list: an extra small kernel per layer is what a top-N list hides)."""
    if not device_events:
        return {}
    device_events.sort()
    first, last = device_events[0][0], max(a + d for a, d, _ in device_events)
    start = first + (last - first) / 2
    window = [ev for ev in device_events if ev[0] >= start]
    marks: list = []  # decode-step annotations (one per step and thread: those 0.5 ms apart count once)
    for ts, name in sorted(batches):
        if ts >= start and name.startswith("execute_context_0(0)") and (not marks or ts - marks[-1] > 500):
            marks.append(ts)
    steps = len(marks) or 1
    kernels: dict = defaultdict(lambda: [0, 0.0])
    busy, end = 0.0, None
    for a, d, name in window:
        kernels[name][0] += 1
        kernels[name][1] += d
        busy += max(0.0, a + d - max(a, end if end is not None else a))
        end = a + d if end is None else max(end, a + d)
    span = last - window[0][0]
    # the pace: from the first counted step's start to the last's (host annotations; equal to the device's pace in
    # a steady decode), per step
    period = (marks[-1] - marks[0]) / (len(marks) - 1) if len(marks) > 1 else span / steps
    rows = sorted(([name[:160], round(n / steps, 3), round(us / steps, 3)] for name, (n, us) in kernels.items()),
                  key=lambda r: -r[2])
    return {"steps": steps, "period_us": round(period, 2), "busy_us_per_step": round(busy / steps, 2),
            "idle_us_per_step": round(period - busy / steps, 2),
            "launches_per_step": round(sum(n for n, _ in kernels.values()) / steps, 2), "kernels": rows}
