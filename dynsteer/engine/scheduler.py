"""Engine core: stop the requests the workers report, hold requests until their table rows are free, and never share
the KV blocks of a stopped request.

The scheduler class is patched in place (no ``--scheduler-cls``, so a user's own scheduler subclass keeps working):

* **Stops.** A worker that cannot steer a request as asked (a payload that bypassed admission, a custom controller
  that failed, no free table row) records a reason; the runner glue attaches the step's reasons to its output
  (``STOPS_ATTR``). The scheduler finishes those requests as aborted with ``stop_reason = "dynsteer: <field>:
  <message>"`` (the OpenAI server answers with that reason, the offline API sets ``finish_reason="abort"``), drops
  the tokens of that step, evicts the request's exclusive KV blocks from the prefix cache and has the workers zero
  them before they are reused (vLLM's own ``new_block_ids_to_zero`` path): what a stopped request computed is never
  served to, nor left stale for, another request.
* **Rows.** Each steered request takes up to two table rows (its prefill and decode configurations, shared by every
  request with the same configuration; admission stores their digests in ``extra_args``). The scheduler mirrors the
  workers' row pool and does not start a request whose configuration would need a row when all are taken: it waits
  in the queue, like a request that needs KV blocks, until a steered request finishes.

vLLM calls some methods once per request and step (``allocate_slots``, ``cache_blocks``, ``_update_request_with_output``,
``Request.update_block_hashes``). dynsteer's versions of them run only while a live request needs them: one waiting
for rows, one whose block hashing a dynamic policy holds back or a command forked (``prefix_cache``), a step with
stops.
Otherwise vLLM's own methods run, and an unsteered step calls no dynsteer code per request.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from dynsteer.config import DynsteerConfig
from dynsteer.engine import patching
from dynsteer.engine.command_desk import CommandDesk
from dynsteer.engine.keys import (ABORTS_ATTR, ACTED_ATTR, ACTS_ATTR, COMMANDS_ATTR, DYNAMIC_KEY, REPORTS_ATTR,
                                  ROWS_KEY, SCHEDULER_ATTR, STEP_ATTR, STOPS_ATTR)
from dynsteer.engine.patching import Switch
from dynsteer.engine.prefix_cache import ActedState, hash_limit, resalt
from dynsteer.engine.reports import ReportRelay
from dynsteer.spec import SteeringValidationError

logger = logging.getLogger("dynsteer")

# What the workers report with a step's output (engine.keys), read in update_from_output:
# STOPS_ATTR: {request id: reason} of requests the workers stopped at that step.
# ABORTS_ATTR: {request id: reason} of requests whose policy's abort rule fired (they finish at that output, with its
#   tokens; their blocks stay shareable).
# ACTS_ATTR: a list of ActedReports (steering.dynamic.tokens), one per read-back, a column per request: the workers
#   computed and read back every decode position < upto of a request with a dynamic policy; steering first acted in
#   that read-back (under signature) at acted_at (-1: it did not). Folded into block hashes (engine.prefix_cache).
# REPORTS_ATTR: {request id: report delta} of requests that asked for a report; relayed to the frontend with their
#   outputs, a final output held until its values have arrived (engine.reports).


@dataclass
class SchedulerState:
    """dynsteer's bookkeeping in the engine core."""

    capacity: int
    live: Counter = field(default_factory=Counter)  # row digest -> live requests using it
    holding: dict[str, tuple[str, ...]] = field(default_factory=dict)  # request id -> its row digests
    stops: dict[str, str] = field(default_factory=dict)  # this step's reports, while update_from_output runs
    to_zero: list[int] = field(default_factory=list)  # blocks of stopped requests, zeroed before reuse
    stopped: set[str] = field(default_factory=set)  # stopped requests whose blocks are not freed yet
    waits: int = 0  # allocations refused for lack of rows (a request waited a step)
    stopped_total: int = 0
    aborts: dict[str, str] = field(default_factory=dict)  # monitors' aborts, finished at the next output
    step: int = 0  # schedule() calls so far: the step number acks and stream frames name
    desk: CommandDesk | None = None  # the async tier's command desk, when a monitor channel is configured
    hash_block_size: int = 16
    # set by a monitor's global command (engine.command_desk): requests added from then on are salted with it, since
    # the frontend salted them by the global it knows; "" when the frontend's view is current
    global_salt: str = ""
    # Requests that need the per-request hooks below; while none does, vLLM's own methods run (no per-request
    # Python of dynsteer's in a step). pending: requests with rows to take before their next allocation (new or
    # preempted); held: live requests whose block hashing dynsteer holds back (dynamic policy) or forked (commands).
    pending: set[str] = field(default_factory=set)
    held: set[str] = field(default_factory=set)
    alloc_hook: Switch | None = None  # the KV cache manager's allocate_slots: the row check
    cache_hook: Switch | None = None  # the coordinator's cache_blocks: cache no further than hashed
    reports: ReportRelay = field(default_factory=ReportRelay)  # report requests' values on their way (engine.reports)

    def sync_hooks(self) -> None:
        """Put the per-request hooks in while some request needs them, vLLM's own methods otherwise."""
        if self.alloc_hook is not None:
            self.alloc_hook.set(bool(self.pending))
        if self.cache_hook is not None:
            self.cache_hook.set(bool(self.held))

    def hold(self, req_id: str) -> None:
        """``req_id``'s block hashing is held back or forked by dynsteer from now on (until it finishes)."""
        self.held.add(req_id)
        self.sync_hooks()

    def fits(self, rows: tuple[str, ...]) -> bool:
        new = sum(1 for d in set(rows) if d not in self.live)
        return len(self.live) + new <= self.capacity

    def take(self, req_id: str, rows: tuple[str, ...]) -> None:
        self.holding[req_id] = rows
        self.live.update(set(rows))

    def release(self, req_id: str) -> None:
        rows = self.holding.pop(req_id, ())
        for d in set(rows):
            self.live[d] -= 1
            if self.live[d] <= 0:
                del self.live[d]

    def swap_decode_row(self, request: Any, decode: str) -> None:
        """A command gives ``request`` a new decode configuration (digest ``decode``, '' if unsteered): move it to
        that row in this mirror of the workers' row pool.

        Raises:
            SteeringValidationError: no row is free for it (the command is rejected; nothing changed).
        """
        params = request.sampling_params
        extra = dict((params.extra_args if params is not None else None) or {})
        prefill = (extra.get(ROWS_KEY) or ",").split(",", 1)[0]
        rows = tuple(d for d in (prefill, decode) if d)
        if request.request_id in self.holding:
            old = self.holding[request.request_id]
            self.release(request.request_id)
            if not self.fits(rows):
                self.take(request.request_id, old)
                raise SteeringValidationError(f"command: no free steering row for the new configuration (all "
                                              f"{self.capacity} in use; raise DynsteerConfig.max_rows)")
            self.take(request.request_id, rows)
        elif rows:  # not admitted yet (or preempted): the row check runs when it is
            self.pending.add(request.request_id)
            self.sync_hooks()
        if params is not None:
            extra[ROWS_KEY] = f"{prefill},{decode}"
            params.extra_args = extra


