"""The monitor-service side of the async tier: watch activation streams, send commands, await acks.

A safety monitor in a few lines (see ``examples/safety_monitor.py``)::

    from dynsteer.monitor import MonitorClient

    with MonitorClient(stream_endpoint, command_endpoint, name="tox", streams=["resid"]) as mon:
        for frame in mon.frames():
            scores = frame.values["12.post_block"] @ probe
            for req_id in frame.requests_where(scores > threshold):
                mon.abort(req_id, reason="toxicity probe")

Frames arrive as numpy views of the received buffers (no copy); ``frame.torch(place)`` wraps one as a tensor.
Commands are applied by the engine at one step on every rank; :class:`~dynsteer.commands.CommandAck` names it.
``abort``/``steer``/... wait for their ack; :meth:`MonitorClient.send` and :meth:`MonitorClient.send_all` send
without waiting, so commands for one frame reach the engine before the same step. Frames name requests by the
engine's ids (``frame.req_ids``) and by those vLLM's outputs show (``frame.user_ids``); commands take either.

Under data parallelism (``--data-parallel-size N``) pass ``replicas=N``: the client subscribes to every replica's
hub, each frame names its replica (``frame.replica``), a command naming a request goes to the replica whose frames
showed that request (a request no frame showed is refused here, naming it), and a ``global`` command to every
replica.

Over ``tcp://`` the engine requires CURVE: pass its server key and this monitor's key pair (``curve_server_public``,
``curve_client_secret``, ``curve_client_public``); the operator lists the public key in ``MonitorConfig.curve`` and
may bind names to it. A key the engine does not let in raises ``PermissionError`` at the first wait for an ack; a
command too large for the engine's socket is refused here (the engine would drop the connection unanswered).
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import msgspec
import numpy as np
import zmq

from dynsteer._deprecated import renamed
from dynsteer.commands import (AbortCommand, CommandAck, CommandEnvelope, GlobalCommand, RuleCommand, SteerCommand,
                               ThresholdCommand, encode_command, max_message_bytes, user_request_id)
from dynsteer.config import Limits, replica_endpoint
from dynsteer.spec import SteeringSpec, SteeringValidationError
from dynsteer.transport.security import connect_curve, connect_options

__all__ = ["CommandClient", "CommandError", "MonitorClient", "Pending", "StreamFrame"]
_SAME: Any = object()  # frames(): the first frame's wait is timeout_s too


def bfloat16_bits_to_float32(a: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 numbers given as their 16 bits (a bfloat16 is a float32's upper half; exact).
    Arrays that are not 16-bit integers (float32 rows from an engine that widened them itself) pass unchanged."""
    if a.dtype.itemsize != 2 or a.dtype.kind not in "iu":
        return a
    return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


@dataclass
class StreamFrame:
    """One engine step of one stream: rows of every published request at the stream's places.

    Attributes:
        stream, seq: the stream and the message's sequence number (contiguous per stream).
        step: the engine step that computed the rows (acks of commands name steps too).
        req_ids: the requests in this frame, by the engine's ids (vLLM's: the user's id, ``-`` and 8 hex
            characters); ``request[i]`` indexes it for row ``i``.
        user_ids: the same requests by the ids vLLM's outputs show (``RequestOutput.request_id``; see
            :func:`dynsteer.commands.user_request_id`). Commands take either.
        positions: absolute token position of each row.
        values: ``{"layer.site": [rows, hidden]}`` (float32 for bfloat16 streams).
        replica: the data-parallel replica whose engine computed the rows (0 without data parallelism).
    """

    stream: str
    seq: int
    step: int
    req_ids: list[str]
    request: np.ndarray
    positions: np.ndarray
    values: dict[str, np.ndarray]
    dtype: str = "float32"
    user_ids: list[str] = field(default_factory=list)
    replica: int = 0

    def __post_init__(self) -> None:
        if not self.user_ids:
            self.user_ids = [user_request_id(r) for r in self.req_ids]

    @classmethod
    def from_wire(cls, frame: Any) -> "StreamFrame":
        meta, arrays = frame.meta, frame.arrays
        places = list(meta.get("places", ()))
        dtype = str(meta.get("dtype", "float32"))
        values = arrays[2:]
        if dtype == "bfloat16":  # the rows' 16 bits on the wire: widened here, exactly
            values = [bfloat16_bits_to_float32(a) for a in values]
        return cls(stream=frame.stream, seq=frame.seq, step=int(meta.get("step", -1)),
                   req_ids=list(meta.get("req_ids", ())), request=arrays[0], positions=arrays[1],
                   values=dict(zip(places, values)), dtype=dtype, replica=int(meta.get("replica", 0)))

    def rows_of(self, req_id: str) -> np.ndarray:
        """Row indices of ``req_id`` in this frame (empty if absent)."""
        try:
            i = self.req_ids.index(req_id)
        except ValueError:
            return np.zeros(0, np.int64)
        return np.flatnonzero(self.request == i)

    def requests_where(self, mask: np.ndarray, user_ids: bool = False) -> list[str]:
        """The requests with at least one row where ``mask`` (one bool per row) holds (engine ids; ``user_ids``: the
        ids vLLM's outputs show)."""
        ids = self.user_ids if user_ids else self.req_ids
        return [ids[i] for i in np.unique(self.request[np.asarray(mask, bool)]).tolist()]

    def user_id(self, req_id: str) -> str:
        """The id vLLM's outputs show for engine id ``req_id``."""
        return user_request_id(req_id)

    def torch(self, place: str) -> Any:
        """``values[place]`` as a torch tensor sharing its memory."""
        import torch

        return torch.from_numpy(self.values[place])


