"""The stream hub's data plane, on its I/O thread: spilling subscribers' overflow to disk and sending each
subscriber's messages in order within its window. The semantics are :mod:`dynsteer.streams.hub`'s;
:class:`HubDelivery` is one part of :class:`~dynsteer.streams.hub.StreamHub`.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable

import zmq

from dynsteer.streams.spill import SpillBudget, SpillRing
from dynsteer.streams.state import LossLedger, Message, Spilled, Subscriber, SubStream

logger = logging.getLogger("dynsteer")
# The I/O thread takes and releases the lock once per message sent or acked while holding the GIL, so a publish
# blocked on the lock could lose the race for it turn after turn; every this many messages it lets the GIL go.
YIELD_EVERY = 16


class HubDelivery:
    """Spilling and sending (a part of ``StreamHub``, whose ``__init__`` sets the state below; the I/O thread alone
    touches the rings and the socket, and changes queues and counters under ``_cond``)."""

    _cond: threading.Condition
    _router: zmq.Socket
    _subs: dict[str, Subscriber]
    _losses: LossLedger
    _spill_dir: str | None
    _own_spill_dir: str | None
    _spill_bytes: int
    _spill_budget: SpillBudget
    _disconnect: Callable[[Subscriber], None]

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
                    # Only this thread takes mem's head of a spilling subscriber; publish's caps spare it.
                    msg = ss.spilling = ss.mem[0]
                stored = False
                if self._spill_bytes:
                    try:
                        ring = ss.ring if ss.ring is not None else self._new_ring(ss)
                        stored = ring.push(msg.seq, msg.frames())  # outside the lock: disk must not stall publish
                    except OSError as exc:  # no spill folder: the message is lost, the hub goes on
                        logger.warning("stream hub: cannot spill for %s (%s); dropping", ss.sub.name, exc)
                with self._cond:
                    ss.spill_done(msg, stored, self._losses)
        return False

    def _new_ring(self, ss: SubStream) -> SpillRing:
        base = self._spill_dir
        if base is None:
            if self._own_spill_dir is None:
                self._own_spill_dir = tempfile.mkdtemp(prefix="dynsteer-spill-")
            base = self._own_spill_dir
        os.makedirs(base, mode=0o700, exist_ok=True)
        ss.ring = SpillRing(tempfile.mkdtemp(prefix=f"{ss.sub.name}.{ss.stream.name}.", dir=base), self._spill_bytes,
                            budget=self._spill_budget)
        return ss.ring

    def _send_all(self) -> None:
        now = time.monotonic()
        with self._cond:
            ready = [sub for sub in self._subs.values() if sub.connected and sub.stalled_until <= now]
            for sub in ready:
                sub.stalled_until = 0.0
        sent = 0
        for sub in ready:
            for ss in list(sub.streams.values()):
                while (item := self._take(ss)) is not None:
                    if not self._send(sub, ss, item):
                        break
                    sent += 1
                    if sent % YIELD_EVERY == 0:
                        time.sleep(0)  # publish first (see YIELD_EVERY)
                if sub.stalled_until or not sub.connected:
                    break

    def _take(self, ss: SubStream) -> Message | Spilled | None:
        """Move the next message to send into ``inflight``."""
        with self._cond:
            source = ss.next_source()
            if source is None:
                return None
            if source != "ring":
                return ss.take(source)
        assert ss.ring is not None
        peeked = ss.ring.peek()  # disk read outside the lock
        assert peeked is not None
        with self._cond:
            ss.ring.pop()
            return ss.take_spilled(*peeked)

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
                    self._disconnect(sub)
            return False
