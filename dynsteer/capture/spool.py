"""A capturing request's rows written to shared memory as they land, so the caller receives them without a copy.

Without a spool, a request's rows stay in the worker as the steps' arrays and are copied into one delivery file
when the caller takes them: for 64 requests capturing 127 tokens of a 4096-wide layer that is 133 MB copied (and
its pages allocated) after the last step, while the engine waits (~100-180 ms on a CPU core, 15-25 % of such a
call). A spool instead appends each landed chunk to one file per place in ``/dev/shm`` (``os.pwrite``: the kernel
copies the rows into the file's pages while the GPU runs later steps), so when the request finishes its arrays
already lie in their final layout and delivery renames the files to the caller's name: nothing is copied.
The writes run on one background thread per process (:class:`SpoolWriter`, in order; the copies release the GIL), so
a decode step's host path only queues them: writing into fresh tmpfs pages costs ~0.5-1.5 ms per MB on a virtual
machine's core, which inline would lengthen every capturing step.

Files are named like delivery files (``dynsteer-capture-<pid namespace>-<pid>-<uuid>``) with this worker's pid until
they are handed over, so :func:`dynsteer.capture.result.sweep_shared` removes them if the worker dies; a spool that
is dropped without being handed over (request aborted, record evicted) unlinks its files when it is collected.
A full ``/dev/shm`` (``ENOSPC``; Docker's default is 64 MB) is an ``OSError`` from the write, never a ``SIGBUS``:
the record then keeps its rows in worker memory instead (``CaptureRecord``), losing nothing.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import uuid
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Callable, Hashable

import numpy as np

logger = logging.getLogger("dynsteer")
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "dynsteer-capture-"


_NAMESPACE: tuple[int, str] = (-1, "")  # (pid, namespace): a process never changes namespace; a child may differ


def pid_namespace() -> str:
    """This process's pid namespace (an inode number): a pid means that process only within it."""
    global _NAMESPACE
    pid = os.getpid()
    if _NAMESPACE[0] != pid:
        try:
            _NAMESPACE = (pid, str(os.stat("/proc/self/ns/pid").st_ino))
        except OSError:
            _NAMESPACE = (pid, "0")
    return _NAMESPACE[1]


class _Unique:
    """Name parts no other live file of this host shares: this process's pid, a random part drawn once per
    process, and a counter (a uuid4 per file reads the OS's random source each time, ~3 µs, hundreds per take)."""

    def __init__(self) -> None:
        self.pid, self.base, self.count = -1, "", itertools.count()

    def next(self) -> str:
        pid = os.getpid()
        if pid != self.pid:  # first use, or a forked child: its own random part and counter
            self.pid, self.base, self.count = pid, uuid.uuid4().hex[:16], itertools.count()
        return f"{pid:x}x{self.base}x{next(self.count):x}"


_UNIQUE = _Unique()


def shm_name(namespace: str, pid: int) -> str:
    """A fresh delivery file name, tied to process ``pid`` of pid namespace ``namespace``."""
    return f"{SHM_PREFIX}{namespace}-{pid}-{_UNIQUE.next()}"


def spool_dir() -> Path | None:
    """Where spools go: :data:`SHM_DIR` if this process can create files there, else None (no spooling)."""
    return SHM_DIR if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK | os.X_OK) else None


def _remove(fds: list[int], paths: list[Path]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    for path in paths:
        path.unlink(missing_ok=True)


class SpoolError(OSError):
    """A spool's write failed: ``written`` rows lie in its files, ``unwritten`` chunks (``{place: rows}``, in
    order) never reached them."""

    def __init__(self, cause: BaseException, written: int, unwritten: list[dict[Hashable, np.ndarray]]) -> None:
        super().__init__(str(cause))
        self.cause, self.written, self.unwritten = cause, written, unwritten


class RowList:
    """Rows of one place that lie in separate arrays (a request's row of consecutive steps): the writer writes them
    with one ``pwritev``, never copying them into one array. Shaped like the ``[rows, hidden]`` arrays a spool
    takes; slicing it stacks the rows (a copy)."""

    ndim = 2

    def __init__(self, rows: list[np.ndarray]) -> None:
        self.rows = rows
        self.dtype = rows[0].dtype
        self.shape = (len(rows), rows[0].shape[-1])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, span: slice) -> np.ndarray:
        return np.stack(self.rows[span])