@dataclass
class Pending:
    """A command sent and not yet acked (:meth:`MonitorClient.send`): collect its ack later, so several commands
    sent together reach the engine before its next step and are taken at the same step (within its per-step
    budget, ``MonitorConfig.max_commands_per_step`` and ``max_command_bytes_per_step``)."""

    id: str
    command: Any
    client: "CommandClient"
    replica: int = 0  # the data-parallel replica it was sent to

    def ack(self, timeout_s: float = 30.0) -> CommandAck:
        """The engine's ack, a rejection included. Raises ``TimeoutError`` without one in time."""
        return self.client.wait(self.id, timeout_s)

    def result(self, timeout_s: float = 30.0) -> CommandAck:
        """The ack of an applied command; raises :class:`CommandError` when it was rejected."""
        ack = self.ack(timeout_s)
        if ack.status != "applied":
            raise CommandError(ack)
        return ack


@dataclass
class _AllReplicas(Pending):
    """A ``global`` command sent to every replica: its ack is replica 0's once every replica acked; the first
    rejection among them otherwise."""

    sent: list[Pending] = field(default_factory=list)

    def ack(self, timeout_s: float = 30.0) -> CommandAck:
        deadline = time.monotonic() + timeout_s
        acks = [p.ack(max(0.0, deadline - time.monotonic())) for p in self.sent]
        for ack in acks:
            if ack.status != "applied":
                return ack
        return acks[0]


class CommandError(RuntimeError):
    """The engine rejected a command; ``ack.error`` names the field."""

    def __init__(self, ack: CommandAck) -> None:
        super().__init__(ack.error or "rejected")
        self.ack = ack


