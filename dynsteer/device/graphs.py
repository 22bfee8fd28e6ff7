"""Kernel launches replayed from CUDA graphs, one graph per grid size bucket.

A Triton launch from Python costs ~25 µs of host time (argument binding, specialisation key, cache lookup; H200,
``benchmarks/sync_host.py``), a CUDA graph replay ~3 µs. The dynamic tier launches its controller kernels every
step outside vLLM's own graphs, on buffers that never move: each launch is captured once per grid bucket (powers of
two up to a limit) and replayed. The kernel runs ``bucket(n)`` programs where ``n`` were asked for: the caller makes
the extra programs no-ops (through the staged words they read), as the controller kernels' contracts allow.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["GraphedLaunch", "bucket"]


def bucket(n: int, limit: int) -> int:
    """The grid a request for ``n`` programs runs with: the next power of two, at most ``limit`` (n ≤ limit)."""
    if not 0 < n <= limit:
        raise ValueError(f"bucket: n must be in [1, {limit}], got {n}")
    return min(1 << (n - 1).bit_length(), limit)


class GraphedLaunch:
    """``launch(grid)`` captured in a CUDA graph per bucket on first use, then replayed on the current stream.

    ``launch`` must read and write only buffers that live as long as this object (a graph holds their addresses)
    and must already be compiled (a first, uncaptured launch did that): capturing runs no kernel. Capture happens on
    a side stream in thread-local mode, so other threads' CUDA work (a capture writer's copies) is not disturbed.
    """

    def __init__(self, launch: Callable[[int], None], limit: int, device: torch.device) -> None:
        self.launch, self.limit, self.device = launch, limit, device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._side = torch.cuda.Stream(device=device)

    def __call__(self, n: int) -> int:
        """Run ``launch`` over ``bucket(n)`` programs after the current stream's work; returns that grid."""
        grid = bucket(n, self.limit)
        graph = self.graphs.get(grid)
        if graph is None:
            graph = self.graphs[grid] = self._capture(grid)
        graph.replay()
        return grid

    def _capture(self, grid: int) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self.launch(grid)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(self._side)
        return graph
