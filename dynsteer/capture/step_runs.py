"""Steady decode steps' rows held together per request, so the spool writer writes each request's run of steps once.

In a steady decode step every capturing request lands one row. Written as it lands, that is one ``pwrite`` (and a
round of Python) per request and step on the spool writer thread: at batch 256 about a millisecond per step of a
thread that takes the GIL back after every system call, beside the engine's own host loop. Instead the writer holds
the steps' arrays (no copy) and, once the run holds :data:`RUN_BYTES` or :data:`MAX_STEPS` steps, the batch
changes, or anything else reaches the writer (a non-batched step, a wait for the queue), writes each request's rows
of the whole run with one ``pwritev`` per place (:class:`~dynsteer.capture.spool.RowList`).

Only the writer thread touches a run (:class:`~dynsteer.capture.spool.SpoolWriter` calls :meth:`BatchedStep.gather`,
:meth:`StepRun.absorb` and :meth:`StepRun.entries`), and the collector waits for the writer (``WRITER.drain``) before
a record leaves, so a held run is always written before its records are read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dynsteer.capture.names import Place
from dynsteer.capture.spool import RowList

if TYPE_CHECKING:
    from dynsteer.capture.step import BatchCapture

# A run holds at most this many bytes of steps' arrays and this many steps. Its requests' last run is written when
# they finish, after their last step: the bound keeps that wait to a few milliseconds.
RUN_BYTES = 16 << 20
MAX_STEPS = 16


@dataclass
class BatchedStep:
    """One steady decode step's landed rows for the records the writer splits: ``batch.split_recs[j]`` owns row
    ``rows[j]`` of ``by_dtype[dtype][place]`` and position ``positions[rows[j]]``."""

    batch: BatchCapture
    rows: np.ndarray  # int64, one per split record
    positions: np.ndarray  # the step's positions, every row
    by_dtype: dict[str, dict[Place, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for arrays in self.by_dtype.values() for a in arrays.values())

    def gather(self) -> StepRun:
        """A run that starts with this step."""
        return StepRun(self)

    def lost(self, exc: BaseException) -> None:
        """The writer failed on this step: its records say their rows are incomplete (never a silent loss)."""
        for rec in self.batch.split_recs:
            rec.fail(f"capture: rows of a decode step were lost in the spool writer ({exc!r})")


class StepRun:
    """Consecutive batched steps of one batch composition (the same records at the same rows)."""

    def __init__(self, first: BatchedStep) -> None:
        self.batch, self.rows = first.batch, first.rows
        self.steps: list[BatchedStep] = [first]
        self.nbytes = first.nbytes

    @property
    def full(self) -> bool:
        return len(self.steps) >= MAX_STEPS or self.nbytes >= RUN_BYTES

    def absorb(self, step: BatchedStep) -> bool:
        """Take ``step`` if it continues this run (same batch composition and rows, room left); False: it does not."""
        if step.batch is not self.batch or self.full or not np.array_equal(step.rows, self.rows):
            return False
        self.steps.append(step)
        self.nbytes += step.nbytes
        return True

    def entries(self) -> Iterator[tuple]:
        """Land each record's rows of the run (positions, and its spool's next chunk, whose write entry is
        yielded); a spool that cannot take a chunk keeps it, and every later one, in memory
        (:meth:`~dynsteer.capture.spool.Spool.take`).

        A generator, so the writer writes each record's chunk as soon as it is landed: its ``pwritev`` releases the
        GIL every record. Landing the whole run first held the GIL for a few hundred records' Python at a time (about
        a millisecond at batch 256), and the engine's thread waited for it in the middle of its step."""
        steps, rows = self.steps, self.rows.tolist()
        positions = np.stack([step.positions[self.rows] for step in steps], axis=1)  # [records, steps]
        for j, rec in enumerate(self.batch.split_recs):
            r = rows[j]
            rec.positions.append(positions[j].copy())
            rec.chunks += 1
            arrays = {place: RowList([step.by_dtype[rec.spec.dtype][place][r] for step in steps])
                      for place in rec.places}
            entry = rec.spool.take(arrays, 0, len(steps), rec.places) if rec.spool is not None else None
            if entry is not None:
                yield entry

    def release(self) -> None:
        """The run's entries are written: it holds no step's arrays any more."""
        self.steps = []

    def lost(self, exc: BaseException) -> None:
        """The writer failed on this run: its records say their rows are incomplete (never a silent loss)."""
        for rec in self.batch.split_recs:
            rec.fail(f"capture: rows of a run of decode steps were lost in the spool writer ({exc!r})")
