"""Per-worker steering state: global spec, named vectors, the request registry, and the per-step row index.

Engine-agnostic: a runner adapter in ``dynsteer.engine.runner`` turns each vLLM step into a :class:`BatchView`, and
this module turns the view into the ``row_index`` the forward pass reads. Every TP rank runs the same code on the same
scheduler output, so all ranks fill identical tables.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from dynsteer.capture.spec import CaptureSpec
from dynsteer.capture.spool import WRITER
from dynsteer.capture.store import CaptureCollector, CaptureRecord
from dynsteer.config import Limits
from dynsteer.controllers.registry import ControllerFault, ControllerRegistry
from dynsteer.policy import admit_policy
from dynsteer.steering.staging import StagingRing
from dynsteer.memo import BoundedMemo, body_digest
from dynsteer.payload import PAYLOAD_KEY, config_fingerprint, decode_payload, payload_body
from dynsteer.request.compile_spec import compile_phase
from dynsteer.request.programs import EMPTY, RowContent, SiteKey
from dynsteer.spec import ModelShape, SteeringSpec, SteeringValidationError, check_vector
from dynsteer.steering.dynamic.driver import DynamicDriver
from dynsteer.steering.dynamic.state import DynState
from dynsteer.steering.dynamic.tokens import StepTokens
from dynsteer.steering.rows import RowPool, RowsExhausted
from dynsteer.steering.tables import SteeringTables

logger = logging.getLogger("dynsteer")


@dataclass
class BatchView:
    """One step's flattened batch, in the runner's row order.

    Request ``req_ids[i]`` owns tokens ``[query_start_loc[i], query_start_loc[i+1])``; its first token sits at
    absolute position ``num_computed[i]``; tokens at positions ``>= prompt_lens[i]`` are generated (decode) tokens.
    Tokens ``num_tokens..num_tokens_padded`` are padding. ``prompt_lens`` is read only for requests being admitted
    (an array, or anything indexable by position).
    """

    req_ids: Sequence[str]
    query_start_loc: np.ndarray
    num_computed: np.ndarray
    prompt_lens: Sequence[int] | np.ndarray
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
    payload_key: bytes | None = None  # digest of the packed payload body (no tag), if the request sent one (memo key)
    policy: Any = None  # the request's own DynamicSteeringPolicy (overrides the global one)
    dyn: DynState | None = None
    trace: bool = False  # keep the trace for the caller (payload's ``trace`` flag)
    cmd_spec: SteeringSpec | None = None  # a monitor's ``steer`` command: added to its decode tokens
    cmd_policy: Any = None  # its dynamic policy as monitors' threshold/rule commands patched it


@dataclass
class RuntimeStats:
    steps: int = 0
    admitted: int = 0
    rejected: int = 0  # requests stopped by dynsteer (bad payload, rows exhausted, controller fault)
    rows_exhausted: int = 0
    traces_dropped: int = 0  # traces not taken within Limits.trace_ttl_s, or over Limits.max_traces
    stream_errors: int = 0  # stream messages that could not be published (logged)
    # take_captures calls, their time in this process (finishing records, waiting for the spool writer) and the
    # spool writer's queue length when each began (steps still to be written: a writer behind)
    takes: int = 0
    take_ms: float = 0.0
    take_backlog: int = 0
    pack_ms: float = 0.0  # packing the taken records for the caller (files handed over, or bytes copied)
    errors: list[str] = field(default_factory=list)


PayloadLookup = Callable[[str], Any]
_KEEP = object()


@dataclass
class _Batch:
    """Per-request arrays of one batch composition, gathered once and reused while the composition and the
    runtime's request state are unchanged (a steady decode step does no per-request Python)."""

    ids: tuple[str, ...]
    version: int
    rows: np.ndarray  # [n, 2] prefill and decode row
    prompt_lens: np.ndarray
    steered: bool  # any row is not 0
    dyn: np.ndarray  # a dynamic policy steers its decode tokens
    slot: np.ndarray  # device sync-tier slot (-1: none)
    sync: np.ndarray
    record: np.ndarray  # read-back record slot (-1: none)
    host: np.ndarray  # host sync tier
    act: np.ndarray  # bitmask of gate slots that steer (rules with actions)
    signature: np.ndarray  # object: decode configuration digest (hex)
    prompt: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # prompt-level gates (held per request)
    streams: dict[str, np.ndarray] = field(default_factory=dict)  # stream -> which requests it publishes


