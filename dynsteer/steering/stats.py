"""Counters of one worker's runtime, shared by its components and reported by ``SteeringRuntime.describe``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RuntimeStats:
    steps: int = 0
    admitted: int = 0
    rejected: int = 0  # requests stopped by dynsteer (bad payload, rows exhausted, controller fault)
    rows_exhausted: int = 0
    traces_dropped: int = 0  # traces not taken within Limits.trace_ttl_s, or over Limits.max_traces
    stream_errors: int = 0  # stream messages that could not be published (logged)
    # take_captures calls, their time in this process (finishing records, waiting for the spool writer) and the
    # spool writer's queue length when each began (steps still to be written: a writer behind)
    takes: int = 0
    take_ms: float = 0.0
    take_backlog: int = 0
    pack_ms: float = 0.0  # packing the taken records for the caller (files handed over, or bytes copied)
    errors: list[str] = field(default_factory=list)
