"""The async tier's wire format, shared by the hub (server) and its subscribers (clients).

Every message is msgpack; a data message adds one raw frame per array after its header. Version :data:`WIRE_VERSION`.

Client -> server, one frame each (the hub's ROUTER sees the connection's identity before it):

* ``{"op": "hello", "v": 1, "name", "streams", "policy", "max_pending", "max_delay_ms", "window", "resume",
  "declare"}``: register (or re-register) subscriber ``name`` for ``streams``; see :class:`Hello`.
* ``{"op": "ack", "stream", "seq"}``: every message of ``stream`` up to ``seq`` was processed (cumulative).
* ``{"op": "ping"}``, ``{"op": "bye"}``, ``{"op": "stats"}``.

Server -> client: ``{"op": "welcome", "streams": {name: {"head", "first", "next"}}}`` (``next``: the first seq
the hub will send this subscriber: its oldest unsettled message, else the head), ``{"op": "error", "field",
"message"}``, ``{"op": "stats", "stats": {...}}``, ``{"op": "ping"}`` (the hub checking that the connection still
exists; nothing to answer) and data messages ``[header, *arrays]`` with header
``{"op": "frame", "v": 1, "stream", "seq", "meta", "arrays": [{"dtype", "shape"}, ...]}``.

A hello for a name that another live connection holds is refused with field ``hello.name`` and a message starting
with :data:`NAME_HELD`; a subscriber may retry it (the name frees once the holder leaves or is disconnected).

Clients are untrusted: :func:`decode_client` checks every field and bound, and every failure is a
:class:`WireError` whose text starts with the field (``hello.max_pending: must be >= 1``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

import msgspec
import numpy as np

WIRE_VERSION = 1
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # stream and subscriber names (as dynsteer.spec)
MAX_STREAMS = 64
MAX_CLIENT_BYTES = 1 << 20  # one client message, declared specs included
MAX_PENDING_LIMIT = 1 << 24
MAX_WINDOW = 1 << 16
MAX_DELAY_MS = 60_000.0
MAX_NDIM = 32
ARRAY_KINDS = frozenset("biufc")  # plain numbers: no objects, strings, records or datetimes
Policy = Literal["drop", "block", "spill"]
POLICIES: tuple[str, ...] = ("drop", "block", "spill")
NAME_HELD = "held by another connection"

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode


class WireError(ValueError):
    """A malformed or refused message; ``str()`` starts with the field (``hello.streams[2]: ...``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class Hello(msgspec.Struct, frozen=True):
    """Register subscriber ``name`` (the same name after a restart is the same subscriber) for ``streams``.

    ``policy`` says what the hub does once ``max_pending`` messages of a stream wait for this subscriber (``drop``
    the oldest; ``block`` the engine step up to ``max_delay_ms``, then drop: only for names the operator allows, up
    to the operator's cap; ``spill`` to disk). ``window``: most un-acked messages in flight per stream. ``resume``:
    per stream, the next seq wanted (re-sent from the replay buffer). ``declare``: streams this subscriber defines
    (name -> opaque spec; each also in ``streams``), if the hub lets subscribers declare streams.
    """

    name: str
    streams: tuple[str, ...]
    policy: Policy = "drop"
    max_pending: int = 1024
    max_delay_ms: float = 50.0
    window: int = 64
    resume: dict[str, int] | None = None
    declare: dict[str, dict[str, Any]] | None = None


class StreamAck(msgspec.Struct, frozen=True):
    """Every message of ``stream`` with seq <= ``seq`` was processed."""

    stream: str
    seq: int


class Ping(msgspec.Struct, frozen=True):
    """Liveness only."""


class Bye(msgspec.Struct, frozen=True):
    """Unregister this connection's subscriber."""


class StatsRequest(msgspec.Struct, frozen=True):
    """Ask for the hub's counters."""


ClientMessage = Union[Hello, StreamAck, Ping, Bye, StatsRequest]
_OPS: dict[type, str] = {Hello: "hello", StreamAck: "ack", Ping: "ping", Bye: "bye", StatsRequest: "stats"}


@dataclass
class Frame:
    """One data message: ``arrays`` are read-only views of the received buffers (no copy)."""

    stream: str
    seq: int
    meta: dict[str, Any]
    arrays: list[np.ndarray]


def encode_client(msg: ClientMessage) -> bytes:
    """The frame a client sends for ``msg``."""
    body = {"op": _OPS[type(msg)], **msgspec.structs.asdict(msg)}
    if isinstance(msg, Hello):
        body["v"] = WIRE_VERSION
        body["streams"] = list(msg.streams)
    return encode(body)


def decode_client(frame: bytes | memoryview) -> ClientMessage:
    """Decode and check one client frame.

    Raises:
        WireError: naming the field (``message`` for the frame as a whole, ``op``, ``hello.<field>``, ...).
    """
    if len(frame) > MAX_CLIENT_BYTES:
        raise WireError("message", f"{len(frame)} bytes, more than the {MAX_CLIENT_BYTES} allowed")
    try:
        body = msgspec.msgpack.decode(frame)
    except Exception:  # DecodeError, or RecursionError on absurd nesting
        raise WireError("message", "not valid msgpack") from None
    if not isinstance(body, dict):
        raise WireError("message", f"expected a map, got {type(body).__name__}")
    op = body.get("op")
    if op == "hello":
        return _hello(body)
    if op == "ack":
        _only(body, "ack", {"op", "stream", "seq"})
        return StreamAck(stream=_name(body.get("stream"), "ack.stream"),
                         seq=_int(body.get("seq"), "ack.seq", 0, 2**63 - 1))
    for cls in (Ping, Bye, StatsRequest):
        if op == _OPS[cls]:
            _only(body, op, {"op"})
            return cls()
    raise WireError("op", f"unknown operation {_show(op)} (hello, ack, ping, bye, stats)")


def _hello(body: dict[Any, Any]) -> Hello:
    _only(body, "hello", {"op", "v", "name", "streams", "policy", "max_pending", "max_delay_ms", "window", "resume",
                          "declare"})
    if body.get("v") != WIRE_VERSION:
        raise WireError("hello.v", f"wire version {_show(body.get('v'))}; this side speaks {WIRE_VERSION}")
    name = _name(body.get("name"), "hello.name")
    streams = body.get("streams")
    if not isinstance(streams, list) or not 1 <= len(streams) <= MAX_STREAMS:
        raise WireError("hello.streams", f"expected a list of 1 to {MAX_STREAMS} stream names")
    checked = tuple(_name(s, f"hello.streams[{i}]") for i, s in enumerate(streams))
    if len(set(checked)) != len(checked):
        raise WireError("hello.streams", "names a stream twice")
    policy = body.get("policy", "drop")
    if policy not in POLICIES:
        raise WireError("hello.policy", f"{_show(policy)} is not one of {', '.join(POLICIES)}")
    resume = _map(body.get("resume"), "hello.resume")
    if resume is not None:
        resume = {_name(k, "hello.resume"): _int(v, f"hello.resume[{k!r}]", 0, 2**63 - 1) for k, v in resume.items()}
        for key in resume:
            if key not in checked:
                raise WireError(f"hello.resume[{key!r}]", "not one of hello.streams")
    declare = _map(body.get("declare"), "hello.declare")
    if declare is not None:
        for key, spec in declare.items():
            _name(key, "hello.declare")
            if not isinstance(spec, dict):
                raise WireError(f"hello.declare[{key!r}]", f"expected a map, got {type(spec).__name__}")
    return Hello(name=name, streams=checked, policy=policy,
                 max_pending=_int(body.get("max_pending"), "hello.max_pending", 1, MAX_PENDING_LIMIT),
                 max_delay_ms=_float(body.get("max_delay_ms", 50.0), "hello.max_delay_ms", 0.0, MAX_DELAY_MS),
                 window=_int(body.get("window", 64), "hello.window", 1, MAX_WINDOW), resume=resume, declare=declare)


def _only(body: Mapping[Any, Any], op: str, allowed: set[str]) -> None:
    for key in body:
        if key not in allowed:
            named = isinstance(key, str) and len(key) <= 40 and NAME_PATTERN.fullmatch(key) is not None
            raise WireError(f"{op}.{key}" if named else op, f"unknown field {_show(key)}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 48 else f"{text[:40]}... ({len(text)} chars)"


def _name(value: Any, field: str) -> str:
    if not isinstance(value, str) or NAME_PATTERN.fullmatch(value) is None:
        raise WireError(field, f"{_show(value)} is not a name (1 to 128 of A-Z a-z 0-9 . _ -, starting with a "
                               f"letter or digit)")
    return value


def _int(value: Any, field: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(field, f"expected an integer, got {_show(value)}")
    if value < low:
        raise WireError(field, f"must be >= {low}")
    if value > high:
        raise WireError(field, f"must be <= {high}")
    return value


def _float(value: Any, field: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise WireError(field, f"expected a finite number, got {_show(value)}")
    if not low <= value <= high:
        raise WireError(field, f"must be between {low:g} and {high:g}")
    return float(value)


def _map(value: Any, field: str) -> dict[Any, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_STREAMS:
        raise WireError(field, f"expected a map of at most {MAX_STREAMS} entries or nil")
    return value


# ---- server -> client -------------------------------------------------------------------------------------------


def check_array(arr: Any, field: str = "arrays") -> np.ndarray:
    """``arr`` if it is a numpy array of plain numbers (what a data message can carry)."""
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{field}: expected a numpy array, got {type(arr).__name__}")
    if arr.dtype.kind not in ARRAY_KINDS or arr.dtype.fields is not None or arr.ndim > MAX_NDIM:
        raise ValueError(f"{field}: dtype {arr.dtype} / ndim {arr.ndim} cannot be sent (plain numbers only)")
    return arr


def encode_header(stream: str, seq: int, meta: Mapping[str, Any], arrays: Sequence[np.ndarray]) -> bytes:
    """A data message's header frame (raises if ``meta`` is not msgpack-able)."""
    return encode({"op": "frame", "v": WIRE_VERSION, "stream": stream, "seq": seq, "meta": meta,
                   "arrays": [{"dtype": str(a.dtype), "shape": list(a.shape)} for a in arrays]})


def array_buffers(arrays: Sequence[np.ndarray]) -> list[memoryview]:
    """Each array's bytes as a flat view: no copy for C-contiguous arrays (others are made contiguous first)."""
    # reshape(-1) of a C-contiguous array is a view; the uint8 view makes any dtype (complex, float16) a plain buffer.
    return [np.ascontiguousarray(a).reshape(-1).view(np.uint8).data for a in arrays]


def encode_frame(stream: str, seq: int, meta: Mapping[str, Any], arrays: Sequence[np.ndarray]) -> list[Any]:
    """``[header, *array buffers]``, ready for ``send_multipart(copy=False)``."""
    return [encode_header(stream, seq, meta, arrays), *array_buffers(arrays)]


def _buffer(frame: Any) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)  # zmq.Frame, or any bytes-like


def decode_frame(frames: Sequence[Any]) -> Frame:
    """Decode a data message (``frames``: zmq Frames or bytes-likes); arrays view the frames' memory.

    Raises:
        WireError: naming the field (``frame.arrays[1].dtype``, ``frame.arrays`` for a wrong frame count, ...).
    """
    if not frames:
        raise WireError("frame", "empty message")
    header = decode_server_header(frames[0])
    return frame_from_header(header, frames[1:])


def decode_server_header(frame: Any) -> dict[str, Any]:
    """The msgpack map of a server message's first frame."""
    try:
        header = msgspec.msgpack.decode(_buffer(frame))
    except Exception:
        raise WireError("message", "not valid msgpack") from None
    if not isinstance(header, dict):
        raise WireError("message", f"expected a map, got {type(header).__name__}")
    return header


def frame_from_header(header: dict[str, Any], data: Sequence[Any]) -> Frame:
    """Check a data message's header and view its array frames."""
    if header.get("op") != "frame":
        raise WireError("frame.op", f"expected 'frame', got {_show(header.get('op'))}")
    if header.get("v") != WIRE_VERSION:
        raise WireError("frame.v", f"wire version {_show(header.get('v'))}; this side speaks {WIRE_VERSION}")
    if not isinstance(header.get("stream"), str):
        raise WireError("frame.stream", f"expected a string, got {_show(header.get('stream'))}")
    seq = _int(header.get("seq"), "frame.seq", 0, 2**63 - 1)
    meta = header.get("meta")
    if not isinstance(meta, dict):
        raise WireError("frame.meta", f"expected a map, got {type(meta).__name__}")
    descs = header.get("arrays")
    if not isinstance(descs, list):
        raise WireError("frame.arrays", f"expected a list, got {type(descs).__name__}")
    if len(descs) != len(data):
        raise WireError("frame.arrays", f"{len(descs)} arrays described but {len(data)} array frames follow")
    arrays = [_array(desc, _buffer(buf), f"frame.arrays[{i}]") for i, (desc, buf) in enumerate(zip(descs, data))]
    return Frame(stream=header["stream"], seq=seq, meta=meta, arrays=arrays)


def _array(desc: Any, buf: memoryview, field: str) -> np.ndarray:
    if not isinstance(desc, dict):
        raise WireError(field, f"expected a map, got {type(desc).__name__}")
    try:
        dtype = np.dtype(desc.get("dtype"))
    except Exception:
        raise WireError(f"{field}.dtype", f"{_show(desc.get('dtype'))} is not a dtype") from None
    if dtype.kind not in ARRAY_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise WireError(f"{field}.dtype", f"{dtype} is not a plain number type")
    shape = desc.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise WireError(f"{field}.shape", f"expected a list of at most {MAX_NDIM} sizes")
    dims = [_int(d, f"{field}.shape", 0, 2**62) for d in shape]
    expected = math.prod(dims) * dtype.itemsize
    if expected != buf.nbytes:
        raise WireError(field, f"{dtype} {dims} needs {expected} bytes, the frame has {buf.nbytes}")
    return np.frombuffer(buf, dtype=dtype).reshape(dims)


def encode_welcome(streams: Mapping[str, Mapping[str, int]]) -> bytes:
    return encode({"op": "welcome", "streams": streams})


def encode_error(field: str, message: str) -> bytes:
    return encode({"op": "error", "field": field, "message": message})


def encode_stats(stats: Mapping[str, Any]) -> bytes:
    return encode({"op": "stats", "stats": stats})


_PING = encode({"op": "ping"})


def encode_ping() -> bytes:
    return _PING
