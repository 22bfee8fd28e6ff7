"""Per-worker steering: the coordinator of one model instance's tables, live requests and tiers.

Engine-agnostic: a runner adapter in ``dynsteer.engine.runner`` turns each vLLM step into a :class:`BatchView`, and
this module turns the view into the ``row_index`` the forward pass reads. Every TP rank runs the same code on the same
scheduler output, so all ranks fill identical tables.

The runtime coordinates; each concern keeps its state in its own component: the request registry (live requests,
the global configuration, their rows: ``requests``), the dynamic tier (``dynamic``), the stream publisher
(``publish``) and capture delivery (``delivery``). An engine without a tier holds its null version, which the step
path calls unconditionally. A monitor's commands (applied between steps, on every rank alike) are recorded here; one
that retunes a gate goes through :meth:`SteeringRuntime.retune`, the one path that moves every copy of its parameters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np

from dynsteer.capture.spec import CaptureSpec
from dynsteer.capture.store import CaptureCollector, CaptureRecord
from dynsteer.commands import COMMAND_ADAPTER, Command, SteerCommand
from dynsteer.config import Limits, StreamSpec
from dynsteer.controllers.registry import ControllerFault, ControllerRegistry
from dynsteer.memo import body_digest
from dynsteer.policy import DynamicSteeringPolicy, admit_policy
from dynsteer.request.payload import PAYLOAD_KEY, decode_payload, payload_body
from dynsteer.request.programs import EMPTY, SiteKey
from dynsteer.request.resolve import GLOBAL_POLICY, REQUEST_POLICY, CommandPatch, Configuration, apply_command
from dynsteer.spec import ModelShape, SteeringSpec, SteeringValidationError
from dynsteer.steering.batch import BatchArrays, Columns
from dynsteer.steering.delivery import CaptureDelivery, NullCaptureDelivery
from dynsteer.steering.dynamic.driver import DynamicDriver
from dynsteer.steering.dynamic.tier import Acts, ControllerOptionsError, DynamicTier, NullDynamicTier
from dynsteer.steering.dynamic.traces import TraceStore
from dynsteer.steering.publish import NullStreamPublisher, StreamPublisher, stream_validator
from dynsteer.steering.requests import RequestEntry, RequestRegistry
from dynsteer.steering.rows import RowsExhausted
from dynsteer.device.staging import StagingRing
from dynsteer.steering.stats import RuntimeStats
from dynsteer.steering.tables import SteeringTables

if TYPE_CHECKING:
    from dynsteer.capture.consumers import CaptureConsumer
    from dynsteer.probefile.fileformat import Probe
    from dynsteer.steering.site import SiteHook
    from dynsteer.streams.hub import StreamHub

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


#: a request's payload as its ``extra_args`` hold it (untrusted: validated at admission), by request id
PayloadLookup = Callable[[str], Any]
_KEEP: Any = object()


class SteeringRuntime:
    """Owns the device tables of one model instance in one worker process."""

    def __init__(self, shape: ModelShape, tables: SteeringTables, limits: Limits | None = None,
                 probes: dict[str, Probe] | None = None, controllers: ControllerRegistry | None = None,
                 sync_slots: int = 256) -> None:
        self.shape = shape
        self.tables = tables
        self.limits = limits or Limits()
        self.probes: dict[str, Probe] = dict(probes or {})  # registered probe files, loaded
        self.controllers = controllers or ControllerRegistry()
        # Requests to stop, with the reason, reported to the scheduler with the step's output (engine.scheduler).
        self.stops: dict[str, str] = {}
        self.stats = RuntimeStats()
        self._version = 0  # bumped whenever a request's rows or dynamic state change (invalidates _batch)
        self._state = 0  # likewise, but not on release: what each request's cached batch values are valid for
        self._columns = Columns()
        self.registry = RequestRegistry(shape, tables, self.limits, self._touch)
        # the registry's own containers (never rebound): what the engine glue and callers read
        self.requests, self.named, self.pool = self.registry.entries, self.registry.named, self.registry.pool
        self.inline_forward = False  # set by the engine adapter from DynsteerConfig.forward
        self.fuse_norms = False  # likewise: sites run inside the following add + RMS norm where the layer allows
        self.hooks: dict[SiteKey, SiteHook] = {}  # the SiteHook of every hooked place, filled as layers are built
        self.delivery: CaptureDelivery | NullCaptureDelivery = NullCaptureDelivery()  # attach_capture
        self.streams: StreamPublisher | NullStreamPublisher = NullStreamPublisher()  # attach_hub
        # the engine's configured consumer names (every rank: only TP rank 0 builds the consumers themselves);
        # None leaves captures' consumers unchecked (a runtime built outside an engine)
        self.consumer_names: frozenset[str] | None = None
        self._staging = StagingRing(tables.row_index)
        # The rows row_index holds on the device: these first, 0 past them (every upload clears up to the last
        # one's extent, and only plan writes it).
        self._staged_rows = np.zeros(0, np.int32)
        g = tables.gate_buffers
        self.dynamic_tier: DynamicTier | NullDynamicTier = (DynamicTier(
            DynamicDriver(g["gate_mul"], g["gate_add"], g["scores"], g["gates"], max_slots=sync_slots),
            self.controllers, shape.max_dyn_scale, TraceStore(self.limits, self.stats), self._touch)
            if g else NullDynamicTier())
        self.step = 0  # the engine core's step number (scheduler output), named by stream frames
        # monitors' commands per request id, kept across preemption (a resumed request is admitted again)
        self._cmd_specs: dict[str, SteeringSpec] = {}
        self._cmd_policies: dict[str, DynamicSteeringPolicy] = {}
        self._deferred: dict[str, list[Command]] = {}  # commands for requests not admitted on this worker yet
        self._batch: BatchArrays | None = None
        self._arange = np.arange(tables.row_index.shape[0])
        self._decoding = np.ones(tables.row_index.shape[0], bool)  # read only: is_decode of a steady decode step
        # the batch arrays of the last step, when it was a decode step of every request (the next such step over
        # the same arrays has the same rows and the same dynamic tokens)
        self._steady: BatchArrays | None = None

    @property
    def dynamic(self) -> DynamicDriver | None:
        """The dynamic tier's driver (``None``: this engine has no gate buffers)."""
        return self.dynamic_tier.driver

    @property
    def capture(self) -> CaptureCollector | None:
        """The capture collector (``None``: this engine has no capture places)."""
        return self.delivery.collector

    @property
    def global_spec(self) -> SteeringSpec:
        return self.registry.global_spec

    @property
    def global_policy(self) -> DynamicSteeringPolicy | None:
        return self.registry.global_policy

    def _touch(self) -> None:
        self._version += 1
        self._state += 1

    # ---- control plane (collective_rpc, between steps) ---------------------------------------------------------------
    def register_vector(self, name: str, vector: np.ndarray) -> None:
        """Register (or replace) a named vector; refused, changing nothing, when it would exceed
        ``limits.max_named_vectors`` (every rank holds the same names, so every rank refuses alike)."""
        self.registry.register_vector(name, vector)

    def unregister_vector(self, name: str) -> None:
        """Forget a named vector (live requests that use it keep their rows; new ones naming it are refused)."""
        self.registry.unregister_vector(name)

    def set_global(self, spec: SteeringSpec, policy: DynamicSteeringPolicy | None = _KEEP) -> None:
        """Replace the global spec (and, if given, the global dynamic policy; ``None`` removes it); every live
        request's rows are recompiled (global is folded into rows)."""
        policy = self.global_policy if policy is _KEEP else policy
        if policy is not None and policy is not self.global_policy:
            policy = admit_policy(policy, self.probes, self.controllers, GLOBAL_POLICY)
        self.registry.check_global(spec, policy)  # validate before touching state
        old_entries = list(self.requests.items())
        for _, entry in old_entries:
            self.registry.release(entry)
        changed = policy != self.global_policy
        self.registry.set_global(spec, policy)
        for req_id, entry in old_entries:
            if changed and entry.policy is None:
                self._set_dyn(req_id, entry, fresh=True)
            self._assign_rows(req_id, entry)

    def global_fingerprint(self) -> str:
        """Hex id of the global prefill configuration ('' when prompts are unsteered globally)."""
        return self.registry.global_fingerprint()

    def attach_capture(self, collector: CaptureCollector, consumers: dict[str, CaptureConsumer]) -> None:
        self.delivery = CaptureDelivery(collector, consumers, self.stats)

    def stream_validator(self, allow_declare: bool) -> Callable[[str, dict[str, Any]], None]:
        """What checks a stream a subscriber declares (runs on the hub's I/O thread; raises ValueError naming the
        field)."""
        return stream_validator(allow_declare, lambda: self.delivery.engine_places)

    def attach_hub(self, hub: StreamHub, declared: dict[str, StreamSpec],
                   header: dict[str, Any] | None = None) -> None:
        """Publish streams through ``hub``; ``declared``: the engine's streams; ``header``: added to every frame's
        header (the data-parallel replica)."""
        self.streams = StreamPublisher(hub, self.stats, header)
        for name, spec in declared.items():
            hub.declare(name, spec.model_dump(mode="json"))
        if self.capture is not None:
            self.capture.on_stream = self.streams.publish

    # ---- requests ----------------------------------------------------------------------------------------------------
    def release(self, req_ids: Iterable[str], finished: bool = True) -> None:
        """Drop finished or preempted requests' rows; a resumed request is admitted again on its next step.

        A preempted request keeps its capture record (its ledger skips the positions it recomputes); a finished one
        hands the record to its consumers.
        """
        # sorted: vLLM hands a set, whose order varies per process (string hashing); every TP rank must free slots
        # and rows in the same order to keep identical buffers
        state = self._state
        for req_id in sorted(req_ids):
            # the batch arrays are gathered again only when something was released (the runner calls this every
            # step, usually with no ids: bumping regardless re-gathered every request at every step)
            self._version += 1
            self._columns.forget(req_id)
            entry = self.requests.pop(req_id, None)
            if entry is not None:
                self.registry.release(entry)
            if finished:
                self.dynamic_tier.finish(req_id, entry)
                self._cmd_specs.pop(req_id, None)
                self._cmd_policies.pop(req_id, None)
                self._deferred.pop(req_id, None)
                self.delivery.finish(req_id)
        if finished and not self.requests:  # nothing left to run: finished records are delivered now, not next step
            self.delivery.complete()
        self._state = state  # what a release changes concerns the released requests alone: their values are forgotten

    def admit(self, req_id: str, payload: Any, prompt_len: int) -> RequestEntry:
        """Register a request on first sight. Any error stops the request alone (reported to the scheduler, which
        finishes it with the reason); it runs unsteered until then and the engine keeps serving."""
        spec = tag = policy = None
        capture: CaptureSpec | None = None
        error = None
        trace = False
        report = None
        payload_key = body_digest(payload_body(payload)) if isinstance(payload, str) else None
        if payload is not None:
            try:
                decoded = decode_payload(payload, limits=self.limits, digest=payload_key)
                spec, tag, capture, trace, report = (decoded.spec, decoded.tag, decoded.capture, decoded.trace,
                                                     decoded.report)
                if decoded.policy is not None:
                    policy = admit_policy(decoded.policy, self.probes, self.controllers, REQUEST_POLICY)
                if capture is not None:
                    capture.check(self.shape, self.delivery.engine_places, f"extra_args.{PAYLOAD_KEY}.capture",
                                  self.consumer_names)
            except Exception as exc:  # noqa: BLE001 - the frontend validates too; this catches what bypassed it
                error = self._stop(req_id, exc)
        entry = RequestEntry(prompt_len=prompt_len, spec=spec, tag=tag, error=error, policy=policy, trace=trace,
                             report=report,
                             payload_key=payload_key,
                             cmd_spec=self._cmd_specs.get(req_id), cmd_policy=self._cmd_policies.get(req_id))
        for cmd in self._deferred.pop(req_id, ()):
            try:
                self._command_entry(req_id, entry, cmd)
            except Exception as exc:  # noqa: BLE001
                entry.error = self._stop(req_id, exc)
        self._set_dyn(req_id, entry, fresh=False)
        if report is not None:
            self.dynamic_tier.start_report(req_id, report, entry.dyn)
        self._assign_rows(req_id, entry)
        self.delivery.begin(req_id, tag, None if entry.error else capture, prompt_len)
        self.requests[req_id] = entry
        self.stats.admitted += 1
        return entry

    def _set_dyn(self, req_id: str, entry: RequestEntry, fresh: bool) -> None:
        """Give the request its dynamic state (a resumed request keeps the one it had before preemption)."""
        self._touch()
        try:
            # a report reads the trace's record, so a request asking for one keeps it too
            entry.dyn = self.dynamic_tier.attach(req_id, self.registry.effective_policy(entry),
                                                 entry.trace or entry.report is not None, fresh)
        except ControllerOptionsError as exc:
            where = f"extra_args.{PAYLOAD_KEY}.policy" if entry.policy is not None else "global_policy"
            entry.error = self._stop(req_id, SteeringValidationError(f"{where}.controller.options: {exc}"))
            entry.dyn = None

    def _assign_rows(self, req_id: str, entry: RequestEntry) -> None:
        try:
            self.registry.assign(entry)
        except Exception as exc:  # noqa: BLE001
            # The frontend validates at admission and the scheduler holds requests until rows are free, so this is
            # rare (a vector name unregistered mid-flight, rows taken by a global change): the request stops with
            # the reason (never silently unsteered), the others go on.
            if isinstance(exc, RowsExhausted):
                self.stats.rows_exhausted += 1
            entry.error = self._stop(req_id, exc)
            entry.dyn = None
            self.dynamic_tier.drop(req_id)
            entry.prefill, entry.decode, entry.rows = EMPTY, EMPTY, (0, 0)

    # ---- a monitor's commands ----------------------------------------------------------------------------------------
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
        cmd = COMMAND_ADAPTER.validate_python(raw)
        if cmd.op == "global":  # validated by the engine core exactly as set_global compiles it
            self.set_global(cmd.spec if cmd.spec is not None else SteeringSpec(), cmd.policy)
            return
        entry = self.requests.get(cmd.request)
        if entry is None:
            self._deferred.setdefault(cmd.request, []).append(cmd)
            return
        self._command_entry(cmd.request, entry, cmd)
        if isinstance(cmd, SteerCommand) and entry.error is None:
            self.registry.release(entry)
            self._assign_rows(cmd.request, entry)

    def _command_entry(self, req_id: str, entry: RequestEntry, cmd: Command) -> None:
        """Record a command on the request (kept across preemption) and on its entry: a ``steer`` command's spec,
        or the request's policy as a ``threshold`` or ``rule`` command patches it (then retuned)."""
        patch = apply_command(CommandPatch(self._cmd_specs.get(req_id), self._cmd_policies.get(req_id)), cmd,
                              self.registry.global_config, Configuration(entry.spec, entry.policy))
        if isinstance(cmd, SteerCommand):
            if patch.spec is None:
                self._cmd_specs.pop(req_id, None)
            else:
                self._cmd_specs[req_id] = patch.spec
            entry.cmd_spec = patch.spec
            return
        # (abort commands never reach the workers)
        self._cmd_policies[req_id] = entry.cmd_policy = patch.policy
        self.retune(req_id, entry)

    def retune(self, req_id: str, entry: RequestEntry) -> None:
        """Move a request's gate parameters to its commanded policy (``entry.cmd_policy``: same slots, new
        thresholds or rule switches) in every copy: the host state and the device controller slot (the dynamic
        tier's driver; the controller state is kept), then the table row (recompiled), so the step's forward, its
        update kernel and the host all use them from this step on. Every retune goes through here: a live
        request's command, and one deferred to its (re-)admission, where a preempted request's state is retuned and
        its rows are assigned next."""
        self._state += 1  # its gate slots' actions may change (the batch values' act mask)
        self.dynamic_tier.retune(req_id, entry.cmd_policy)
        if entry.error is None and self.requests.get(req_id) is entry:
            self.registry.release(entry)
            self._assign_rows(req_id, entry)

    # ---- what the runner glue and the caller take --------------------------------------------------------------------
    def take_acts(self) -> Acts:
        """Where dynamic steering acted, from the read-backs landed since the last call (see
        ``engine.scheduler.ACTS_ATTR``); polls without waiting first."""
        return self.dynamic_tier.take_acts()

    def take_aborts(self) -> dict[str, str]:
        """Requests whose policy's abort rule fired, from the read-backs landed so far (polled without waiting),
        with their stop reasons: the runner glue reports them with the step's output and the scheduler finishes
        them at that output (their tokens so far delivered, their blocks shareable)."""
        return self.dynamic_tier.take_aborts(self.requests)

    def take_reports(self) -> dict[str, dict[str, Any]]:
        """Report deltas of requests that asked for a report (``dynsteer.steering.dynamic.reports``), from the
        read-backs landed so far (polled without waiting); ``{}`` at the cost of one check while none did."""
        return self.dynamic_tier.take_reports()

    def take_stops(self) -> dict[str, str]:
        """Requests to stop since the last call, with their reasons (the runner glue reports them with the step's
        output; the scheduler finishes them and never shares their KV blocks)."""
        stops, self.stops = self.stops, {}
        return stops

    def take_captures(self, tags: Iterable[str]) -> list[CaptureRecord]:
        """Finish live records with these tags (the caller knows they are done) and take them from memory."""
        return self.delivery.take(tags)

    def take_traces(self, tags: Iterable[str]) -> list[dict[str, Any]]:
        """Traces of finished requests with these tags (each can be taken once).

        The caller knows these requests are done; the scheduler tells the runner only at the next step, so live
        states with these tags are finished here.
        """
        return self.dynamic_tier.take_traces(tags, self.requests)

    def _stop(self, req_id: str, error: BaseException) -> str:
        """Record that ``req_id`` must stop: a validation error names its field; anything else is internal."""
        if isinstance(error, (SteeringValidationError, RowsExhausted, ControllerFault)):
            message = str(error)
        else:
            message = f"internal error while admitting the request: {error!r}"
        self.stops.setdefault(req_id, f"dynsteer: {message}")
        self._record_error(f"request {req_id}: {message}")
        return message

    def _record_error(self, message: str) -> None:
        self.stats.rejected += 1
        self.stats.errors = (self.stats.errors + [message])[-32:]
        logger.error("dynsteer: %s; the request is stopped", message)

    # ---- data plane (once per step) ----------------------------------------------------------------------------------
    def plan(self, view: BatchView, payload_of: PayloadLookup) -> None:
        """Fill ``row_index`` for this step (padding and unsteered tokens read row 0).

        Per-request arrays are gathered only when the batch's composition or a request's state changed (admission
        happens then), each request's values from a cache kept while its state is unchanged (a new composition
        costs a lookup per request); per-token work is vectorised. An unsteered batch after an unsteered step writes
        nothing.
        The index reaches the device through a pinned staging ring with a non-blocking copy, so the host never
        waits for the GPU here (a blocking copy would serialise vLLM's asynchronous scheduling with the forward).
        """
        self.stats.steps += 1
        n_req = len(view.req_ids)
        ids = tuple(view.req_ids[:n_req])
        b = self._batch
        if self.streams.stale():
            self.streams.refresh(self.delivery.places)
            self._version += 1
        if b is None or b.version != self._version or b.ids != ids:
            b = self._batch = self._gather(ids, view, payload_of)
        qsl = view.query_start_loc
        n = view.num_tokens
        # A decode step over the same arrays as a decode step of every request: every request still decodes (its
        # position only grew), so its tokens read the rows the device holds and are the same dynamic tokens.
        steady = n == n_req and b is self._steady
        if n == n_req:  # one token per request (a decode step)
            req_of_token = self._arange[:n]
            position = np.asarray(view.num_computed[:n_req], np.int64)
        else:
            qsl = np.asarray(qsl[: n_req + 1], np.int64)
            counts = np.diff(qsl)
            req_of_token = np.repeat(self._arange[:n_req], counts)
            position = np.asarray(view.num_computed[:n_req], np.int64)[req_of_token] + (
                self._arange[:n] - np.repeat(qsl[:-1], counts))
        if steady:
            is_decode = self._decoding[:n]
        else:
            is_decode = position >= b.prompt_lens[req_of_token]
            self._steady = b if n == n_req and is_decode.all() else None
        dyn = self.dynamic_tier
        if dyn.retuning:
            dyn.note_retunes(ids, view.num_computed)
        streams = (self.streams.select(b.streams, self.step, ids, req_of_token, position, is_decode)
                   if b.streams else [])
        self.delivery.plan(ids, view.query_start_loc, view.num_computed, streams)
        if not steady and (b.steered or self._staged_rows.size):  # else row_index holds this step's rows already
            rows = b.rows[req_of_token, is_decode.astype(np.int64)] if b.steered else np.zeros(0, np.int32)
            # a steady decode step reads the rows of the step before: the device holds them already
            if not np.array_equal(rows, self._staged_rows):
                upto = max(n, self._staged_rows.size, view.num_tokens_padded)
                idx = self._staging.next()
                idx[:rows.size] = rows
                idx[rows.size:upto] = 0
                self._staging.copy_to(upto)
                self._staged_rows = rows
        if dyn.live:
            faults = dyn.plan(b, ids, req_of_token, position, is_decode, max(n, view.num_tokens_padded), steady)
            if faults:
                self._stop_faulted(faults)
        if dyn.finishing:
            dyn.complete_traces()

    def _gather(self, ids: tuple[str, ...], view: BatchView, payload_of: PayloadLookup) -> BatchArrays:
        """Admit the batch's new requests and gather every request's arrays (once per batch composition)."""
        self._columns.begin(self._state)
        get = self.requests.get
        entries = [get(r) for r in ids]
        for i in [i for i, e in enumerate(entries) if e is None]:  # (not `None in`: entries compare by value)
            entries[i] = self.admit(ids[i], payload_of(ids[i]), int(view.prompt_lens[i]))
        b = self._columns.gather(ids, entries, self._state, self._version, self.streams.specs)
        # each site's summary: what the batch's rows hold there (the kernels skip a site whose summary is 0)
        self.tables.summarize(np.unique(b.rows))
        return b

    def _stop_faulted(self, faults: dict[str, str]) -> None:
        """Requests whose custom controller failed: stop them, and steer them no further meanwhile (their decode
        rows are released: the next steps run them unsteered until the scheduler finishes them)."""
        for req_id, message in faults.items():
            self._stop(req_id, SteeringValidationError(f"policy.controller: {message}"))
            entry = self.requests.get(req_id)
            if entry is not None:
                entry.error = message
                self.registry.release(entry)
                entry.dyn = None
            self.dynamic_tier.drop(req_id)

    def after_forward(self) -> None:
        """Called once the step's forward is enqueued: start copying captured rows and read-backs out."""
        self.delivery.after_forward()
        self.dynamic_tier.after_forward()

    def describe(self) -> dict[str, Any]:
        """JSON-friendly state for ``collective_rpc`` callers."""
        return {"shape": self.shape.model_dump(mode="json"), **self.registry.describe(),
                "live_requests": len(self.requests), "named_vectors": sorted(self.named),
                "global_empty": self.global_spec.is_empty(), "table_bytes": self.tables.nbytes(),
                "stats": vars(self.stats).copy(),
                "forward": {"inline": self.inline_forward,
                            "fused_into_norm": sorted(f"{k[0]}:{k[1]}" for k, h in self.hooks.items()
                                                      if h.fused)},
                "dynamic": self.dynamic_tier.describe(self.global_policy is not None)}
