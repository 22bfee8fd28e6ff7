"""The stream hub's bookkeeping: streams with their replay buffers, subscribers, and per (stream, subscriber) queues
and counters. No sockets and no locking here: :class:`dynsteer.streams.hub.StreamHub` holds its one lock around
every call, so each transition below keeps the accounting identity of :class:`SubStream` exact at every instant.

Where a message that a subscriber still owes an ack for lives (oldest first, but for a resume's re-opened ones):

* ``inflight``: sent on the current connection, not acked (at most ``window`` of them);
* ``resend``: sent on an earlier connection (or a send that did not go out), to be sent again;
* ``replay_q``: put back by a ``resume`` (re-sent, exempt from ``max_pending``);
* the spill ring (``spill`` policy only) and ``mem``: not sent yet. ``mem`` takes every new message; a spilling
  subscriber's overflow moves from the head of ``mem`` to the tail of the ring, so the ring is always older than
  ``mem``.

Sending takes whichever of ``resend``, ``replay_q``, ring and ``mem`` has the lowest seq (a resume can re-open
messages older than the re-sends), so each subscriber sees a stream in strictly increasing seq order. Each queue is
sorted, so a cumulative ack settles a prefix of each.

Memory a subscriber holds is tracked in bytes, per subscriber over all its streams: ``inflight_bytes`` are those of
``inflight`` and ``resend`` (whether or not the replay buffer still holds them; read-back spilled messages
included); ``unsent_bytes`` are those of its messages in ``replay_q`` and ``mem`` that the replay buffer no longer
holds (it alone keeps them alive). Every move into or out of those queues goes through the ``_unsent_*`` /
``_inflight_*`` helpers of :class:`SubStream`, and the replay buffer's evictions charge the subscribers named in
:attr:`Message.unsent_by`, so both are exact at every instant.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynsteer.transport.wire import Policy, array_buffers
from dynsteer.streams.spill import SpillRing


SPILL_LAG = 256  # messages a spilling subscriber may have waiting for the disk beyond max_pending


@dataclass(eq=False, slots=True)
class Message:
    """One published message, shared by the replay buffer and every subscriber's queues (arrays by reference)."""

    seq: int
    header: bytes
    arrays: list[np.ndarray]
    nbytes: int
    req_ids: tuple[str, ...]
    dropped_by: set[str] = field(default_factory=set)  # subscribers for which it is currently lost
    unsent_by: set[str] = field(default_factory=set)  # subscribers for which it waits unsent in replay_q or mem
    loss_counted: bool = False  # whether LossLedger counted it
    _buffers: list[memoryview] | None = None

    def frames(self) -> list[Any]:
        """``[header, *array buffers]`` (buffers built once, on the I/O thread that sends)."""
        if self._buffers is None:
            self._buffers = array_buffers(self.arrays)
        return [self.header, *self._buffers]


@dataclass(eq=False, slots=True)
class Spilled:
    """A message read back from a spill ring: only its frames remain."""

    seq: int
    data: list[Any]
    nbytes: int = 0

    def __post_init__(self) -> None:
        self.nbytes = sum(len(f) for f in self.data)

    def frames(self) -> list[Any]:
        return self.data


Item = Message | Spilled


