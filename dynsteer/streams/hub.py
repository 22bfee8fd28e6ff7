"""The stream hub: publishes each engine step's captured activations, per stream, to monitor processes.

A worker calls :meth:`StreamHub.publish` once per step and stream; monitors connect with
:class:`dynsteer.monitor.subscriber.StreamSubscriber` (wire format: :mod:`dynsteer.monitor.wire`). ``publish`` only
files the message (arrays by reference, no copy, no serialization of arrays, no socket call but a wake-up); the hub's
own I/O thread owns the ROUTER socket and does all sending, receiving and spilling.

Semantics:

* **Sequence numbers** are per stream, from 0, one per publish, whether or not anyone subscribes
  (:meth:`StreamHub.subscribed` lets the caller skip building unwanted messages).
* **Replay buffer**: per stream the newest messages, bounded by ``replay_bytes`` and ``replay_messages`` (the
  newest message always stays). The engine must not mutate published arrays.
* **Subscribers** are known by name: a restarted monitor with the same name is the same subscriber on a new
  connection, and what the old connection had in flight is re-sent. ``bye`` unregisters; a hello's stream list
  replaces the previous one (streams left out are unregistered for it). A subscriber silent for more than
  ``3 * heartbeat_s``, or whose connection is gone, is marked disconnected: it stays registered, its messages queue
  under its policy, and nothing is sent to it until it speaks again.
* **Accounting** per (stream, subscriber), exact at every instant under the hub's lock:
  ``published = delivered + dropped + spilled + pending``. ``published``: messages of the stream from the
  subscriber's registration on (or from an earlier resume seq, see below); ``delivered``: acked; ``dropped``: lost
  for it; ``spilled``: on disk only; ``pending``: held in memory, sent or not. Cumulative: ``dropped_total``,
  ``spilled_total``, ``replayed``, ``block_waits``, ``blocked_ms_max`` (longest wait of one publish for it).
* **Policies** (per subscriber; ``max_pending`` bounds its pending messages per stream, resume replays aside):
  ``drop`` drops the oldest unsent ones; ``block`` makes ``publish`` wait until it has fewer than ``max_pending``,
  at most ``max_delay_ms`` from the start of that publish call whatever the number of blocking subscribers, then
  drops like ``drop`` (disconnected subscribers are not waited for); ``spill`` moves the oldest unsent ones past
  ``max_pending``, and those the replay buffer evicted unsent, to an on-disk ring of ``spill_bytes`` (full: dropped)
  and sends them back in order before newer ones. Messages in flight (at most ``window``) stay in memory. If the
  disk cannot keep up (more than ``max_pending + 256`` waiting in memory, the oldest already out of the replay
  buffer), ``publish`` drops the oldest unsent ones (counted), so memory stays bounded.
* **Flow control**: at most ``window`` un-acked messages in flight per stream and subscriber; sends never block
  (a full pipe postpones that subscriber).
* **Resume** (hello with ``resume={stream: next_seq}``): pending and spilled messages before ``next_seq`` count as
  delivered; from ``next_seq`` on, everything still in the replay buffer (or pending, or spilled) is sent again in
  order. A message re-opened this way returns to pending from ``delivered`` or ``dropped`` (so those two can go
  down; a message is never counted twice); seqs before the subscriber's registration become published, and those
  no longer in the replay buffer dropped. A ``next_seq`` past the head is clamped to it (the hub restarted).
* **Untrusted clients**: a malformed or refused message gets an ``error`` reply naming the field and is counted
  (``stats()["_errors"]``); the hub goes on.

Example::

    hub = StreamHub(default_endpoint("streams"))
    hub.declare("post_block.12", {"hidden": 4096})
    if hub.subscribed("post_block.12"):
        hub.publish("post_block.12", {"step": 7, "req_ids": ["r1"]}, [rows])
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from dynsteer.monitor.wire import (MAX_CLIENT_BYTES, NAME_PATTERN, Ack, Bye, Hello, StatsRequest, WireError,
                                   check_array, decode_client, encode_error, encode_header, encode_stats,
                                   encode_welcome)
from dynsteer.streams.security import CurveKeys, bind
from dynsteer.streams.spill import SpillRing
from dynsteer.streams.state import LossLedger, Message, Spilled, StreamState, Subscriber, SubStream, stream_stats

logger = logging.getLogger("dynsteer")
MAX_STREAMS_TOTAL = 4096  # subscribers can declare streams: bound what they can make the hub hold
_RECV_BATCH = 256  # client messages handled per loop turn, so sending is never starved


class StreamHub:
    """Publishes messages to subscribers over ZeroMQ (see the module docstring for the semantics).

    Args:
        endpoint: where to listen (:func:`dynsteer.streams.security.check_endpoint`); ``:0`` picks a free port.
        curve: CURVE keys and client allowlist (required for non-loopback TCP).
        replay_bytes, replay_messages: bounds of each stream's replay buffer.
        spill_dir: folder for ``spill`` subscribers' rings (default: a private temp folder, removed on close).
        spill_bytes: bound of each (stream, subscriber) spill ring.
        heartbeat_s: a subscriber silent for 3 times this is marked disconnected.
        on_declare: validates a stream declared by a subscriber's hello (raise ValueError to refuse it); runs on
            the hub's I/O thread.
        max_subscribers: most registered subscribers.
    """

    def __init__(self, endpoint: str, *, curve: CurveKeys | None = None, replay_bytes: int = 256 << 20,
                 replay_messages: int = 4096, spill_dir: str | None = None, spill_bytes: int = 1 << 30,
                 heartbeat_s: float = 2.0, on_declare: Callable[[str, dict[str, Any]], None] | None = None,
                 max_subscribers: int = 64) -> None:
        if replay_bytes < 0 or replay_messages < 1 or spill_bytes < 1 or heartbeat_s <= 0 or max_subscribers < 1:
            raise ValueError("StreamHub: replay_messages, spill_bytes, max_subscribers >= 1, replay_bytes >= 0 and "
                             "heartbeat_s > 0 are required")
        self._replay_bytes, self._replay_messages = replay_bytes, replay_messages
        self._spill_dir, self._spill_bytes = spill_dir, spill_bytes
        self._own_spill_dir: str | None = None  # the temp folder made when spill_dir is None
        self._heartbeat_s, self._on_declare, self._max_subscribers = heartbeat_s, on_declare, max_subscribers
        self._cond = threading.Condition(threading.Lock())  # the one lock: every counter and queue
        self._streams: dict[str, StreamState] = {}
        self._subs: dict[str, Subscriber] = {}
        self._by_identity: dict[bytes, str] = {}
        self._losses = LossLedger()
        self._errors = 0
        self._block_waiters = 0
        self._wake_pending = False
        self._closed = False
        self.version = 0

        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown or full peer raises instead of dropping
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.SNDHWM, 1 << 16)  # windows bound what is queued; the HWM is only a backstop
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_CLIENT_BYTES + 4096)  # oversized clients are disconnected
        try:
            self._binding = bind(self._router, endpoint, curve)
        except BaseException:
            self._router.close()
            self._ctx.term()
            raise
        self.endpoint = self._binding.endpoint
        # publish() wakes the I/O thread through an inproc pair; its end is only used under the lock.
        wake_address = f"inproc://dynsteer-hub-wake-{id(self)}"
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.bind(wake_address)
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.setsockopt(zmq.LINGER, 0)
        self._wake_rx.connect(wake_address)
        self._thread = threading.Thread(target=self._run, name="dynsteer-stream-hub", daemon=True)
        self._thread.start()

    # ---- engine side ----------------------------------------------------------------------------------------------

    def declare(self, stream: str, spec: dict[str, Any] | None = None) -> None:
        """Make ``stream`` known (subscribers can name it); re-declaring replaces its spec."""
        if not isinstance(stream, str) or NAME_PATTERN.fullmatch(stream) is None:
            raise ValueError(f"declare: {stream!r} is not a stream name (1 to 128 of A-Z a-z 0-9 . _ -)")
        with self._cond:
            self._declare_locked(stream, dict(spec or {}))

    def _declare_locked(self, stream: str, spec: dict[str, Any]) -> None:
        st = self._streams.get(stream)
        if st is None:
            if len(self._streams) >= MAX_STREAMS_TOTAL:
                raise ValueError(f"declare: the hub holds its maximum of {MAX_STREAMS_TOTAL} streams")
            self._streams[stream] = StreamState(stream, spec)
        elif st.spec == spec:
            return
        else:
            st.spec = spec
        self.version += 1

    def streams(self) -> dict[str, dict[str, Any]]:
        """Declared streams (by the engine or by subscribers) and their specs."""
        with self._cond:
            return {name: dict(st.spec) for name, st in self._streams.items()}

    def subscribed(self, stream: str) -> bool:
        """Whether ``stream`` has a registered subscriber (connected or not); lock-free, for the step loop."""
        st = self._streams.get(stream)
        return bool(st is not None and st.subs)

    def publish(self, stream: str, meta: dict[str, Any], arrays: Sequence[np.ndarray]) -> int:
        """File one message of ``stream`` for every subscriber and return its seq.

        Cheap and non-blocking, except for ``block`` subscribers over their limit (at most their ``max_delay_ms``).
        ``arrays`` are kept by reference and must not be mutated afterwards; ``meta`` must be msgpack-able, and its
        ``req_ids`` (a list of strings) feed :meth:`request_losses`.
        """
        arrays = [check_array(a, f"publish.arrays[{i}]") for i, a in enumerate(arrays)]
        raw_ids = meta.get("req_ids") or ()
        req_ids = tuple(r for r in raw_ids if isinstance(r, str)) if isinstance(raw_ids, (list, tuple)) else ()
        with self._cond:
            if self._closed:
                raise RuntimeError("publish: the stream hub is closed")
            st = self._streams.get(stream)
            if st is None:
                raise ValueError(f"publish: unknown stream {stream!r} (declare it first)")
            self._wait_for_block_subscribers(st)
            seq = st.head
            msg = Message(seq, encode_header(stream, seq, meta, arrays), arrays, sum(a.nbytes for a in arrays),
                          req_ids)
            st.head += 1
            st.append(msg, self._replay_bytes, self._replay_messages)
            for ss in st.subs.values():
                ss.enqueue(msg, self._losses)
            self._wake_locked()
        return seq

    def _wait_for_block_subscribers(self, st: StreamState) -> None:
        """Wait (lock released meanwhile) while a connected ``block`` subscriber is at its limit, each at most its
        ``max_delay_ms`` from now; record each one's wait."""
        blocking = [ss for ss in st.subs.values() if ss.sub.policy == "block"]
        if not blocking:
            return
        start = time.monotonic()
        waiting = {ss: start + ss.sub.max_delay_ms / 1000 for ss in blocking}
        self._block_waiters += 1
        try:
            for turn in itertools.count():
                now = time.monotonic()
                for ss, deadline in list(waiting.items()):
                    if (ss.load < ss.sub.max_pending or not ss.sub.connected or now >= deadline
                            or st.subs.get(ss.sub.name) is not ss):
                        del waiting[ss]
                        if turn:  # it made this publish wait
                            ss.block_waits += 1
                            ss.blocked_ms_max = max(ss.blocked_ms_max, (now - start) * 1000)
                if not waiting:
                    return
                self._cond.wait(min(waiting.values()) - now)
        finally:
            self._block_waiters -= 1

    def request_losses(self, req_id: str) -> int:
        """Messages naming ``req_id`` in ``meta["req_ids"]`` that some subscriber lost (and has not recovered by a
        resume). The newest 65536 request ids are remembered."""
        with self._cond:
            return self._losses.get(req_id)

    def stats(self) -> dict[str, Any]:
        """``{stream: {"head", "first", "subscribers": {name: counters}}, "_errors": n}`` (one consistent instant)."""
        with self._cond:
            return {**stream_stats(self._streams.values()), "_errors": self._errors}

    def close(self) -> None:
        """Stop the I/O thread, close the socket and delete spill files (pending messages are not flushed)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._wake_locked()
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            self._wake_tx.close()
        self._binding.close()
        self._ctx.term()
        if self._own_spill_dir is not None:
            shutil.rmtree(self._own_spill_dir, ignore_errors=True)

    def __enter__(self) -> StreamHub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake_locked(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # the pipe already holds wake-ups

    # ---- I/O thread -----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        busy = False
        try:
            while not self._closed:
                stalled = any(s.stalled_until for s in list(self._subs.values()))
                events = dict(poller.poll(0 if busy else 5 if stalled else int(min(100, self._heartbeat_s * 250))))
                if self._wake_rx in events:
                    self._drain_wake()
                if self._router in events:
                    self._receive()
                try:
                    self._check_heartbeats()
                    busy = self._spill()
                    self._send_all()
                except Exception:  # a bug must not end publishing: log it and go on
                    logger.exception("stream hub: I/O loop error")
        finally:
            self._router.close(linger=0)
            self._wake_rx.close(linger=0)
            with self._cond:
                for sub in self._subs.values():
                    for ss in sub.streams.values():
                        ss.release()

    def _drain_wake(self) -> None:
        while True:
            try:
                self._wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        with self._cond:
            self._wake_pending = False  # cleared before sending: a publish from now on wakes us again

    def _receive(self) -> None:
        for _ in range(_RECV_BATCH):
            try:
                parts = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity = parts[0]
            try:
                if len(parts) != 2:
                    raise WireError("message", f"expected one frame, got {len(parts) - 1}")
                self._handle(identity, decode_client(parts[1]))
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

    def _handle(self, identity: bytes, msg: Any) -> None:
        if isinstance(msg, StatsRequest):
            self._reply(identity, encode_stats(self.stats()))
            return
        if isinstance(msg, Hello):
            self._hello(identity, msg)
            return
        with self._cond:
            name = self._by_identity.get(identity)
            sub = self._subs.get(name) if name is not None else None
            if sub is not None:
                sub.last_seen = time.monotonic()
                sub.connected = True  # the same connection speaking again (it was only silent)
        if sub is None:
            if not isinstance(msg, Bye):
                raise WireError("hello", "this connection has not said hello (or the hub restarted): send hello")
            return
        if isinstance(msg, Ack):
            with self._cond:
                ss = sub.streams.get(msg.stream)
                if ss is None:
                    raise WireError("ack.stream", f"subscriber {sub.name!r} is not subscribed to {msg.stream!r}")
                ss.ack(msg.seq)
                if self._block_waiters:
                    self._cond.notify_all()
        elif isinstance(msg, Bye):
            with self._cond:
                self._unregister(sub)
                self._cond.notify_all()

    def _hello(self, identity: bytes, hello: Hello) -> None:
        declared = dict(hello.declare or {})
        with self._cond:
            known = {name: st.spec for name, st in self._streams.items()}
        for i, stream in enumerate(hello.streams):
            if stream not in known and stream not in declared:
                raise WireError(f"hello.streams[{i}]", f"unknown stream {stream!r}")
        for stream, spec in declared.items():
            if stream in known:
                if known[stream] != spec:
                    raise WireError(f"hello.declare[{stream!r}]", "already declared with a different spec")
                continue
            if self._on_declare is not None:
                try:
                    self._on_declare(stream, spec)  # outside the lock: user code
                except ValueError as exc:
                    raise WireError(f"hello.declare[{stream!r}]", str(exc)) from None
        with self._cond:
            if hello.name not in self._subs and len(self._subs) >= self._max_subscribers:
                raise WireError("hello.name", f"the hub has its maximum of {self._max_subscribers} subscribers")
            for stream, spec in declared.items():
                try:
                    self._declare_locked(stream, spec)
                except ValueError as exc:
                    raise WireError(f"hello.declare[{stream!r}]", str(exc)) from None
            welcome = self._register(identity, hello)
            self._cond.notify_all()
        self._reply(identity, encode_welcome(welcome))

    def _register(self, identity: bytes, hello: Hello) -> dict[str, dict[str, int]]:
        sub = self._subs.get(hello.name)
        if sub is None:
            sub = self._subs[hello.name] = Subscriber(hello.name)
        if sub.identity and self._by_identity.get(sub.identity) == sub.name:
            del self._by_identity[sub.identity]
        previous = self._subs.get(self._by_identity.get(identity, ""))
        if previous is not None and previous is not sub:  # this connection spoke for another name until now
            previous.connected, previous.identity = False, b""
        self._by_identity[identity] = sub.name
        sub.identity, sub.connected, sub.last_seen, sub.stalled_until = identity, True, time.monotonic(), 0.0
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
        return welcome

    def _leave(self, sub: Subscriber, stream: str) -> None:
        ss = sub.streams.pop(stream)
        ss.release()
        del ss.stream.subs[sub.name]

    def _unregister(self, sub: Subscriber) -> None:
        for stream in list(sub.streams):
            self._leave(sub, stream)
        self._by_identity.pop(sub.identity, None)
        del self._subs[sub.name]

    def _check_heartbeats(self) -> None:
        limit = time.monotonic() - 3 * self._heartbeat_s
        with self._cond:
            for sub in self._subs.values():
                if sub.connected and sub.last_seen < limit:
                    sub.connected = False
                    self._cond.notify_all()  # block publishers stop waiting for it

    # ---- spilling and sending (I/O thread; it alone touches the rings and the socket) -----------------------------

    def _spill(self) -> bool:
        """Move spilling subscribers' overflow to disk, for at most ~10 ms (sending must not starve); True if more
        is left to do."""
        with self._cond:
            work = [ss for sub in self._subs.values() if sub.policy == "spill" for ss in sub.streams.values()]
        until = time.monotonic() + 0.01
        for ss in work:
            while True:
                with self._cond:
                    if not ss.mem or (ss.load <= ss.sub.max_pending and ss.mem[0].seq >= ss.stream.first):
                        break
                    if time.monotonic() > until:
                        return True
                    # Only this thread takes mem's head of a spilling subscriber; publish's lag cap spares it.
                    msg = ss.spilling = ss.mem[0]
                try:
                    ring = ss.ring if ss.ring is not None else self._new_ring(ss)
                    stored = ring.push(msg.seq, msg.frames())  # outside the lock: disk must not stall publish
                except OSError as exc:  # no spill folder: the message is lost, the hub goes on
                    logger.warning("stream hub: cannot spill for %s (%s); dropping", ss.sub.name, exc)
                    stored = False
                with self._cond:
                    ss.mem.popleft()
                    ss.spilling = None
                    if stored:
                        ss.spilled += 1
                        ss.spilled_total += 1
                    else:
                        ss.drop(msg, self._losses)
        return False

    def _new_ring(self, ss: SubStream) -> SpillRing:
        base = self._spill_dir
        if base is None:
            if self._own_spill_dir is None:
                self._own_spill_dir = tempfile.mkdtemp(prefix="dynsteer-spill-")
            base = self._own_spill_dir
        os.makedirs(base, mode=0o700, exist_ok=True)
        ss.ring = SpillRing(tempfile.mkdtemp(prefix=f"{ss.sub.name}.{ss.stream.name}.", dir=base), self._spill_bytes)
        return ss.ring

    def _send_all(self) -> None:
        now = time.monotonic()
        with self._cond:
            ready = [sub for sub in self._subs.values() if sub.connected and sub.stalled_until <= now]
            for sub in ready:
                sub.stalled_until = 0.0
        for sub in ready:
            for ss in list(sub.streams.values()):
                while (item := self._take(ss)) is not None:
                    if not self._send(sub, ss, item):
                        break
                if sub.stalled_until or not sub.connected:
                    break

    def _take(self, ss: SubStream) -> Message | Spilled | None:
        """Move the next message to send into ``inflight``."""
        with self._cond:
            source = ss.next_source()
            if source is None:
                return None
            if source != "ring":
                queues: dict[str, deque[Any]] = {"resend": ss.resend, "replay_q": ss.replay_q, "mem": ss.mem}
                item = queues[source].popleft()
                ss.inflight.append(item)
                return item
        assert ss.ring is not None
        peeked = ss.ring.peek()  # disk read outside the lock
        assert peeked is not None
        with self._cond:
            ss.ring.pop()
            ss.spilled -= 1
            item = Spilled(*peeked)
            ss.inflight.append(item)
        return item

    def _send(self, sub: Subscriber, ss: SubStream, item: Message | Spilled) -> bool:
        try:
            self._router.send_multipart([sub.identity, *item.frames()], zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:
            with self._cond:
                if ss.inflight and ss.inflight[-1] is item:
                    ss.resend.appendleft(ss.inflight.pop())  # older than anything queued: it goes first
                if exc.errno == zmq.EAGAIN:
                    sub.stalled_until = time.monotonic() + 0.005
                else:  # EHOSTUNREACH: the connection is gone; wait for a new hello
                    sub.connected = False
                    self._cond.notify_all()
            return False
