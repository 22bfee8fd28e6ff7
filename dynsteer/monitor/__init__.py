"""A monitor process's side of the async tier: watch an engine's activation streams, send it commands, await acks.

* :class:`MonitorClient` — one engine's streams and command channel together (``with MonitorClient(...) as mon``);
* :class:`StreamFrame` — one step's activations of a stream, as numpy views, with the requests they belong to;
* :class:`CommandClient` and :class:`CommandError` — the command channel alone, and a command the engine rejected;
* :class:`Pending` — a command sent without waiting (:meth:`MonitorClient.send`), its ack collected later;
* :class:`StreamSubscriber` and :class:`StreamError` — the stream channel alone (ordered frames, acks, resume);
* :func:`run_probe_monitor` — a ready-made safety monitor: a probe file flags requests, which it steers or aborts.

The wire format they share with the engine's stream hub is :mod:`dynsteer.transport.wire`; commands and their acks
(:class:`~dynsteer.commands.CommandAck`) are :mod:`dynsteer.commands`. Nothing here imports vLLM.

Example:
    >>> from dynsteer.monitor import MonitorClient                                           # doctest: +SKIP
    >>> with MonitorClient(stream_ep, command_ep, name="tox", streams=["resid"]) as mon:    # doctest: +SKIP
    ...     for frame in mon.frames():
    ...         for req_id in frame.requests_where(frame.values["12.post_block"] @ probe > 0.0):
    ...             mon.abort(req_id, reason="toxicity probe")
"""

from dynsteer._deprecated import renamed
from dynsteer.monitor.client import CommandClient, CommandError, MonitorClient, Pending, StreamFrame
from dynsteer.monitor.probe_monitor import ProbeMonitorStats, run_probe_monitor
from dynsteer.monitor.subscriber import StreamError, StreamSubscriber

__all__ = ["CommandClient", "CommandError", "MonitorClient", "Pending", "ProbeMonitorStats", "StreamError",
           "StreamFrame", "StreamSubscriber", "run_probe_monitor"]

# Old name kept for one release (``dynsteer.ProbeGate``, the in-graph gate, was also called ``Monitor``).
__getattr__ = renamed(__name__, {"Monitor": ("MonitorClient", MonitorClient)})
