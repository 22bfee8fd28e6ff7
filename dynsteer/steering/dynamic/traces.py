"""Finished requests' dynamic traces, kept by tag until the caller takes them.

Bounded: at most ``Limits.max_traces`` traces, each for ``Limits.trace_ttl_s``; a trace nobody takes in time is
dropped, oldest first, and counted (``RuntimeStats.traces_dropped``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Iterable

from dynsteer.config import Limits
from dynsteer.steering.stats import RuntimeStats


class TraceStore:
    """Traces by tag, oldest first: ``(monotonic time stored, trace)``."""

    def __init__(self, limits: Limits, stats: RuntimeStats) -> None:
        self.limits, self.stats = limits, stats
        self.traces: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()

    def put(self, tag: str, trace: dict[str, Any]) -> None:
        self.expire()
        while len(self.traces) >= self.limits.max_traces:  # never taken: drop the oldest, counted
            self.traces.popitem(last=False)
            self.stats.traces_dropped += 1
        self.traces[tag] = (time.monotonic(), trace)

    def take(self, tags: Iterable[str]) -> list[dict[str, Any]]:
        """The traces with these tags (each can be taken once)."""
        self.expire()
        return [tr[1] for tag in tags if (tr := self.traces.pop(tag, None)) is not None]

    def expire(self) -> None:
        """Drop traces nobody took within ``Limits.trace_ttl_s`` (oldest first; counted)."""
        deadline = time.monotonic() - self.limits.trace_ttl_s
        while self.traces and next(iter(self.traces.values()))[0] < deadline:
            self.traces.popitem(last=False)
            self.stats.traces_dropped += 1
