"""Per-request reports on the worker: the read-back values of requests that asked for a report (payload ``report``),
sent to the engine core as they land, a delta at a time.

A report reads the same record as the request's trace (the driver's :class:`~dynsteer.device.readback.ReadbackStore`,
which the request keeps once it asks for a report) into the trace's own fields (``DynState.report_fields``), so its
values equal the trace's. Nothing here waits for the device: the values are those of the read-backs landed so far (the
driver polls without blocking), so a token's values may arrive a step or so after the token itself; a request's last
delta says ``done`` once its last read-back has landed (after it finished). A request without a dynamic state (no
policy, or stopped) sends one delta, ``done`` at once, with no slots.

What a delta holds (a plain dict, pickled to the engine core): on its first delta ``report`` (the kind asked),
``monitors``, ``scopes`` and ``acts`` (per gate slot: its monitor, its rule's scope, whether its gate steers); then
``position``, ``score`` and ``applied`` (per read-back token, as in :class:`dynsteer.trace.DynamicTrace`); ``done``
when nothing more will come.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
        delta = self.out.setdefault(req_id, {})
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

    def take(self) -> Deltas:
        out, self.out = self.out, {}
        return out