class SteeringRuntime:
    """Owns the device tables of one model instance in one worker process."""

    def __init__(self, shape: ModelShape, tables: SteeringTables, limits: Limits | None = None,
                 probes: dict[str, Any] | None = None, controllers: ControllerRegistry | None = None,
                 sync_slots: int = 256) -> None:
        self.shape = shape
        self.tables = tables
        self.limits = limits or Limits()
        self.probes: dict[str, Any] = dict(probes or {})  # registered probe files, loaded: {name: Probe}
        self.controllers = controllers or ControllerRegistry()
        # Requests to stop, with the reason, reported to the scheduler with the step's output (engine.scheduler).
        self.stops: dict[str, str] = {}
        self.pool = RowPool(tables.num_rows)
        self.named: dict[str, np.ndarray] = {}
        self.global_spec = SteeringSpec()
        self.global_policy: Any = None
        self.requests: dict[str, RequestEntry] = {}
        self.stats = RuntimeStats()
        self.inline_forward = False  # set by the engine adapter from DynsteerConfig.forward
        self.fuse_norms = False  # likewise: sites run inside the following add + RMS norm where the layer allows
        self.hooks: dict[SiteKey, Any] = {}  # the SiteHook of every hooked place, filled as layers are built
        self.capture: CaptureCollector | None = None  # set when the engine has capture places
        self.consumers: dict[str, Any] = {}
        # the engine's configured consumer names (every rank: only TP rank 0 builds the consumers themselves);
        # None leaves captures' consumers unchecked (a runtime built outside an engine)
        self.consumer_names: frozenset[str] | None = None
        self._staging = StagingRing(tables.row_index)
        # compiled rows by (global configuration, payload body digest), charged what they hold (dynsteer.memo)
        self._compiled: BoundedMemo[list[RowContent]] = BoundedMemo(self.limits.cache_bytes)
        self._global_key = config_fingerprint(self.global_spec, self.global_policy)
        self._high_water = 0
        g = tables.gate_buffers
        self.dynamic = (DynamicDriver(g["gate_mul"], g["gate_add"], g["scores"], g["gates"], max_slots=sync_slots)
                        if g else None)
        self._dyn: dict[str, DynState] = {}  # live and preempted requests with a dynamic policy
        # finished requests whose last read-backs are in flight: (state, entry, read-backs enqueued at finish)
        self._finishing: dict[str, tuple[DynState, RequestEntry | None, int]] = {}
        # finished requests' traces by tag, until taken or expired: (monotonic time stored, trace)
        self.traces: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()
        self._version = 0  # bumped whenever a request's rows or dynamic state change (invalidates _batch)
        self.step = 0  # the engine core's step number (scheduler output), named by stream frames
        # monitors' commands per request id, kept across preemption (a resumed request is admitted again)
        self._cmd_specs: dict[str, SteeringSpec] = {}
        self._cmd_policies: dict[str, Any] = {}
        self._deferred: dict[str, list[Any]] = {}  # commands for requests not admitted on this worker yet
        self._retuning: dict[str, DynState] = {}  # retuned since they were last scheduled (DynState.retuned_from)
        self.hub: Any = None  # the async tier's StreamHub (TP rank 0 of a worker with a monitor config)
        self.stream_specs: dict[str, Any] = {}  # stream name -> StreamSpec, refreshed from the hub
        self._stream_places: dict[str, tuple[Any, ...]] = {}  # stream name -> its places this worker holds
        self._hub_version = -1
        self._batch: _Batch | None = None
        self._arange = np.arange(tables.row_index.shape[0])

    # ---- control plane (collective_rpc, between steps) -------------------------------------------------------
    def register_vector(self, name: str, vector: np.ndarray) -> None:
        """Register (or replace) a named vector; refused, changing nothing, when it would exceed
        ``limits.max_named_vectors`` (every rank holds the same names, so every rank refuses alike)."""
        check_vector(vector, self.shape.hidden_size, f"vector {name!r}")
        limit = self.limits.max_named_vectors
        if name not in self.named and len(self.named) >= limit:
            raise SteeringValidationError(f"name: cannot register {name!r}: {len(self.named)} named vectors are "
                                          f"registered, the engine's limit max_named_vectors = {limit}")
        self.named[name] = np.ascontiguousarray(vector, np.float32)
        self._compiled.clear()

    def set_global(self, spec: SteeringSpec, policy: Any = _KEEP) -> None:
        """Replace the global spec (and, if given, the global dynamic policy; ``None`` removes it); every live
        request's rows are recompiled (global is folded into rows)."""
        policy = self.global_policy if policy is _KEEP else policy
        if policy is not None and policy is not self.global_policy:
            policy = admit_policy(policy, self.probes, self.controllers, "global_policy.")
        for phase in ("prefill", "decode"):  # validate before touching state
            compile_phase([("global.", spec)], phase, self.shape, self.named,
                          None if policy is None else ("global_policy.", policy))
        old_entries = list(self.requests.items())
        for _, entry in old_entries:
            self._release_rows(entry)
        changed = policy != self.global_policy
        self.global_spec, self.global_policy = spec, policy
        self._global_key = config_fingerprint(spec, policy)  # keys _compiled: a global set and cleared hits again
        for req_id, entry in old_entries:
            if changed and entry.policy is None:
                self._set_dyn(req_id, entry, fresh=True)
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
        # sorted: vLLM hands a set, whose order varies per process (string hashing); every TP rank must free slots
        # and rows in the same order to keep identical buffers
        for req_id in sorted(req_ids):
            # the batch arrays are gathered again only when something was released (the runner calls this every
            # step, usually with no ids: bumping regardless re-gathered every request at every step)
            self._version += 1
            entry = self.requests.pop(req_id, None)
            if entry is not None:
                self._release_rows(entry)
            if finished and req_id in self._dyn:
                # Its last steps' read-backs may still be in flight: the trace is completed once they land (the
                # host does not wait here); its device slot is free at once (reuse is ordered on the stream).
                st = self._drop_dyn(req_id, retire=False)
                self._finishing[req_id] = (st, entry, self.dynamic.enqueued)
            if finished:
                self._cmd_specs.pop(req_id, None)
                self._cmd_policies.pop(req_id, None)
                self._deferred.pop(req_id, None)
            if finished and self.capture is not None:
                self._deliver(self.capture.finish(req_id))

    def admit(self, req_id: str, payload: Any, prompt_len: int) -> RequestEntry:
        """Register a request on first sight. Any error stops the request alone (reported to the scheduler, which
        finishes it with the reason); it runs unsteered until then and the engine keeps serving."""
        spec = tag = policy = None
        capture: CaptureSpec | None = None
        error = None
        trace = False
        if payload is not None:
            try:
                decoded = decode_payload(payload, limits=self.limits)
                spec, tag, capture, trace = decoded.spec, decoded.tag, decoded.capture, decoded.trace
                if decoded.policy is not None:
                    policy = admit_policy(decoded.policy, self.probes, self.controllers,
                                          f"extra_args.{PAYLOAD_KEY}.policy.")
                if capture is not None:
                    places = self.capture.engine_places if self.capture is not None else set()
                    capture.check(self.shape, places, f"extra_args.{PAYLOAD_KEY}.capture", self.consumer_names)
            except Exception as exc:  # noqa: BLE001 - the frontend validates too; this catches what bypassed it
                error = self._stop(req_id, exc)
        entry = RequestEntry(prompt_len=prompt_len, spec=spec, tag=tag, error=error, policy=policy, trace=trace,
                             payload_key=body_digest(payload_body(payload)) if isinstance(payload, str) else None,
                             cmd_spec=self._cmd_specs.get(req_id), cmd_policy=self._cmd_policies.get(req_id))
        for cmd in self._deferred.pop(req_id, ()):
            try:
                self._command_entry(req_id, entry, cmd)
            except Exception as exc:  # noqa: BLE001
                entry.error = self._stop(req_id, exc)
        self._set_dyn(req_id, entry, fresh=False)
        self._assign_rows(req_id, entry)
        if self.capture is not None:
            self.capture.begin(req_id, tag, None if entry.error else capture, prompt_len)
        self.requests[req_id] = entry
        self.stats.admitted += 1
        return entry

    def begin_step(self, step: int | None, commands: list[dict[str, Any]] | None) -> None:
        """Start engine step ``step`` (the scheduler output's number): apply the monitors' commands the engine core
        took at this step, before the step is planned (every TP rank does the same at the same step)."""
        if step is not None:
            self.step = step
        for wire in commands or ():
            try:
                self.apply_command(wire["command"])
            except Exception as exc:  # noqa: BLE001 - validated by the engine core; never take the worker down
                self._record_error(f"command {wire!r} could not be applied: {exc!r}")

    def apply_command(self, raw: dict[str, Any]) -> None:
        """Apply one command (already validated by the engine core against the same configuration). A request
        not admitted on this worker yet (new in this step, or preempted) gets it when it is admitted."""
        from dynsteer.commands import COMMAND_ADAPTER

        cmd = COMMAND_ADAPTER.validate_python(raw)
        if cmd.op == "global":  # validated by the engine core exactly as set_global compiles it
            self.set_global(cmd.spec if cmd.spec is not None else SteeringSpec(), cmd.policy)
            return
        entry = self.requests.get(cmd.request)
        if entry is None:
            self._deferred.setdefault(cmd.request, []).append(cmd)
            return
        self._command_entry(cmd.request, entry, cmd)
        if entry.error is None:
            self._release_rows(entry)
            self._assign_rows(cmd.request, entry)

    def _command_entry(self, req_id: str, entry: RequestEntry, cmd: Any) -> None:
        """Record a command on the request (kept across preemption) and on its live entry."""
        from dynsteer.commands import SteerCommand, patch_policy

        if isinstance(cmd, SteerCommand):
            spec = None if cmd.spec is None or cmd.spec.is_empty() else cmd.spec
            if spec is None:
                self._cmd_specs.pop(req_id, None)
            else:
                self._cmd_specs[req_id] = spec
            entry.cmd_spec = spec
            return
        current = self._cmd_policies.get(req_id)
        if current is None:
            current = entry.policy if entry.policy is not None else self.global_policy
        patched = self._cmd_policies[req_id] = entry.cmd_policy = patch_policy(current, cmd)
        st = self._dyn.get(req_id)
        if st is not None:  # same slots, new thresholds/switches: the controller state is kept
            self.dynamic.retune(st, patched)  # host and device copies; the caller recompiles the table row
            self._retuning[req_id] = st
            self._track_aborts(req_id, st)

    def take_acts(self) -> list[tuple[list[str], list[int], list[int], list[str]]]:
        """Where dynamic steering acted, from the read-backs landed since the last call (see
        ``engine.scheduler.ACTS_ATTR``); polls without waiting first."""
        if self.dynamic is None or not self.dynamic.report_acts:
            return []
        self.dynamic.poll(self._state_of)
        acts, self.dynamic.acts = self.dynamic.acts, []
        return acts

    def _track_aborts(self, req_id: str, st: DynState) -> None:
        """The driver watches the read-backs of requests with abort rules (only those: see DynamicDriver.poll)."""
        if st.aborts:
            self.dynamic.abort_watch.add(req_id)
        else:
            self.dynamic.abort_watch.discard(req_id)

    def take_aborts(self) -> dict[str, str]:
        """Requests whose policy's abort rule fired, from the read-backs landed so far (polled without waiting),
        with their stop reasons: the runner glue reports them with the step's output and the scheduler finishes
        them at that output (their tokens so far delivered, their blocks shareable)."""
        if self.dynamic is None:
            return {}
        if self.dynamic.abort_watch:
            self.dynamic.poll(self._state_of)
        if not self.dynamic.aborts:  # (an abort that fired has left the watch but may still be unreported)
            return {}
        fired, self.dynamic.aborts = self.dynamic.aborts, {}
        return {r: f"{reason} (fired at position {pos})" for r, (pos, reason) in fired.items() if r in self.requests}

    def take_stops(self) -> dict[str, str]:
        """Requests to stop since the last call, with their reasons (the runner glue reports them with the step's
        output; the scheduler finishes them and never shares their KV blocks)."""
        stops, self.stops = self.stops, {}
        return stops

    def _stop(self, req_id: str, error: Any) -> str:
        """Record that ``req_id`` must stop: a validation error names its field; anything else is internal."""
        if isinstance(error, (SteeringValidationError, RowsExhausted, ControllerFault)):
            message = str(error)
        else:
            message = f"internal error while admitting the request: {error!r}"
        self.stops.setdefault(req_id, f"dynsteer: {message}")
        self._record_error(f"request {req_id}: {message}")
        return message

    def plan(self, view: BatchView, payload_of: PayloadLookup) -> None:
        """Fill ``row_index`` for this step (padding and unsteered tokens read row 0).

        Per-request arrays are gathered only when the batch's composition or a request's state changed (admission
        happens then); per-token work is vectorised. An unsteered batch after an unsteered step writes nothing.
        The index reaches the device through a pinned staging ring with a non-blocking copy, so the host never
        waits for the GPU here (a blocking copy would serialise vLLM's asynchronous scheduling with the forward).
        """
        self.stats.steps += 1
        n_req = len(view.req_ids)
        ids = tuple(view.req_ids[:n_req])
        b = self._batch
        if self.hub is not None and self.hub.version != self._hub_version:
            self._refresh_streams()
        if b is None or b.version != self._version or b.ids != ids:
            b = self._batch = self._gather(ids, view, payload_of)
        qsl = view.query_start_loc
        n = view.num_tokens
        if n == n_req:  # one token per request (a decode step)
            req_of_token = self._arange[:n]
            position = np.asarray(view.num_computed[:n_req], np.int64)
        else:
            qsl = np.asarray(qsl[: n_req + 1], np.int64)
            counts = np.diff(qsl)
            req_of_token = np.repeat(self._arange[:n_req], counts)
            position = np.asarray(view.num_computed[:n_req], np.int64)[req_of_token] + (
                self._arange[:n] - np.repeat(qsl[:-1], counts))
        is_decode = position >= b.prompt_lens[req_of_token]
        if self._retuning:
            self._note_retunes(ids, view)
        if self.capture is not None:
            streams = self._select_streams(b, req_of_token, position, is_decode) if b.streams else []
            if streams or self.capture.needs_plan:
                self.capture.plan(ids, np.asarray(view.query_start_loc[: n_req + 1], np.int64), view.num_computed,
                                  streams)
        if b.steered or self._high_water:  # else row_index is 0 on the device already
            upto = max(n, self._high_water, view.num_tokens_padded)
            idx = self._staging.next()
            idx[:n] = b.rows[req_of_token, is_decode.astype(np.int64)]
            idx[n:upto] = 0
            self._high_water = n if b.steered else 0
            self._staging.copy_to(upto)
        if self.dynamic is not None and self._dyn:
            upto = max(n, view.num_tokens_padded)
            if b.dyn.any():
                picked = np.flatnonzero(is_decode & b.dyn[req_of_token])
                r = req_of_token[picked]
                tokens = StepTokens(ids, r, picked, position[picked], b.slot[r], b.sync[r], b.record[r], b.host[r],
                                    b.act[r], b.signature[r])
            else:
                tokens = StepTokens.empty()
            self.dynamic.plan(self._dyn, self._state_of, tokens, upto)
            if b.prompt.any():  # prompt-level gates: latch at the prompt's last token, held while generating
                on = b.prompt[req_of_token]
                dec = np.flatnonzero(is_decode & on)
                pre = np.flatnonzero(~is_decode & on)
                r = req_of_token[pre]
                states = [self._dyn.get(i) for i in ids]
                self.dynamic.stage_prompt(states, dec, req_of_token[dec], pre, r, position[pre], b.prompt_lens[r],
                                          upto)
            if self.dynamic.faults:
                self._stop_faulted()
        if self._finishing:
            self._complete_traces()

    def _note_retunes(self, ids: tuple[str, ...], view: BatchView) -> None:
        """Retuned requests scheduled in this step compute their first position under the new gate parameters."""
        for i, req_id in enumerate(ids):
            st = self._retuning.pop(req_id, None)
            if st is not None:
                st.retuned_from(int(view.num_computed[i]))
        for req_id in [r for r in self._retuning if r not in self._dyn]:
            del self._retuning[req_id]  # finished, or its policy replaced, before it was scheduled again

    def _gather(self, ids: tuple[str, ...], view: BatchView, payload_of: PayloadLookup) -> _Batch:
        """Admit the batch's new requests and gather every request's arrays (once per batch composition)."""
        n = len(ids)
        entries = []
        for i, req_id in enumerate(ids):
            entry = self.requests.get(req_id)
            if entry is None:
                entry = self.admit(req_id, payload_of(req_id), int(view.prompt_lens[i]))
            entries.append(entry)
        rows = np.array([e.rows for e in entries], np.int32).reshape(n, 2)
        # each site's summary: what the batch's rows hold there (the kernels skip a site whose summary is 0)
        self.tables.summarize(np.unique(rows))
        dyn = [e.dyn if e.dyn is not None and e.rows[1] != 0 else None for e in entries]
        return _Batch(
            ids=ids, version=self._version, rows=rows,
            prompt_lens=np.fromiter((e.prompt_len for e in entries), np.int64, n), steered=bool(rows.any()),
            dyn=np.array([st is not None for st in dyn], bool).reshape(n),
            slot=np.array([-1 if st is None or st.device_slot is None else st.device_slot for st in dyn], np.int64),
            sync=np.array([st is not None and st.sync for st in dyn], bool).reshape(n),
            record=np.array([-1 if st is None or st.record is None else st.record for st in dyn], np.int64),
            host=np.array([st is not None and st.tier == "host" for st in dyn], bool).reshape(n),
            act=np.array([0 if st is None else st.act_mask for st in dyn], np.int64),
            signature=np.array([e.decode.digest.hex() for e in entries] + [None], object)[:n],
            prompt=np.array([st is not None and st.prompt_level for st in dyn], bool).reshape(n),
            streams={name: _stream_mask(spec, entries) for name, spec in self.stream_specs.items()})

    # ---- async tier: streams ---------------------------------------------------------------------------------------
    def stream_validator(self, allow_declare: bool) -> Callable[[str, dict[str, Any]], None]:
        """What checks a stream a subscriber declares (runs on the hub's I/O thread; raises ValueError naming the
        field)."""
        from dynsteer.config import StreamSpec

        def on_declare(name: str, raw: dict[str, Any]) -> None:
            if not allow_declare:
                raise ValueError("declare: this engine does not let subscribers declare streams "
                                 "(MonitorConfig.allow_declare)")
            spec = StreamSpec.model_validate(raw)
            engine = self.capture.engine_places if self.capture is not None else set()
            for i, place in enumerate(spec.place_tuples()):
                if place not in engine:
                    raise ValueError(f"declare[{name!r}].places[{i}]: {place[0]}.{place[1]} has no capture buffer")

        return on_declare

    def attach_hub(self, hub: Any, declared: dict[str, Any]) -> None:
        """Publish streams through ``hub`` (a ``StreamHub``); ``declared``: the engine's streams (StreamSpec)."""
        self.hub = hub
        for name, spec in declared.items():
            hub.declare(name, spec.model_dump(mode="json"))
        if self.capture is not None:
            self.capture.on_stream = self._publish

    def _refresh_streams(self) -> None:
        from dynsteer.config import StreamSpec

        self._hub_version = self.hub.version
        mine = self.capture.places if self.capture is not None else set()
        specs, places = {}, {}
        for name, raw in self.hub.streams().items():
            spec = StreamSpec.model_validate(raw)
            here = tuple(p for p in spec.place_tuples() if p in mine)  # a pipeline stage publishes its own layers
            if here:
                specs[name], places[name] = spec, here
        self.stream_specs, self._stream_places = specs, places
        self._version += 1

    def _select_streams(self, b: _Batch, req_of_token: np.ndarray, position: np.ndarray,
                        is_decode: np.ndarray) -> list[Any]:
        """This step's tokens of every stream that has a subscriber (vectorised per stream)."""
        from dynsteer.capture.store import StreamSelection

        out = []
        for name, mask in b.streams.items():
            if not self.hub.subscribed(name):
                continue
            spec = self.stream_specs[name]
            keep = mask[req_of_token]
            if spec.positions == "generated":
                keep &= is_decode
            elif spec.positions == "prompt":
                keep &= ~is_decode
            tokens = np.flatnonzero(keep)
            if tokens.size:
                out.append(StreamSelection(name, self.step, self._stream_places[name], spec.dtype, tokens,
                                           req_of_token[tokens], position[tokens], b.ids))
        return out

    def _publish(self, sel: Any, values: dict[Any, np.ndarray]) -> None:
        """One stream's rows of one step have landed: one message (header + raw frames)."""
        from dynsteer.capture.store import place_key

        uniq, inverse = np.unique(sel.req, return_inverse=True)
        meta = {"step": int(sel.step), "req_ids": [sel.req_ids[i] for i in uniq.tolist()],
                "places": [place_key(p) for p in sel.places], "dtype": sel.dtype}
        arrays = [inverse.astype(np.int32), np.ascontiguousarray(sel.positions, np.int64),
                  *(np.ascontiguousarray(values[p]) for p in sel.places)]
        try:
            self.hub.publish(sel.name, meta, arrays)
        except Exception as exc:  # noqa: BLE001 - a stream never aborts generation; the loss is logged and counted
            if isinstance(exc, ValueError) and sel.name not in self.hub.streams():
                return  # a subscriber-declared stream whose last subscriber left since the step was planned
            self.stats.stream_errors += 1
            logger.error("dynsteer: stream %r: publishing step %d failed: %r", sel.name, sel.step, exc)

    def _state_of(self, req_id: str) -> DynState | None:
        """A request's dynamic state, live or finishing (read-backs land after the request finished)."""
        st = self._dyn.get(req_id)
        if st is None:
            done = self._finishing.get(req_id)
            st = done[0] if done is not None else None
        return st

    def _complete_traces(self) -> None:
        """Finish the traces of finished requests whose last read-backs have landed."""
        for req_id in [r for r, (_, _, seq) in self._finishing.items() if self.dynamic.completed >= seq]:
            st, entry, _ = self._finishing.pop(req_id)
            self._store_trace(req_id, st, entry)
            self.dynamic.retire(st)

    def _stop_faulted(self) -> None:
        """Requests whose custom controller failed: stop them, and steer them no further meanwhile (their decode
        rows are released: the next steps run them unsteered until the scheduler finishes them)."""
        faults, self.dynamic.faults = self.dynamic.faults, {}
        for req_id, message in faults.items():
            self._stop(req_id, SteeringValidationError(f"policy.controller: {message}"))
            entry = self.requests.get(req_id)
            if entry is not None:
                entry.error = message
                self._release_rows(entry)
                entry.dyn = None
            self._drop_dyn(req_id)

    def after_forward(self) -> None:
        """Called once the step's forward is enqueued: start copying captured rows out."""
        if self.capture is not None:
            self.capture.after_forward()
        if self.dynamic is not None:
            self.dynamic.after_forward(self._state_of)

    def take_captures(self, tags: Iterable[str]) -> list[CaptureRecord]:
        """Finish live records with these tags (the caller knows they are done) and take them from memory."""
        if self.capture is None:
            return []
        t0, stats = time.perf_counter(), self.stats
        stats.takes += 1
        stats.take_backlog += WRITER.backlog()
        tags = set(tags)
        for req_id in [r for r, rec in self.capture.records.items() if rec.tag in tags]:
            self._deliver(self.capture.finish(req_id))
        memory = self.consumers.get("memory")
        out = [rec for tag in tags if memory is not None and (rec := memory.take(tag)) is not None]
        stats.take_ms += (time.perf_counter() - t0) * 1e3
        return out

    def take_traces(self, tags: Iterable[str]) -> list[dict[str, Any]]:
        """Traces of finished requests with these tags (each can be taken once).

        The caller knows these requests are done; the scheduler tells the runner only at the next step, so live
        states with these tags are finished here.
        """
        tags = set(tags)
        done = [r for r in self._dyn if (e := self.requests.get(r)) is not None and e.tag in tags]
        if self.dynamic is not None:
            self.dynamic.poll(self._state_of, block=True)
            for req_id in done:
                self._finishing[req_id] = (self._drop_dyn(req_id, retire=False), self.requests[req_id],
                                           self.dynamic.enqueued)
            self._complete_traces()
        self._expire_traces()
        return [tr[1] for tag in tags if (tr := self.traces.pop(tag, None)) is not None]

    def _expire_traces(self) -> None:
        """Drop traces nobody took within ``Limits.trace_ttl_s`` (oldest first; counted)."""
        deadline = time.monotonic() - self.limits.trace_ttl_s
        while self.traces and next(iter(self.traces.values()))[0] < deadline:
            self.traces.popitem(last=False)
            self.stats.traces_dropped += 1

    def _drop_dyn(self, req_id: str, retire: bool = True) -> DynState | None:
        """Forget a request's dynamic state (its device slot is freed; its record too unless its trace is still
        to be completed)."""
        self._version += 1
        st = self._dyn.pop(req_id, None)
        if self.dynamic is not None:
            self.dynamic.abort_watch.discard(req_id)
            self.dynamic.aborts.pop(req_id, None)
        if st is not None and self.dynamic is not None:
            self.dynamic.free(st)
            if retire:
                self.dynamic.retire(st)
        return st

    def _set_dyn(self, req_id: str, entry: RequestEntry, fresh: bool) -> None:
        """Give the request its dynamic state (a resumed request keeps the one it had before preemption)."""
        self._version += 1
        policy = self._effective_policy(entry)
        if policy is None or self.dynamic is None:
            self._drop_dyn(req_id)
            entry.dyn = None
            return
        st = self._dyn.get(req_id)
        if fresh and st is not None:
            self._drop_dyn(req_id)
            st = None
        if st is None:
            try:
                st = DynState.for_policy(policy, self.controllers, self.shape.max_dyn_scale)
                st.keep = entry.trace
            except Exception as exc:  # noqa: BLE001 - a custom controller's factory is operator code
                where = f"extra_args.{PAYLOAD_KEY}.policy" if entry.policy is not None else "global_policy"
                entry.error = self._stop(req_id, SteeringValidationError(f"{where}.controller.options: {exc}"))
                self._drop_dyn(req_id)
                entry.dyn = None
                return
        self.dynamic.place(st)  # the device sync tier, when it implements the policy's controller
        self._track_aborts(req_id, st)
        entry.dyn = self._dyn[req_id] = st

    def _effective_policy(self, entry: RequestEntry) -> Any:
        if entry.error is not None:
            return None
        policy = entry.cmd_policy if entry.cmd_policy is not None else (
            entry.policy if entry.policy is not None else self.global_policy)
        return policy if policy is not None and (policy.rules or policy.controller) else None

    def _store_trace(self, req_id: str, st: DynState, entry: RequestEntry | None) -> None:
        if entry is None or not entry.trace or st.record is None:
            return  # nobody asked to keep it (e.g. an HTTP request): keeping it would only grow memory
        tag = entry.tag or req_id
        self._expire_traces()
        while len(self.traces) >= self.limits.max_traces:  # never taken: drop the oldest, counted
            self.traces.popitem(last=False)
            self.stats.traces_dropped += 1
        self.traces[tag] = (time.monotonic(), {"tag": tag, "monitors": [s.monitor for s in st.slots],
                                               "scopes": [s.scope for s in st.slots],
                                               **st.trace(*self.dynamic.records.record(st.record))})

    def attach_capture(self, collector: CaptureCollector, consumers: dict[str, Any]) -> None:
        self.capture, self.consumers = collector, consumers
        collector.on_chunk = self._on_chunk
        streaming = {name for name, c in consumers.items()
                     if callable(getattr(c, "on_chunk", None)) and getattr(c, "streams", True)}
        collector.streams = lambda spec: any(name in streaming for name in spec.consumers)

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
    def _compile(self, specs: list[tuple[str, SteeringSpec]], key: Any, policy: Any = None,
                 decode_extra: list[tuple[str, SteeringSpec]] = ()) -> list[RowContent]:
        """Both phases' contents, memoised per (global configuration, payload) (most traffic repeats a few
        configurations; compiling hashes every vector, which would otherwise run for each admitted request).
        ``decode_extra``: specs added to the decode phase only (a monitor's ``steer`` command)."""
        key = None if key is None else (self._global_key, key)
        cached = self._compiled.get(key) if key is not None else None
        if cached is None:
            pol = None if policy is None else (f"extra_args.{PAYLOAD_KEY}.policy.", policy)
            cached = [compile_phase(specs, "prefill", self.shape, self.named, pol),
                      compile_phase([*specs, *decode_extra], "decode", self.shape, self.named, pol)]
            if key is not None:
                self._compiled.put(key, cached)
        return cached

    def _assign_rows(self, req_id: str, entry: RequestEntry) -> None:
        self._version += 1
        if entry.error is not None:  # stopped: it runs unsteered until the scheduler finishes it
            entry.prefill, entry.decode, entry.rows = EMPTY, EMPTY, (0, 0)
            return
        specs = [("global.", self.global_spec)]
        key: Any = b""  # the global configuration alone
        if entry.spec is not None and not entry.spec.is_empty():
            specs.append((f"extra_args.{PAYLOAD_KEY}.spec.", entry.spec))
            key = entry.payload_key
        policy = self._effective_policy(entry)
        if entry.policy is not None and policy is not None:
            key = entry.payload_key
        extra = []
        if entry.cmd_spec is not None or entry.cmd_policy is not None:
            key = None  # commanded: not worth memoising
            if entry.cmd_spec is not None:
                extra = [("command.spec.", entry.cmd_spec)]
        try:
            contents = self._compile(specs, key, policy, extra)
            rows = self._acquire(contents)
        except Exception as exc:  # noqa: BLE001
            # The frontend validates at admission and the scheduler holds requests until rows are free, so this is
            # rare (a vector name unregistered mid-flight, rows taken by a global change): the request stops with
            # the reason (never silently unsteered), the others go on.
            if isinstance(exc, RowsExhausted):
                self.stats.rows_exhausted += 1
            entry.error = self._stop(req_id, exc)
            entry.dyn = None
            self._drop_dyn(req_id)
            contents, rows = [EMPTY, EMPTY], (0, 0)
        entry.prefill, entry.decode = contents
        entry.rows = rows

    def _record_error(self, message: str) -> None:
        self.stats.rejected += 1
        self.stats.errors = (self.stats.errors + [message])[-32:]
        logger.error("dynsteer: %s; the request is stopped", message)

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
        self._version += 1
        self.pool.release(entry.prefill.digest)
        self.pool.release(entry.decode.digest)
        entry.prefill = entry.decode = EMPTY
        entry.rows = (0, 0)

    def describe(self) -> dict[str, Any]:
        """JSON-friendly state for ``collective_rpc`` callers."""
        return {"shape": self.shape.model_dump(mode="json"), "rows_in_use": self.pool.in_use,
                "rows_idle": self.pool.idle, "rows_revived": self.pool.revived,
                "rows_written": self.pool.written,
                "rows_total": self.tables.num_rows - 1, "live_requests": len(self.requests),
                "named_vectors": sorted(self.named), "global_empty": self.global_spec.is_empty(),
                "table_bytes": self.tables.nbytes(), "stats": vars(self.stats).copy(),
                "forward": {"inline": self.inline_forward,
                            "fused_into_norm": sorted(f"{k[0]}:{k[1]}" for k, h in self.hooks.items()
                                                      if h.fused)},
                "dynamic": None if self.dynamic is None else {
                    "live": len(self._dyn), "global_policy": self.global_policy is not None,
                    "controller_state": dict(zip(("digest", "slots_nonzero"), self.dynamic.state_digest())),
                    **vars(self.dynamic.stats)}}


def _stream_mask(spec: Any, entries: list[RequestEntry]) -> np.ndarray:
    """Which of a batch's requests a stream publishes (its ``requests`` filter)."""
    if spec.requests == "all":
        return np.ones(len(entries), bool)
    if spec.requests == "dynamic":
        return np.array([e.dyn is not None for e in entries], bool).reshape(len(entries))
    prefix = spec.tag_prefix or ""
    return np.array([e.tag is not None and e.tag.startswith(prefix) for e in entries], bool).reshape(len(entries))
