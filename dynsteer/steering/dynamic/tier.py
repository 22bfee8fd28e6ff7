"""What the runtime calls of the dynamic tier: requests' states, the driver's step, their aborts, acts and traces.

An engine without gate buffers (``max_gates = 0``) holds a :class:`NullDynamicTier`: the runtime calls it
unconditionally and it does nothing, so no request ever gets a dynamic state.

Every state change goes through ``touch`` (the runtime gathers its per-batch arrays again), as the driver reads a
request's tier, device slot and record from those arrays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Container, Iterable, Mapping

import numpy as np

from dynsteer.controllers.registry import ControllerRegistry
from dynsteer.steering.dynamic.driver import DynamicDriver
from dynsteer.steering.dynamic.reports import Deltas, ReportCursors
from dynsteer.steering.dynamic.state import DynState
from dynsteer.steering.dynamic.tokens import ActedReport, StepTokens, gate_bits
from dynsteer.steering.dynamic.traces import TraceStore

if TYPE_CHECKING:
    from dynsteer.policy import DynamicSteeringPolicy
    from dynsteer.steering.batch import BatchArrays
    from dynsteer.steering.requests import RequestEntry


class ControllerOptionsError(Exception):
    """A custom controller's factory refused a policy's options (operator code): the request must stop."""


#: where dynamic steering acted, per completed read-back (``engine.scheduler.ACTS_ATTR``)
Acts = list[ActedReport]


class DynamicTier:
    """Live requests' dynamic states around one :class:`DynamicDriver`.

    Args:
        max_scale: the largest scale a custom controller may output (``ModelShape.max_dyn_scale``).
        touch: called on every change of a request's state.
    """

    def __init__(self, driver: DynamicDriver, controllers: ControllerRegistry, max_scale: float, traces: TraceStore,
                 touch: Callable[[], None]) -> None:
        self.driver, self.controllers, self.max_scale, self.traces = driver, controllers, max_scale, traces
        self._touch = touch
        self.live: dict[str, DynState] = {}  # live and preempted requests with a dynamic policy
        # finished requests whose last read-backs are in flight: (state, entry, read-backs enqueued at finish)
        self.finishing: dict[str, tuple[DynState, RequestEntry | None, int]] = {}
        self.retuning: dict[str, DynState] = {}  # retuned since they were last scheduled (DynState.retuned_from)
        self.reports = ReportCursors()  # requests that asked for a report (payload ``report``)
        # the last step's batch arrays, dynamic token columns and tokens: per-request fields are gathered again only
        # when the batch's arrays (rebuilt on any state change) or the columns change
        self._tokens: tuple[BatchArrays, np.ndarray, StepTokens] | None = None

    # ---- a request's state -------------------------------------------------------------------------------------------
    def attach(self, req_id: str, policy: DynamicSteeringPolicy | None, keep: bool, fresh: bool) -> DynState | None:
        """The request's state under ``policy`` (``None``: it has none); a resumed request keeps the state it had
        before preemption unless ``fresh``. ``keep``: the caller asked for the trace.

        Raises:
            ControllerOptionsError: a custom controller's factory failed (its message).
        """
        if policy is None:
            self.drop(req_id)
            return None
        st = self.live.get(req_id)
        if fresh and st is not None:
            self.drop(req_id)
            st = None
        if st is None:
            try:
                st = DynState.for_policy(policy, self.controllers, self.max_scale)
            except Exception as exc:  # noqa: BLE001 - a custom controller's factory is operator code
                raise ControllerOptionsError(str(exc)) from exc
            st.keep = keep
        self.driver.place(st)  # the device sync tier, when it implements the policy's controller
        self._track_aborts(req_id, st)
        self.live[req_id] = st
        return st

    def drop(self, req_id: str, retire: bool = True) -> DynState | None:
        """Forget a request's dynamic state (its device slot is freed; its record too unless its trace is still
        to be completed)."""
        self._touch()
        st = self.live.pop(req_id, None)
        self.driver.abort_watch.discard(req_id)
        self.driver.aborts.pop(req_id, None)
        if st is not None:
            self.driver.free(st)
            if retire:
                if req_id in self.reports:  # it loses its state: what landed is all its report will hold
                    self.reports.flush(req_id, st, self.driver.records, done=True)
                self.driver.retire(st)
        return st

    def finish(self, req_id: str, entry: RequestEntry | None) -> None:
        """The request finished: its last steps' read-backs may still be in flight, so its trace is completed once
        they land (the host does not wait here); its device slot is free at once (reuse is ordered on the stream)."""
        st = self.live.get(req_id)
        if st is not None:
            self.drop(req_id, retire=False)
            self.finishing[req_id] = (st, entry, self.driver.enqueued)

    def retune(self, req_id: str, policy: DynamicSteeringPolicy | None) -> None:
        """The host and device copies of a request's gate parameters, if it has a state (live, or preempted); see
        ``SteeringRuntime.retune``, the one path, which also recompiles the table row."""
        st = self.live.get(req_id)
        if st is not None:
            self.driver.retune(st, policy)
            self.retuning[req_id] = st
            self._track_aborts(req_id, st)

    def note_retunes(self, ids: tuple[str, ...], num_computed: np.ndarray) -> None:
        """Retuned requests scheduled in this step compute their first position under the new gate parameters."""
        for i, req_id in enumerate(ids):
            st = self.retuning.pop(req_id, None)
            if st is not None:
                st.retuned_from(int(num_computed[i]))
        for req_id in [r for r in self.retuning if r not in self.live]:
            del self.retuning[req_id]  # finished, or its policy replaced, before it was scheduled again

    def state_of(self, req_id: str) -> DynState | None:
        """A request's dynamic state, live or finishing (read-backs land after the request finished)."""
        st = self.live.get(req_id)
        if st is None:
            done = self.finishing.get(req_id)
            st = done[0] if done is not None else None
        return st

    def _track_aborts(self, req_id: str, st: DynState) -> None:
        """The driver watches the read-backs of requests with abort rules (only those: see DynamicDriver.poll)."""
        if st.aborts:
            self.driver.abort_watch.add(req_id)
        else:
            self.driver.abort_watch.discard(req_id)

    # ---- per step ----------------------------------------------------------------------------------------------------
    def plan(self, b: BatchArrays, ids: tuple[str, ...], req_of_token: np.ndarray, position: np.ndarray,
             is_decode: np.ndarray, upto: int, steady: bool = False) -> dict[str, str]:
        """Stage the step's dynamic decode tokens and prompt-level gates (``upto``: the step's tokens, padding
        included); returns the requests whose custom controller failed, with the reason (to stop). ``steady``: a
        decode step of every request over the batch arrays of the step before, itself such a step."""
        driver = self.driver
        if b.dyn.any():
            last = self._tokens
            same = last is not None and last[0] is b
            picked = last[1] if same and steady else np.flatnonzero(is_decode & b.dyn[req_of_token])
            if same and (picked is last[1] or np.array_equal(last[1], picked)):
                # the same requests' tokens in the same columns, one position further on
                tokens = last[2].moved(position[picked])
            else:
                r = req_of_token[picked]
                act = b.act[r]
                tokens = StepTokens(ids, r, picked, position[picked], b.slot[r], b.sync[r], b.record[r], b.host[r],
                                    act, b.signature[r],
                                    gate_bits(act, driver.layout.G) if driver.report_acts else None)
                self._tokens = (b, picked, tokens)
        else:
            tokens = StepTokens.empty()
        driver.plan(self.live, self.state_of, tokens, upto)
        if b.prompt.any():  # prompt-level gates: latch at the prompt's last token, held while generating
            on = b.prompt[req_of_token]
            dec = np.flatnonzero(is_decode & on)
            pre = np.flatnonzero(~is_decode & on)
            r = req_of_token[pre]
            states = [self.live.get(i) for i in ids]
            driver.stage_prompt(states, dec, req_of_token[dec], pre, r, position[pre], b.prompt_lens[r], upto)
        if not driver.faults:
            return driver.faults
        faults, driver.faults = driver.faults, {}
        return faults

    def after_forward(self) -> None:
        self.driver.after_forward(self.state_of)

    # ---- what the runner glue and the caller take --------------------------------------------------------------------
    def take_acts(self) -> Acts:
        """Where dynamic steering acted, from the read-backs landed since the last call; polls without waiting."""
        if not self.driver.report_acts:
            return []
        self.driver.poll(self.state_of)
        acts, self.driver.acts = self.driver.acts, []
        return acts

    def take_aborts(self, live: Container[str]) -> dict[str, str]:
        """Requests among ``live`` whose abort rule fired, from the read-backs landed so far (polled without
        waiting), with their stop reasons."""
        driver = self.driver
        if driver.abort_watch:
            driver.poll(self.state_of)
        if not driver.aborts:  # (an abort that fired has left the watch but may still be unreported)
            return {}
        fired, driver.aborts = driver.aborts, {}
        return {r: f"{reason} (fired at position {pos})" for r, (pos, reason) in fired.items() if r in live}

    def start_report(self, req_id: str, kind: str, st: DynState | None) -> None:
        """``req_id`` asked for a ``kind`` report (``st``: its state, ``None`` without one)."""
        self.reports.start(req_id, kind, st, self.driver.records)

    def take_reports(self) -> Deltas:
        """Report deltas of the requests that asked for one, from the read-backs of every step but the newest;
        nothing at all while no request asked for one.

        The newest read-back is this step's own, just enqueued: it is not waited for. The one before it belongs to
        the step the device is finishing, whose output the engine core waits for next in any case (with async
        scheduling it waits for the step before the one it just sent), so waiting for it costs the device no time.
        It makes each token's values reach the frontend one step after the token rather than two, and a streamed
        report request's tokens (held until their values arrive) one step late rather than two or three."""
        if not self.reports:
            return {}
        self.driver.poll(self.state_of, block=True, leave=1)
        self.driver.poll(self.state_of)  # and this step's own if it has landed already (on CPU: always)
        if self.finishing:
            self.complete_traces()
        self.reports.flush_all(self.state_of, self.driver.records)
        return self.reports.take()

    def take_traces(self, tags: Iterable[str], entries: Mapping[str, RequestEntry]) -> list[dict[str, Any]]:
        """Traces of finished requests with these tags; live states with these tags (``entries``: the live
        requests) are finished here, since the caller knows they are done before the scheduler tells the runner."""
        tags = set(tags)
        done = [r for r in self.live if (e := entries.get(r)) is not None and e.tag in tags]
        self.driver.poll(self.state_of, block=True)
        for req_id in done:
            self.finishing[req_id] = (self.live[req_id], entries[req_id], self.driver.enqueued)
            self.drop(req_id, retire=False)
        self.complete_traces()
        return self.traces.take(tags)

    def complete_traces(self) -> None:
        """Finish the traces of finished requests whose last read-backs have landed."""
        for req_id in [r for r, (_, _, seq) in self.finishing.items() if self.driver.completed >= seq]:
            st, entry, _ = self.finishing.pop(req_id)
            if req_id in self.reports:
                self.reports.flush(req_id, st, self.driver.records, done=True)
            self._store_trace(req_id, st, entry)
            self.driver.retire(st)

    def _store_trace(self, req_id: str, st: DynState, entry: RequestEntry | None) -> None:
        if entry is None or not entry.trace or st.record is None:
            return  # nobody asked to keep it (e.g. an HTTP request): keeping it would only grow memory
        tag = entry.tag or req_id
        self.traces.put(tag, {"tag": tag, "monitors": [s.monitor for s in st.slots],
                              "scopes": [s.scope for s in st.slots],
                              **st.trace(*self.driver.records.record(st.record))})

    def describe(self, global_policy: bool) -> dict[str, Any]:
        return {"live": len(self.live), "global_policy": global_policy,
                "controller_state": dict(zip(("digest", "slots_nonzero"), self.driver.state_digest())),
                **vars(self.driver.stats)}


