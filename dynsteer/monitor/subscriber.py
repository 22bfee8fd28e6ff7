"""A monitor's connection to a stream hub: receives data frames in order and acknowledges them.

Example::

    sub = StreamSubscriber(endpoint, "probe-a", ["post_block.12"], policy="spill", resume=saved_next_seq)
    for frame in sub:  # a frame is acked (as processed) when the next one is asked for
        handle(frame.meta, frame.arrays)
        saved_next_seq = dict(sub.next_seq)  # persist to resume after a crash without gaps or repeats

Call :meth:`StreamSubscriber.recv` (or iterate) at least every few heartbeats: pings are sent while it waits, and
a hub that hears nothing for 3 of its heartbeats marks the subscriber disconnected (its messages then queue under
its policy). If the hub restarts or the connection is replaced, the subscriber says hello again by itself, resuming
at :attr:`StreamSubscriber.next_seq`. A hello refused because another connection holds the name (a previous run of
this monitor the hub has not yet seen go) is repeated until ``hello_timeout_s``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import zmq

from dynsteer.transport.wire import (NAME_HELD, Bye, Frame, Hello, Ping, Policy, StatsRequest, StreamAck, WireError,
                                   decode_client, decode_server_header, encode_client, frame_from_header)
from dynsteer.transport.security import check_endpoint, connect_curve, connect_options

logger = logging.getLogger("dynsteer")
HELLO_RETRY_S = 0.2  # between hellos refused because the name is held (each one costs the hub a check)


class StreamError(RuntimeError):
    """The hub refused something this subscriber sent; ``str()`` starts with the field (``hello.streams[0]: ...``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class StreamSubscriber:
    """Subscriber ``name`` of ``streams`` at the hub listening on ``endpoint``.

    Args:
        policy, max_pending, max_delay_ms, window: what the hub does when this subscriber falls behind (see
            :mod:`dynsteer.streams.hub`).
        resume: per stream, the next seq wanted (e.g. a saved :attr:`next_seq`); the hub re-sends from there.
            Streams without one start at the hub's head.
        declare: streams this subscriber defines (name -> spec), validated by the hub.
        curve_server_public, curve_client_secret, curve_client_public: CURVE keys (Z85), all three or none.
        heartbeat_s: ping interval while waiting.
        hello_timeout_s: how long to wait for the hub's welcome, retrying while another connection holds ``name``
            (also for the hellos said again later).

    Raises:
        WireError: a bad argument (named like the hello field).
        StreamError: the hub refused the hello.
        TimeoutError: no welcome in time (hub absent, or CURVE keys refused).
    """

    def __init__(self, endpoint: str, name: str, streams: Sequence[str], *, policy: Policy = "drop",
                 max_pending: int = 1024, max_delay_ms: float = 50.0, window: int = 64,
                 resume: dict[str, int] | None = None, declare: dict[str, dict[str, Any]] | None = None,
                 curve_server_public: str | None = None, curve_client_secret: str | None = None,
                 curve_client_public: str | None = None, heartbeat_s: float = 1.0,
                 hello_timeout_s: float = 10.0) -> None:
        keys = (curve_server_public, curve_client_secret, curve_client_public)
        if any(k is not None for k in keys) and not all(k is not None for k in keys):
            raise ValueError("curve: give curve_server_public, curve_client_secret and curve_client_public together")
        check_endpoint(endpoint, curve=keys[0] is not None)
        self._hello = Hello(name=name, streams=tuple(streams), policy=policy, max_pending=max_pending,
                            max_delay_ms=max_delay_ms, window=window, resume=dict(resume) if resume else None,
                            declare=declare)
        decode_client(encode_client(self._hello))  # the hub's own checks, here, with the same field names
        self.endpoint, self.name, self.heartbeat_s, self.hello_timeout_s = endpoint, name, heartbeat_s, hello_timeout_s
        self.next_seq: dict[str, int] = {}
        self.welcome: dict[str, dict[str, int]] = {}  # the hub's last welcome: per stream head and first
        self._expect: dict[str, int] = {}  # next seq accepted into the buffer (duplicates are below it)
        self._processed: dict[str, int] = {}  # last seq returned and since processed (ack-able)
        self._acked: dict[str, int] = {}  # last seq acked to the hub
        self._returned: dict[str, int] = {}
        self._ack_every = max(1, window // 4)
        self._buffer: deque[Frame] = deque()
        self._error: StreamError | None = None
        self._stats: dict[str, Any] | None = None
        self._welcomed, self._closed = False, False
        self._resumed: dict[str, int] | None = None  # the resume of the last hello sent
        self._hello_until = 0.0  # retry a hello refused for a held name until then
        self._retry_at = 0.0  # when to send the refused hello again (0: no retry due)
        self._held: StreamError | None = None  # the last refusal for a held name, raised if no welcome comes
        # When the hello awaiting its answer was sent (0: none). The hub answers each hello once, so "say hello"
        # errors answering messages sent before it must not start a second one: its welcome, arriving after the
        # first's frames were returned, would move the position back and repeat them.
        self._hello_out = 0.0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        connect_options(self._sock, endpoint)
        if keys[0] is not None:
            connect_curve(self._sock, *keys)  # type: ignore[arg-type]
        self._sock.connect(endpoint)
        self._last_sent = time.monotonic()
        try:
            self._hello_until = time.monotonic() + hello_timeout_s
            self._send_hello(self._hello.resume)
            if not self._wait(lambda: self._welcomed, hello_timeout_s):
                if self._held is not None:
                    raise self._held
                raise TimeoutError(f"{endpoint}: no welcome from the stream hub within {hello_timeout_s:g}s (is it "
                                   f"running, and are the CURVE keys allowed?)")
        except BaseException:
            self._sock.close(linger=0)
            self._ctx.term()
            raise

    # ---- receiving ------------------------------------------------------------------------------------------------

    def recv(self, timeout_s: float | None = None) -> Frame | None:
        """The next data frame (in seq order per stream), or None after ``timeout_s``; frames returned before are
        acked first (cumulatively)."""
        self._processed.update(self._returned)
        self._flush_acks(force=False)
        if not self._wait(lambda: bool(self._buffer), timeout_s):
            return None
        frame = self._buffer.popleft()
        self._returned[frame.stream] = frame.seq
        self.next_seq[frame.stream] = frame.seq + 1
        return frame

    def __iter__(self) -> Iterator[Frame]:
        while True:
            frame = self.recv()
            if frame is not None:
                yield frame

    def ack(self) -> None:
        """Ack every frame returned so far, now."""
        self._processed.update(self._returned)
        self._flush_acks(force=True)

    def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The hub's :meth:`~dynsteer.streams.hub.StreamHub.stats` (frames arriving meanwhile are kept)."""
        self._stats = None
        self._send(encode_client(StatsRequest()))
        if not self._wait(lambda: self._stats is not None, timeout_s):
            raise TimeoutError(f"{self.endpoint}: no stats reply within {timeout_s:g}s")
        assert self._stats is not None
        return self._stats

    def close(self, bye: bool = True) -> None:
        """Ack what was returned and, with ``bye``, unregister (the hub forgets this subscriber's queues and
        counters; without it the hub keeps queueing for a later resume)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.ack()
            if bye:
                self._send(encode_client(Bye()))
            self._sock.close(linger=1000)  # let the acks and bye reach the hub
        finally:
            self._ctx.term()

    def __enter__(self) -> StreamSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------------------------------

    def _wait(self, done: Callable[[], bool], timeout_s: float | None) -> bool:
        """Handle incoming messages (pinging when due) until ``done()`` or the timeout; raise a refusal."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        final = False
        while True:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if done():
                return True
            now = time.monotonic()
            # Before the deadline check: a caller polling with timeout 0 (MonitorClient over several replicas)
            # must still ping, ack and retry, or a hub that heard nothing for 3 heartbeats stops sending to it.
            self._flush_acks(force=True)  # about to wait: the hub may be holding messages back for these acks
            if self._retry_at and now >= self._retry_at:
                self._retry_at = 0.0
                self._send_hello(self._resumed)
            if now - self._last_sent >= self.heartbeat_s:
                self._send(encode_client(Ping()))
                now = time.monotonic()
            if deadline is not None and now >= deadline:
                if final or not self._sock.poll(0, zmq.POLLIN):
                    return False
                final = True  # what reached the socket by the deadline counts (a caller may have been busy)
                self._drain()
                continue
            wait = self._last_sent + self.heartbeat_s - now
            if self._retry_at:
                wait = min(wait, self._retry_at - now)
            if deadline is not None:
                wait = min(wait, deadline - now)
            if self._sock.poll(max(0, int(wait * 1000) + 1), zmq.POLLIN):
                self._drain()

    def _drain(self) -> None:
        while True:
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(parts)

    def _handle(self, parts: list[Any]) -> None:
        header = decode_server_header(parts[0])
        op = header.get("op")
        if op == "frame":
            frame = frame_from_header(header, parts[1:])
            expect = self._expect.get(frame.stream)
            if expect is None:
                return  # not ours (a stream dropped from a re-hello)
            if frame.seq < expect:  # a re-send after a reconnect: already here
                if frame.seq <= self._acked.get(frame.stream, -1):
                    self._send(encode_client(StreamAck(frame.stream, self._acked[frame.stream])))
                return
            self._expect[frame.stream] = frame.seq + 1
            self._buffer.append(frame)
        elif op == "welcome":
            self._on_welcome(header.get("streams"))
        elif op == "error":
            field, message = str(header.get("field")), str(header.get("message"))
            if field == "hello" and not self._closed and self._hello_outstanding():
                return  # an answer to a message (a ping) sent before the hello on its way: that hello settles it
            if field == "hello" and self._welcomed and not self._closed:
                logger.info("stream subscriber %s: the hub lost this connection (%s); saying hello again", self.name,
                            message)
                self._hello_until = time.monotonic() + self.hello_timeout_s
                self._send_hello(dict(self.next_seq))
            elif field == "hello.name" and message.startswith(NAME_HELD) and time.monotonic() < self._hello_until:
                self._hello_out = 0.0
                self._held = StreamError(field, message)
                self._retry_at = time.monotonic() + HELLO_RETRY_S
            else:
                if field.startswith("hello"):
                    self._hello_out = 0.0
                self._error = StreamError(field, message)
        elif op == "stats":
            self._stats = header.get("stats") if isinstance(header.get("stats"), dict) else {}
        elif op == "ping":
            pass  # the hub checking that this connection exists
        else:
            logger.warning("stream subscriber %s: ignoring a message with op %r", self.name, op)

    def _on_welcome(self, streams: Any) -> None:
        if not isinstance(streams, dict):
            raise WireError("welcome.streams", "expected a map")
        for stream in self._hello.streams:
            info = streams.get(stream) or {}
            head = info.get("head", 0)
            wanted = self._resumed.get(stream) if self._resumed else None
            if wanted is None:  # what the hub still holds for this name (a restart without resume) comes first
                self.next_seq[stream] = min(head, info.get("next", head))
            else:  # a resume past the head means the hub restarted and counts from 0 again: follow it
                self.next_seq[stream] = min(wanted, head)
            self._expect[stream] = self.next_seq[stream]
            self._acked[stream] = self._processed[stream] = self.next_seq[stream] - 1
            self._returned.pop(stream, None)
        # Frames of the previous connection still buffered come again from the resume point.
        self._buffer = deque(f for f in self._buffer if f.stream not in self._expect)
        self.welcome = {k: v for k, v in streams.items() if isinstance(v, dict)}
        self._welcomed, self._retry_at, self._hello_out = True, 0.0, 0.0

    def _hello_outstanding(self) -> bool:
        """A hello was sent and not yet answered (within ``hello_timeout_s``), or a refused one is due again."""
        if self._retry_at:
            return True
        return bool(self._hello_out) and time.monotonic() - self._hello_out < self.hello_timeout_s

    def _send_hello(self, resume: dict[str, int] | None) -> None:
        self._resumed = resume
        self._buffer.clear()  # what the hub sends after this hello starts again at the resume point
        self._hello_out = time.monotonic()
        self._send(encode_client(msgspec.structs.replace(self._hello, resume=resume)))

    def _flush_acks(self, force: bool) -> None:
        behind = {s: seq for s, seq in self._processed.items() if seq > self._acked.get(s, -1)}
        if not behind:
            return
        if not force and sum(seq - self._acked.get(s, -1) for s, seq in behind.items()) < self._ack_every:
            return
        for stream, seq in behind.items():
            if self._send(encode_client(StreamAck(stream, seq))):
                self._acked[stream] = seq

    def _send(self, frame: bytes) -> bool:
        """Send without waiting; False if the socket has no room or no connection to queue on (a DEALER whose CURVE
        handshake was refused has none, and a blocking send would hang the caller). A lost ping or ack is made
        good by the next; a lost hello by the hello timeout."""
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        finally:
            self._last_sent = time.monotonic()  # tried: the next ping waits a heartbeat either way
        return True
