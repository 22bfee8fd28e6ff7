"""A ready-made safety monitor: a probe file watches a stream and steers or aborts the requests it flags.

Used by ``dynsteer monitor PROBE_FILE`` and ``examples/safety_monitor.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import numpy as np

from dynsteer.monitor.client import CommandError, MonitorClient, StreamFrame

logger = logging.getLogger("dynsteer.monitor")


@dataclass
class ProbeMonitorStats:
    frames: int = 0
    rows: int = 0
    flagged: dict[str, int] = field(default_factory=dict)  # request id -> step of the command
    rejected: int = 0


def run_probe_monitor(monitor: MonitorClient, probe: Any, *, action: Literal["steer", "abort"] = "abort",
                      steer_spec: Any = None, threshold: float | None = None, place: str | None = None,
                      timeout_s: float | None = None, on_flag: Callable[[str, StreamFrame, Any], None] | None = None,
                      ) -> ProbeMonitorStats:
    """Watch ``monitor``'s streams with ``probe`` (a loaded ``dynsteer.probes`` Probe) until ``timeout_s`` passes
    without a frame; each request whose decision value exceeds ``threshold`` (default: the probe's calibrated
    threshold, else 0) gets one command: ``abort``, or ``steer`` with ``steer_spec``.

    Args:
        place: ``"layer.site"`` to read (default: the probe's own layer and site).
    """
    if action == "steer" and steer_spec is None:
        raise ValueError("steer_spec: required for action='steer'")
    w, b = probe.linear_form()
    if threshold is None:
        threshold = probe.meta.calibration.threshold if probe.meta.calibration is not None else 0.0
    place = place or f"{probe.layer}.{probe.site}"
    stats = ProbeMonitorStats()
    for frame in monitor.frames(timeout_s):
        stats.frames += 1
        values = frame.values.get(place)
        if values is None:
            continue
        stats.rows += len(values)
        decision = values.astype(np.float64) @ w + b
        for req_id in frame.requests_where(decision > threshold):
            if req_id in stats.flagged:
                continue
            try:
                ack = (monitor.abort(req_id, reason=f"probe {probe.meta.model_id or ''} layer {probe.layer} flagged")
                       if action == "abort" else monitor.steer(req_id, steer_spec))
            except CommandError as exc:  # e.g. it finished meanwhile
                stats.rejected += 1
                logger.info("command for %s rejected: %s", req_id, exc)
                continue
            stats.flagged[req_id] = int(ack.step or -1)
            logger.info("%s %s at step %s", action, req_id, ack.step)
            if on_flag is not None:
                on_flag(req_id, frame, ack)
    return stats