def rows_of(request: Any) -> tuple[str, ...]:
    """The non-empty row digests admission recorded for ``request``."""
    params = getattr(request, "sampling_params", None)
    raw = ((params.extra_args if params is not None else None) or {}).get(ROWS_KEY)
    if not isinstance(raw, str):
        return ()
    return tuple(d for d in raw.split(",") if d)


def patch_scheduler(cls: type) -> None:
    """Patch vLLM's ``Scheduler`` (the async scheduler derives from it)."""
    if patching.is_patched(cls, "schedule"):
        return
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import RequestStatus

    orig_init, orig_update, orig_add = cls.__init__, cls.update_from_output, cls.add_request
    orig_update_req, orig_free_blocks, orig_schedule = (cls._update_request_with_output, cls._free_request_blocks,
                                                        cls.schedule)

    @functools.wraps(orig_init)
    def __init__(self: Any, *a: Any, **k: Any) -> None:
        orig_init(self, *a, **k)
        cfg = DynsteerConfig.from_additional(self.vllm_config.additional_config)
        state = SchedulerState(capacity=cfg.max_rows - 1)
        setattr(self, SCHEDULER_ATTR, state)
        if cfg.monitor is not None:
            state.desk = CommandDesk(cfg, self.vllm_config)
        kvm = self.kv_cache_manager
        orig_alloc = kvm.allocate_slots

        @functools.wraps(orig_alloc)
        def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
            req_id = request.request_id
            if request.status == RequestStatus.RUNNING or req_id in state.holding or req_id not in state.pending:
                return orig_alloc(request, *args, **kwargs)
            rows = rows_of(request)
            if rows and not state.fits(rows):
                state.waits += 1
                return None  # as if KV blocks were short: the request stays queued until rows are released
            out = orig_alloc(request, *args, **kwargs)
            if out is not None:
                if rows:
                    state.take(req_id, rows)
                state.pending.discard(req_id)
                state.sync_hooks()
            return out

        state.alloc_hook = Switch(kvm, "allocate_slots", allocate_slots,
                                  why="a request waits in the queue while its steering rows are all taken")
        coordinator = kvm.coordinator
        orig_cache = coordinator.cache_blocks
        hash_block_size = state.hash_block_size = (getattr(coordinator.block_pool, "hash_block_size", None)
                                                   or self.block_size)

        @functools.wraps(orig_cache)
        def cache_blocks(request: Any, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
            # A request with a dynamic policy has hashes only for blocks the workers reported on: cache no further
            # (prefix_cache.hashed_tokens, inlined: this runs per request and step while any request is held).
            if ACTED_ATTR in request.__dict__:
                num_tokens = min(num_tokens, len(request.block_hashes) * hash_block_size)
            return orig_cache(request, num_tokens, *args, **kwargs)

        state.cache_hook = Switch(coordinator, "cache_blocks", cache_blocks,
                                  why="blocks of a request with a dynamic policy are cached no further than hashed")

    @functools.wraps(orig_add)
    def add_request(self: Any, request: Any, *a: Any, **k: Any) -> Any:
        state = getattr(self, SCHEDULER_ATTR)
        if state.global_salt:
            resalt(request, f"global:{state.global_salt}")
        params = getattr(request, "sampling_params", None)
        extra = (params.extra_args if params is not None else None) or {}
        if extra:  # the per-request hooks, for as long as this request needs them
            if rows_of(request):
                state.pending.add(request.request_id)
            if DYNAMIC_KEY in extra:
                state.held.add(request.request_id)
            state.sync_hooks()
        return orig_add(self, request, *a, **k)

    @functools.wraps(orig_schedule)
    def schedule(self: Any, *a: Any, **k: Any) -> Any:
        state = getattr(self, SCHEDULER_ATTR)
        state.step += 1
        # Commands are taken before vLLM schedules (and caches blocks for) this step: see engine.command_desk.
        commands = state.desk.take(self, state.step) if state.desk is not None else None
        out = orig_schedule(self, *a, **k)
        setattr(out, STEP_ATTR, state.step)
        if commands:
            setattr(out, COMMANDS_ATTR, commands)
        if state.to_zero:
            # Blocks freed by stopped requests: the workers zero them before this step's forward (ordered after any
            # step still writing them), so nothing they computed is read through a reused block.
            out.new_block_ids_to_zero = [*(out.new_block_ids_to_zero or ()), *state.to_zero]
            state.to_zero = []
        return out

    @functools.wraps(orig_update)
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        state = getattr(self, SCHEDULER_ATTR)
        state.stops = dict(getattr(model_runner_output, STOPS_ATTR, None) or {})
        aborts, state.aborts = state.aborts, {}
        for req_id, reason in (getattr(model_runner_output, ABORTS_ATTR, None) or {}).items():
            aborts.setdefault(req_id, reason)  # a monitor's abort taken at this step keeps its own reason
        _apply_acts(self, getattr(model_runner_output, ACTS_ATTR, None), state.hash_block_size)
        reports = getattr(model_runner_output, REPORTS_ATTR, None)
        if reports:  # before vLLM frees the requests this output finishes
            state.reports.fold(self, reports)
        swapped = bool(state.stops)
        if swapped:  # a step with stops (rare): the stop-aware per-request update, for this call only
            _STOP_AWARE.acquire(cls)
        try:
            outputs = orig_update(self, scheduler_output, model_runner_output)
            # Stopped requests that produced no token this step (still prefilling), and monitors' aborts (after
            # this output's tokens were delivered): finish them here.
            # A worker's stop wins over a monitor's abort: its blocks must be quarantined.
            for req_id, (reason, aborted) in {**{r: (m, True) for r, m in aborts.items()},
                                              **{r: (m, False) for r, m in state.stops.items()}}.items():
                request = self.requests.get(req_id)
                if request is None or request.is_finished():
                    continue
                if aborted:  # what it computed is sound: its blocks stay shareable
                    request.stop_reason = reason
                    logger.info("dynsteer: request %s aborted: %s", req_id, reason)
                else:
                    _mark_stopped(self, request, reason)
                for req in self.finish_requests([req_id], RequestStatus.FINISHED_ABORTED):
                    eco = outputs.setdefault(req.client_index, EngineCoreOutputs())
                    eco.outputs.append(EngineCoreOutput(request_id=req_id, new_token_ids=[],
                                                        finish_reason=req.get_finished_reason(),
                                                        stop_reason=req.stop_reason, events=req.take_events(),
                                                        trace_headers=req.trace_headers))
        finally:
            if swapped:
                _STOP_AWARE.release(cls)
            state.stops = {}
        if state.reports.buffers:
            state.reports.deliver(outputs, EngineCoreOutputs)
        return outputs

    @functools.wraps(orig_update_req)
    def _update_request_with_output(self: Any, request: Any, new_token_ids: list[int]) -> tuple[list[int], bool]:
        reason = getattr(self, SCHEDULER_ATTR).stops.get(request.request_id)
        if reason is None:
            return orig_update_req(self, request, new_token_ids)
        # This step's tokens came from a request dynsteer could not steer as asked: drop them, finish it.
        _mark_stopped(self, request, reason)
        request.status = RequestStatus.FINISHED_ABORTED
        return [], True

    _STOP_AWARE.register(cls, orig_update_req, _update_request_with_output)

    @functools.wraps(orig_free_blocks)
    def _free_request_blocks(self: Any, request: Any) -> Any:
        state = getattr(self, SCHEDULER_ATTR)
        req_id = request.request_id
        state.release(req_id)
        if request.is_finished():
            state.pending.discard(req_id)
            state.held.discard(req_id)
            if state.reports.buffers:
                state.reports.freed(req_id)
        elif rows_of(request):  # preempted: its rows are released, and taken again when it is resumed
            state.pending.add(req_id)
        state.sync_hooks()
        if req_id in state.stopped:
            state.stopped.discard(req_id)
            _quarantine_blocks(self, request)
        return orig_free_blocks(self, request)

    orig_has_finished = cls.has_finished_requests

    @functools.wraps(orig_has_finished)
    def has_finished_requests(self: Any) -> bool:
        # a final output held for its report values: keep stepping (empty steps), so the workers' read-backs land
        # and reach this process (engine.reports)
        return orig_has_finished(self) or bool(getattr(self, SCHEDULER_ATTR).reports.held)

    orig_shutdown = cls.shutdown

    @functools.wraps(orig_shutdown)
    def shutdown(self: Any) -> None:
        desk = getattr(getattr(self, SCHEDULER_ATTR, None), "desk", None)
        if desk is not None:
            desk.close()
        return orig_shutdown(self)

    for name, fn, why in (
            ("__init__", __init__, "dynsteer's engine-core state: the row mirror, the command desk, the switches"),
            ("add_request", add_request, "a request with rows or a dynamic policy switches the per-request hooks on"),
            ("schedule", schedule, "take monitors' commands at the step; number steps; zero stopped requests' blocks"),
            ("update_from_output", update_from_output, "finish requests the workers stopped or aborted; fold acts"),
            ("_free_request_blocks", _free_request_blocks, "release rows; quarantine a stopped request's blocks"),
            ("has_finished_requests", has_finished_requests,
             "keep stepping while a report request's final output waits for its values"),
            ("shutdown", shutdown, "close the command desk")):
        patching.patch(cls, name, fn, why=why)


class _StopAwareUpdate:
    """The scheduler class's ``_update_request_with_output`` is vLLM's own but while a step with stops is folded
    (reference-counted: engine cores in threads of one process share the class). vLLM calls it once per request
    and step; the subclass that async scheduling uses calls it through ``super()``, so it is swapped on the class."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users: dict[type, int] = {}
        self._methods: dict[type, tuple[Any, Any]] = {}

    def register(self, cls: type, orig: Any, aware: Any) -> None:
        patching.record(cls, "_update_request_with_output", aware, kind="switched",
                        why="for a step with stops: drop the stopped requests' tokens and finish them")
        self._methods[cls] = (orig, aware)

    def original(self, cls: type) -> Any:
        """vLLM's own method of ``cls`` (what the class holds while no step with stops is folded)."""
        return self._methods[cls][0]

    def acquire(self, cls: type) -> None:
        with self._lock:
            self._users[cls] = self._users.get(cls, 0) + 1
            if self._users[cls] == 1:
                cls._update_request_with_output = self._methods[cls][1]

    def release(self, cls: type) -> None:
        with self._lock:
            self._users[cls] -= 1
            if self._users[cls] == 0:
                cls._update_request_with_output = self._methods[cls][0]


_STOP_AWARE = _StopAwareUpdate()


def _apply_acts(scheduler: Any, acts: Any, hash_block_size: int) -> None:
    """Fold the workers' reports (``ActedReport``s) into their requests' hashing state, and hash the blocks they
    complete (before this step's new tokens are appended, which hashes again up to what is reported). Only the
    columns that can change a hash are visited: where steering acted, or a block's last token was read back (a
    request or two per step at batch 256, not every request). ``hash_block_size``: the block size the engine's
    request block hasher hashes at (``SchedulerState.hash_block_size``)."""
    if not acts:
        return
    from vllm.v1.request import RequestStatus

    get, todo, preempted = scheduler.requests.get, {}, RequestStatus.PREEMPTED  # statuses above it are finished
    for report in acts:
        for req_id, u, a, sig in report.rows(report.to_fold(hash_block_size)):  # kept to dict lookups and compares
            request = get(req_id)
            if request is None or request.status > preempted:  # (vLLM's Request.is_finished, inlined)
                continue
            acted = request.__dict__.get(ACTED_ATTR)
            if acted is None:
                acted = request.__dict__[ACTED_ATTR] = ActedState()
            if a < 0:  # nothing acted in this report: only how far it reaches
                if u > acted.reported:
                    acted.reported = u
            else:
                acted.report(u, a, sig)
            if request._block_hasher is None:
                continue
            # hash_limit is at most max(prompt, reported), which only grows: a request whose report completes no
            # block is not hashed again
            end = (len(request.block_hashes) + 1) * hash_block_size
            if end > acted.reported and end > request.num_prompt_tokens:
                continue
            todo[req_id] = request
    for request in todo.values():  # once every report is folded in
        if hash_limit(request, request.__dict__[ACTED_ATTR]) is not None:
            request.update_block_hashes()


def _mark_stopped(scheduler: Any, request: Any, reason: str) -> None:
    request.stop_reason = reason
    state = getattr(scheduler, SCHEDULER_ATTR)
    state.stopped.add(request.request_id)
    state.stopped_total += 1
    logger.warning("dynsteer: request %s stopped: %s", request.request_id, reason)


def _quarantine_blocks(scheduler: Any, request: Any) -> None:
    """Evict the blocks only this request holds from the prefix cache and queue them for zeroing.

    Blocks shared with other requests (prefix hits) were computed by someone else and are in use: they stay.
    """
    kvm = scheduler.kv_cache_manager
    try:
        groups = kvm.get_blocks(request.request_id).blocks
    except (KeyError, AttributeError):
        return
    own = {b.block_id for group in groups for b in group if b.ref_cnt == 1 and not getattr(b, "is_null", False)}
    if own:
        kvm.block_pool.evict_blocks(own)
        getattr(scheduler, SCHEDULER_ATTR).to_zero.extend(sorted(own))