class LossLedger:
    """How many messages naming each request id (``meta["req_ids"]``) are lost to some subscriber; LRU-bounded."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._counts: OrderedDict[str, int] = OrderedDict()

    def get(self, req_id: str) -> int:
        return self._counts.get(req_id, 0)

    def lost(self, msg: Message, subscriber: str) -> None:
        msg.dropped_by.add(subscriber)
        if msg.loss_counted:
            return  # a message counts once, however many subscribers lost it
        msg.loss_counted = True
        for rid in msg.req_ids:
            self._counts[rid] = self._counts.get(rid, 0) + 1
            self._counts.move_to_end(rid)
        while len(self._counts) > self.capacity:
            self._counts.popitem(last=False)

    def recovered(self, msg: Message, subscriber: str) -> None:
        msg.dropped_by.discard(subscriber)
        if msg.dropped_by or not msg.loss_counted:
            return
        msg.loss_counted = False
        for rid in msg.req_ids:
            if rid in self._counts:
                self._counts[rid] -= 1
                if self._counts[rid] <= 0:
                    del self._counts[rid]


class StreamState:
    """A declared stream: its next seq and its replay buffer (contiguous seqs ``first .. head-1``).

    ``by_subscriber``: declared by a subscriber's hello (not the engine); such a stream lives while some subscriber
    is registered for it.
    """

    def __init__(self, name: str, spec: dict[str, Any], by_subscriber: bool = False) -> None:
        self.name, self.spec, self.by_subscriber = name, spec, by_subscriber
        self.head = 0
        self.replay: deque[Message] = deque()
        self.replay_bytes = 0
        self.subs: dict[str, SubStream] = {}

    @property
    def first(self) -> int:
        """Oldest seq still in the replay buffer (``head`` when it is empty)."""
        return self.replay[0].seq if self.replay else self.head

    def get(self, seq: int) -> Message | None:
        first = self.first
        return self.replay[seq - first] if first <= seq < self.head else None

    def append(self, msg: Message, max_bytes: int, max_messages: int) -> None:
        """Add the newest message, evicting the oldest past either bound (the newest always stays)."""
        self.replay.append(msg)
        self.replay_bytes += msg.nbytes
        while len(self.replay) > 1 and (len(self.replay) > max_messages or self.replay_bytes > max_bytes):
            old = self.replay.popleft()
            self.replay_bytes -= old.nbytes
            for name in old.unsent_by:  # from now on only these subscribers keep it alive
                self.subs[name].sub.unsent_bytes += old.nbytes

    def replay_from(self, seq: int) -> Iterator[Message]:
        return itertools.islice(self.replay, max(0, seq - self.first), None)


class Subscriber:
    """A monitor, known by name; its connection (ZeroMQ identity) changes when it restarts.

    ``max_held_bytes`` bounds its ``inflight_bytes`` (no new message is sent past it) and its ``unsent_bytes`` (see
    :meth:`shed`). ``overdue``: a ``block`` wait for it timed out and it has not acked anything since, so publishes
    do not wait for it.
    """

    def __init__(self, name: str, max_held_bytes: int) -> None:
        self.name, self.max_held_bytes = name, max_held_bytes
        self.identity = b""
        self.key: str | None = None  # the CURVE public key (Z85) its hello came with
        self.policy: Policy = "drop"
        self.max_pending, self.max_delay_ms, self.window = 1024, 50.0, 64
        self.connected = False
        self.last_seen = 0.0
        self.disconnected_at = 0.0
        self.stalled_until = 0.0  # its pipe was full: no sends before this monotonic time
        self.overdue = False
        self.unsent_bytes = 0
        self.inflight_bytes = 0
        self.streams: dict[str, SubStream] = {}

    def shed(self, ledger: LossLedger) -> None:
        """Bring ``unsent_bytes`` down to ``max_held_bytes`` (give or take the message being spilled): drop the
        oldest of its unsent messages that only it keeps alive."""
        for ss in self.streams.values():
            while self.unsent_bytes > self.max_held_bytes and (msg := ss.take_unsent_evicted()) is not None:
                ss.drop(msg, ledger)
            if self.unsent_bytes <= self.max_held_bytes:
                return


class SubStream:
    """One stream as one subscriber sees it, with the identity ``published = delivered + dropped + spilled +
    pending`` at every instant (``pending`` = messages held in memory, sent or not; ``spilled`` = on disk only).

    ``published`` counts seqs from ``start`` (the stream's head when the subscriber registered, or an earlier resume
    seq) to the stream's head. Every such seq is in exactly one state; ``delivered`` and ``dropped`` go down when a
    resume re-opens a message (see :meth:`resume`), the ``*_total`` counters and ``replayed`` never do.
    """

    def __init__(self, sub: Subscriber, stream: StreamState) -> None:
        self.sub, self.stream = sub, stream
        self.start = stream.head
        self.published = self.delivered = self.dropped = self.spilled = 0
        self.spilled_total = self.dropped_total = self.replayed = 0
        self.block_waits, self.blocked_ms_max, self.block_timeouts = 0, 0.0, 0
        self.inflight: deque[Item] = deque()
        self.resend: deque[Item] = deque()
        self.replay_q: deque[Item] = deque()
        self.mem: deque[Message] = deque()
        self.ring: SpillRing | None = None
        self.spilling: Message | None = None  # the head of mem while the I/O thread writes it to disk

    # ---- what the counters are made of --------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self.inflight) + len(self.resend) + len(self.replay_q) + len(self.mem)

    @property
    def load(self) -> int:
        """What ``max_pending`` bounds: pending less the resume's replays (which are never dropped again)."""
        return len(self.inflight) + len(self.resend) + len(self.mem)

    @property
    def window(self) -> int:
        # Never more in flight than max_pending, so a subscriber over its limit always has an unsent message to drop.
        return min(self.sub.window, self.sub.max_pending)

    def _queues(self) -> tuple[deque[Any], ...]:
        return self.inflight, self.resend, self.replay_q, self.mem

    def held(self) -> set[int]:
        """Seqs pending or spilled."""
        seqs = {item.seq for q in self._queues() for item in q}
        if self.ring is not None:
            seqs.update(self.ring.seqs())
        return seqs

    # ---- transitions ----------------------------------------------------------------------------------------------

    def _unsent_in(self, msg: Message) -> None:
        """``msg`` enters ``replay_q`` or ``mem``."""
        msg.unsent_by.add(self.sub.name)
        if msg.seq < self.stream.first:  # else the replay buffer's eviction charges it
            self.sub.unsent_bytes += msg.nbytes

    def _unsent_out(self, msg: Message) -> None:
        msg.unsent_by.discard(self.sub.name)
        if msg.seq < self.stream.first:
            self.sub.unsent_bytes -= msg.nbytes

    def _inflight_in(self, item: Item) -> None:
        """``item`` enters ``inflight`` from a queue of unsent messages."""
        self.sub.inflight_bytes += item.nbytes

    def _inflight_out(self, item: Item) -> None:
        """``item`` leaves ``inflight`` or ``resend`` for good."""
        self.sub.inflight_bytes -= item.nbytes

    def _settle(self, queue: deque[Any]) -> Item:
        """Take the head of one of the four queues out of this subscriber's memory."""
        item = queue.popleft()
        if queue is self.inflight or queue is self.resend:
            self._inflight_out(item)
        else:
            self._unsent_out(item)
        return item

    def enqueue(self, msg: Message, ledger: LossLedger) -> None:
        """A new message of the stream; ``drop`` and ``block`` then hold at most ``max_pending``."""
        self.published += 1
        self.mem.append(msg)
        self._unsent_in(msg)
        if self.sub.policy != "spill":
            self.trim(ledger)
        else:
            self.cap_spill_lag(ledger)

    def trim(self, ledger: LossLedger) -> None:
        """Drop the oldest unsent messages past ``max_pending``."""
        while self.load > self.sub.max_pending and self.mem:
            self.drop(self.mem.popleft(), ledger)

    def cap_spill_lag(self, ledger: LossLedger) -> None:
        """Bound memory when the disk cannot keep up: drop the oldest unsent messages once more than
        ``max_pending + SPILL_LAG`` wait and the oldest has left the replay buffer (it holds memory of its own)."""
        while self.load > self.sub.max_pending + SPILL_LAG and (i := self._mem_evicted()) is not None:
            self.drop(self._pop_mem(i), ledger)

    def take_unsent_evicted(self) -> Message | None:
        """Take out of ``replay_q`` or ``mem`` the oldest unsent message the replay buffer evicted, if any."""
        i = self._mem_evicted()
        if self.replay_q and self.replay_q[0].seq < self.stream.first and (
                i is None or self.replay_q[0].seq < self.mem[i].seq):
            return self.replay_q.popleft()
        return self._pop_mem(i) if i is not None else None

    def _mem_evicted(self) -> int | None:
        """Index in ``mem`` of its oldest message out of the replay buffer, passing over the one being written to
        the ring (the I/O thread takes that one out itself)."""
        i = 1 if self.mem and self.mem[0] is self.spilling else 0
        return i if len(self.mem) > i and self.mem[i].seq < self.stream.first else None

    def _pop_mem(self, i: int) -> Message:
        if i == 0:
            return self.mem.popleft()
        msg = self.mem[i]
        del self.mem[i]
        return msg

    def drop(self, msg: Message, ledger: LossLedger) -> None:
        """``msg`` (taken out of ``replay_q`` or ``mem``) is lost for this subscriber."""
        self._unsent_out(msg)
        self.dropped += 1
        self.dropped_total += 1
        ledger.lost(msg, self.sub.name)

    def spill_done(self, msg: Message, stored: bool, ledger: LossLedger) -> None:
        """``msg``, the head of ``mem``, was written to the ring (``stored``) or could not be (then it is lost)."""
        self.spilling = None
        if not self.mem or self.mem[0] is not msg:
            return  # settled meanwhile (publish's caps pass over it, so only a bug gets here): counted already
        self.mem.popleft()
        if stored:
            self._unsent_out(msg)
            self.spilled += 1
            self.spilled_total += 1
        else:
            self.drop(msg, ledger)

    def take(self, source: str) -> Item:
        """Move the head of ``source`` (``resend``, ``replay_q``, ``mem``) into ``inflight``."""
        queue = {"resend": self.resend, "replay_q": self.replay_q, "mem": self.mem}[source]
        item = queue.popleft()
        self.inflight.append(item)
        if source != "resend":  # a re-send was in flight already
            self._unsent_out(item)
            self._inflight_in(item)
        return item

    def take_spilled(self, seq: int, data: list[Any]) -> Spilled:
        """The ring's head, read back (then popped by the caller), goes into ``inflight``."""
        self.spilled -= 1
        item = Spilled(seq, data)
        self.inflight.append(item)
        self._inflight_in(item)
        return item

    def ack(self, seq: int) -> int:
        """Settle everything up to ``seq`` as delivered, wherever it waits (the I/O thread: it owns the ring); return
        how many messages that settled."""
        before = self.delivered
        for queue in self._queues():
            while queue and queue[0].seq <= seq:
                self._settle(queue)
                self.delivered += 1
        ring = self.ring
        while ring is not None and ring.head_seq is not None and ring.head_seq <= seq:
            ring.pop()
            self.spilled -= 1
            self.delivered += 1
        return self.delivered - before

    def reconnect(self) -> None:
        """A new connection: whatever was in flight goes out again, first."""
        self.resend.extendleft(reversed(self.inflight))
        self.inflight.clear()

    def next_unsettled(self) -> int:
        """The lowest seq pending or spilled (what this subscriber gets next), or the stream's head."""
        heads = [q[0].seq for q in self._queues() if q]
        if self.ring is not None and self.ring.head_seq is not None:
            heads.append(self.ring.head_seq)
        return min(heads, default=self.stream.head)

    def next_source(self) -> str | None:
        """Which queue the next message to send comes from (``resend``, ``replay_q``, ``ring``, ``mem``), if any."""
        if len(self.inflight) >= self.window:
            return None
        heads = [(q[0].seq, name) for name, q in (("resend", self.resend), ("replay_q", self.replay_q),
                                                   ("mem", self.mem)) if q]
        if self.ring is not None and self.ring.head_seq is not None:
            heads.append((self.ring.head_seq, "ring"))
        if not heads:
            return None
        source = min(heads)[1]
        # Re-sends are charged already. A resume that re-opened messages older than them sends those first (in
        # seq order, or the subscriber would drop them as seen); with the re-sends filling the budget and nothing
        # of this stream on the wire, no ack could free it, so they go regardless.
        if source != "resend" and self.sub.inflight_bytes >= self.sub.max_held_bytes and self.sub.inflight_bytes \
                and not (self.resend and not self.inflight):
            return None  # its memory budget is in flight: wait for acks
        return source

    def resume(self, next_seq: int, ledger: LossLedger) -> None:
        """The subscriber processed everything before ``next_seq`` (clamped to the head) and wants the rest again.

        * Pending or spilled messages before ``next_seq`` become delivered (as an ack of ``next_seq - 1``).
        * ``next_seq`` before ``start``: those seqs become published too, each pending (re-sent) if the replay
          buffer still has it, else dropped.
        * Every later message that is delivered or dropped and still in the replay buffer is re-opened: pending
          again, ``delivered``/``dropped`` one less, re-sent in order. Counters never count a message twice.
        """
        stream = self.stream
        next_seq = min(next_seq, stream.head)
        if next_seq > 0:
            self.ack(next_seq - 1)
        held, reopened = self.held(), []
        if next_seq < self.start:
            lost = max(0, min(self.start, stream.first) - next_seq)  # before the replay buffer: gone
            self.published += self.start - next_seq
            self.dropped += lost
            self.dropped_total += lost
            for msg in itertools.takewhile(lambda m: m.seq < self.start, stream.replay_from(next_seq)):
                reopened.append(msg)
            old_start, self.start = self.start, next_seq
        else:
            old_start = self.start
        for msg in stream.replay_from(max(next_seq, old_start)):
            if msg.seq in held:
                continue
            if self.sub.name in msg.dropped_by:
                self.dropped -= 1
                ledger.recovered(msg, self.sub.name)
            else:
                self.delivered -= 1
            reopened.append(msg)
        self.replayed += len(reopened)
        for msg in reopened:
            self._unsent_in(msg)
        if reopened:
            self.replay_q = deque(sorted(itertools.chain(self.replay_q, reopened), key=lambda m: m.seq))

    def release(self) -> None:
        """The subscriber left this stream: forget it in shared messages and delete its spill files."""
        for msg in self.stream.replay:
            msg.dropped_by.discard(self.sub.name)
        for q in self._queues():
            while q:
                self._settle(q)
        if self.ring is not None:
            self.ring.close()
            self.ring = None

    def counters(self) -> dict[str, Any]:
        return {"published": self.published, "delivered": self.delivered, "dropped": self.dropped,
                "spilled": self.spilled, "pending": self.pending, "inflight": len(self.inflight),
                "spilled_total": self.spilled_total, "dropped_total": self.dropped_total, "replayed": self.replayed,
                "block_waits": self.block_waits, "blocked_ms_max": round(self.blocked_ms_max, 3),
                "block_timeouts": self.block_timeouts, "overdue": self.sub.overdue,
                "unsent_bytes": self.sub.unsent_bytes, "inflight_bytes": self.sub.inflight_bytes,
                "connected": self.sub.connected, "policy": self.sub.policy, "start": self.start}


def stream_stats(streams: Iterable[StreamState]) -> dict[str, Any]:
    return {st.name: {"head": st.head, "first": st.first,
                      "subscribers": {name: ss.counters() for name, ss in st.subs.items()}} for st in streams}
