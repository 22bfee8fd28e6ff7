"""The dynamic tier's per-step driver: control words before each forward, the device sync tier's update and the
read-back of scores, gates and multipliers after it.

The sync tier (a controller, or a carried scope) runs on the device: each request's controller and carried gates
live in a slot of a persistent buffer; a control kernel writes every token's ``mul, add`` before the forward and an
update kernel advances the slots from the step's scores after it (``dynsteer.kernels.controller_reference``). The
host stages one int32 per token and never waits, so the latency is exactly one step and vLLM's asynchronous
scheduling stays on. Custom Python controllers keep a host path that waits for the previous step. Every rank runs
this on identical inputs (the same scheduler output and all-reduced residuals), so every rank takes the same
decisions.
"""

from __future__ import annotations

import hashlib
import heapq
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from dynsteer.controllers.registry import ControllerFault
from dynsteer.kernels.controller_reference import Layout, controller_row
from dynsteer.device.graphs import GraphedLaunch, bucket
from dynsteer.steering.dynamic.prompt_gates import PromptGates
from dynsteer.steering.dynamic.state import DynState, fired_aborts
from dynsteer.steering.dynamic.tokens import StepTokens, acted_report
from dynsteer.device.readback import ReadbackStore
from dynsteer.device.staging import HostRing, StagingRing

if TYPE_CHECKING:
    from dynsteer.policy import DynamicSteeringPolicy

#: ``req_id -> state`` of a live or finishing request (read-backs land after a request finished)
StateLookup = Callable[[str], DynState | None]


@dataclass
class _Pending:
    event: torch.cuda.Event | None
    host: np.ndarray  # [4G+1, m]: scores, applied gates, gate_mul, gate_add, scale of the step's dynamic tokens
    tokens: StepTokens


@dataclass
class SyncStats:
    """Cost of the dynamic tier's host side (milliseconds, summed over steps)."""

    dynamic_steps: int = 0
    sync_steps: int = 0  # steps with sync-tier tokens (device or host)
    host_sync_steps: int = 0  # steps that waited for the previous one (host-tier controllers)
    wait_ms: float = 0.0  # blocked waiting for the previous step's scores (host tier only)
    host_ms: float = 0.0  # staging the step (token control words, replay rows)
    controller_ms: float = 0.0  # read-back bookkeeping and host-tier controllers
    device_slots_in_use: int = 0
    device_slots_exhausted: int = 0  # sync-tier requests that ran in the host tier for lack of a device slot


#: rows of the int32 staging buffer: per-token control word, position, read-back columns, update list
CTL, POS, COLS, UPD = range(4)


