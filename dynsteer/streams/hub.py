"""The stream hub: publishes each engine step's captured activations, per stream, to monitor processes.

A worker calls :meth:`StreamHub.publish` once per step and stream; monitors connect with
:class:`dynsteer.monitor.subscriber.StreamSubscriber` (wire format: :mod:`dynsteer.transport.wire`). ``publish`` only
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
  ``3 * heartbeat_s``, or whose connection is gone (a send to it fails), is *disconnected*: it stays registered,
  its messages queue under its policy, nothing is sent to it, and its connection must say hello again (anything
  else gets an ``error`` for field ``hello``; :class:`~dynsteer.monitor.subscriber.StreamSubscriber` says hello
  again by itself).
* **Names** (a monitor is a peer, not the operator): a hello must use a name in ``subscribers`` (``None``: any) and,
  with CURVE, one that ``curve.name_allowed`` grants the key the connection authenticated with (``hello.name``
  otherwise); every later message of that connection must come with the same key. A name held by a connected
  subscriber cannot be taken by a hello from another connection (``hello.name: held by another connection``; the
  hub first sends the holder a ``ping``, so a connection that is gone frees the name at once); it is free once the
  holder says ``bye`` or is disconnected. One connection speaks for one name: a hello under a new name releases the
  previous one as ``bye`` would. At most ``max_subscribers`` are registered: a hello for a new name then releases
  the disconnected subscriber silent longest, and is refused (``hello.name``) only if all are connected. A
  disconnected subscriber is released ``subscriber_ttl_s`` after it was disconnected.
* **Declared streams**: the engine's (:meth:`StreamHub.declare`) and, only with ``allow_declare``, subscribers'
  (a hello's ``declare``, each also in its ``streams``, checked by ``on_declare``; ``hello.declare`` otherwise).
  At most ``max_declared_streams`` subscriber-declared streams exist at once (``hello.declare[name]`` past it); one
  is removed once no subscriber is registered for it (:attr:`StreamHub.version` goes up, as for every change of
  :meth:`StreamHub.streams`). A refused hello changes nothing: no stream, registration or version.
* **Accounting** per (stream, subscriber), exact at every instant under the hub's lock:
  ``published = delivered + dropped + spilled + pending``. ``published``: messages of the stream from the
  subscriber's registration on (or from an earlier resume seq, see below); ``delivered``: acked; ``dropped``: lost
  for it; ``spilled``: on disk only; ``pending``: held in memory, sent or not. Cumulative: ``dropped_total``,
  ``spilled_total``, ``replayed``, ``block_waits``, ``blocked_ms_max`` (longest wait of one publish for it),
  ``block_timeouts`` (waits for it that ended at its deadline). Per subscriber (all streams): ``overdue``,
  ``unsent_bytes``, ``inflight_bytes`` (see below).
* **Policies** (per subscriber; ``max_pending`` bounds its pending messages per stream, resume replays aside):
  ``drop`` drops the oldest unsent ones. ``block`` (only names in ``block_subscribers``, with ``max_delay_ms`` at
  most ``max_block_delay_ms``, else the hello is refused: ``hello.policy`` / ``hello.max_delay_ms``) makes
  ``publish`` wait until it has fewer than ``max_pending``, then drops like ``drop``. The wait is bounded per engine
  step, all streams together: publishes in a row whose ``meta["step"]`` (an int) is the same share the step's start
  (its first publish's start; a publish without one is a step of its own), and none waits for a subscriber past that
  start plus its ``max_delay_ms``, whatever the number of blocking subscribers and streams. A subscriber whose wait
  timed out is *overdue*: publishes do not wait for it until it acks progress (an ack that settles a message;
  releasing its name does not clear it), so one that never acks delays at most one step, by at most
  ``max_block_delay_ms``. Disconnected subscribers are not waited for. ``spill`` moves the oldest unsent ones past
  ``max_pending``, and those the replay buffer evicted unsent, to an on-disk ring of ``spill_bytes``, all rings of
  the hub together at most ``spill_total_bytes`` (a push past either is dropped, counted), and sends them back in
  order before newer ones. Messages in flight (at most ``window``) stay in memory. If the disk cannot keep up (more
  than ``max_pending + 256`` waiting in memory, the oldest already out of the replay buffer), ``publish`` drops the
  oldest unsent ones (counted), so memory stays bounded.
* **Memory per subscriber** (all its streams together), bounded in bytes whatever ``max_pending`` and ``window``
  say: ``inflight_bytes`` (messages in flight or to re-send) stop new sends at ``max_held_bytes`` until acks come
  (one message always may go); ``unsent_bytes`` (its unsent messages that no replay buffer holds any more: behind a
  slow subscriber, re-opened by a resume, or waiting for the disk) past ``max_held_bytes`` make ``publish`` drop the
  oldest of them (counted), whatever the policy (a ``spill`` subscriber's reach the ring first unless the disk
  lags). So beyond the replay buffers a subscriber keeps at most ``2 * max_held_bytes`` plus two messages alive, and
  the hub ``max_subscribers`` times that.
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
import shutil
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
import zmq

from dynsteer.transport.wire import MAX_CLIENT_BYTES, MAX_DELAY_MS, NAME_PATTERN, check_array, encode_header
from dynsteer.streams.control import MAX_STREAMS_TOTAL, HubControl
from dynsteer.streams.delivery import HubDelivery
from dynsteer.transport.security import CurveKeys, bind
from dynsteer.streams.spill import SpillBudget
from dynsteer.streams.state import LossLedger, Message, StreamState, Subscriber, stream_stats

logger = logging.getLogger("dynsteer")


class StreamHub(HubControl, HubDelivery):
    """Publishes messages to subscribers over ZeroMQ (see the module docstring for the semantics).

    This class holds the state, the engine side (declare, publish, stats) and the I/O thread's loop; the loop's
    control plane (subscribers' messages and registry) is :class:`~dynsteer.streams.control.HubControl`, its data
    plane (spilling and sending) :class:`~dynsteer.streams.delivery.HubDelivery`.

    Defaults are :class:`dynsteer.config.MonitorConfig`'s.

    Args:
        endpoint: where to listen (:func:`dynsteer.transport.security.check_endpoint`); ``:0`` picks a free port.
        curve: CURVE keys, client allowlist and the names each client key may use (required for TCP).
        replay_bytes, replay_messages: bounds of each stream's replay buffer.
        spill_dir: folder for ``spill`` subscribers' rings (default: a private temp folder, removed on close).
        spill_bytes: bound of each (stream, subscriber) spill ring (0: nothing is spilled, all is dropped).
        spill_total_bytes: bound of all spill rings together.
        heartbeat_s: a subscriber silent for 3 times this is disconnected.
        on_declare: validates a stream declared by a subscriber's hello (raise ValueError to refuse it); runs on
            the hub's I/O thread.
        allow_declare: whether subscribers may declare streams at all.
        max_declared_streams: most subscriber-declared streams at once (the engine's do not count).
        subscribers: names a hello may use (``None``: any).
        max_subscribers: most registered subscribers (connected or disconnected).
        subscriber_ttl_s: a disconnected subscriber is released this long after it was disconnected.
        block_subscribers: names allowed the ``block`` policy.
        max_block_delay_ms: the most ``block`` subscribers may make one engine step wait, all streams together.
        max_held_bytes: per subscriber, bound of its bytes in flight, and of its unsent messages that only it keeps
            in memory.
    """

    def __init__(self, endpoint: str, *, curve: CurveKeys | None = None, replay_bytes: int = 256 << 20,
                 replay_messages: int = 4096, spill_dir: str | None = None, spill_bytes: int = 1 << 30,
                 spill_total_bytes: int = 4 << 30, heartbeat_s: float = 2.0,
                 on_declare: Callable[[str, dict[str, Any]], None] | None = None, allow_declare: bool = False,
                 max_declared_streams: int = 16, subscribers: Collection[str] | None = None,
                 max_subscribers: int = 64, subscriber_ttl_s: float = 300.0, block_subscribers: Collection[str] = (),
                 max_block_delay_ms: float = 50.0, max_held_bytes: int = 64 << 20) -> None:
        if (replay_bytes < 0 or replay_messages < 1 or spill_bytes < 0 or spill_total_bytes < 0 or heartbeat_s <= 0
                or max_declared_streams < 0 or max_subscribers < 1 or subscriber_ttl_s <= 0
                or not 0 <= max_block_delay_ms <= MAX_DELAY_MS or max_held_bytes < 0):
            raise ValueError("StreamHub: replay_messages, max_subscribers >= 1; replay_bytes, spill_bytes, "
                             "spill_total_bytes, max_declared_streams, max_held_bytes >= 0; heartbeat_s, "
                             f"subscriber_ttl_s > 0 and 0 <= max_block_delay_ms <= {MAX_DELAY_MS:g} are required")
        self._replay_bytes, self._replay_messages = replay_bytes, replay_messages
        self._spill_dir, self._spill_bytes = spill_dir, spill_bytes
        self._spill_budget = SpillBudget(spill_total_bytes)  # the I/O thread's alone, like the rings
        self._own_spill_dir: str | None = None  # the temp folder made when spill_dir is None
        self._heartbeat_s, self._on_declare = heartbeat_s, on_declare
        self._curve = curve
        self._allow_declare, self._max_declared = allow_declare, max_declared_streams
        self._names = frozenset(subscribers) if subscribers is not None else None
        self._max_subscribers, self._ttl_s = max_subscribers, subscriber_ttl_s
        self._block_names, self._max_block_delay_ms = frozenset(block_subscribers), max_block_delay_ms
        self._max_held_bytes = max_held_bytes
        self._cond = threading.Condition(threading.Lock())  # the one lock: every counter and queue
        self._streams: dict[str, StreamState] = {}
        self._subs: dict[str, Subscriber] = {}
        self._by_identity: dict[bytes, str] = {}
        self._overdue: set[str] = set()  # released while overdue: still overdue if it comes back (block names only)
        self._step: int | None = None  # the engine step being published, and when its first publish started
        self._step_start = 0.0
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
        """Make ``stream`` known (subscribers can name it); re-declaring replaces its spec, and makes a
        subscriber-declared stream the engine's (kept without subscribers, not counted as declared by them)."""
        if not isinstance(stream, str) or NAME_PATTERN.fullmatch(stream) is None:
            raise ValueError(f"declare: {stream!r} is not a stream name (1 to 128 of A-Z a-z 0-9 . _ -)")
        spec = dict(spec or {})
        with self._cond:
            st = self._streams.get(stream)
            if st is None:
                if len(self._streams) >= MAX_STREAMS_TOTAL:
                    raise ValueError(f"declare: the hub holds its maximum of {MAX_STREAMS_TOTAL} streams")
                self._streams[stream] = StreamState(stream, spec)
            elif st.spec == spec and not st.by_subscriber:
                return
            else:
                st.spec, st.by_subscriber = spec, False
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

        Cheap and non-blocking, except for ``block`` subscribers over their limit (at most their ``max_delay_ms``
        from the start of the step's first publish, ``meta["step"]`` telling which publishes share a step).
        ``arrays`` are kept by reference and must not be mutated afterwards; ``meta`` must be msgpack-able, and its
        ``req_ids`` (a list of strings) feed :meth:`request_losses`.
        """
        arrays = [check_array(a, f"publish.arrays[{i}]") for i, a in enumerate(arrays)]
        raw_ids = meta.get("req_ids") or ()
        req_ids = tuple(r for r in raw_ids if isinstance(r, str)) if isinstance(raw_ids, (list, tuple)) else ()
        step = meta.get("step")
        with self._cond:
            if self._closed:
                raise RuntimeError("publish: the stream hub is closed")
            st = self._streams.get(stream)
            if st is None:
                raise ValueError(f"publish: unknown stream {stream!r} (declare it first)")
            start = time.monotonic()
            if not isinstance(step, int) or isinstance(step, bool):
                self._step, step_start = None, start
            elif step != self._step:
                self._step, self._step_start = step, start
                step_start = start
            else:
                step_start = self._step_start
            self._wait_for_block_subscribers(st, start, step_start)
            seq = st.head
            msg = Message(seq, encode_header(stream, seq, meta, arrays), arrays, sum(a.nbytes for a in arrays),
                          req_ids)
            st.head += 1
            st.append(msg, self._replay_bytes, self._replay_messages)
            for ss in st.subs.values():
                ss.enqueue(msg, self._losses)
                if ss.sub.unsent_bytes > ss.sub.max_held_bytes:
                    ss.sub.shed(self._losses)
            self._wake_locked()
        return seq

    def _wait_for_block_subscribers(self, st: StreamState, start: float, step_start: float) -> None:
        """Wait (lock released meanwhile) while a connected ``block`` subscriber that is not overdue is at its limit,
        each at most until ``step_start`` plus its ``max_delay_ms``; record each one's wait, and make those whose
        deadline came overdue."""
        waiting = {ss: step_start + ss.sub.max_delay_ms / 1000 for ss in st.subs.values()
                   if ss.sub.policy == "block" and not ss.sub.overdue}
        if not waiting:
            return
        self._block_waiters += 1
        try:
            for turn in itertools.count():
                now = time.monotonic()
                for ss, deadline in list(waiting.items()):
                    room = (ss.load < ss.sub.max_pending or not ss.sub.connected or ss.sub.overdue
                            or st.subs.get(ss.sub.name) is not ss)
                    if room or now >= deadline:
                        del waiting[ss]
                        if turn:  # it made this publish wait
                            ss.block_waits += 1
                            ss.blocked_ms_max = max(ss.blocked_ms_max, (now - start) * 1000)
                        if not room:
                            ss.block_timeouts += 1
                            ss.sub.overdue = True
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
        """``{stream: {"head", "first", "subscribers": {name: counters}}, "_errors": n, "_spill_bytes": n}`` (one
        consistent instant; ``_spill_bytes``: what all spill rings hold)."""
        with self._cond:
            return {**stream_stats(self._streams.values()), "_errors": self._errors,
                    "_spill_bytes": self._spill_budget.used}

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

