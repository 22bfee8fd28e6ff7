"""Slow capture consumers' calls, run in order on one background thread instead of the engine's step.

A ``filesystem`` consumer fsyncs every file it publishes (about 10 ms a record on a virtual machine's disk, far more
on a busy one) and a ``zmq`` consumer copies a whole record out of its spool to send it; called where a request
finishes, either would hold up the next step of every other request. Consumers that set ``background = True`` have
their ``on_chunk`` and ``on_finish`` run here instead, in submission order (a record's chunks before its finish).

The queue is bounded: a call that finds it full is not made, and the record says so (``partial``, naming the
consumer); its data stays reachable in worker memory. Whoever hands a record to the caller first waits for its calls
(:meth:`ConsumerThread.wait`), so the caller sees every delivery's outcome and no call still reads the record's
files when they are handed over.
"""

from __future__ import annotations

import atexit
import collections
import logging
import queue
import threading
from typing import Callable, Iterable

logger = logging.getLogger("dynsteer")

#: calls waiting at most (a record's finish is one; a streaming consumer's chunk is one)
MAX_PENDING = 1024


class ConsumerThread:
    """One daemon thread running queued consumer calls in order; tracks the calls pending per record tag."""

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self.max_pending = max_pending
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._pending: collections.Counter[str] = collections.Counter()  # tag -> calls not yet done
        self._done = threading.Condition()
        self._thread: threading.Thread | None = None
        self.refused = 0  # calls not made: the queue was full

    def submit(self, tag: str, call: Callable[[], None]) -> bool:
        """Queue ``call`` (which reports its own failures) for record ``tag``; False if the queue is full."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="dynsteer-consumers", daemon=True)
            self._thread.start()
            atexit.register(self.drain, 30.0)
        with self._done:
            self._pending[tag] += 1
        try:
            self._queue.put_nowait((tag, call))
        except queue.Full:
            self._finished(tag)
            self.refused += 1
            return False
        return True

    def pending(self, tags: Iterable[str] | None = None) -> int:
        """Calls not yet done, for these record tags (default: all)."""
        with self._done:
            return sum(self._pending.values()) if tags is None else sum(self._pending[t] for t in tags)

    def wait(self, tags: Iterable[str] | None = None, timeout: float | None = None) -> bool:
        """Wait until the calls queued so far for records with these tags (default: all) are done; False on
        timeout."""
        tags = None if tags is None else set(tags)
        with self._done:
            return self._done.wait_for(
                lambda: not (sum(self._pending.values()) if tags is None else any(self._pending[t] for t in tags)),
                timeout)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for every queued call (at interpreter exit too, so queued writes are not lost)."""
        return self.wait(None, timeout)

    def _finished(self, tag: str) -> None:
        with self._done:
            self._pending[tag] -= 1
            if self._pending[tag] <= 0:
                del self._pending[tag]
            self._done.notify_all()

    def _run(self) -> None:
        while True:
            tag, call = self._queue.get()
            try:
                call()
            except BaseException:  # noqa: BLE001 - a call reports its own failures; the thread must live on
                logger.exception("dynsteer capture %s: a background consumer call failed", tag)
            finally:
                del call
                self._finished(tag)