class SpoolWriter:
    """One daemon thread writing every spool's chunks in submission order (so a spool's file grows in order)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """Fresh state (also in a forked child: the parent's thread does not exist there, and its queue and lock
        are the parent's)."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.landed = threading.Condition()  # notified after each queue item

    def submit(self, entries: list[tuple] | Callable[[], list[tuple]] | Any) -> None:
        """Queue the chunks :meth:`Spool.reserve` counted (one step's chunks of many spools: one queue item), a
        job that returns or yields such entries when the thread reaches it (it reserves them there: a capture
        step's split per request runs off the host path; see ``CaptureCollector``), or a batched decode step
        (:class:`~dynsteer.capture.step_runs.BatchedStep`), held with the steps after it and written per request
        once per run."""
        if not entries:
            return
        if self._thread is None or not self._thread.is_alive():
            with self._lock:  # started lazily
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._run, name="dynsteer-spool", daemon=True)
                    self._thread.start()
        self._queue.put(entries)

    def backlog(self) -> int:
        """Queue items (steps' chunks or split jobs) not yet taken by the writer thread."""
        return self._queue.qsize()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is written (True) or ``timeout`` seconds pass (False)."""
        if self._thread is None or not self._thread.is_alive():
            return True
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def _run(self) -> None:
        held = None  # a run of batched steps (dynsteer.capture.step_runs) not written yet
        while True:
            item = self._queue.get()
            if hasattr(item, "gather"):  # a batched decode step: joins the held run, or ends it and starts one
                try:
                    if held is not None and not held.absorb(item):
                        held = self._write_run(held)
                    if held is None:
                        held = item.gather()
                    if held.full:
                        held = self._write_run(held)
                except BaseException as exc:  # noqa: BLE001 - the thread must live on; the records say what they lost
                    logger.exception("dynsteer spool writer: a batched step failed")
                    for lost in (held, item):
                        if lost is not None:
                            lost.lost(exc)
                    held = None
                del item
                continue
            if held is not None:  # anything else comes after the held run's rows (order per spool, drain waits)
                held = self._write_run(held)
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:  # a job returns its entries, or yields them (landing each record just before its write)
                self._write(item() if callable(item) else item)
            except BaseException:  # noqa: BLE001 - a job reports its own failures; the thread must live on
                logger.exception("dynsteer spool writer: a job failed")
            # while waiting for the next item, hold no spool alive (its finalizer unlinks its files)
            del item

    def _write_run(self, run: Any) -> None:  # a StepRun (dynsteer.capture.step_runs imports this module)
        try:
            self._write(run.entries())
        except BaseException as exc:  # noqa: BLE001 - the thread must live on; the records say what they lost
            logger.exception("dynsteer spool writer: a run of batched steps failed")
            run.lost(exc)
        finally:
            run.release()

    def _write(self, entries: Iterable[tuple]) -> None:
        try:
            for spool, arrays, start, end, targets in entries:
                # Each counter below is written by this thread only (the queued count by whoever reserves the
                # spool's chunks: the host path, or this thread for a job's), so no lock per chunk: waiters are
                # woken once per queue item, under `landed`.
                failed = spool._error is not None  # nothing after a failed chunk is written
                if not failed:
                    try:
                        for place, fd, offset in targets:
                            src = arrays[place]
                            if isinstance(src, RowList):  # one system call for rows that lie apart
                                row = src.rows[0].nbytes
                                done = os.pwritev(fd, src.rows[start:end], offset)
                                if done == (end - start) * row:
                                    continue
                                data = src[start:end]  # short: the rest from one stacked copy
                            else:
                                data = np.ascontiguousarray(src[start:end])  # row slices: already so
                                done = os.pwrite(fd, data, offset)
                            if done < data.nbytes:  # pwrite may write less than asked
                                view = memoryview(data).cast("B")
                                while done < len(view):
                                    done += os.pwrite(fd, view[done:], offset + done)
                        spool._written += end - start
                    except BaseException as exc:  # noqa: BLE001 - handed to the spool's owner at flush
                        spool._error, failed = exc, True
                if failed:
                    spool._unwritten.append({p: arrays[p][start:end] for p, _, _ in targets})
                spool._landed += 1
        finally:  # an entry generator that fails mid-way (StepRun.entries) must still wake the waiters
            with self.landed:
                self.landed.notify_all()


WRITER = SpoolWriter()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=WRITER._reset)


class Spool:
    """Rows of one request, one append-only file per place (``[rows, hidden]`` in landing order, row-major).

    Its chunks are written by the process's :data:`WRITER`.

    Args:
        directory: where the files go (a tmpfs, normally :data:`SHM_DIR`).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.rows = 0  # rows appended to every file (places are written together), written or still queued
        self._files: dict[Hashable, tuple[int, Path, np.dtype, int]] = {}  # place -> (fd, path, dtype, hidden)
        self._fds: list[int] = []
        self._paths: list[Path] = []
        # Write-back state: _queued is written by the host path only, the rest by the writer thread only.
        self._queued = 0
        self._landed = 0
        self._written = 0
        self._error: BaseException | None = None
        self._unwritten: list[dict[Hashable, np.ndarray]] = []
        # Unlinks the files if the spool is dropped without hand_over (abort, eviction, a crash in a consumer).
        self._finalizer = weakref.finalize(self, _remove, self._fds, self._paths)

    def append(self, arrays: dict[Hashable, np.ndarray]) -> None:
        """Queue one chunk: the same number of rows for every place (held by reference until written). Raises
        ValueError for rows that do not match the places' layout and OSError if a file cannot be created (the
        chunk is then not counted); write errors surface at :meth:`flush`."""
        sizes = {len(rows) for rows in arrays.values()}
        if len(sizes) > 1:
            raise ValueError(f"spool: places have different row counts {sorted(sizes)}")
        entry = self.reserve(arrays, 0, sizes.pop() if sizes else 0, tuple(arrays))
        if entry is not None:
            WRITER.submit([entry])

    def reserve(self, arrays: Mapping[Hashable, np.ndarray], start: int, end: int,
                places: tuple[Hashable, ...]) -> tuple | None:
        """Count rows ``[start, end)`` of ``arrays[place]`` for every place as this spool's next chunk and return the
        writer's entry for it (None for no rows), to :meth:`SpoolWriter.submit` with others: the host path pays a
        few attribute reads per chunk; the writer slices and copies. Raises ValueError for rows that do not match
        a place's layout and OSError if a file cannot be created (nothing is counted then)."""
        if end <= start:
            return None
        targets = []
        for place in places:
            rows = arrays[place]
            entry = self._files.get(place)
            if entry is None:
                entry = self._open(place, rows)
            fd, _, dtype, hidden = entry
            if rows.dtype != dtype or rows.ndim != 2 or rows.shape[1] != hidden or end > len(rows):
                raise ValueError(f"spool: place {place}: rows {rows.dtype} {rows.shape} do not match "
                                 f"{dtype} [*, {hidden}] (rows {start}:{end})")
            targets.append((place, fd, self.rows * hidden * dtype.itemsize))
        self._queued += 1
        self.rows += end - start
        return self, arrays, start, end, targets

    def take(self, arrays: Mapping[Hashable, np.ndarray], start: int, end: int,
             places: tuple[Hashable, ...]) -> tuple | None:
        """Writer thread: :meth:`reserve` rows ``[start, end)`` as the next chunk and return its entry, or, once this
        spool has failed (now or before), keep them in memory for the owner (``_unwritten``, found at flush) and
        return None: nothing after a failed chunk is written."""
        if self._error is None:
            try:
                return self.reserve(arrays, start, end, places)
            except (OSError, ValueError) as exc:
                self._error = exc
        self._unwritten.append({place: arrays[place][start:end] for place in places})
        return None

    def flush(self) -> None:
        """Wait until every queued chunk is written. Raises :class:`SpoolError` if one failed (nothing after a
        failed chunk is written)."""
        self._idle()
        if self._error is not None:
            raise SpoolError(self._error, self._written, list(self._unwritten))

    def _open(self, place: Hashable, rows: np.ndarray) -> tuple[int, Path, np.dtype, int]:
        path = self.directory / shm_name(pid_namespace(), os.getpid())
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._fds.append(fd)
        self._paths.append(path)
        entry = self._files[place] = (fd, path, rows.dtype, rows.shape[1])
        return entry

    def _idle(self) -> None:
        """Wait until the writer holds no chunk of this spool (before its descriptors close: a closed number could
        be reused by another file while a write is in flight)."""
        landed = WRITER.landed
        with landed:
            landed.wait_for(lambda: self._landed == self._queued)

    def seal(self) -> None:
        """No more rows: close the descriptors (reads and hand-over go by name), so a finished record waiting to be
        taken holds no file descriptor."""
        self._idle()
        for place, (fd, path, dtype, hidden) in self._files.items():
            self._files[place] = (-1, path, dtype, hidden)
        _remove(self._fds, [])
        self._fds.clear()

    def read(self, place: Hashable, rows: int | None = None) -> np.ndarray:
        """A copy of one place's first ``rows`` rows (default all), once queued writes are done."""
        self._idle()
        fd, path, dtype, hidden = self._files[place]
        out = np.empty((self.rows if rows is None else rows, hidden), dtype)
        own = fd < 0
        if own:
            fd = os.open(path, os.O_RDONLY)
        try:
            view, done = memoryview(out).cast("B"), 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], done)
                if got <= 0:
                    raise OSError(f"spool: {place}: file shorter than its {self.rows} rows")
                done += got
        finally:
            if own:
                os.close(fd)
        return out

    def layout(self, place: Hashable) -> tuple[np.dtype, int] | None:
        """``(dtype, hidden)`` of a place that has rows, else None."""
        entry = self._files.get(place)
        return None if entry is None else (entry[2], entry[3])

    def hand_over(self, namespace: str, pid: int) -> dict[Hashable, str]:
        """Close the files and rename them to delivery files of process ``pid`` (the caller that maps and unlinks
        them; swept once it is gone); the spool forgets them. Raises :class:`SpoolError` if a queued write failed
        (a spool whose writes all succeeded holds exactly its counted rows: each chunk is written whole, at its
        reserved offset)."""
        self.flush()
        out = {}
        folder = str(self.directory)
        for place, (fd, path, dtype, hidden) in self._files.items():
            target = os.path.join(folder, shm_name(namespace, pid))
            os.rename(path, target)
            out[place] = target
        self._finalizer.detach()
        _remove(self._fds, [])
        self._files.clear()
        self._fds.clear()
        self._paths.clear()
        return out

    def discard(self) -> None:
        """Close and unlink the files now (once queued writes are done)."""
        self._idle()
        self._finalizer()
        self._files.clear()