class DynamicDriver:
    """Before each forward: stage one int32 control word per token and launch the control kernel (gate
    multipliers from the device sync tier's state); after it: launch the update kernel (controllers advance on the
    device) and copy the step's scores, gates and multipliers of dynamic tokens to the host on a side stream.

    The host waits for the device only for host-tier requests (custom controllers): every other step is planned
    while earlier ones still run. Kernels: ``dynsteer.kernels.controller_reference`` (contract, CPU) and
    ``dynsteer.kernels.triton_controller`` (CUDA).
    """

    def __init__(self, gate_mul: torch.Tensor, gate_add: torch.Tensor, scores: torch.Tensor,
                 gates: torch.Tensor, max_slots: int = 256, graphed: bool = True) -> None:
        from dynsteer.kernels.ops import runs_reference, select_controller_impl, select_readback_impl

        self.gate_mul, self.gate_add, self.scores, self.gates = gate_mul, gate_add, scores, gates
        self.cuda = gates.is_cuda
        G, N = gates.shape
        dev = gates.device
        gate_mul.fill_(1.0)
        gate_add.zero_()
        self.layout = Layout(G)
        # one row at least: the kernels index it even when every request runs in the host tier
        self.state = torch.zeros(max(max_slots, 1), self.layout.width, dtype=torch.float64, device=dev)
        self._init = torch.zeros(max(max_slots, 1), self.layout.width, dtype=torch.float64, device="cpu",
                                 pin_memory=self.cuda)
        self.max_slots = max_slots
        self._free_slots = list(range(max_slots))  # a min-heap: a request takes the lowest free slot, whatever
        # order others were freed in (identical slots, so bit-identical state buffers, on every TP rank)
        self.sched_pos = np.full(max(max_slots, 1), -1, np.int64)  # by device slot: the last position staged fresh
        self.records = ReadbackStore(self.layout.G * 4 + 1)
        self.scale_used = torch.ones(N, dtype=torch.float32, device=dev)
        # Column N is padding: its control word stays -1 (no fresh token), so update entries naming it are no-ops.
        self.words = torch.full((4, N + 1), -1, dtype=torch.int32, device=dev)
        self.replay = torch.zeros(N, 2 * G + 1, dtype=torch.float32, device=dev)
        self._words = StagingRing(self.words)
        for view in self._words.views:
            view[CTL, N] = -1
        self.max_tokens = N
        self._replay = StagingRing(self.replay)
        self.control, self.update = select_controller_impl(gates)
        self.readback = select_readback_impl(gates)
        self._side = torch.cuda.Stream(device=dev) if self.cuda else None
        # Pinned read-back buffers and events made once: a step's copy to the host allocates nothing.
        self._ring = HostRing((4 * G + 1) * N) if self.cuda else None
        self._fwd_done = torch.cuda.Event() if self.cuda else None
        self._pending: list[_Pending] = []
        self.faults: dict[str, str] = {}  # requests whose custom controller failed: stopped by the runtime
        self._step: tuple[StepTokens, int, int] | None = None
        self._dirty = 0  # gate multipliers [:dirty] may hold sync-tier values
        # The read-back columns the device's COLS row holds from the last columns-only upload (None: unknown, after
        # a whole-buffer upload): a steady decode reads the same columns every step and uploads them once.
        self._cols_on_device: np.ndarray | None = None
        self.prompt = PromptGates(gates, gate_mul, scores, max(max_slots, 256))

        def control_at(grid: int) -> None:  # the control kernel over tokens [0, grid) of the staged words
            self.control(self.words[CTL], self.state, self.replay, gate_mul, gate_add, self.scale_used, grid)

        def update_at(grid: int) -> None:  # the update kernel over the first `grid` entries of the update list
            self.update(self.words[UPD], self.words[CTL], self.words[POS], scores, self.state, grid)

        # The read-back writes a buffer of its own (a graph needs one that stays), reused once the previous step's
        # copy out of it has run (``_rb_copied``).
        self._rb_out = torch.empty((4 * G + 1) * N, dtype=torch.float32, device=dev)
        self._rb_copied: torch.cuda.Event | None = None

        def readback_at(grid: int) -> int:  # the read-back of staged columns [0, grid) into _rb_out
            self.readback(scores, gates, gate_mul, gate_add, self.scale_used, self.words[COLS, :grid],
                          out=self._rb_out)
            return grid

        if self.cuda:  # compile the kernels now, not at the first sync-tier step (a latency spike mid-serving)
            self.words[UPD, 0] = 0  # token 0's word is -1: nothing is updated
            self.words[COLS, 0] = 0
            control_at(1)
            update_at(1)
            readback_at(1)
            gate_mul.fill_(1.0)
        # On CUDA the three replay from CUDA graphs (their buffers never move): ~3 µs of host time per launch instead
        # of Triton's ~25 (benchmarks/sync_host.py). Grids round up to a power of two; plan makes the extra programs
        # harmless (control words -1 up to the grid, update entries naming the padding column, read-back columns 0
        # whose values are not taken).
        self.graphed = self.cuda and graphed and not runs_reference(gates)
        if self.graphed:
            control_at, update_at, readback_at = (GraphedLaunch(control_at, N, dev), GraphedLaunch(update_at, N, dev),
                                                  GraphedLaunch(readback_at, N, dev))
        self._control_at, self._update_at, self._readback_at = control_at, update_at, readback_at
        self.report_acts = False  # report where dynamic steering acted (the engine core's prefix-cache hashing)
        # per completed read-back: (request ids, upto, first acted position or -1, signature) by request run
        self.acts: list[tuple[list[str], list[int], list[int], list[str]]] = []
        self.abort_watch: set[str] = set()  # live requests with abort rules not fired yet (the runtime adds them)
        self.aborts: dict[str, tuple[int, str]] = {}  # req_id -> (position, reason): fired, not yet reported
        self.enqueued = 0  # read-backs started
        self.completed = 0  # read-backs fed to their requests
        self.host_tier = 0  # live requests in the host tier (their steps wait for the previous one)
        self.stats = SyncStats()

    # ---- slots -------------------------------------------------------------------------------------------------------
    def place(self, st: DynState) -> None:
        """Register a new request's state: a sync-tier request goes to the device tier (a free slot, its row written
        asynchronously) when the kernel implements its controller and a slot is free (else the host tier,
        counted)."""
        if st.tier:
            return
        self.prompt.place(st)
        if not st.sync:
            st.tier = "plain"
        elif not st.device_eligible or not self._free_slots:
            self.stats.device_slots_exhausted += int(st.device_eligible and self.max_slots > 0)
            self.host_tier += 1
            st.tier = "host"
        else:
            s = heapq.heappop(self._free_slots)
            self._init[s] = torch.tensor(controller_row(self.layout, st.slots, st.ctrl_slot, st.ctrl_spec),
                                         dtype=torch.float64)
            # Ordered on the compute stream after every step that used the slot before (its last update included).
            self.state[s].copy_(self._init[s], non_blocking=self.cuda)
            self.sched_pos[s] = -1
            st.device_slot, st.tier = s, "device"
            self.stats.device_slots_in_use += 1
        if st.keep or st.tier == "device":
            st.record = self.records.acquire()

    def state_digest(self) -> tuple[str, int]:
        """blake2b of the device controller state (every slot, finished requests' last states included) and how
        many slots hold a non-zero row: TP ranks must agree bit for bit. Synchronises with the device (diagnostic)."""
        host = self.state.detach().cpu().numpy()
        return hashlib.blake2b(host.tobytes(), digest_size=16).hexdigest(), int(np.count_nonzero(host.any(axis=1)))

    def retune(self, st: DynState, policy: DynamicSteeringPolicy) -> None:
        """Move a live request's gate parameters to ``policy``'s (a monitor's ``threshold`` or ``rule`` command) in
        every copy the driver keeps: the host's (read-backs, host-tier controllers) and, in the device tier, its
        slot of the controller state, which carries ``next_step`` / ``rest_of_request`` gates and feeds its
        controller. Called only by ``SteeringRuntime.retune``, which recompiles the table row (the in-graph gate) in
        the same step, so the step's forward, its update kernel and the host all use the new parameters from that
        step on."""
        st.retune(policy)
        if st.device_slot is None:
            return
        L, s = self.layout, st.device_slot
        lo, hi = L.sharp(0), L.floor(0) + L.G  # every slot's sharpness, threshold and floor: one span of columns
        row = controller_row(L, st.slots, st.ctrl_slot, st.ctrl_spec)
        # The pinned row may still feed an earlier copy into this slot; both carry the newest values for these
        # columns, and a later request's placement overwrites the whole row after this copy on the same stream.
        self._init[s, lo:hi] = torch.tensor(row[lo:hi], dtype=torch.float64)
        self.state[s, lo:hi].copy_(self._init[s, lo:hi], non_blocking=self.cuda)

    def free(self, st: DynState) -> None:
        """The request finished (or its policy was replaced): release its slot or its host-tier place, once."""
        self.prompt.free(st)
        if st.tier == "host":
            self.host_tier -= 1
            st.tier = "host-freed"
        if st.device_slot is not None:
            heapq.heappush(self._free_slots, st.device_slot)
            st.device_slot = None
            self.stats.device_slots_in_use -= 1

    def retire(self, st: DynState) -> None:
        """The request's record is no longer needed (its trace was taken, or nobody asked for one): its slot is
        reused once the read-backs in flight, which may name it, have landed."""
        if st.record is not None:
            self.records.retire(st.record, self.enqueued)
            st.record = None

    # ---- per step ----------------------------------------------------------------------------------------------------
    def plan(self, states: dict[str, DynState], lookup: StateLookup, tokens: StepTokens, upto: int) -> None:
        """Stage this step's control words (and replay rows) and launch the control kernel.

        Args:
            states: live requests' states by id.
            lookup: ``req_id -> state`` for read-backs, including requests that finished since.
            tokens: this step's dynamic decode tokens.
            upto: tokens of this step, padding included.
        """
        t1 = time.perf_counter()
        if self.host_tier > 0:  # host-tier controllers decide this step's multipliers from the previous one's scores
            self.poll(lookup, block=True)
            t0, t1 = t1, time.perf_counter()
            self.stats.wait_ms += (t1 - t0) * 1e3
            self.stats.host_sync_steps += 1
        # Otherwise read-backs are fed in after_forward: this is the stretch of the step between vLLM's inputs and
        # the forward's launch, where the device may be waiting for the host.
        self._step = None
        if not len(tokens):
            return
        self.stats.dynamic_steps += 1
        # Read back only what someone reads: a record (a trace, device-tier replays), a host-tier controller, or
        # the prefix cache (where steering acted). Untraced plain gates without prefix caching cost no host work.
        read = (np.arange(len(tokens)) if self.report_acts
                else np.flatnonzero((tokens.record >= 0) | tokens.host))
        any_sync = bool(tokens.sync.any())
        if not len(read) and not self._dirty and not any_sync:
            return
        m = len(read)
        if not any_sync and not self._dirty:  # gates only (no control kernel): the read-back's columns suffice
            self._stage_reads(tokens, read)
            self.stats.host_ms += (time.perf_counter() - t1) * 1e3
            return
        # Columns up to the last sync step's extent may hold its multipliers: they get words (-1: defaults) too.
        span = max(upto, self._dirty)
        grid = bucket(span, self.max_tokens) if self.graphed else span
        words = self._words.next()
        words[CTL, :grid] = -1
        self._stage_cols(words, tokens, read)
        slot, position = tokens.slot, tokens.position
        dev = (slot >= 0) & (position > self.sched_pos[np.maximum(slot, 0)])  # fresh device-tier tokens
        d = np.flatnonzero(dev)
        upd = tokens.index[d]
        words[CTL, upd] = slot[d]
        words[POS, upd] = position[d]
        words[UPD, :len(upd)] = upd
        if self.graphed and len(upd):
            words[UPD, len(upd):bucket(len(upd), self.max_tokens)] = self.max_tokens  # the padding column
        if len(d):
            sd, pd = slot[d], position[d]
            last = np.ones(len(d), bool)  # each request's last fresh token (its highest position)
            last[:-1] = sd[1:] != sd[:-1]
            self.sched_pos[sd[last]] = pd[last]
        # host-tier tokens, and recomputed positions of device-tier requests, take staged replay rows
        replays = np.flatnonzero(tokens.sync & ~dev)
        if len(replays):
            self._stage_replays(states, lookup, tokens, replays, words)
        n_sync = len(upd) + len(replays)
        if n_sync:
            self.stats.sync_steps += 1
        self._words.copy_to()
        self._cols_on_device = None  # the whole buffer went up: its COLS row is this slot's
        if n_sync or self._dirty:
            self._control_at(span)
            self._dirty = span if n_sync else 0
        self._step = (self._read_tokens(tokens, read), len(upd), m)
        self.stats.host_ms += (time.perf_counter() - t1) * 1e3

    def _stage_reads(self, tokens: StepTokens, read: np.ndarray) -> None:
        """A step of plain gates read back (traces, prefix caching): only the read-back's column list goes to the
        device (its row of the control words, up to the read-back's grid), not the whole (4, N+1) buffer."""
        cols = tokens.index if len(read) == len(tokens) else tokens.index[read]
        known = self._cols_on_device
        if known is None or (known is not cols and not np.array_equal(known, cols)):
            words = self._words.next()
            self._words.copy_to(self._stage_cols(words, tokens, read), row=COLS)
            self._cols_on_device = cols
        self._step = (self._read_tokens(tokens, read), 0, len(read))

    def _stage_cols(self, words: np.ndarray, tokens: StepTokens, read: np.ndarray) -> int:
        """Stage the read-back's token columns; returns its grid (graphed: the bucket, whose extra columns read
        column 0 and are not taken)."""
        m = len(read)
        words[COLS, :m] = tokens.index[read]
        grid = bucket(m, self.max_tokens) if self.graphed and m else m
        words[COLS, m:grid] = 0
        return grid

    @staticmethod
    def _read_tokens(tokens: StepTokens, read: np.ndarray) -> StepTokens:
        """The tokens read back (``read``: sorted indices into ``tokens``): all of them without a copy."""
        return tokens if len(read) == len(tokens) else tokens.subset(read)

    def stage_prompt(self, states: list[DynState | None], decode: np.ndarray, d_req: np.ndarray, prompt: np.ndarray,
                     p_req: np.ndarray, p_pos: np.ndarray, p_len: np.ndarray, upto: int) -> None:
        """Prompt-level gates of this step (see :class:`PromptGates`); after :meth:`plan`'s control kernel, so the
        conditions' multipliers land on top of its defaults, which it restores at the next step."""
        if self.prompt.stage(states, decode, d_req, prompt, p_req, p_pos, p_len):
            self._dirty = max(self._dirty, upto)

    def _stage_replays(self, states: dict[str, DynState], lookup: StateLookup, tokens: StepTokens,
                       replays: np.ndarray, words: np.ndarray) -> None:
        """Tokens whose multipliers come from the host: host-tier requests, and recomputed positions of
        device-tier ones (after a preemption: the values they had when first computed)."""
        rows = self._replay.next()
        G = self.layout.G
        waited = False
        for j, k in enumerate(replays.tolist()):
            st = states[tokens.req_ids[tokens.req[k]]]
            pos = int(tokens.position[k])
            if st.device_slot is not None:
                values = self.records.at(st.record, pos)
                if values is None and not waited:
                    self.poll(lookup, block=True)  # rare (resumed after preemption): its earlier steps are long done
                    waited = True
                    values = self.records.at(st.record, pos)
                if values is None:  # never read back (cannot happen for a position computed before): defaults
                    mul, add, scale = [1.0] * G, [0.0] * G, 1.0
                else:
                    mul, add = values[2 * G:3 * G].tolist(), values[3 * G:4 * G].tolist()
                    scale = float(values[4 * G])
            else:
                kept = st.staged.get(pos)
                if kept is None:
                    mul, add = st.multipliers()
                    kept = st.staged[pos] = (mul, add, st.scale)
                mul, add, scale = kept
            row = rows[j]
            row[:] = 0.0
            row[:len(mul)], row[G:G + len(add)], row[2 * G] = mul, add, scale
            row[len(mul):G] = 1.0
            words[CTL, tokens.index[k]] = -2 - j
        self._replay.copy_to(len(replays))

    def after_forward(self, lookup: StateLookup) -> None:
        """Advance the device sync tier and start copying this step's dynamic-token values to the host; then feed
        earlier steps' completed read-backs to their requests (``lookup``: ``req_id -> state``), while the device
        runs the forward just launched."""
        self._launch_readback(lookup)
        self.poll(lookup)

    def _launch_readback(self, lookup: StateLookup) -> None:
        self.prompt.latch()
        step, self._step = self._step, None
        if step is None:
            return
        tokens, n_upd, m = step
        if n_upd:
            self._update_at(n_upd)
        if not m:
            return
        if self._rb_copied is not None:  # the buffer is free once the last copy out of it has run
            torch.cuda.current_stream().wait_event(self._rb_copied)
        grid = self._readback_at(m)
        both = self._rb_out[:(4 * self.layout.G + 1) * grid].view(-1, grid)
        if self.cuda:
            if len(self._pending) >= self._ring.depth:  # every pinned slot still unread (the device far behind)
                self.poll(lookup, block=True, leave=self._ring.depth - 1)
            self._fwd_done.record()
            self._side.wait_event(self._fwd_done)
            with torch.cuda.stream(self._side):
                done, host = self._ring.copy(both, self._side)
            self._rb_copied = done
            self._pending.append(_Pending(done, host[:, :m], tokens))
        else:
            self._pending.append(_Pending(None, both.clone().numpy(), tokens))
        self.enqueued += 1

    def _watch_aborts(self, lookup: StateLookup, tok: StepTokens, host: np.ndarray) -> None:
        """Record requests whose abort rule fired in this read-back (only requests with abort rules are looked at)."""
        for r in np.unique(tok.req).tolist():
            req_id = tok.req_ids[r]
            if req_id not in self.abort_watch:
                continue
            st = lookup(req_id)
            if st is None or not st.aborts:
                continue
            cols = np.flatnonzero(tok.req == r)
            hit = fired_aborts(st, host, cols, tok.position[cols])
            if hit is not None:  # reported once: it leaves the watch
                self.abort_watch.discard(req_id)
                self.aborts[req_id] = hit

    def poll(self, lookup: StateLookup, block: bool = False, leave: int = 0) -> None:
        """Feed completed read-backs to their requests (``lookup``: ``req_id -> state``), in step order
        (``block``: wait until at most ``leave`` are pending). A read-back's pinned host slot is free once fed."""
        while len(self._pending) > leave or (self._pending and not block):
            pend = self._pending[0]
            if pend.event is not None and not pend.event.query():
                if not block:
                    return
                pend.event.synchronize()
            self._pending.pop(0)
            t0 = time.perf_counter()
            host, tok = pend.host, pend.tokens
            self.records.append(tok.record, tok.position, host)  # one vectorised scatter for the whole step
            if self.report_acts and len(tok):
                self.acts.append(acted_report(tok, host, self.layout.G))
            if self.abort_watch and len(tok):
                self._watch_aborts(lookup, tok, host)
            for k in np.flatnonzero(tok.host).tolist():  # host-tier controllers run in Python, token by token
                st = lookup(tok.req_ids[tok.req[k]])
                pos = int(tok.position[k])
                if st is None or st.tier != "host" or pos <= st.last_pos:
                    continue  # finished meanwhile, or a recomputed position (already observed)
                try:
                    st.observe(host, k, pos)
                except ControllerFault as exc:
                    self.faults.setdefault(tok.req_ids[tok.req[k]], str(exc))
            self.completed += 1
            self.records.reclaim(self.completed)
            self.stats.controller_ms += (time.perf_counter() - t0) * 1e3
