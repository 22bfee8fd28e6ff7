"""The collector that fills per-request capture records (:mod:`dynsteer.capture.record`) from the forward pass's
staging buffers.

Before each forward that captures, the collector gives the step's selected tokens consecutive rows of the capture
buffers (``slot``, one int32 per token, -1 for the rest, staged through pinned memory); the steering op at each
captured place then writes those tokens' unsteered residuals to their rows (inside CUDA graphs too, as part of the
steering launch), so ``stage[:n]`` holds exactly the step's capture and a step that captures nothing stores nothing.
After the forward, the collector converts those rows to the requested dtype on the compute stream, copies them to
pinned host memory on a side stream (GPU) and moves them into the requests' records once the copy's event has
completed, so the hot path never waits on the device. Per step the host does one conversion, one copy and one host
copy-out per place and dtype.

A steady decode step (one token per request, every capturing request at its next position, selectors ``all`` or
``all_generated``) is planned with array operations over the batch's capturing requests
(:class:`~dynsteer.capture.step.BatchCapture`, rebuilt when the batch or the records change), and its landed rows go
to the spool writer thread as one item (records the memory consumer delivers through a spool, without a streaming
consumer), which holds consecutive such steps together and writes each request's rows once per run of steps
(:mod:`dynsteer.capture.step_runs`): neither the host path nor the writer does per-request work per step. Other steps (prefill chunks, joins, recomputed positions after a preemption,
explicit or prompt selectors) take the per-request path, as do records delivered otherwise.

A finished request's record is retired, not waited for: its last rows may still be on their way from the device
(with asynchronous scheduling the engine learns that a request finished while a later step still runs) and in the
spool writer's queue. The step path moves it aside (:meth:`CaptureCollector.retire`); a later step's poll hands it to
``on_finished`` once its copies have landed and the writer has passed a marker queued after its writes. Taking a
record (the caller knows it is done) or an engine with no request left waits for it instead.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable

import numpy as np
import torch

from dynsteer.capture.names import SAFE_TAG, Place, check_tag, place_from_key, place_key
from dynsteer.capture.record import CaptureRecord, split_step
from dynsteer.capture.select import select_positions
from dynsteer.capture.spec import CaptureSpec
from dynsteer.capture.spool import WRITER, Spool, spool_dir
from dynsteer.capture.step import BF16_BITS, BatchCapture, PendingCopy, StreamSelection
from dynsteer.capture.step_runs import BatchedStep
from dynsteer.device.staging import StagingRing

# The collector, and (re-exported) the names callers have always imported from here.
__all__ = ["CaptureCollector", "CaptureRecord", "MAX_SPOOL_FILES", "Place", "SAFE_TAG", "StreamSelection", "check_tag",
           "place_from_key", "place_key"]

# Spool files (one per place of a capturing request) open at once in one worker; later requests keep rows in memory.
MAX_SPOOL_FILES = 512

# numpy has no bfloat16: bfloat16 captures are rounded to bfloat16 on the device and returned as float32 arrays;
# bfloat16 streams are rounded and copied out as their 16 bits (BF16_BITS), widened by the monitor client.
_DEVICE_DTYPES = {"float32": (torch.float32,), "bfloat16": (torch.bfloat16, torch.float32),
                  "float16": (torch.float16,), BF16_BITS: (torch.bfloat16,)}


class CaptureCollector:
    """Owns staging buffers for the engine's captured places and the live records of one worker."""

    def __init__(self, stages: dict[Place, torch.Tensor], emit: bool = True,
                 engine_places: set[Place] | None = None, spool: bool = True) -> None:
        self.stages = stages
        # Records the memory consumer delivers spool their rows to shared memory as they land (see
        # dynsteer.capture.spool), up to MAX_SPOOL_FILES open files; beyond that, or without /dev/shm, in memory.
        self.spool_dir = spool_dir() if spool else None
        self._spooling: dict[str, int] = {}  # request -> spool files it was counted for at begin
        self.places = set(stages)  # this worker's places (a pipeline stage holds only its own layers)
        self.engine_places = set(stages) if engine_places is None else engine_places  # what requests may ask for
        self.emit = emit
        self.records: dict[str, CaptureRecord] = {}
        self.global_spec: CaptureSpec | None = None
        self._rows: list[int] = []
        self._pos: list[int] = []
        self._segments: list[tuple[CaptureRecord, int, int]] = []
        self._pending: list[PendingCopy] = []
        first = next(iter(stages.values()), None)
        device = first.device if first is not None else torch.device("cpu")
        self._cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device=device) if self._cuda else None
        # Each token's capture row (-1: none), read by the steering ops of every captured place. It reaches the
        # device through pinned slots (a pageable host-to-device copy would block the host until the forward
        # already queued has finished, serialising vLLM's asynchronous scheduling).
        self.slot = torch.full((first.shape[0] if first is not None else 1,), -1, dtype=torch.int32, device=device)
        self._slots = StagingRing(self.slot)
        # the rows whose map the device holds (batch row rows[j] -> capture row j; every other entry -1)
        self._staged: list[int] = []
        # Called with (record, positions, {place: values}) as chunks land, for records with ``streaming`` set.
        self.on_chunk: Callable[[CaptureRecord, np.ndarray, dict[Place, np.ndarray]], None] | None = None
        # Called with (selection, {place: rows}) once a stream's rows of a step have landed (async tier).
        self.on_stream: Callable[[StreamSelection, dict[Place, np.ndarray]], None] | None = None
        self._streams: list[StreamSelection] = []
        self.streams: Callable[[CaptureSpec], bool] = lambda spec: False
        self._version = 0  # bumped when a record begins (finish drops the batch arrays instead)
        self._batch: BatchCapture | None = None  # the last batch composition's capturing requests
        self._step_batch: tuple[BatchCapture, int] | None = None  # this step's batched rows
        self._jobs = 0  # split jobs handed to the spool writer since finish last waited for it
        # Finished requests' records on their way out: [record, copies queued when it finished, the writer's marker
        # (None until queued)]. Handed to on_finished from poll or complete; finish returns its record instead.
        self._retiring: dict[int, list] = {}  # id(record) -> entry, in retiring order
        self._queued = self._landed = 0  # PendingCopy queued and landed so far
        self.on_finished: Callable[[CaptureRecord], None] | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def begin(self, req_id: str, tag: str | None, spec: CaptureSpec | None, prompt_len: int) -> None:
        spec = spec or self.global_spec
        if spec is None or not self.emit or req_id in self.records:
            return
        rec = CaptureRecord(tag=tag or req_id, req_id=req_id, spec=spec, prompt_len=prompt_len,
                            streaming=self.streams(spec))
        rec.places = tuple(p for p in rec.places if p in self.places)
        if not rec.places:  # another pipeline stage holds every place this request asks for
            return
        if (self.spool_dir is not None and "memory" in spec.consumers
                and self.spool_files + len(rec.places) <= MAX_SPOOL_FILES):
            rec.spool = Spool(self.spool_dir)
            self._spooling[req_id] = len(rec.places)
            rec.split_off = not rec.streaming
        self.records[req_id] = rec
        self._version += 1

    def plan(self, req_ids: list[str] | tuple[str, ...], query_start: np.ndarray, num_computed: np.ndarray,
             streams: list[StreamSelection] = ()) -> None:
        """Select this step's rows of every capturing request in the batch (request ``i`` owns batch rows
        ``query_start[i]:query_start[i+1]``, its first at absolute position ``num_computed[i]``), and of every
        stream (a token that a record and streams select takes one capture row)."""
        rows, pos, segments = self._rows, self._pos, self._segments
        if not self._plan_batched(req_ids, query_start, num_computed, rows, pos):
            self._plan_each(req_ids, query_start, num_computed, rows, pos, segments)
        if streams:
            self._plan_streams(streams, rows, pos)
        self._stage_slots(rows)

    def _batch_of(self, req_ids: list[str] | tuple[str, ...]) -> BatchCapture:
        """The capturing requests of this batch composition (rebuilt when the batch or the records change)."""
        b = self._batch
        req_ids = req_ids if isinstance(req_ids, tuple) else tuple(req_ids)
        if b is not None and b.version == self._version and b.ids == req_ids:
            return b
        if b is not None:
            b.sync()
        idx, recs = [], []
        for i, req_id in enumerate(req_ids):
            rec = self.records.get(req_id)
            if rec is not None:
                idx.append(i)
                recs.append(rec)
                rec.ledger.start_run()
        split = [i for i, rec in enumerate(recs) if rec.split_off]
        b = self._batch = BatchCapture(
            ids=req_ids, version=self._version, idx=np.asarray(idx, np.int64), recs=recs,
            high=np.asarray([rec.ledger.high for rec in recs], np.int64),
            generated_only=np.asarray([rec.selector == "all_generated" for rec in recs], bool),
            prompt_len=np.asarray([rec.prompt_len for rec in recs], np.int64),
            batched=all(rec.selector in ("all", "all_generated") for rec in recs),
            split=np.asarray(split, np.int64), split_recs=[recs[i] for i in split],
            main=[(i, rec) for i, rec in enumerate(recs) if not rec.split_off],
            wanted={(place, rec.spec.dtype) for rec in recs for place in rec.places})
        return b

    def _plan_batched(self, req_ids: list[str] | tuple[str, ...], query_start: np.ndarray,
                      num_computed: np.ndarray, rows: list[int], pos: list[int]) -> bool:
        """A decode step (one token per request) in which every capturing request takes its next position (or none
        is in the batch): the rows and positions as arrays, no per-request Python. False (nothing done) for any
        other step."""
        n = len(req_ids)
        if not self.records or self._step_batch is not None or int(query_start[n]) - int(query_start[0]) != n:
            return False
        b = self._batch_of(req_ids)
        if not b.recs:  # nobody in this batch captures (records live elsewhere, e.g. preempted): nothing to plan
            return True
        if not b.batched:
            return False
        first = np.asarray(num_computed[:n], np.int64)[b.idx]
        if not (first == b.high + 1).all() or not (first[b.generated_only] >= b.prompt_len[b.generated_only]).all():
            return False
        tokens = np.asarray(query_start[:n], np.int64)[b.idx]
        self._step_batch = (b, len(pos))
        rows.extend(tokens.tolist())
        pos.extend(first.tolist())
        b.high[:] = first
        b.dirty = True
        return True

    def _plan_each(self, req_ids: list[str] | tuple[str, ...], query_start: np.ndarray, num_computed: np.ndarray,
                   rows: list[int], pos: list[int], segments: list[tuple[CaptureRecord, int, int]]) -> None:
        """Any step (prefill chunks, recomputed positions, explicit selectors), request by request."""
        if self._batch is not None:  # the ledgers move here: the arrays are rebuilt from them next time
            self._batch.sync()
            self._batch = None
        records = self.records
        for i, req_id in enumerate(req_ids):
            rec = records.get(req_id)
            if rec is None:
                continue
            start, first = int(query_start[i]), int(num_computed[i])
            count = int(query_start[i + 1]) - start
            before = len(pos)
            if count == 1 and first > rec.ledger.high and _decode_selects(rec, first):
                rows.append(start)  # a decode step of a request that never saw this position: no numpy work
                pos.append(first)
                rec.ledger.mark(first)
            elif count != 1 or first <= rec.ledger.high:
                fresh = rec.ledger.take(select_positions(rec.selector, first, count, rec.prompt_len))
                if fresh.size:
                    rows.extend((start + (fresh - first)).tolist())
                    pos.extend(fresh.tolist())
            if len(pos) > before:
                segments.append((rec, before, len(pos)))

    def _plan_streams(self, streams: list[StreamSelection], rows: list[int], pos: list[int]) -> None:
        """Give each stream's tokens capture rows, reusing the rows of tokens that records (or earlier streams)
        already took; vectorised per stream."""
        high = max([int(sel.tokens.max()) + 1 for sel in streams if sel.tokens.size] + [max(rows) + 1 if rows else 0])
        row_of = np.full(high, -1, np.int64)
        if rows:
            row_of[np.asarray(rows, np.int64)] = np.arange(len(rows))
        for sel in streams:
            fresh = sel.tokens[row_of[sel.tokens] < 0]
            if fresh.size:
                row_of[fresh] = np.arange(len(rows), len(rows) + fresh.size)
                rows.extend(fresh.tolist())
                pos.extend(sel.positions[np.searchsorted(sel.tokens, fresh)].tolist())
            sel.rows = row_of[sel.tokens]
            self._streams.append(sel)

    @property
    def spool_files(self) -> int:
        """Spool files counted against :data:`MAX_SPOOL_FILES`: those of the live records that were given a spool."""
        return sum(self._spooling.values())

    @property
    def needs_plan(self) -> bool:
        """Whether this step must be planned: a request captures, or the last step's slots must be cleared."""
        return bool(self.records) or bool(self._staged)

    def _stage_slots(self, rows: list[int]) -> None:
        """Give batch row ``rows[j]`` capture row ``j`` (every other token: -1), before the forward reads it.

        After every upload the device holds exactly the staged rows' map (each upload clears up to the last one's
        highest row), and only this method writes it: a steady decode step, whose rows are the step before's,
        stages nothing."""
        if rows == self._staged:
            return
        upto = max(rows + self._staged) + 1
        buf = self._slots.next()
        buf[:upto] = -1
        buf[rows] = np.arange(len(rows), dtype=np.int32)
        self._slots.copy_to(upto)
        self._staged = list(rows)

    def after_forward(self) -> None:
        """Convert the step's captured rows (compute stream) and start their copy to host (side stream)."""
        if not self._segments and not self._streams and self._step_batch is None:
            self.poll()
            return
        n, positions, segments = len(self._rows), np.array(self._pos, dtype=np.int64), self._segments
        streams, batch = self._streams, self._step_batch
        self._rows, self._pos, self._segments, self._streams, self._step_batch = [], [], [], [], None
        specs = {id(rec.spec): rec for rec, _, _ in segments}.values()  # requests sharing a payload share its spec
        wanted = {(place, rec.spec.dtype) for rec in specs for place in rec.places}
        wanted |= {(place, sel.dtype) for sel in streams for place in sel.places}
        if batch is not None:
            wanted |= batch[0].wanted
        gathered: dict[tuple[Place, str], torch.Tensor] = {}
        for place, dtype in wanted:
            rows_at = self.stages[place][:n]
            t = rows_at
            for cast in _DEVICE_DTYPES[dtype]:
                t = t.to(cast)
            # A fresh tensor on the compute stream: the next forward overwrites the buffer's rows.
            t = rows_at.clone() if t is rows_at else t
            gathered[(place, dtype)] = t.view(torch.int16) if dtype == BF16_BITS else t
        if self._cuda:
            done = torch.cuda.Event()
            self._side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._side):
                host = {k: torch.empty(g.shape, dtype=g.dtype, device="cpu", pin_memory=True).copy_(g, non_blocking=True)
                        for k, g in gathered.items()}
                for g in gathered.values():
                    g.record_stream(self._side)
                done.record(self._side)
            self._pending.append(PendingCopy(done, host, positions, segments, streams, *(batch or (None, 0))))
        else:  # fresh tensors already: the staging buffers may be overwritten by the next step
            self._pending.append(PendingCopy(None, gathered, positions, segments, streams, *(batch or (None, 0))))
        self._queued += 1
        self.poll()

    def poll(self, block: bool = False) -> None:
        """Move completed copies into their records (``block``: wait for all), then hand out retired records whose
        rows are all written."""
        self._land(block)
        if self._retiring:
            self._advance(block=False)

    def _land(self, block: bool) -> None:
        while self._pending:
            pend = self._pending[0]
            if pend.event is not None and not pend.event.query():
                if not block:
                    return  # copies complete in order (one side stream): later ones are not done either
                pend.event.synchronize()
            self._pending.pop(0)
            self._landed += 1
            # Copied out of pinned memory at once, so the caching host allocator recycles the pinned blocks
            # instead of growing with everything captured until the requests finish.
            # Only rows that stay referenced (records without a spool, streams) are copied; a spool's write reads the
            # pinned rows directly, and they return to the allocator with this step's tensors.
            # Records the writer thread splits (split_off) are handed over as one job per step: the host path
            # does no per-request work for them.
            batch, base = pend.batch, pend.batch_base
            split = [seg for seg in pend.segments if seg[0].split_off]
            main = [seg for seg in pend.segments if not seg[0].split_off]
            if batch is not None:
                main += [(rec, base + i, base + i + 1) for i, rec in batch.main]
            keep = bool(pend.streams) or any(not rec.spooled for rec, _, _ in main)
            by_dtype: dict[str, dict[Place, np.ndarray]] = {}
            for (place, dtype), t in pend.host.items():
                arr = t.numpy()
                by_dtype.setdefault(dtype, {})[place] = arr.copy() if self._cuda and keep else arr
            if split:
                WRITER.submit(functools.partial(split_step, pend.positions, by_dtype, [seg[0] for seg in split],
                                                [seg[1] for seg in split], [seg[2] for seg in split]))
                self._jobs += 1
            if batch is not None and batch.split_recs:  # held with the next steps, written per request once per run
                WRITER.submit(BatchedStep(batch, base + batch.split, pend.positions, by_dtype))
                self._jobs += 1
            spooled: list = []  # the step's spool writes, handed to the writer thread as one item
            try:
                for rec, s, e in main:
                    if self.records.get(rec.req_id) is not rec and id(rec) not in self._retiring:
                        continue  # handed out meanwhile
                    arrays = by_dtype[rec.spec.dtype]
                    rec.add_chunk(pend.positions[s:e], arrays, s, e, spooled)
                    if rec.streaming and self.on_chunk is not None:
                        self.on_chunk(rec, pend.positions[s:e], {place: arrays[place][s:e] for place in rec.places})
            finally:  # a reserved chunk must reach the writer, or its spool's flush would wait for it forever
                WRITER.submit([entry for entry in spooled if entry is not None])
            for sel in pend.streams:
                if self.on_stream is not None:
                    rows, arrays = sel.rows, by_dtype[sel.dtype]
                    # the common case (only streams capture): consecutive rows, sent as a view without a copy
                    contiguous = rows.size and bool((np.diff(rows) == 1).all())
                    pick = slice(int(rows[0]), int(rows[0]) + rows.size) if contiguous else rows
                    self.on_stream(sel, {place: arrays[place][pick] for place in sel.places})

    def retire(self, req_id: str) -> None:
        """The request is done: its record takes no more rows and goes to ``on_finished`` once its rows are all
        landed and written (a later :meth:`poll`, or :meth:`complete`). Never waits."""
        rec = self.records.pop(req_id, None)
        if rec is None:
            return
        if self._batch is not None:  # it holds its records: drop it, or a finished one would outlive delivery
            self._batch.sync()
            self._batch = None
        self._retiring[id(rec)] = [rec, self._queued, None]

    @property
    def retiring(self) -> list[CaptureRecord]:
        """Retired records not yet handed out."""
        return [entry[0] for entry in self._retiring.values()]

    def complete(self, tags: set[str] | None = None) -> None:
        """Wait for the retired records with these tags (default: all) and hand them to ``on_finished``."""
        if any(tags is None or entry[0].tag in tags for entry in self._retiring.values()):
            self._land(block=True)
            self._advance(block=True, tags=tags)

    def _advance(self, block: bool, tags: set[str] | None = None) -> None:
        """Hand out retired records whose copies have landed and whose writes the spool writer has passed (``block``:
        wait for the writer, for the records with ``tags``)."""
        marker = None  # one for every record it concerns: each round trip through the writer's queue costs a switch
        for key, entry in list(self._retiring.items()):
            rec, after, written = entry
            if after > self._landed:
                continue  # a copy holding its rows has not landed (never so once _land(block=True) ran)
            if written is None and (rec.spool is not None or rec.split_off):
                # the writer runs its queue in order: once it sets this, every write and split job of the record's
                # landed steps is done (a held run of batched steps is written before any other item)
                if marker is None:
                    marker = threading.Event()
                    WRITER.submit(functools.partial(_mark_written, marker))
                entry[2] = written = marker
            if written is not None and not written.is_set():
                if not block or (tags is not None and rec.tag not in tags):
                    continue
                written.wait()
            del self._retiring[key]
            self._seal(rec)
            if self.on_finished is not None:
                self.on_finished(rec)

    def _seal(self, rec: CaptureRecord) -> None:
        self._spooling.pop(rec.req_id, None)  # counted at begin, whatever became of the spool since
        rec.settle()  # its queued writes done (or, failed, its rows in memory)
        if rec.spool is not None:
            rec.spool.seal()  # complete: its files need no descriptor until delivery

    def finish(self, req_id: str) -> CaptureRecord | None:
        """The request is done: wait for its copies and writes and return the record (None if it captured nothing);
        it does not go to ``on_finished``."""
        self.retire(req_id)
        key = next((k for k, e in self._retiring.items() if e[0].req_id == req_id), None)
        if key is None:
            return None
        self._land(block=True)
        if self._jobs:  # the writer thread has split every landed step into the records
            WRITER.drain()
            self._jobs = 0
        rec = self._retiring.pop(key)[0]
        self._seal(rec)
        return rec



def _mark_written(event: threading.Event) -> tuple:
    """A spool writer job: everything queued before it is written."""
    event.set()
    return ()


def _decode_selects(rec: CaptureRecord, pos: int) -> bool:
    """Whether the record's selector keeps a decode token at ``pos`` (the one-token case of ``select_positions``,
    spelled with scalars: it runs once per capturing request and step)."""
    selector, prompt_len = rec.selector, rec.prompt_len
    if selector == "all_generated":
        return pos >= prompt_len
    if selector == "all":
        return True
    if selector == "all_prompt":
        return pos < prompt_len
    if selector == "last_prompt":
        return pos == prompt_len - 1
    return pos in rec.explicit
