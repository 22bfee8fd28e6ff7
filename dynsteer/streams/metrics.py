"""Prometheus metrics of the async tier's streams, for the process that serves ``/metrics`` (the OpenAI server).

The hub lives in a worker process; this collector asks it for its counters (the ``stats`` request of the stream
protocol, bounded by a short timeout) on every scrape, so the figures are one consistent instant of the hub's
accounting: ``published = delivered + dropped + spilled + pending`` per stream and subscriber.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Iterator

import msgspec
import zmq

from dynsteer.transport.wire import StatsRequest, encode_client
from dynsteer.transport.security import connect_options

logger = logging.getLogger("dynsteer")
_lock = threading.Lock()
_collector: "StreamMetricsCollector | None" = None


class StreamMetricsCollector:
    """A ``prometheus_client`` collector querying the hubs at ``endpoints`` (one per engine of this process; every
    series is labelled with its ``endpoint``)."""

    def __init__(self, endpoints: list[str] | None = None, timeout_ms: int = 500) -> None:
        self.endpoints, self.timeout_ms = list(endpoints or []), timeout_ms

    def query(self, endpoint: str) -> dict[str, Any] | None:
        """The hub's stats, or None when it does not answer in time (a scrape never hangs)."""
        return self.query_all([endpoint])[endpoint]

    def query_all(self, endpoints: list[str]) -> dict[str, dict[str, Any] | None]:
        """Every hub's stats (None for those that do not answer), asked at once: a scrape waits at most one
        timeout, however many engines this process made (and closed) so far."""
        ctx = zmq.Context.instance()
        socks: dict[str, zmq.Socket] = {}
        out: dict[str, dict[str, Any] | None] = {e: None for e in endpoints}
        try:
            for endpoint in endpoints:
                if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@") and \
                        not os.path.exists(endpoint[len("ipc://"):]):
                    continue  # its hub is closed (a closed hub removes its socket file): nothing to wait for
                sock = socks[endpoint] = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                try:
                    connect_options(sock, endpoint)
                    sock.connect(endpoint)
                    sock.send(encode_client(StatsRequest()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    continue
            poller = zmq.Poller()
            for sock in socks.values():
                poller.register(sock, zmq.POLLIN)
            by_sock = {sock: e for e, sock in socks.items()}
            deadline = time.monotonic() + self.timeout_ms / 1000
            waiting = len(socks)
            while waiting and (left := deadline - time.monotonic()) > 0:
                for sock, _ in poller.poll(max(1, int(left * 1000))):
                    poller.unregister(sock)
                    waiting -= 1
                    try:
                        reply = msgspec.msgpack.decode(sock.recv(zmq.NOBLOCK))
                    except (zmq.ZMQError, msgspec.DecodeError):
                        continue
                    out[by_sock[sock]] = reply.get("stats") if isinstance(reply, dict) else None
        finally:
            for sock in socks.values():
                sock.close(0)
        return out

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["endpoint", "stream", "subscriber"]
        up = GaugeMetricFamily("dynsteer_stream_hub_up", "Whether the stream hub answered this scrape",
                               labels=["endpoint"])
        head = GaugeMetricFamily("dynsteer_stream_head", "Next sequence number of the stream",
                                 labels=["endpoint", "stream"])
        families = {
            "published": CounterMetricFamily("dynsteer_stream_published", "Messages published to the subscriber",
                                             labels=labels),
            # a resume can move messages back to pending (re-sent from the replay buffer): gauges, not counters
            "delivered": GaugeMetricFamily("dynsteer_stream_delivered", "Messages the subscriber acknowledged",
                                           labels=labels),
            "dropped": GaugeMetricFamily("dynsteer_stream_dropped", "Messages currently lost for the subscriber",
                                         labels=labels),
            "dropped_total": CounterMetricFamily("dynsteer_stream_dropped_messages",
                                                 "Messages ever dropped for the subscriber", labels=labels),
            "spilled": GaugeMetricFamily("dynsteer_stream_spilled", "Messages waiting on disk", labels=labels),
            "pending": GaugeMetricFamily("dynsteer_stream_pending", "Messages waiting in memory", labels=labels),
        }
        answers = self.query_all(list(self.endpoints))
        for endpoint, stats in answers.items():
            up.add_metric([endpoint], 0.0 if stats is None else 1.0)
            for stream, st in (stats or {}).items():
                if stream.startswith("_") or not isinstance(st, dict):
                    continue
                head.add_metric([endpoint, stream], float(st.get("head", 0)))
                for name, counters in (st.get("subscribers") or {}).items():
                    for key, fam in families.items():
                        fam.add_metric([endpoint, stream, name], float(counters.get(key, 0)))
        yield up
        yield head
        yield from families.values()


def register_stream_metrics(endpoint: str) -> None:
    """Add the collector for ``endpoint`` to prometheus_client's default registry (once per endpoint).

    vLLM serves that registry on ``/metrics`` unless ``PROMETHEUS_MULTIPROC_DIR`` is set (then the stream metrics
    are not exported: multi-process registries only aggregate files written by prometheus_client itself).
    """
    from prometheus_client import REGISTRY

    global _collector
    with _lock:
        if _collector is None:
            _collector = StreamMetricsCollector()
            REGISTRY.register(_collector)
        if endpoint not in _collector.endpoints:
            _collector.endpoints.append(endpoint)
