"""Per-request capture records, and the collector that fills them from the forward pass's staging buffers.

The forward writes the unsteered residual of every token at each captured place into a persistent staging buffer
(inside CUDA graphs too). After the forward, the collector gathers just the selected rows on the compute stream,
copies them to pinned host memory on a side stream (GPU) and hands them to the request's record once the copy's event
has completed, so the hot path never waits on the host.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dynsteer.capture.select import PositionLedger, select_positions
from dynsteer.capture.spec import CaptureSpec
from dynsteer.spec import Site

logger = logging.getLogger("dynsteer")
Place = tuple[int, Site]
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CaptureRecord:
    """Everything captured for one request. ``status`` is ``ok``, ``partial`` (a consumer failed) or ``error``."""

    tag: str
    req_id: str
    spec: CaptureSpec
    prompt_len: int
    positions: list[np.ndarray] = field(default_factory=list)
    values: dict[Place, list[np.ndarray]] = field(default_factory=dict)
    status: str = "ok"
    errors: list[str] = field(default_factory=list)
    ledger: PositionLedger = field(default_factory=PositionLedger)
    chunks: int = 0

    def arrays(self) -> tuple[np.ndarray, dict[Place, np.ndarray]]:
        """Positions (sorted) and one ``[n, hidden]`` array per place, rows in position order."""
        pos = np.concatenate(self.positions) if self.positions else np.zeros(0, np.int64)
        order = np.argsort(pos, kind="stable")
        out = {}
        for place, parts in self.values.items():
            out[place] = np.concatenate(parts)[order] if parts else np.zeros((0, 0), np.float32)
        return pos[order], out

    def fail(self, message: str, status: str = "partial") -> None:
        self.status = status if self.status == "ok" else self.status
        self.errors.append(message)
        logger.error("dynsteer capture %s: %s", self.tag, message)


@dataclass
class _Pending:
    event: Any
    host: dict[Place, torch.Tensor]
    segments: list[tuple[str, int, int, np.ndarray]]  # (req_id, start, end, positions)


class CaptureCollector:
    """Owns staging buffers for the engine's captured places and the live records of one worker."""

    def __init__(self, stages: dict[Place, torch.Tensor], emit: bool = True) -> None:
        self.stages = stages
        self.places = set(stages)
        self.emit = emit
        self.records: dict[str, CaptureRecord] = {}
        self.global_spec: CaptureSpec | None = None
        self._step: list[tuple[str, np.ndarray, np.ndarray]] = []
        self._pending: list[_Pending] = []
        device = next(iter(stages.values())).device if stages else torch.device("cpu")
        self._cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device=device) if self._cuda else None
        # Called with (record, positions, {place: values}) as chunks land (streaming consumers such as per_file).
        self.on_chunk: Any = None

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def begin(self, req_id: str, tag: str | None, spec: CaptureSpec | None, prompt_len: int) -> None:
        spec = spec or self.global_spec
        if spec is None or not self.emit or req_id in self.records:
            return
        self.records[req_id] = CaptureRecord(tag=tag or req_id, req_id=req_id, spec=spec, prompt_len=prompt_len,
                                             values={p: [] for p in spec.places()})

    def plan(self, req_id: str, batch_start: int, first_pos: int, count: int) -> None:
        """Select this step's rows of one request (called while the runtime walks the batch)."""
        rec = self.records.get(req_id)
        if rec is None:
            return
        wanted = select_positions(rec.spec.positions, first_pos, count, rec.prompt_len)
        fresh = rec.ledger.take(wanted)
        if fresh.size:
            self._step.append((req_id, batch_start + (fresh - first_pos), fresh))

    def after_forward(self) -> None:
        """Gather the selected rows (compute stream) and start their copy to host (side stream)."""
        if not self._step:
            self.poll()
            return
        step, self._step = self._step, []
        rows = np.concatenate([r for _, r, _ in step])
        places = {p for req_id, _, _ in step for p in self.records[req_id].spec.places()}
        idx = torch.from_numpy(rows).to(next(iter(self.stages.values())).device, non_blocking=True)
        gathered = {p: self.stages[p].index_select(0, idx) for p in places}
        segments, start = [], 0
        for req_id, r, pos in step:
            segments.append((req_id, start, start + len(r), pos))
            start += len(r)
        if self._cuda:
            done = torch.cuda.Event()
            main = torch.cuda.current_stream()
            self._side.wait_stream(main)
            with torch.cuda.stream(self._side):
                host = {p: torch.empty(g.shape, dtype=g.dtype, device="cpu", pin_memory=True).copy_(g, non_blocking=True)
                        for p, g in gathered.items()}
                for g in gathered.values():
                    g.record_stream(self._side)
                done.record(self._side)
            self._pending.append(_Pending(done, host, segments))
        else:
            self._pending.append(_Pending(None, {p: g.clone() for p, g in gathered.items()}, segments))
        self.poll()

    def poll(self, block: bool = False) -> None:
        """Move completed copies into their records (``block``: wait for all)."""
        keep = []
        for pend in self._pending:
            if pend.event is not None and not pend.event.query():
                if not block:
                    keep.append(pend)
                    continue
                pend.event.synchronize()
            converted: dict[tuple[Place, str], np.ndarray] = {}  # one conversion per place and dtype, then views
            for req_id, s, e, pos in pend.segments:
                rec = self.records.get(req_id)
                if rec is None:
                    continue
                rec.positions.append(pos)
                rec.chunks += 1
                chunk = {}
                for place in rec.spec.places():
                    arr = converted.get((place, rec.spec.dtype))
                    if arr is None:
                        t = pend.host[place].to(_TORCH_DTYPES[rec.spec.dtype])
                        arr = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()  # numpy has no bf16
                        converted[(place, rec.spec.dtype)] = arr
                    chunk[place] = arr[s:e]
                    rec.values[place].append(chunk[place])
                if self.on_chunk is not None:
                    self.on_chunk(rec, pos, chunk)
        self._pending = keep

    def finish(self, req_id: str) -> CaptureRecord | None:
        """The request is done: complete its copies and hand the record out (None if it captured nothing)."""
        if req_id not in self.records:
            return None
        self.poll(block=True)
        return self.records.pop(req_id)

    def has_work(self) -> bool:
        return bool(self.records)
