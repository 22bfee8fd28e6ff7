"""Per-worker steering state: global spec, named vectors, the request registry, and the per-step row index.

Engine-agnostic: a runner adapter in ``dynsteer.engine.runner`` turns each vLLM step into a :class:`BatchView`, and
this module turns the view into the ``row_index`` the forward pass reads. Every TP rank runs the same code on the same
scheduler output, so all ranks fill identical tables.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from dynsteer.capture.spec import CaptureSpec
from dynsteer.capture.store import CaptureCollector, CaptureRecord
from dynsteer.payload import decode_payload
from dynsteer.spec import ModelShape, SteeringSpec, SteeringValidationError
from dynsteer.steering.compile import EMPTY, RowContent, compile_phase
from dynsteer.steering.tables import RowPool, RowsExhausted, SteeringTables

logger = logging.getLogger("dynsteer")


@dataclass
class BatchView:
    """One step's flattened batch, in the runner's row order.

    Request ``req_ids[i]`` owns tokens ``[query_start_loc[i], query_start_loc[i+1])``; its first token sits at
    absolute position ``num_computed[i]``; tokens at positions ``>= prompt_lens[i]`` are generated (decode) tokens.
    Tokens ``num_tokens..num_tokens_padded`` are padding.
    """

    req_ids: Sequence[str]
    query_start_loc: np.ndarray
    num_computed: np.ndarray
    prompt_lens: np.ndarray
    num_tokens: int
    num_tokens_padded: int


@dataclass
class RequestEntry:
    prompt_len: int
    spec: SteeringSpec | None
    tag: str | None = None
    prefill: RowContent = EMPTY
    decode: RowContent = EMPTY
    rows: tuple[int, int] = (0, 0)
    error: str | None = None


@dataclass
class RuntimeStats:
    steps: int = 0
    admitted: int = 0
    rejected: int = 0
    rows_exhausted: int = 0
    errors: list[str] = field(default_factory=list)


PayloadLookup = Callable[[str], Any]


class SteeringRuntime:
    """Owns the device tables of one model instance in one worker process."""

    def __init__(self, shape: ModelShape, tables: SteeringTables) -> None:
        self.shape = shape
        self.tables = tables
        self.pool = RowPool(tables.num_rows)
        self.named: dict[str, np.ndarray] = {}
        self.global_spec = SteeringSpec()
        self.requests: dict[str, RequestEntry] = {}
        self.stats = RuntimeStats()
        self.inline_forward = False  # set by the engine adapter from DynsteerConfig.forward
        self.capture: CaptureCollector | None = None  # set when the engine has capture places
        self.consumers: dict[str, Any] = {}
        self._host_index = np.zeros(tables.row_index.shape[0], np.int32)
        self._high_water = 0

    # ---- control plane (collective_rpc, between steps) -------------------------------------------------------
    def register_vector(self, name: str, vector: np.ndarray) -> None:
        if vector.shape != (self.shape.hidden_size,):
            raise SteeringValidationError(
                f"vector {name!r}: expected hidden size {self.shape.hidden_size}, got shape {tuple(vector.shape)}")
        if not np.all(np.isfinite(vector)):
            raise SteeringValidationError(f"vector {name!r}: contains NaN or infinite values")
        self.named[name] = np.ascontiguousarray(vector, np.float32)

    def set_global(self, spec: SteeringSpec) -> None:
        """Replace the global spec; every live request's rows are recompiled (global is folded into rows)."""
        for phase in ("prefill", "decode"):
            compile_phase([("global.", spec)], phase, self.shape, self.named)  # validate before touching state
        old_entries = list(self.requests.items())
        for _, entry in old_entries:
            self._release_rows(entry)
        self.global_spec = spec
        for req_id, entry in old_entries:
            self._assign_rows(req_id, entry)

    def global_fingerprint(self) -> str:
        """Hex id of the global prefill configuration ('' when prompts are unsteered globally)."""
        return compile_phase([("global.", self.global_spec)], "prefill", self.shape, self.named).digest.hex()

    # ---- data plane (once per step) ---------------------------------------------------------------------------
    def release(self, req_ids: Iterable[str], finished: bool = True) -> None:
        """Drop finished or preempted requests' rows; a resumed request is admitted again on its next step.

        A preempted request keeps its capture record (its ledger skips the positions it recomputes); a finished one
        hands the record to its consumers.
        """
        for req_id in req_ids:
            entry = self.requests.pop(req_id, None)
            if entry is not None:
                self._release_rows(entry)
            if finished and self.capture is not None:
                self._deliver(self.capture.finish(req_id))

    def admit(self, req_id: str, payload: Any, prompt_len: int) -> RequestEntry:
        spec = tag = None
        capture: CaptureSpec | None = None
        error = None
        if payload is not None:
            try:
                decoded = decode_payload(payload)
                spec, tag, capture = decoded.spec, decoded.tag, decoded.capture
            except SteeringValidationError as exc:
                # Admission in the frontend rejects these; reaching here means a client bypassed it.
                error = f"request {req_id}: {exc}"
                self._record_error(error)
        entry = RequestEntry(prompt_len=prompt_len, spec=spec, tag=tag, error=error)
        self._assign_rows(req_id, entry)
        if self.capture is not None:
            self.capture.begin(req_id, tag, capture, prompt_len)
        self.requests[req_id] = entry
        self.stats.admitted += 1
        return entry

    def plan(self, view: BatchView, payload_of: PayloadLookup) -> None:
        """Fill ``row_index`` for this step (padding and unsteered tokens read row 0)."""
        self.stats.steps += 1
        idx = self._host_index
        qsl = view.query_start_loc
        for i, req_id in enumerate(view.req_ids):
            entry = self.requests.get(req_id)
            if entry is None:
                entry = self.admit(req_id, payload_of(req_id), int(view.prompt_lens[i]))
            start, end = int(qsl[i]), int(qsl[i + 1])
            if self.capture is not None:
                self.capture.plan(req_id, start, int(view.num_computed[i]), end - start)
            pre_row, dec_row = entry.rows
            if pre_row == dec_row:
                idx[start:end] = pre_row
            else:
                first_decode = entry.prompt_len - int(view.num_computed[i])  # tokens before it are prompt tokens
                split = start + min(max(first_decode, 0), end - start)
                idx[start:split] = pre_row
                idx[split:end] = dec_row
        n = view.num_tokens
        upto = max(n, self._high_water, view.num_tokens_padded)
        idx[n:upto] = 0
        self._high_water = n
        self.tables.row_index[:upto].copy_(torch.from_numpy(idx[:upto]), non_blocking=False)

    def after_forward(self) -> None:
        """Called once the step's forward is enqueued: start copying captured rows out."""
        if self.capture is not None:
            self.capture.after_forward()

    def take_captures(self, tags: Iterable[str]) -> list[CaptureRecord]:
        """Finish live records with these tags (the caller knows they are done) and take them from memory."""
        if self.capture is None:
            return []
        tags = set(tags)
        for req_id in [r for r, rec in self.capture.records.items() if rec.tag in tags]:
            self._deliver(self.capture.finish(req_id))
        memory = self.consumers.get("memory")
        return [rec for tag in tags if memory is not None and (rec := memory.take(tag)) is not None]

    def attach_capture(self, collector: CaptureCollector, consumers: dict[str, Any]) -> None:
        self.capture, self.consumers = collector, consumers
        collector.on_chunk = self._on_chunk

    def _on_chunk(self, record: CaptureRecord, positions: np.ndarray, values: dict) -> None:
        for name in record.spec.consumers:
            sink = getattr(self.consumers.get(name), "on_chunk", None)
            if sink is None:
                continue
            try:
                sink(record, positions, values)
            except Exception as exc:  # noqa: BLE001 - a consumer never aborts generation
                record.fail(f"consumer {name!r} failed on a chunk: {exc!r}")

    def _deliver(self, record: CaptureRecord | None) -> None:
        if record is None:
            return
        for name in record.spec.consumers:
            consumer = self.consumers.get(name)
            try:
                if consumer is None:
                    raise KeyError(f"consumer {name!r} is not configured in this engine")
                consumer.on_finish(record)
            except Exception as exc:  # noqa: BLE001 - a consumer never aborts generation
                record.fail(f"consumer {name!r} failed: {exc!r}")
                memory = self.consumers.get("memory")
                if memory is not None and name != "memory" and "memory" not in record.spec.consumers:
                    memory.on_finish(record)  # keep the data reachable rather than losing it

    # ---- internals ----------------------------------------------------------------------------------------------
    def _assign_rows(self, req_id: str, entry: RequestEntry) -> None:
        specs = [("global.", self.global_spec)]
        if entry.spec is not None and entry.error is None:
            specs.append(("request.", entry.spec))
        try:
            contents = [compile_phase(specs, phase, self.shape, self.named) for phase in ("prefill", "decode")]
            rows = self._acquire(contents)
        except (SteeringValidationError, RowsExhausted) as exc:
            # The frontend validates at admission, so this is rare (e.g. a vector name unregistered mid-flight):
            # run the request with global steering only and report it, rather than failing the whole batch.
            if isinstance(exc, RowsExhausted):
                self.stats.rows_exhausted += 1
            entry.error = f"request {req_id}: {exc}"
            self._record_error(entry.error)
            try:
                contents = [compile_phase(specs[:1], phase, self.shape, self.named) for phase in ("prefill", "decode")]
                rows = self._acquire(contents)
            except (SteeringValidationError, RowsExhausted):
                contents, rows = [EMPTY, EMPTY], (0, 0)
        entry.prefill, entry.decode = contents
        entry.rows = rows

    def _record_error(self, message: str) -> None:
        self.stats.rejected += 1
        self.stats.errors = (self.stats.errors + [message])[-32:]
        logger.error("dynsteer: %s; running it with global steering only", message)

    def _acquire(self, contents: list[RowContent]) -> tuple[int, int]:
        acquired: list[RowContent] = []
        try:
            rows = []
            for content in contents:
                row, new = self.pool.acquire(content)
                acquired.append(content)
                if new:
                    self.tables.write_row(row, content)
                rows.append(row)
            return rows[0], rows[1]
        except RowsExhausted:
            for content in acquired:
                self.pool.release(content.digest)
            raise

    def _release_rows(self, entry: RequestEntry) -> None:
        self.pool.release(entry.prefill.digest)
        self.pool.release(entry.decode.digest)
        entry.prefill = entry.decode = EMPTY
        entry.rows = (0, 0)

    def describe(self) -> dict[str, Any]:
        """JSON-friendly state for ``collective_rpc`` callers."""
        return {"shape": self.shape.model_dump(mode="json"), "rows_in_use": self.pool.in_use,
                "rows_total": self.tables.num_rows - 1, "live_requests": len(self.requests),
                "named_vectors": sorted(self.named), "global_empty": self.global_spec.is_empty(),
                "table_bytes": self.tables.nbytes(), "stats": vars(self.stats).copy()}