class CommandClient:
    """Sends commands to the engine core's command endpoint and matches acks by id.

    Args:
        endpoint: the engine's ``MonitorConfig.command_endpoint``.
        monitor: this monitor's name (with CURVE, one the operator lets this key use).
        curve_server_public / curve_client_secret / curve_client_public: CURVE keys (Z85), for ``tcp://``.
        limits: the engine's ``DynsteerConfig.limits``, to refuse a command the engine would not take
            (``max_payload_bytes``) before sending it.
    """

    def __init__(self, endpoint: str, monitor: str, *, curve_server_public: str | None = None,
                 curve_client_secret: str | None = None, curve_client_public: str | None = None,
                 limits: Limits | None = None) -> None:
        keys = (curve_server_public, curve_client_secret, curve_client_public)
        if any(k is not None for k in keys) and not all(k is not None for k in keys):
            raise ValueError("curve: give curve_server_public, curve_client_secret and curve_client_public together")
        self.monitor = monitor
        self.endpoint = endpoint
        self.max_bytes = max_message_bytes(limits or Limits())
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        connect_options(self.sock, endpoint)
        self._events: zmq.Socket | None = None
        if curve_server_public is not None and curve_client_secret is not None and curve_client_public is not None:
            connect_curve(self.sock, curve_server_public, curve_client_secret, curve_client_public)
            # Handshake outcomes: a refused key is otherwise silent (the engine never sees a message).
            self._events = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                                        | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sock.connect(endpoint)
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._acks: dict[str, CommandAck] = {}
        self.refused = False  # the engine refused this client's CURVE key at the last handshake

    def send(self, command: Any, timeout_s: float = 30.0) -> str:
        """Send a command (a ``dynsteer.commands`` model); returns its id (see :meth:`wait`).

        Raises:
            SteeringValidationError: ``message: ...`` when it is larger than the engine takes.
            PermissionError: the engine refused this client's CURVE key.
            TimeoutError: no connection to queue it on within ``timeout_s``.
        """
        cid = f"{self._prefix}-{next(self._ids)}"
        raw = encode_command(CommandEnvelope(id=cid, monitor=self.monitor, command=command))
        if len(raw) > self.max_bytes:
            raise SteeringValidationError(f"message: {len(raw)} bytes exceeds the engine's limit of {self.max_bytes} "
                                          f"(Limits.max_payload_bytes + COMMAND_ENVELOPE_BYTES); the engine would "
                                          f"drop the connection unanswered")
        # A DEALER blocks a send while it has no connection (after a refused handshake, for one): never forever.
        if not self._ready(zmq.POLLOUT, time.monotonic() + timeout_s):
            raise TimeoutError(f"{self.endpoint}: no connection to send command {cid} on within {timeout_s} s")
        self.sock.send(raw, zmq.NOBLOCK)
        return cid

    def wait(self, cid: str, timeout_s: float = 30.0) -> CommandAck:
        """The ack of command ``cid`` (a rejection is returned, not raised).

        Raises:
            TimeoutError: no ack within ``timeout_s``.
            PermissionError: the engine refused this client's CURVE key.
        """
        deadline = time.monotonic() + timeout_s
        while cid not in self._acks:
            if not self._ready(zmq.POLLIN, deadline):
                raise TimeoutError(f"no ack for command {cid} within {timeout_s} s (is the engine running and "
                                   f"scheduling? commands are taken at the next step)")
            ack = CommandAck.model_validate(msgspec.msgpack.decode(self.sock.recv(zmq.NOBLOCK)))
            self._acks[ack.id] = ack
        return self._acks.pop(cid)

    def _ready(self, flags: int, deadline: float) -> bool:
        """Wait until the socket is ready for ``flags`` (``False``: the deadline passed first), watching handshakes.

        Raises:
            PermissionError: the engine refused this client's CURVE key at the last handshake.
        """
        from zmq.utils.monitor import recv_monitor_message

        poller = zmq.Poller()
        poller.register(self.sock, flags)
        if self._events is not None:
            poller.register(self._events, zmq.POLLIN)
        while True:
            while self._events is not None and self._events.poll(0):
                self.refused = recv_monitor_message(self._events)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            if self.refused:
                raise PermissionError(f"{self.endpoint}: the engine refused this client's CURVE key (not in its "
                                      f"MonitorConfig.curve.client_public_keys)")
            left = deadline - time.monotonic()
            ready = dict(poller.poll(max(0, int(left * 1000) + 1)))
            if self.sock in ready:
                return True
            if left <= 0:
                return False

    def call(self, command: Any, timeout_s: float = 30.0) -> CommandAck:
        """Send and wait; raises :class:`CommandError` when rejected."""
        ack = self.wait(self.send(command), timeout_s)
        if ack.status != "applied":
            raise CommandError(ack)
        return ack

    def close(self) -> None:
        if self._events is not None:
            self.sock.disable_monitor()
            self._events.close(0)
        self.sock.close(0)


