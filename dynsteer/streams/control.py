"""The stream hub's control plane, on its I/O thread: subscribers' messages (``hello``, ``ack``, ``bye``, ``stats``)
and the registry they change (names, connections, declared streams, heartbeats). The semantics are
:mod:`dynsteer.streams.hub`'s; :class:`HubControl` is one part of :class:`~dynsteer.streams.hub.StreamHub`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from dynsteer.transport.wire import (NAME_HELD, Bye, Hello, StatsRequest, StreamAck, WireError, decode_client,
                                   encode_error, encode_ping, encode_stats, encode_welcome)
from dynsteer.streams.delivery import YIELD_EVERY
from dynsteer.transport.security import CurveKeys
from dynsteer.streams.state import LossLedger, StreamState, Subscriber, SubStream

logger = logging.getLogger("dynsteer")
MAX_STREAMS_TOTAL = 4096  # bounds what the engine's declare() can make the hub hold
_RECV_BATCH = 256  # client messages handled per loop turn, so sending is never starved


class HubControl:
    """Subscribers' control messages and the registry of subscribers and streams (a part of ``StreamHub``, whose
    ``__init__`` sets the state below; every change is made under ``_cond``)."""

    _cond: threading.Condition
    _router: zmq.Socket
    _curve: CurveKeys | None
    _streams: dict[str, StreamState]
    _subs: dict[str, Subscriber]
    _by_identity: dict[bytes, str]
    _overdue: set[str]
    _losses: LossLedger
    _errors: int
    _block_waiters: int
    _names: frozenset[str] | None
    _block_names: frozenset[str]
    _max_block_delay_ms: float
    _allow_declare: bool
    _max_declared: int
    _on_declare: Callable[[str, dict[str, Any]], None] | None
    _heartbeat_s: float
    _max_subscribers: int
    _ttl_s: float
    _max_held_bytes: int
    version: int
    stats: Callable[[], dict[str, Any]]

    def _receive(self) -> None:
        for i in range(1, _RECV_BATCH + 1):
            if i % YIELD_EVERY == 0:
                time.sleep(0)  # publish first (see YIELD_EVERY)
            try:
                parts = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = parts[0].bytes
            try:
                if len(parts) != 2:
                    raise WireError("message", f"expected one frame, got {len(parts) - 1}")
                # ZAP (the CURVE authenticator) sets User-Id to the Z85 public key the connection authenticated with
                key = parts[1].get("User-Id") if self._curve is not None else None
                self._handle(identity, decode_client(parts[1].buffer), key)
            except WireError as exc:
                self._reply_error(identity, exc.field, exc.message)
            except Exception:
                logger.exception("stream hub: error handling a client message")
                self._reply_error(identity, "message", "internal error")

    def _reply(self, identity: bytes, frame: bytes) -> None:
        try:
            self._router.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the client is gone or not reading: a reply is not worth waiting for

    def _reply_error(self, identity: bytes, field: str, message: str) -> None:
        with self._cond:
            self._errors += 1
        self._reply(identity, encode_error(field, message))

    def _handle(self, identity: bytes, msg: Any, key: str | None) -> None:
        if isinstance(msg, StatsRequest):
            self._reply(identity, encode_stats(self.stats()))
            return
        if isinstance(msg, Hello):
            self._hello(identity, msg, key)
            return
        with self._cond:
            name = self._by_identity.get(identity)
            sub = self._subs.get(name) if name is not None else None
            if sub is not None and sub.key != key:  # a routing id reused by another client: not the same peer
                sub = None
            if sub is not None:
                sub.last_seen = time.monotonic()
        if sub is None:
            if not isinstance(msg, Bye):
                raise WireError("hello", "this connection has not said hello, was disconnected, or the hub "
                                         "restarted: send hello")
            return
        if isinstance(msg, StreamAck):
            with self._cond:
                ss = sub.streams.get(msg.stream)
                if ss is None:
                    raise WireError("ack.stream", f"subscriber {sub.name!r} is not subscribed to {msg.stream!r}")
                if ss.ack(msg.seq):
                    sub.overdue = False  # progress: its block waits count again
                if self._block_waiters:
                    self._cond.notify_all()
        elif isinstance(msg, Bye):
            with self._cond:
                self._unregister(sub)
                self._cond.notify_all()

    def _hello(self, identity: bytes, hello: Hello, key: str | None) -> None:
        """Check ``hello`` against the operator's rules and the hub's state, then register it: a refusal raises
        WireError before anything changed."""
        name = hello.name
        if self._names is not None and name not in self._names:
            raise WireError("hello.name", f"{name!r} is not one of the subscriber names the operator allows "
                                          f"(MonitorConfig.subscribers)")
        if self._curve is not None and (key is None or not self._curve.name_allowed(key, name)):
            raise WireError("hello.name", f"this client's CURVE key may not use the name {name!r} "
                                          f"(CurveKeys.client_names)")
        if hello.policy == "block":
            if name not in self._block_names:
                raise WireError("hello.policy", f"'block' lets a subscriber hold the engine's steps; {name!r} is not "
                                                f"one of the operator's MonitorConfig.block_subscribers")
            if hello.max_delay_ms > self._max_block_delay_ms:
                raise WireError("hello.max_delay_ms", f"{hello.max_delay_ms:g} is above the operator's cap of "
                                                      f"{self._max_block_delay_ms:g} ms per engine step "
                                                      f"(MonitorConfig.max_block_delay_ms)")
        declared = dict(hello.declare or {})
        if declared and not self._allow_declare:
            raise WireError("hello.declare", "this hub does not let subscribers declare streams "
                                             "(MonitorConfig.allow_declare)")
        for stream in declared:
            if stream not in hello.streams:
                raise WireError(f"hello.declare[{stream!r}]", "not one of hello.streams (a declared stream lives "
                                                              "while subscribers are registered for it)")
        with self._cond:
            new = self._check_streams(hello, declared)
        for stream in new:
            if self._on_declare is not None:
                try:
                    self._on_declare(stream, declared[stream])  # outside the lock: user code
                except ValueError as exc:
                    raise WireError(f"hello.declare[{stream!r}]", str(exc)) from None
        with self._cond:
            new = self._check_streams(hello, declared)  # again: the engine may have declared meanwhile
            sub = self._subs.get(name)
            if sub is not None and sub.connected and sub.identity != identity and self._alive(sub):
                raise WireError("hello.name", f"{NAME_HELD} (free once it says bye or is silent for "
                                              f"{3 * self._heartbeat_s:g} s)")
            previous = self._by_identity.get(identity)
            previous = previous if previous != name else None
            victim = None
            if sub is None and len(self._subs) - (previous is not None) >= self._max_subscribers:
                victim = min((s for s in self._subs.values() if not s.connected), key=lambda s: s.last_seen,
                             default=None)
                if victim is None:
                    raise WireError("hello.name", f"the hub has its maximum of {self._max_subscribers} subscribers, "
                                                  f"all connected")
            # Nothing is refused from here on. The new registration goes first, so a stream it shares with those
            # released below keeps a subscriber and is not removed.
            for stream in new:
                self._streams[stream] = StreamState(stream, declared[stream], by_subscriber=True)
                self.version += 1
            welcome = self._register(identity, hello, key)
            for old in (victim, self._subs.get(previous) if previous is not None else None):
                if old is not None:
                    self._unregister(old)
            self._cond.notify_all()
        self._reply(identity, encode_welcome(welcome))

    def _check_streams(self, hello: Hello, declared: dict[str, dict[str, Any]]) -> list[str]:
        """Refuse unknown streams and conflicting or excess declarations; return the streams ``hello`` would add."""
        for i, stream in enumerate(hello.streams):
            if stream not in self._streams and stream not in declared:
                raise WireError(f"hello.streams[{i}]", f"unknown stream {stream!r}")
        new = []
        for stream, spec in declared.items():
            st = self._streams.get(stream)
            if st is None:
                new.append(stream)
            elif st.spec != spec:
                raise WireError(f"hello.declare[{stream!r}]", "already declared with a different spec")
        if new:
            count = sum(st.by_subscriber for st in self._streams.values())
            if count + len(new) > self._max_declared:
                raise WireError(f"hello.declare[{new[max(0, self._max_declared - count)]!r}]",
                                f"subscribers may declare at most {self._max_declared} streams at once, and "
                                f"{count} exist (MonitorConfig.max_declared_streams)")
            if len(self._streams) + len(new) > MAX_STREAMS_TOTAL:
                raise WireError(f"hello.declare[{new[0]!r}]", f"the hub holds its maximum of {MAX_STREAMS_TOTAL} "
                                                              f"streams")
        return new

    def _alive(self, sub: Subscriber) -> bool:
        """Whether ``sub``'s connection still exists: a ping to it must not fail (else it is disconnected now)."""
        try:
            self._router.send_multipart([sub.identity, encode_ping()], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EAGAIN:
                return True  # there, with a full pipe
            self._disconnect(sub)
            return False
        return True

    def _register(self, identity: bytes, hello: Hello, key: str | None) -> dict[str, dict[str, int]]:
        sub = self._subs.get(hello.name)
        if sub is None:
            sub = self._subs[hello.name] = Subscriber(hello.name, self._max_held_bytes)
            sub.overdue = hello.name in self._overdue
        self._forget_identity(sub)
        self._by_identity[identity] = sub.name
        sub.identity, sub.key, sub.connected, sub.last_seen, sub.stalled_until = (identity, key, True,
                                                                                time.monotonic(), 0.0)
        sub.policy, sub.max_pending, sub.max_delay_ms, sub.window = (hello.policy, hello.max_pending,
                                                                     hello.max_delay_ms, hello.window)
        for stream in [s for s in sub.streams if s not in hello.streams]:
            self._leave(sub, stream)
        welcome = {}
        for stream in hello.streams:
            st = self._streams[stream]
            ss = sub.streams.get(stream)
            if ss is None:
                ss = sub.streams[stream] = st.subs[sub.name] = SubStream(sub, st)
            ss.reconnect()
            if hello.resume and stream in hello.resume:
                ss.resume(hello.resume[stream], self._losses)
            if sub.policy != "spill":
                ss.trim(self._losses)
            welcome[stream] = {"head": st.head, "first": st.first, "next": ss.next_unsettled()}
        sub.shed(self._losses)
        return welcome

    def _leave(self, sub: Subscriber, stream: str) -> None:
        ss = sub.streams.pop(stream)
        ss.release()
        st = ss.stream
        del st.subs[sub.name]
        if st.by_subscriber and not st.subs:  # nobody left to want it: the worker stops capturing it
            del self._streams[stream]
            self.version += 1

    def _unregister(self, sub: Subscriber) -> None:
        for stream in list(sub.streams):
            self._leave(sub, stream)
        self._forget_identity(sub)
        del self._subs[sub.name]
        if sub.overdue:
            self._overdue.add(sub.name)  # bounded: only block_subscribers become overdue
        else:
            self._overdue.discard(sub.name)

    def _forget_identity(self, sub: Subscriber) -> None:
        if sub.identity and self._by_identity.get(sub.identity) == sub.name:
            del self._by_identity[sub.identity]
        sub.identity = b""

    def _disconnect(self, sub: Subscriber) -> None:
        """Nothing more is sent to ``sub`` until a hello; its name is free for another connection."""
        if not sub.connected:
            return
        sub.connected, sub.disconnected_at = False, time.monotonic()
        self._forget_identity(sub)
        self._cond.notify_all()  # block publishers stop waiting for it

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        silent, expired = now - 3 * self._heartbeat_s, now - self._ttl_s
        with self._cond:
            for sub in list(self._subs.values()):
                if sub.connected and sub.last_seen < silent:
                    self._disconnect(sub)
                elif not sub.connected and sub.disconnected_at < expired:
                    self._unregister(sub)