class NullDynamicTier:
    """An engine without a dynamic tier: no request gets a state; the per-step calls do nothing."""

    driver = None

    def __init__(self) -> None:
        self.live: dict[str, DynState] = {}  # stay empty: the runtime's checks of them are its only per-step cost
        self.finishing: dict[str, tuple[DynState, RequestEntry | None, int]] = {}
        self.retuning: dict[str, DynState] = {}
        self.reports = ReportCursors()

    def attach(self, req_id: str, policy: DynamicSteeringPolicy | None, keep: bool, fresh: bool) -> None:
        return None

    def drop(self, req_id: str, retire: bool = True) -> None:
        return None

    def finish(self, req_id: str, entry: RequestEntry | None) -> None:
        pass

    def retune(self, req_id: str, policy: DynamicSteeringPolicy | None) -> None:
        pass

    def after_forward(self) -> None:
        pass

    def take_acts(self) -> Acts:
        return []

    def take_aborts(self, live: Container[str]) -> dict[str, str]:
        return {}

    def start_report(self, req_id: str, kind: str, st: None) -> None:
        self.reports.start(req_id, kind, None, None)  # no state: done at once

    def take_reports(self) -> Deltas:
        return self.reports.take() if self.reports else {}

    def take_traces(self, tags: Iterable[str], entries: Mapping[str, RequestEntry]) -> list[dict[str, Any]]:
        return []

    def describe(self, global_policy: bool) -> None:
        return None
