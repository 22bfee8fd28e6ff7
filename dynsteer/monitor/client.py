"""The monitor-service side of the async tier: watch activation streams, send commands, await acks.

A safety monitor in a few lines (see ``examples/safety_monitor.py``)::

    from dynsteer.monitor import Monitor

    with Monitor(stream_endpoint, command_endpoint, name="tox", streams=["resid"]) as mon:
        for frame in mon.frames():
            scores = frame.values["12.post_block"] @ probe
            for req_id in frame.requests_where(scores > threshold):
                mon.abort(req_id, reason="toxicity probe")

Frames arrive as numpy views of the received buffers (no copy); ``frame.torch(place)`` wraps one as a tensor.
Commands are applied by the engine at one step on every rank; :class:`~dynsteer.commands.Ack` names it.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import msgspec
import numpy as np
import zmq

from dynsteer.commands import (AbortCommand, Ack, CommandEnvelope, GlobalCommand, RuleCommand, SteerCommand,
                               ThresholdCommand, encode_command)
from dynsteer.spec import SteeringSpec
from dynsteer.streams.security import connect_curve, connect_options


@dataclass
class StreamFrame:
    """One engine step of one stream: rows of every published request at the stream's places.

    Attributes:
        stream, seq: the stream and the message's sequence number (contiguous per stream).
        step: the engine step that computed the rows (acks of commands name steps too).
        req_ids: the requests in this frame; ``request[i]`` indexes it for row ``i``.
        positions: absolute token position of each row.
        values: ``{"layer.site": [rows, hidden]}`` (float32 for bfloat16 streams).
    """

    stream: str
    seq: int
    step: int
    req_ids: list[str]
    request: np.ndarray
    positions: np.ndarray
    values: dict[str, np.ndarray]
    dtype: str = "float32"

    @classmethod
    def from_wire(cls, frame: Any) -> "StreamFrame":
        meta, arrays = frame.meta, frame.arrays
        places = list(meta.get("places", ()))
        return cls(stream=frame.stream, seq=frame.seq, step=int(meta.get("step", -1)),
                   req_ids=list(meta.get("req_ids", ())), request=arrays[0], positions=arrays[1],
                   values=dict(zip(places, arrays[2:])), dtype=str(meta.get("dtype", "float32")))

    def rows_of(self, req_id: str) -> np.ndarray:
        """Row indices of ``req_id`` in this frame (empty if absent)."""
        try:
            i = self.req_ids.index(req_id)
        except ValueError:
            return np.zeros(0, np.int64)
        return np.flatnonzero(self.request == i)

    def requests_where(self, mask: np.ndarray) -> list[str]:
        """The requests with at least one row where ``mask`` (one bool per row) holds."""
        return [self.req_ids[i] for i in np.unique(self.request[np.asarray(mask, bool)]).tolist()]

    def torch(self, place: str) -> Any:
        """``values[place]`` as a torch tensor sharing its memory."""
        import torch

        return torch.from_numpy(self.values[place])


class CommandError(RuntimeError):
    """The engine rejected a command; ``ack.error`` names the field."""

    def __init__(self, ack: Ack) -> None:
        super().__init__(ack.error or "rejected")
        self.ack = ack


class CommandClient:
    """Sends commands to the engine core's command endpoint and matches acks by id."""

    def __init__(self, endpoint: str, monitor: str, *, curve_server_public: str | None = None,
                 curve_client_secret: str | None = None, curve_client_public: str | None = None) -> None:
        self.monitor = monitor
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        connect_options(self.sock, endpoint)
        if curve_server_public is not None:
            connect_curve(self.sock, curve_server_public, curve_client_secret or "", curve_client_public or "")
        self.sock.connect(endpoint)
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._acks: dict[str, Ack] = {}

    def send(self, command: Any) -> str:
        """Send a command (a ``dynsteer.commands`` model); returns its id (see :meth:`wait`)."""
        cid = f"{self._prefix}-{next(self._ids)}"
        self.sock.send(encode_command(CommandEnvelope(id=cid, monitor=self.monitor, command=command)))
        return cid

    def wait(self, cid: str, timeout_s: float = 30.0) -> Ack:
        """The ack of command ``cid`` (raises ``TimeoutError``; a rejection is returned, not raised)."""
        deadline = time.monotonic() + timeout_s
        while cid not in self._acks:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                if cid in self._acks:
                    break
                raise TimeoutError(f"no ack for command {cid} within {timeout_s} s (is the engine running and "
                                   f"scheduling? commands are taken at the next step)")
            ack = Ack.model_validate(msgspec.msgpack.decode(self.sock.recv()))
            self._acks[ack.id] = ack
        return self._acks.pop(cid)

    def call(self, command: Any, timeout_s: float = 30.0) -> Ack:
        """Send and wait; raises :class:`CommandError` when rejected."""
        ack = self.wait(self.send(command), timeout_s)
        if ack.status != "applied":
            raise CommandError(ack)
        return ack

    def close(self) -> None:
        self.sock.close(0)