class MonitorClient:
    """A monitor service's connection to one engine: its streams and its command channel.

    Args:
        stream_endpoint / command_endpoint: ``MonitorConfig.endpoint`` / ``command_endpoint`` of the engine.
        name: the monitor's name (a restarted monitor with the same name resumes: pass ``resume``); commands'
            abort reasons name it.
        streams: streams to subscribe to (declared by the engine, or in ``declare``).
        replicas: the engine's data-parallel size: the client connects to every replica's endpoints
            (:func:`dynsteer.config.replica_endpoint`) and routes each command to the replica holding its request.
        policy, max_pending, max_delay_ms, window, resume, declare: see ``StreamSubscriber``.
        curve_server_public, curve_client_secret, curve_client_public: CURVE keys (Z85) for ``tcp://`` endpoints,
            used for both channels.
        limits: the engine's ``DynsteerConfig.limits`` (see :class:`CommandClient`).
    """

    #: requests remembered per client for routing commands (the oldest are forgotten first)
    MAX_ROUTED = 65536

    def __init__(self, stream_endpoint: str, command_endpoint: str, name: str, streams: Sequence[str] = (),
                 replicas: int = 1, **subscriber: Any) -> None:
        from dynsteer.monitor.subscriber import StreamSubscriber

        if replicas < 1:
            raise SteeringValidationError(f"replicas: {replicas} is not a data-parallel size (1 or more)")
        curve = {k: subscriber[k] for k in ("curve_server_public", "curve_client_secret", "curve_client_public")
                 if k in subscriber}
        limits = subscriber.pop("limits", None)
        self.name = name
        self.replica_commands = [CommandClient(replica_endpoint(command_endpoint, r), name, limits=limits, **curve)
                                 for r in range(replicas)]
        self.commands = self.replica_commands[0]
        self.subscribers: list[Any] = []
        try:  # each waits for its hub's welcome: one that never comes closes what was opened
            for r in range(replicas if streams else 0):
                self.subscribers.append(StreamSubscriber(replica_endpoint(stream_endpoint, r), name, list(streams),
                                                         **subscriber))
        except BaseException:
            self.close()
            raise
        self.subscriber = self.subscribers[0] if self.subscribers else None
        self._where: dict[str, int] = {}  # request id (engine's and user's) -> the replica whose frames showed it
        self._turn = 0  # the replica whose buffered frames recv takes first (fairness between replicas)

    # ---- streams -------------------------------------------------------------------------------------------------
    def recv(self, timeout_s: float | None = None) -> StreamFrame | None:
        """The next frame of any subscribed stream of any replica (None on timeout)."""
        if not self.subscribers:
            raise RuntimeError("this monitor subscribed to no stream")
        if len(self.subscribers) == 1:
            raw = self.subscribers[0].recv(timeout_s)
        else:
            raw = self._recv_any(timeout_s)
        if raw is None:
            return None
        frame = StreamFrame.from_wire(raw)
        self._remember(frame)
        return frame

    def _recv_any(self, timeout_s: float | None) -> Any:
        """The next frame of whichever replica has one, taking them in turns; short polls keep each subscriber's
        heartbeats going while another one waits."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        poller = zmq.Poller()
        for sub in self.subscribers:
            poller.register(sub._sock, zmq.POLLIN)
        n = len(self.subscribers)
        while True:
            for i in range(n):
                r = (self._turn + i) % n
                raw = self.subscribers[r].recv(0)
                if raw is not None:
                    self._turn = (r + 1) % n
                    return raw
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            poller.poll(50 if left is None else max(1, min(50, int(left * 1000))))

    def _remember(self, frame: StreamFrame) -> None:
        """Note which replica holds the frame's requests (for routing commands)."""
        if len(self.replica_commands) == 1:
            return
        for ids in (frame.req_ids, frame.user_ids):
            for rid in ids:
                self._where.pop(rid, None)
                self._where[rid] = frame.replica
        while len(self._where) > self.MAX_ROUTED:
            del self._where[next(iter(self._where))]

    def replica_of(self, request: str) -> int:
        """The replica whose frames showed ``request`` (an engine or user id); 0 without data parallelism.

        Raises:
            SteeringValidationError: ``command.request: ...`` when no frame of any replica showed it.
        """
        if len(self.replica_commands) == 1:
            return 0
        try:
            return self._where[request]
        except KeyError:
            raise SteeringValidationError(
                f"command.request: request {request!r} appeared in no frame of this engine's "
                f"{len(self.replica_commands)} data-parallel replicas, so no replica is known to hold it") from None

    def frames(self, timeout_s: float | None = None, start_timeout_s: float | None = _SAME) -> Iterator[StreamFrame]:
        """Frames until none came for ``timeout_s`` since the last one returned (None: forever).

        Args:
            timeout_s: the idle time, counted from when the last frame was returned; frames that arrived while the
                caller handled it are returned first, however long that took. Make it longer than the engine's
                longest step: a step prefilling a long prompt publishes its rows when it ends.
            start_timeout_s: how long to wait for the first frame (default: ``timeout_s``; None: as long as it
                takes, for a monitor started before any traffic).
        """
        frame = self.recv(timeout_s if start_timeout_s is _SAME else start_timeout_s)
        while frame is not None:
            last = time.monotonic()
            yield frame
            left = None if timeout_s is None else max(0.0, last + timeout_s - time.monotonic())
            frame = self.recv(left)

    @property
    def next_seq(self) -> dict[str, int]:
        """Per stream, the sequence number to resume from after a restart."""
        if len(self.subscribers) > 1:
            raise RuntimeError("next_seq: with several replicas use replica_next_seq (each hub counts its own)")
        return dict(self.subscriber.next_seq) if self.subscriber is not None else {}

    @property
    def replica_next_seq(self) -> list[dict[str, int]]:
        """Per replica, per stream, the sequence number to resume from after a restart."""
        return [dict(sub.next_seq) for sub in self.subscribers]

    # ---- commands ------------------------------------------------------------------------------------------------
    def send(self, command: Any) -> Pending:
        """Send a ``dynsteer.commands`` model without waiting for its ack (:meth:`Pending.result` collects it): to
        the replica holding its request (:meth:`replica_of`); a ``global`` command to every replica (the pending
        ack is the first replica's, a rejection by any other raised by :meth:`Pending.result`)."""
        if isinstance(command, GlobalCommand) and len(self.replica_commands) > 1:
            sent = [Pending(c.send(command), command, c, r) for r, c in enumerate(self.replica_commands)]
            return _AllReplicas(sent[0].id, command, sent[0].client, 0, sent)
        request = getattr(command, "request", None)
        r = self.replica_of(request) if isinstance(request, str) else 0
        client = self.replica_commands[r]
        return Pending(client.send(command), command, client, r)

    def send_all(self, commands: Sequence[Any], timeout_s: float = 30.0) -> list[CommandAck]:
        """Send ``commands`` together, then collect their acks in order (rejections included, not raised): taken
        at the same step where the engine's per-step budget allows, e.g. an abort and a steer for one frame. It
        blocks until the engine steps: where this thread also steps the engine, use :meth:`send`."""
        pending = [self.send(c) for c in commands]
        deadline = time.monotonic() + timeout_s
        return [p.ack(max(0.0, deadline - time.monotonic())) for p in pending]

    def abort(self, request: str, reason: str = "", timeout_s: float = 30.0) -> CommandAck:
        """Finish ``request`` (its stop reason names this monitor and ``reason``)."""
        return self.send(AbortCommand(request=request, reason=reason)).result(timeout_s)

    def steer(self, request: str, spec: SteeringSpec | None, timeout_s: float = 30.0) -> CommandAck:
        """Add ``spec`` to ``request``'s generated tokens from the acked step on (None: clear it)."""
        return self.send(SteerCommand(request=request, spec=spec)).result(timeout_s)

    def set_threshold(self, request: str, monitor: str, threshold: float, timeout_s: float = 30.0) -> CommandAck:
        return self.send(ThresholdCommand(request=request, monitor=monitor, threshold=threshold)).result(timeout_s)

    def set_rule(self, request: str, rule: int, enabled: bool, timeout_s: float = 30.0) -> CommandAck:
        return self.send(RuleCommand(request=request, rule=rule, enabled=enabled)).result(timeout_s)

    def set_global(self, spec: SteeringSpec | None = None, policy: Any = None, timeout_s: float = 30.0) -> CommandAck:
        """Replace the engine's global steering (``spec`` and ``policy``; ``None``: none) from the acked step on,
        for live requests too (see :class:`dynsteer.commands.GlobalCommand`)."""
        return self.send(GlobalCommand(spec=spec, policy=policy)).result(timeout_s)

    def close(self) -> None:
        for sub in self.subscribers:
            sub.close()
        for client in self.replica_commands:
            client.close()

    def __enter__(self) -> "MonitorClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# Old name kept for one release (``dynsteer.ProbeGate``, the in-graph gate, was also called ``Monitor``).
__getattr__ = renamed(__name__, {"Monitor": ("MonitorClient", MonitorClient)})
