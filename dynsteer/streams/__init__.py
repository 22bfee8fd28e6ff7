"""The async tier's stream hub, server side: publishes each step's captured activations to monitor processes.

* :class:`StreamHub` — sequence numbers, replay, per-subscriber overload policies (drop, block, spill) and resume;
  its module docstring (:mod:`dynsteer.streams.hub`) is the specification. The engine builds one per worker.
* :class:`StreamMetricsCollector` / :func:`register_stream_metrics` — the hub's counters as Prometheus metrics,
  for the process that serves ``/metrics``.

The hub's control plane (``control``), data plane (``delivery``), bookkeeping (``state``) and disk overflow
(``spill``) are internal. Monitor processes use :mod:`dynsteer.monitor`; the wire format is
:mod:`dynsteer.transport.wire`.
"""

from dynsteer.streams.hub import StreamHub
from dynsteer.streams.metrics import StreamMetricsCollector, register_stream_metrics

__all__ = ["StreamHub", "StreamMetricsCollector", "register_stream_metrics"]