class Monitor:
    """A monitor service's connection to one engine: its streams and its command channel.

    Args:
        stream_endpoint / command_endpoint: ``MonitorConfig.endpoint`` / ``command_endpoint`` of the engine.
        name: the monitor's name (a restarted monitor with the same name resumes: pass ``resume``); commands'
            abort reasons name it.
        streams: streams to subscribe to (declared by the engine, or in ``declare``).
        policy, max_pending, max_delay_ms, window, resume, declare: see ``StreamSubscriber``.
    """

    def __init__(self, stream_endpoint: str, command_endpoint: str, name: str, streams: Sequence[str] = (),
                 **subscriber: Any) -> None:
        from dynsteer.monitor.subscriber import StreamSubscriber

        curve = {k: subscriber[k] for k in ("curve_server_public", "curve_client_secret", "curve_client_public")
                 if k in subscriber}
        self.name = name
        self.commands = CommandClient(command_endpoint, name, **curve)
        self.subscriber = StreamSubscriber(stream_endpoint, name, list(streams), **subscriber) if streams else None

    # ---- streams -------------------------------------------------------------------------------------------------
    def recv(self, timeout_s: float | None = None) -> StreamFrame | None:
        """The next frame of any subscribed stream (None on timeout)."""
        if self.subscriber is None:
            raise RuntimeError("this monitor subscribed to no stream")
        frame = self.subscriber.recv(timeout_s)
        return None if frame is None else StreamFrame.from_wire(frame)

    def frames(self, timeout_s: float | None = None) -> Iterator[StreamFrame]:
        """Frames until ``timeout_s`` passes without one (forever by default)."""
        while (frame := self.recv(timeout_s)) is not None:
            yield frame

    @property
    def next_seq(self) -> dict[str, int]:
        """Per stream, the sequence number to resume from after a restart."""
        return dict(self.subscriber.next_seq) if self.subscriber is not None else {}

    # ---- commands ------------------------------------------------------------------------------------------------
    def abort(self, request: str, reason: str = "", timeout_s: float = 30.0) -> Ack:
        """Finish ``request`` (its stop reason names this monitor and ``reason``)."""
        return self.commands.call(AbortCommand(request=request, reason=reason), timeout_s)

    def steer(self, request: str, spec: SteeringSpec | None, timeout_s: float = 30.0) -> Ack:
        """Add ``spec`` to ``request``'s generated tokens from the acked step on (None: clear it)."""
        return self.commands.call(SteerCommand(request=request, spec=spec), timeout_s)

    def set_threshold(self, request: str, monitor: str, threshold: float, timeout_s: float = 30.0) -> Ack:
        return self.commands.call(ThresholdCommand(request=request, monitor=monitor, threshold=threshold), timeout_s)

    def set_rule(self, request: str, rule: int, enabled: bool, timeout_s: float = 30.0) -> Ack:
        return self.commands.call(RuleCommand(request=request, rule=rule, enabled=enabled), timeout_s)

    def set_global(self, spec: SteeringSpec | None = None, policy: Any = None, timeout_s: float = 30.0) -> Ack:
        """Replace the engine's global steering (``spec`` and ``policy``; ``None``: none) from the acked step on,
        for live requests too (see :class:`dynsteer.commands.GlobalCommand`)."""
        return self.commands.call(GlobalCommand(spec=spec, policy=policy), timeout_s)

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
        self.commands.close()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
