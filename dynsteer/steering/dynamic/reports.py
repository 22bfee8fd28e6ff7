"""Per-request reports on the worker: the read-back values of requests that asked for a report (payload ``report``),
sent to the engine core as they land, a delta at a time.

A report reads the same record as the request's trace (the driver's :class:`~dynsteer.device.readback.ReadbackStore`,
which the request keeps once it asks for a report) into the trace's own fields (``DynState.report_fields``), so its
values equal the trace's. The current step's read-back is never waited for: a step takes the values of the read-backs
before it (the one the device is finishing, whose output the engine core waits for anyway) and of its own where it has
landed already, so a token's values arrive with its step's output or the next one; a request's last delta says
``done`` once its last read-back has landed (after it finished). A request without a dynamic state (no
policy, or stopped) sends one delta, ``done`` at once, with no slots.

What a delta holds (a plain dict, pickled to the engine core): on its first delta ``report`` (the kind asked),
``monitors``, ``scopes`` and ``acts`` (per gate slot: its monitor, its rule's scope, whether its gate steers); then
``position``, ``score`` and ``applied`` (per read-back token, as in :class:`dynsteer.trace.DynamicTrace`); ``done``
when nothing more will come.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from dynsteer.device.readback import ReadbackStore
    from dynsteer.steering.dynamic.state import DynState

#: request id -> the values landed since its last delta
Deltas = dict[str, dict[str, Any]]


class ReportCursors:
    """Requests that asked for a report, how much of each one's record was sent, and the deltas not yet taken."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}  # request id -> entries of its record sent so far (-1: header not sent)
        self.out: Deltas = {}

    def __bool__(self) -> bool:
        return bool(self.sent) or bool(self.out)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.sent

    def start(self, req_id: str, kind: str, st: DynState | None, records: ReadbackStore | None) -> None:
        """``req_id`` asked for a ``kind`` report (a resumed request keeps its cursor); without a state it is done
        at once."""
        if req_id in self.sent:
            return
        self.sent[req_id] = -1
        self.out.setdefault(req_id, {})["report"] = kind
        if st is None:
            self.flush(req_id, None, records, done=True)

    def flush(self, req_id: str, st: DynState | None, records: ReadbackStore | None, done: bool = False) -> None:
        """Move what landed in ``req_id``'s record since its last delta into its pending delta (``done``: its last
        read-back has landed, or it lost its state)."""
        sent = self.sent.get(req_id)
        if sent is None:
            return
        delta = self.out.get(req_id, {})  # kept only if something is put in it: no empty delta goes out
        if sent < 0:
            slots = st.slots if st is not None else []
            delta["monitors"] = [s.monitor for s in slots]
            delta["scopes"] = [s.scope for s in slots]
            delta["acts"] = [s.scope != "monitor" and bool(s.acts) for s in slots]
            sent = 0
        if st is not None and st.record is not None and records is not None:
            n = int(records.count[st.record])
            if n > sent:
                fields = st.report_fields(records.positions[st.record, sent:n], records.values[st.record, sent:n])
                for key in ("position", "score", "applied"):
                    delta.setdefault(key, []).extend(fields[key])
                sent = n
        self.sent[req_id] = sent
        if done:
            delta["done"] = True
            del self.sent[req_id]
        if delta:
            self.out[req_id] = delta

    def flush_all(self, state_of: Callable[[str], DynState | None], records: ReadbackStore) -> None:
        """:meth:`flush` of every request that asked for a report, the values of all of them gathered from the
        records at once: a report request costs a few list operations per step, not a round of numpy calls. The
        deltas equal :meth:`flush`'s (a request whose header is not sent yet, or without a record, goes through it)."""
        live: list[tuple[str, DynState]] = []
        for req_id, sent in list(self.sent.items()):
            st = state_of(req_id)
            if st is None:
                continue
            if sent < 0 or st.record is None:  # its header first (or no record): one by one
                self.flush(req_id, st, records)
                continue
            live.append((req_id, st))
        if not live:
            return
        slots = np.fromiter((st.record for _, st in live), np.int64, len(live))
        sent = np.fromiter((self.sent[r] for r, _ in live), np.int64, len(live))
        new = records.count[slots] - sent
        if not (new > 0).any():
            return
        new = np.maximum(new, 0)
        owner = np.repeat(np.arange(len(live)), new)  # one row per value to send, grouped by request in order
        ends = np.cumsum(new)
        at = sent[owner] + np.arange(len(owner)) - (ends - new)[owner]
        block = records.values[slots[owner], at]  # [K, W]
        G = (block.shape[1] - 1) // 4
        g = max(len(st.slots) for _, st in live)
        scores, applied = block[:, :g].astype(np.float64), block[:, G:G + g].astype(np.float64)
        counts, stops = new.tolist(), ends.tolist()
        for i, (_, st) in enumerate(live):
            if counts[i] and st.prompt_level:  # a prompt-level slot has no per-token score
                scores[stops[i] - counts[i]:stops[i], [j for j, slot in enumerate(st.slots) if slot.prompt]] = np.nan
        positions = records.positions[slots[owner], at].tolist()
        scores_l, applied_l = scores.tolist(), applied.tolist()
        out, cursor = self.out, self.sent
        for i, (req_id, st) in enumerate(live):
            n = counts[i]
            if not n:
                continue
            a, b, k = stops[i] - n, stops[i], len(st.slots)
            score = scores_l[a:b] if k == g else [r[:k] for r in scores_l[a:b]]
            applied_k = applied_l[a:b] if k == g else [r[:k] for r in applied_l[a:b]]
            delta = out.get(req_id)
            if delta is None:  # the usual case: nothing pending since the last take
                out[req_id] = {"position": positions[a:b], "score": score, "applied": applied_k}
            else:
                delta.setdefault("position", []).extend(positions[a:b])
                delta.setdefault("score", []).extend(score)
                delta.setdefault("applied", []).extend(applied_k)
            cursor[req_id] += n

    def take(self) -> Deltas:
        out, self.out = self.out, {}
        return out
