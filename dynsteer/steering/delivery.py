"""Capture delivery: a request's capture record from admission to its consumers.

The capture collector (``dynsteer.capture.store``) stages the captured rows and copies them out; this component
begins a record when its request is admitted, plans each step, hands chunks to streaming consumers as they land
and the finished record to every consumer it names. A consumer never aborts generation: its failure is written
into the record (and the data kept in memory rather than lost). Consumers that write to disk or copy whole records
(``background = True``: ``filesystem``, ``zmq``) run on a thread of their own
(:mod:`dynsteer.capture.consumer_thread`), so their I/O never holds up a step. An engine without capture places
holds a :class:`NullCaptureDelivery`.
"""

from __future__ import annotations

import collections
import functools
import time
from typing import TYPE_CHECKING, Any, Collection, Iterable

import numpy as np

from dynsteer.capture.consumer_thread import ConsumerThread
from dynsteer.capture.spec import CaptureSpec
from dynsteer.capture.spool import WRITER
from dynsteer.capture.store import CaptureCollector, CaptureRecord, Place, StreamSelection
from dynsteer.steering.stats import RuntimeStats

if TYPE_CHECKING:
    from dynsteer.capture.consumers import CaptureConsumer


class CaptureDelivery:
    """The engine's capture collector and consumers (on TP rank 0; other ranks' collectors emit nothing and
    hold no consumers)."""

    def __init__(self, collector: CaptureCollector, consumers: dict[str, CaptureConsumer],
                 stats: RuntimeStats) -> None:
        self.collector, self.consumers, self.stats = collector, consumers, stats
        collector.on_chunk = self._on_chunk
        collector.on_finished = self._deliver
        self.background = ConsumerThread()
        # records a background consumer failed to take, to keep in memory (memory's calls stay on this thread)
        self._kept: collections.deque[CaptureRecord] = collections.deque()
        streaming = {name for name, c in consumers.items()
                     if callable(getattr(c, "on_chunk", None)) and getattr(c, "streams", True)}
        collector.streams = lambda spec: any(name in streaming for name in spec.consumers)

    @property
    def engine_places(self) -> Collection[Place]:
        """What a request may capture (every pipeline stage's places)."""
        return self.collector.engine_places

    @property
    def places(self) -> Collection[Place]:
        """This worker's places (a pipeline stage holds its own layers)."""
        return self.collector.places

    def begin(self, req_id: str, tag: str | None, spec: CaptureSpec | None, prompt_len: int) -> None:
        self.collector.begin(req_id, tag, spec, prompt_len)

    def plan(self, ids: tuple[str, ...], query_start_loc: np.ndarray, num_computed: np.ndarray,
             streams: list[StreamSelection]) -> None:
        """This step's captured tokens and the streams' selected ones (nothing when neither has any)."""
        if streams or self.collector.needs_plan:
            self.collector.plan(ids, np.asarray(query_start_loc[: len(ids) + 1], np.int64), num_computed, streams)

    def after_forward(self) -> None:
        """The step's forward is enqueued: start copying captured rows out."""
        self.collector.after_forward()
        if self._kept:
            self._keep_failed()

    def finish(self, req_id: str) -> None:
        """The request finished: its record goes to its consumers once its last rows have landed and are written (a
        later step's poll; the step path never waits for them)."""
        self.collector.retire(req_id)

    def complete(self) -> None:
        """Wait for every finished request's record and deliver it (nothing else left to run: waiting costs no
        step)."""
        self.collector.complete()

    def take(self, tags: Iterable[str]) -> list[CaptureRecord]:
        """Finish live records with these tags (the caller knows they are done) and take them from memory."""
        t0, stats = time.perf_counter(), self.stats
        stats.takes += 1
        stats.take_backlog += WRITER.backlog()
        tags = set(tags)
        self.collector.complete(tags)  # finished, on their way out: delivered now
        for req_id in [r for r, rec in self.collector.records.items() if rec.tag in tags]:
            self._deliver(self.collector.finish(req_id))
        self.background.wait(tags)  # their background consumers' outcomes, before the caller sees the records
        self._keep_failed()
        memory: Any = self.consumers.get("memory")  # the in-memory consumer: records wait there to be taken
        out = [rec for tag in tags if memory is not None and (rec := memory.take(tag)) is not None]
        stats.take_ms += (time.perf_counter() - t0) * 1e3
        return out

    def _on_chunk(self, record: CaptureRecord, positions: np.ndarray, values: dict[Place, np.ndarray]) -> None:
        owned = None  # the chunk's rows copied once for the background consumers (the step's arrays are recycled)
        for name in record.spec.consumers:
            consumer = self.consumers.get(name)
            sink = getattr(consumer, "on_chunk", None)
            if sink is None:
                continue
            if getattr(consumer, "background", False):
                if owned is None:
                    owned = (positions.copy(), {place: rows.copy() for place, rows in values.items()})
                if not self.background.submit(record.tag, functools.partial(_chunk_call, name, sink, record, *owned)):
                    record.fail(f"consumer {name!r} missed a chunk: its background queue is full "
                                f"({self.background.max_pending} calls waiting)")
                continue
            _chunk_call(name, sink, record, positions, values)

    def _deliver(self, record: CaptureRecord | None) -> None:
        if record is None:
            return
        for name in record.spec.consumers:
            consumer = self.consumers.get(name)
            if consumer is not None and getattr(consumer, "background", False):
                call = functools.partial(self._finish_call, name, consumer, record, self._kept.append)
                if self.background.submit(record.tag, call):
                    continue
                self._failed(name, record, RuntimeError(f"its background queue is full "
                                                        f"({self.background.max_pending} calls waiting)"), self._keep)
                continue
            self._finish_call(name, consumer, record, self._keep)

    def _finish_call(self, name: str, consumer: Any, record: CaptureRecord, keep: Any) -> None:
        """``consumer.on_finish(record)``; a failure is written into the record, which ``keep`` keeps in memory."""
        try:
            if consumer is None:
                raise KeyError(f"consumer {name!r} is not configured in this engine")
            consumer.on_finish(record)
        except Exception as exc:  # noqa: BLE001 - a consumer never aborts generation
            self._failed(name, record, exc, keep)

    def _failed(self, name: str, record: CaptureRecord, exc: BaseException, keep: Any) -> None:
        record.fail(f"consumer {name!r} failed: {exc!r}")
        if "memory" in self.consumers and name != "memory" and "memory" not in record.spec.consumers:
            keep(record)  # keep the data reachable rather than losing it

    def _keep(self, record: CaptureRecord) -> None:
        self.consumers["memory"].on_finish(record)

    def _keep_failed(self) -> None:
        """Records a background consumer failed: into memory, on this thread."""
        while self._kept:
            self._keep(self._kept.popleft())


def _chunk_call(name: str, sink: Any, record: CaptureRecord, positions: np.ndarray,
                values: dict[Place, np.ndarray]) -> None:
    try:
        sink(record, positions, values)
    except Exception as exc:  # noqa: BLE001 - a consumer never aborts generation
        record.fail(f"consumer {name!r} failed on a chunk: {exc!r}")


class NullCaptureDelivery:
    """An engine without capture places: nothing is captured, nothing delivered."""

    collector = None
    engine_places: Collection[Place] = frozenset()
    places: Collection[Place] = frozenset()

    def begin(self, req_id: str, tag: str | None, spec: CaptureSpec | None, prompt_len: int) -> None:
        pass

    def plan(self, ids: tuple[str, ...], query_start_loc: np.ndarray, num_computed: np.ndarray,
             streams: list[StreamSelection]) -> None:
        pass

    def after_forward(self) -> None:
        pass

    def finish(self, req_id: str) -> None:
        pass

    def complete(self) -> None:
        pass

    def take(self, tags: Iterable[str]) -> list[CaptureRecord]:
        return []
