"""Waiting until monitors are subscribed to a stream, so the traffic they should watch is sent after they are.

A hub sends a subscriber only what it publishes from that subscriber's registration on (or from its resume
point): frames published before a monitor subscribed never reach it, by design. The start handshake is therefore:
start the monitors, wait here until ``n`` of them are connected to the stream, then send the requests. The count is
read from the hub's ``stats`` request (the same one ``/metrics`` uses), so no subscriber name needs to be known in
advance; a subscriber counts while the hub holds it *connected* (it said hello and has not been silent for three
heartbeats).

Used by :meth:`dynsteer.Steerer.wait_for_subscribers` and the OpenAI server's
``GET /v1/steering/streams/{name}/subscribers?min=N&timeout_s=T``.
"""

from __future__ import annotations

import time
from typing import Any

from dynsteer.spec import SteeringValidationError
from dynsteer.streams.metrics import StreamMetricsCollector

POLL_S = 0.05  # between two stats requests while waiting
MAX_WAIT_S = 600.0  # the longest wait one call may ask for


def connected(answers: dict[str, dict[str, Any] | None], stream: str) -> tuple[bool, bool, list[str]]:
    """From the hubs' stats (``None``: a hub that did not answer): whether any hub answered, whether any knows
    ``stream``, and the names connected to it on any of them (a pipeline stage's monitor connects to that stage's
    hub; one name connected to several counts once)."""
    answered = known = False
    names: set[str] = set()
    for stats in answers.values():
        if stats is None:
            continue
        answered = True
        st = stats.get(stream)
        if not isinstance(st, dict):
            continue
        known = True
        names.update(name for name, c in (st.get("subscribers") or {}).items()
                     if isinstance(c, dict) and c.get("connected"))
    return answered, known, sorted(names)


def check_wait(n: int, timeout_s: float) -> None:
    """Refuse a bad count or timeout (``SteeringValidationError``, a ``ValueError``, naming it)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SteeringValidationError(f"min: a whole number >= 1, got {n!r}")
    if not 0 <= timeout_s <= MAX_WAIT_S:
        raise SteeringValidationError(f"timeout_s: between 0 and {MAX_WAIT_S:g} seconds, got {timeout_s!r}")


def timeout_message(stream: str, n: int, timeout_s: float, answered: bool, names: list[str]) -> str:
    if not answered:
        return (f"timeout_s: the stream hub did not answer within {timeout_s:g} s (is the engine running with a "
                f"MonitorConfig?)")
    return (f"timeout_s: {len(names)} of {n} subscribers connected to stream {stream!r} after {timeout_s:g} s "
            f"({', '.join(names) or 'none'}); start the monitors first: frames published before a monitor "
            f"subscribes are not delivered to it")


def unknown_message(stream: str, answers: dict[str, dict[str, Any] | None]) -> str:
    declared = sorted({s for stats in answers.values() if stats for s in stats if not s.startswith("_")})
    return f"name: no stream {stream!r} on the engine's hub (streams: {', '.join(declared) or 'none'})"


class SubscriberWait:
    """Polls the hubs at ``endpoints`` (one per pipeline stage of each data-parallel replica, replica by replica)
    for the subscribers of one stream. With ``replicas > 1`` a name counts once it is connected at every replica
    (a monitor watching one replica would miss the others' frames)."""

    def __init__(self, endpoints: list[str], stream: str, n: int, timeout_s: float, replicas: int = 1) -> None:
        check_wait(n, timeout_s)
        if replicas < 1 or len(endpoints) % replicas:
            raise SteeringValidationError(f"replicas: {replicas} does not divide the {len(endpoints)} hub endpoints")
        self.endpoints, self.stream, self.n, self.timeout_s = list(endpoints), stream, n, timeout_s
        per = len(self.endpoints) // replicas
        self.groups = [self.endpoints[i:i + per] for i in range(0, len(self.endpoints), per)]
        self.deadline = time.monotonic() + timeout_s
        self.answered, self.names = False, []
        self._query = StreamMetricsCollector(timeout_ms=500)

    def poll(self) -> bool:
        """One stats request: True once ``n`` are connected.

        Raises:
            LookupError: the hub answered and does not know the stream (message names it).
            TimeoutError: the deadline passed (message says how many are connected, and who).
        """
        answers = self._query.query_all(self.endpoints)
        answered = known = False
        common: set[str] | None = None
        for group in self.groups:
            a, k, names = connected({e: answers.get(e) for e in group}, self.stream)
            answered, known = answered or a, known or k
            common = set(names) if common is None else common & set(names)
        names = sorted(common or ())
        self.answered |= answered
        if answered and not known:
            raise LookupError(unknown_message(self.stream, answers))
        self.names = names
        if len(names) >= self.n:
            return True
        if time.monotonic() >= self.deadline:
            raise TimeoutError(timeout_message(self.stream, self.n, self.timeout_s, self.answered, names))
        return False

    def pause(self) -> float:
        """Seconds to sleep before the next poll."""
        return max(0.0, min(POLL_S, self.deadline - time.monotonic()))


def wait_for_subscribers(endpoints: list[str], stream: str, n: int = 1, timeout_s: float = 30.0) -> list[str]:
    """Block until at least ``n`` subscribers are connected to ``stream`` at the hubs at ``endpoints``; returns
    their names.

    Raises:
        ValueError: ``n`` or ``timeout_s`` out of range (message names ``min`` / ``timeout_s``).
        LookupError: the hub does not know ``stream``.
        TimeoutError: fewer than ``n`` after ``timeout_s`` (message names the count and the connected ones).
    """
    wait = SubscriberWait(endpoints, stream, n, timeout_s)
    while not wait.poll():
        time.sleep(wait.pause())
    return wait.names
