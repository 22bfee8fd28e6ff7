"""A ready-made safety monitor: a probe file watches a stream and steers or aborts the requests it flags.

Used by ``dynsteer monitor PROBE_FILE`` and ``examples/safety_monitor.py``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Any, Callable, Literal

import numpy as np

from dynsteer.commands import user_request_id
from dynsteer.monitor.client import CommandError, MonitorClient, StreamFrame

logger = logging.getLogger("dynsteer.monitor")


@dataclass
class ProbeMonitorStats:
    """What a probe monitor saw and did (request ids are the engine's; :meth:`summary` shows the users')."""

    frames: int = 0
    rows: int = 0
    flagged: dict[str, int] = field(default_factory=dict)  # request id -> step of the command
    aborted: dict[str, int] = field(default_factory=dict)  # escalated (steered, then aborted): id -> step
    rejected: int = 0
    commands: int = 0  # sent (applied: len(flagged); the rest rejected)
    action: str = "abort"

    def summary(self) -> str:
        """One line: frames, rows, commands, and the requests acted on by the ids vLLM's outputs show."""
        done = "aborted" if self.action == "abort" else "steered"
        ids = ", ".join(user_request_id(r) for r in self.flagged) or "none"
        line = (f"{self.frames} frames, {self.rows} rows; {self.commands} commands "
                f"({len(self.flagged) + len(self.aborted)} applied, {self.rejected} rejected); {done}: {ids}")
        if self.aborted:
            line += "; then aborted: " + ", ".join(user_request_id(r) for r in self.aborted)
        return line


def run_probe_monitor(monitor: MonitorClient, probe: Any, *, action: Literal["steer", "abort"] = "abort",
                      steer_spec: Any = None, threshold: float | None = None, place: str | None = None,
                      timeout_s: float | None = None, start_timeout_s: float | None = None,
                      target_class: int = 1, probe_name: str = "probe",
                      on_flag: Callable[[str, StreamFrame, Any], None] | None = None,
                      on_progress: Callable[[ProbeMonitorStats], None] | None = None,
                      progress_s: float = 10.0, stats: ProbeMonitorStats | None = None,
                      abort_above: float | None = None) -> ProbeMonitorStats:
    """Watch ``monitor``'s streams with ``probe`` (a loaded ``dynsteer.probes`` Probe); each request whose score
    for ``target_class`` exceeds ``threshold`` gets one command: ``abort``, or ``steer`` with ``steer_spec``.

    The score is the probe's decision value ``x·w + b`` for class 1, its negation for class 0 (a logistic probe's
    log-odds of the target class); ``threshold`` is in those units (default: the probe's calibrated threshold for
    class 1, its negation for class 0, else 0). An abort's reason names ``probe_name``, the place, the target class
    and the score, never a file path.

    Args:
        place: ``"layer.site"`` to read (default: the probe's own layer and site).
        timeout_s: stop after this long without a frame, counted from the last frame (None: never).
        start_timeout_s: how long to wait for the first frame (None: as long as it takes; a long prefill or an idle
            engine sends none).
        on_progress: called with the stats when a frame arrives, at most every ``progress_s`` seconds (at the
            first frame too).
        stats: filled in place and returned (pass one to keep the figures of a run stopped by ``KeyboardInterrupt``).
        abort_above: with ``action="steer"``, escalate: a request already steered whose score later exceeds this
            (above ``threshold``) is aborted, once (``stats.aborted``).
    """
    if target_class not in (0, 1):
        raise ValueError(f"target_class: 0 or 1, got {target_class!r}")
    if action == "steer" and steer_spec is None:
        raise ValueError("steer_spec: required for action='steer'")
    if abort_above is not None and action != "steer":
        raise ValueError("abort_above: escalates a steered request; it needs action='steer'")
    w, b = probe.linear_form()
    sign = 1.0 if target_class == 1 else -1.0
    if threshold is None:
        threshold = sign * probe.meta.calibration.threshold if probe.meta.calibration is not None else 0.0
    place = place or f"{probe.layer}.{probe.site}"
    stats = stats if stats is not None else ProbeMonitorStats()
    stats.action = action
    reported = -float("inf")
    for frame in _frames(monitor, timeout_s, start_timeout_s):
        stats.frames += 1
        if on_progress is not None and time.monotonic() - reported >= progress_s:
            reported = time.monotonic()
            on_progress(stats)
        values = frame.values.get(place)
        if values is None:
            continue
        stats.rows += len(values)
        score = sign * (values.astype(np.float64) @ w + b)
        if abort_above is not None:  # escalation first: a request steered at an earlier frame
            for req_id in frame.requests_where(score > abort_above):
                if req_id in stats.flagged and req_id not in stats.aborted:
                    top = float(score[frame.rows_of(req_id)].max())
                    reason = (f"{probe_name} at {place} scored {top:.3f} for class {target_class} after steering "
                              f"(abort above {abort_above:.3f})")
                    ack = _command(stats, lambda: monitor.abort(req_id, reason=reason), req_id)
                    if ack is not None:
                        stats.aborted[req_id] = int(ack.step or -1)
        for req_id in frame.requests_where(score > threshold):
            if req_id in stats.flagged:
                continue
            top = float(score[frame.rows_of(req_id)].max())
            ack = _command(stats, lambda: monitor.abort(req_id, reason=f"{probe_name} at {place} scored {top:.3f} "
                                                                       f"for class {target_class} (threshold "
                                                                       f"{threshold:.3f})")
                           if action == "abort" else monitor.steer(req_id, steer_spec), req_id)
            if ack is None:
                continue
            stats.flagged[req_id] = int(ack.step or -1)
            logger.info("%s %s at step %s", action, req_id, ack.step)
            if on_flag is not None:
                on_flag(req_id, frame, ack)
    return stats


def _command(stats: ProbeMonitorStats, send: Callable[[], Any], req_id: str) -> Any:
    """Send one command; its ack, or ``None`` counted as rejected (e.g. the request finished meanwhile)."""
    stats.commands += 1
    try:
        return send()
    except CommandError as exc:
        stats.rejected += 1
        logger.info("command for %s rejected: %s", req_id, exc)
        return None


def _frames(monitor: Any, timeout_s: float | None, start_timeout_s: float | None) -> Iterator[StreamFrame]:
    """The first frame within ``start_timeout_s``, then frames until ``timeout_s`` passes without one."""
    first = monitor.recv(start_timeout_s)
    if first is None:
        return
    yield first
    yield from monitor.frames(timeout_s)
