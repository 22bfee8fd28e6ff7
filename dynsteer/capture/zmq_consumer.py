"""The ``zmq`` capture consumer: captures streamed to a ZeroMQ endpoint, and the receiving side's decoder.

Each message is multipart: a msgpack header (``v``, ``kind`` = ``chunk`` or ``record``, ``tag``, ``status``,
``errors``, ``prompt_len``, ``chunk``, and dtype/shape of the positions and of each place's array), then one raw frame
per array (positions first, then the places in header order), sent without copying. ``record`` messages carry a
finished request's whole capture; with ``stream=True`` every chunk is sent as it lands (kind ``chunk``) and the
``record`` message that ends the request carries no arrays.

Sends run in the worker's step loop, so by default they never wait: up to ``hwm`` messages queue per connected
receiver, and a receiver that is missing or does not keep up makes the send fail at once (``timeout_ms`` allows a
bounded wait instead). A failed send marks the record ``partial`` and leaves it reachable in memory (see the
runtime's delivery): never dropped silently. A send that succeeds was only queued by ZeroMQ (a receiver that dies
before reading loses it), so the record's ``deliveries`` says ``queued`` for this consumer, never ``delivered``; with
``stream=True`` a request any of whose chunks failed to send says ``incomplete``.

Example (the receiving process binds; workers connect)::

    ctx = zmq.Context(); sock = ctx.socket(zmq.PULL); sock.bind("tcp://127.0.0.1:5555")
    cfg = DynsteerConfig(capture_sites=("post_block",),
                         capture_consumers={"memory": {}, "zmq": {"endpoint": "tcp://127.0.0.1:5555"}})
    ...  # generate with CaptureSpec(..., consumers=("zmq",))
    kind, capture = receive_capture(sock)
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np
import zmq

from dynsteer.capture.names import Place, place_from_key, place_key
from dynsteer.capture.record import CaptureRecord
from dynsteer.capture.result import Capture

WIRE_VERSION = 1


class ZmqConsumer:
    """Sends captures to ``endpoint`` (PUSH, or PUB) as multipart messages.

    Args:
        endpoint: a ZeroMQ address, e.g. ``tcp://127.0.0.1:5555`` or ``ipc:///tmp/captures``.
        bind: bind instead of connecting (default: connect; the receiver binds).
        socket_type: ``push`` (each message to one receiver, queued while none is there) or ``pub`` (fan out; a
            slow subscriber misses messages by ZeroMQ's design, so use it only where that is acceptable).
        stream: send every chunk as it lands, not only whole records.
        hwm: send high-water mark (messages queued per peer).
        timeout_ms: how long a send may wait for room (on the consumers' background thread, holding up the
            captures queued behind it, never a step) before the capture is marked ``partial``; 0 (default): not at
            all.
    """

    name = "zmq"
    background = True  # copying a whole record out of its spool and sending it runs off the engine's step

    def __init__(self, endpoint: str, bind: bool = False, socket_type: Literal["push", "pub"] = "push",
                 stream: bool = False, hwm: int = 1000, timeout_ms: int = 0) -> None:
        if socket_type not in ("push", "pub"):
            raise ValueError(f"zmq consumer: socket_type must be 'push' or 'pub', got {socket_type!r}")
        self.endpoint, self.stream = endpoint, stream
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUSH if socket_type == "push" else zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
        self._sock.setsockopt(zmq.LINGER, 1000)  # a closing worker flushes what is queued, within bounds
        # Queue only to connected peers: with no receiver a send times out and the capture is marked partial,
        # instead of piling up in a pipe that may never drain.
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        (self._sock.bind if bind else self._sock.connect)(endpoint)
        self._encode = msgspec.msgpack.Encoder().encode

    @property
    def streams(self) -> bool:
        """Whether chunks are sent as they land."""
        return self.stream

    def on_chunk(self, record: CaptureRecord, positions: np.ndarray, values: dict[Place, np.ndarray]) -> None:
        if not self.stream:
            return
        try:
            self._send("chunk", record, positions, values)
        except Exception:
            record.deliveries[self.name] = "incomplete"  # the closing record message must not make it look whole
            raise

    def on_finish(self, record: CaptureRecord) -> None:
        if self.stream:
            self._send("record", record, None, {})
        else:
            self._send("record", record, *record.arrays())
        # Handed to ZeroMQ only: whether a receiver got it is unknown here.
        record.deliveries.setdefault(self.name, "queued")

    def close(self) -> None:
        self._sock.close()

    def _send(self, kind: str, record: CaptureRecord, positions: np.ndarray | None,
              values: dict[Place, np.ndarray]) -> None:
        arrays = [np.ascontiguousarray(a) for a in ([] if positions is None else [positions]) + list(values.values())]
        header = {"v": WIRE_VERSION, "kind": kind, "tag": record.tag, "status": record.status,
                  "errors": list(record.errors), "prompt_len": record.prompt_len, "chunk": record.chunks,
                  "positions": None if positions is None else _describe(positions),
                  "arrays": [{"place": place_key(p), **_describe(a)} for p, a in values.items()]}
        frames = [self._encode(header)] + [a.data for a in arrays]  # zero-copy: zmq holds the views until sent
        try:
            self._sock.send_multipart(frames, copy=False)
        except zmq.Again:
            raise RuntimeError(f"zmq consumer: no room to send to {self.endpoint} (receiver missing or not keeping "
                               f"up)") from None


def _describe(arr: np.ndarray) -> dict[str, Any]:
    return {"dtype": str(arr.dtype), "shape": list(arr.shape)}


def receive_capture(sock: Any, flags: int = 0) -> tuple[str, Capture]:
    """Receive one message of the ``zmq`` consumer: ``(kind, capture)``, kind ``chunk`` or ``record``.

    A ``record`` message of a streamed request has empty arrays (its chunks came before it).
    """
    frames = sock.recv_multipart(flags=flags, copy=False)
    header = msgspec.msgpack.decode(frames[0].buffer)
    if header.get("v") != WIRE_VERSION:
        raise ValueError(f"zmq capture message of wire version {header.get('v')!r}; this reader speaks {WIRE_VERSION}")
    data = iter(frames[1:])

    def take(desc: dict[str, Any]) -> np.ndarray:
        return np.frombuffer(next(data).buffer, dtype=desc["dtype"]).reshape(desc["shape"])

    positions = take(header["positions"]) if header["positions"] is not None else np.zeros(0, np.int64)
    arrays: dict[Place, np.ndarray] = {}
    for desc in header["arrays"]:
        arrays[place_from_key(desc["place"])] = take(desc)
    return header["kind"], Capture(tag=header["tag"], positions=positions, arrays=arrays, status=header["status"],
                                   errors=list(header["errors"]))
