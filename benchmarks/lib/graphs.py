"""Device timing of kernel chains: CUDA-graph capture and replay, alternating rounds, per-kernel times (CUDA).

A chain of launches is captured once in a CUDA graph and replayed, so what is timed is the device's work and not
the host's launches; variants are replayed in alternating order round by round, so drift hits them alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fn``'s launches captured once in a CUDA graph, after three warm-up calls (compiles) off the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_replays(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Microseconds per replay."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def alternate(names: list[str], rounds: int, measure: Callable[[str], float]) -> dict[str, list[float]]:
    """``measure(name)`` for every name, ``rounds`` times, in ``names``' order in even rounds and reversed in odd
    ones; every measurement per name, in round order."""
    out: dict[str, list[float]] = {name: [] for name in names}
    for rnd in range(rounds):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            out[name].append(measure(name))
    return out


def kernel_times(graph: torch.cuda.CUDAGraph, prepare, replays: int = 5, most: int = 10) -> dict[str, list[float]]:
    """The ``most`` kernels of ``graph`` with the largest total time: ``[calls per replay, mean µs per call]`` over
    ``replays`` profiled replays (``prepare`` sets the row index first). Inductor names its add-norm after the ops
    it fuses (``add``, ``mean``, ``rsqrt``...), dynsteer's is ``_steer_add_rms_norm_kernel``."""
    from torch.profiler import ProfilerActivity, profile

    prepare()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((ev for ev in prof.key_averages() if ev.count and ev.device_time_total > 0),
                     key=lambda ev: -ev.device_time_total)[:most]
    return {ev.key[:80]: [round(ev.count / replays, 1), round(ev.device_time_total / ev.count, 3)] for ev in kernels}
