"""Dynamic policies on the worker: drive a policy's gate slots step by step.

A policy's rules each own one *gate slot* (plus one for a controller's monitor when no rule uses it). The decode row
of a request carries, at the monitor's site, the probe that computes the slot's gate, and at each action's site the
gated vector or clamp that reads it (compiled by ``dynsteer.request.compile_policy``; DESIGN §3/§4). The forward
writes every slot's score and effective gate into persistent ``[G, N]`` buffers; each token's gate is
``gate = g·mul + add`` with two multipliers per slot:

=================  ==========================  ===========================================================
scope              mul, add                    where ``mul, add`` come from
=================  ==========================  ===========================================================
``this_token``     ``d, 0``                    ``1, 0`` without a controller; else ``d`` = its scale
``next_step``      ``0, d·g(previous token)``  the sync tier
``rest_of_request`` ``d, 0`` → ``0, d`` once fired  the sync tier
=================  ==========================  ===========================================================

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dynsteer.controllers.registry import ControllerFault
from dynsteer.kernels.graphed import bucket
from dynsteer.request.compile_policy import SlotPlan, abort_slots, policy_slots
from dynsteer.steering.readback import ReadbackStore
from dynsteer.steering.staging import HostRing, StagingRing

if TYPE_CHECKING:
    from dynsteer.policy import DynamicSteeringPolicy

#: the gate at which ``rest_of_request`` latches (the probe's decision boundary), on top of the rule's floor
FIRE_GATE = 0.5


# ---- per-request state ---------------------------------------------------------------------------------------------
@dataclass
class DynState:
    """One request's dynamic state on a worker.

    Three tiers of per-step work:

    * plain in-graph gates (``this_token`` rules, no controller): nothing per step; the trace is assembled from
      the read-back blocks when the request finishes;
    * the **device** sync tier (built-in controllers, ``next_step`` / ``rest_of_request`` scopes): the controller
      and the carried gates live in a slot of the driver's device buffer (``device_slot``) and are advanced by a
      kernel after each forward; the host never waits for them;
    * the **host** sync tier (``kind="custom"`` controllers, or a built-in one when no device slot is free): the
      Python controller runs on the read-back scores, so the host waits for the previous step (one step of
      latency, at the price of vLLM's asynchronous scheduling).
    """

    slots: list[SlotPlan]
    controller: Any = None  # a SyncController (host tier), or None
    ctrl_spec: Any = None  # the controller's spec (the device tier is built from it)
    ctrl_slot: int | None = None
    ctrl_state: Any = None
    scale: float = 1.0  # host tier: dyn_scale for the next step
    latched: list[bool] = field(default_factory=list)
    prev_gate: list[float] = field(default_factory=list)
    steps: int = 0
    sync: bool = False  # in a sync tier (device or host)
    device_slot: int | None = None
    tier: str = ""  # set by the driver once: "plain" (no sync tier), "device" or "host"
    keep: bool = False  # the caller asked for the trace
    # The request's slot in the driver's ReadbackStore (its read-back values, appended a step at a time): kept for a
    # trace, and in the device tier, where a position computed again after preemption replays its first values.
    record: int | None = None
    last_pos: int = -1  # host tier: the last position its controller observed
    # host tier: position -> (mul, add, scale) staged for it; a recomputed position (after preemption) replays it
    staged: dict[int, tuple[list[float], list[float], float]] = field(default_factory=dict)
    # float32 (sharpness, threshold, floor) per slot: the kernel's gate parameters, for raw_gates
    params: np.ndarray = field(default_factory=lambda: np.zeros((3, 0), np.float32))
    # Gate parameters of earlier retunes, as (first position computed with the next ones, params before): a read-back
    # is judged by the parameters its token was computed with, which a command may have changed since.
    retunes: list[tuple[int, np.ndarray]] = field(default_factory=list)
    # params in effect before a retune whose first position is not known yet (the request was not scheduled since)
    retune_pending: np.ndarray | None = None
    # slot -> stop reason, for enabled rules with ``abort`` (watched on the read-backs; see DynamicDriver.poll)
    aborts: dict[int, str] = field(default_factory=dict)
    held: int | None = None  # prompt-level slots: the request's row of the driver's held-gate buffer
    decided: bool = False  # prompt-level slots: the prompt's last token has been scheduled (its gates latch once)
    mean_next: int = 0  # prompt-mean slots: prompt positions below this one are summed already (once each)

    @classmethod
    def for_policy(cls, policy: "DynamicSteeringPolicy", registry: Any = None,
                   max_scale: float = float("inf")) -> "DynState":
        """The state of a request under ``policy`` (resolved); custom controllers come from ``registry`` and their
        output is bounded by ``max_scale``. It starts in the host tier; the driver moves it to the device tier."""
        from dynsteer.controllers.sync import make_controller

        slots, ctrl_slot = policy_slots(policy)
        ctrl = make_controller(policy.controller, registry, max_scale) if policy.controller is not None else None
        g = len(slots)
        sync = ctrl is not None or any(s.scope in ("next_step", "rest_of_request") for s in slots)
        st = cls(slots=slots, controller=ctrl, ctrl_spec=policy.controller, ctrl_slot=ctrl_slot,
                 ctrl_state=ctrl.initial_state() if ctrl is not None else None,
                 scale=0.0 if ctrl is not None else 1.0, latched=[False] * g, prev_gate=[0.0] * g, sync=sync)
        st._take(policy)
        return st

    def _take(self, policy: "DynamicSteeringPolicy") -> None:
        self.slots, _ = policy_slots(policy)
        self.params = np.array([[s.sharpness, s.threshold, s.floor] for s in self.slots], np.float32).T.copy()
        self.aborts = abort_slots(policy)

    def retune(self, policy: "DynamicSteeringPolicy") -> None:
        """Take ``policy``'s thresholds, rule switches and aborts (same slots: a monitor's command patched it; the
        controller and carried state are kept). Only the host copy: :meth:`DynamicDriver.retune` moves every copy.

        Tokens computed before the change keep being judged by the parameters they were computed with
        (:meth:`params_at`) once :meth:`retuned_from` names the first position computed after it."""
        if self.retune_pending is None:  # two retunes before the request computes again: the first params held
            self.retune_pending = self.params
        self._take(policy)

    def retuned_from(self, position: int) -> None:
        """The request computes ``position`` first under the parameters of the last :meth:`retune`."""
        if self.retune_pending is not None:
            self.retunes.append((position, self.retune_pending))
            self.retune_pending = None

    def params_at(self, positions: np.ndarray) -> np.ndarray:
        """The gate parameters each of ``positions`` was computed with: ``[3, G]`` when they are all the current
        ones, else ``[3, T, G]`` (both broadcast against scores ``[T, G]`` in :func:`raw_gates`)."""
        if not self.retunes and self.retune_pending is None:
            return self.params
        positions = np.asarray(positions, np.int64).reshape(-1)
        out = np.repeat(self.params[:, None, :], len(positions), axis=1)
        if self.retune_pending is not None:  # nothing was computed under the current params yet
            out[:] = self.retune_pending[:, None, :]
        for until, params in reversed(self.retunes):  # older spans last: they win over newer ones
            out[:, positions < until, :] = params[:, None, :]
        return out

    @property
    def act_mask(self) -> int:
        """Bitmask of the gate slots whose gate steers (a rule's slot; a controller-only monitor's does not)."""
        return sum(1 << i for i, slot in enumerate(self.slots) if slot.scope != "monitor" and slot.acts)

    @property
    def prompt_level(self) -> bool:
        """Whether any slot is a prompt-level gate (held from the prompt's last token)."""
        return any(s.prompt for s in self.slots)

    @property
    def host_tier(self) -> bool:
        return self.tier == "host"

    @property
    def device_eligible(self) -> bool:
        """A sync-tier request whose controller (if any) the device kernel implements."""
        return self.sync and (self.ctrl_spec is None or not _has_custom(self.ctrl_spec))

    def multipliers(self) -> tuple[list[float], list[float]]:
        """Host tier: ``(mul, add)`` per slot for the request's next decode token."""
        d = self.scale
        mul, add = [0.0] * len(self.slots), [0.0] * len(self.slots)
        for s, slot in enumerate(self.slots):
            if slot.scope == "next_step":
                add[s] = d * self.prev_gate[s]
            elif slot.scope == "rest_of_request" and self.latched[s]:
                add[s] = d
            else:
                mul[s] = d
        return mul, add

    def observe(self, block: np.ndarray, col: int, position: int) -> None:
        """Host tier: advance the carried state and the controller from one computed decode token (column ``col``
        of a read-back block)."""
        self.last_pos = position
        from dynsteer.controllers.sync import StepObservation

        scores = block[:len(self.slots), col]
        raw = raw_gates(scores[None, :], self.params_at(np.array([position])))[0].tolist()
        self.prev_gate = raw
        self.latched = [was or (g >= FIRE_GATE and g > 0) for was, g in zip(self.latched, raw)]
        if self.controller is not None:
            c = self.ctrl_slot
            obs = StepObservation(step=self.steps, position=position, score=float(scores[c]), gate=raw[c])
            self.ctrl_state, scale = self.controller.on_step(self.ctrl_state, obs)
            self.scale = float(scale)
        self.steps += 1

    def trace(self, positions: np.ndarray, values: np.ndarray) -> dict[str, list]:
        """The trace fields (see :class:`dynsteer.trace.DynamicTrace`) from the request's record: ``positions [T]``
        and read-back ``values [T, 4G+1]``."""
        g = len(self.slots)
        G = (values.shape[1] - 1) // 4
        scores = values[:, :g].copy()
        gate = raw_gates(scores, self.params_at(positions)) if len(values) else scores
        prompt = [i for i, slot in enumerate(self.slots) if slot.prompt]
        if prompt and len(values):  # no per-token score: the gate is the held prompt decision (what was applied)
            scores[:, prompt] = np.nan
            gate[:, prompt] = values[:, G:G + g][:, prompt]
        return {"position": positions.tolist(), "score": scores.astype(np.float64).tolist(),
                "gate": gate.astype(np.float64).tolist(), "applied": values[:, G:G + g].astype(np.float64).tolist(),
                "scale": values[:, 4 * G].astype(np.float64).tolist()}


def fired_aborts(st: "DynState", host: np.ndarray, cols: np.ndarray,
                 positions: np.ndarray) -> tuple[int, str] | None:
    """The first of ``positions`` (read-back columns ``cols`` of one request) where one of its abort rules fired
    (its gate ≥ ``FIRE_GATE`` and over its floor), and that rule's reason; ``None`` if none did."""
    slots = sorted(st.aborts)
    gates = raw_gates(host[:len(st.slots)][:, cols].T, st.params_at(positions))[:, slots]  # [tokens, abort slots]
    fired = (gates >= FIRE_GATE) & (gates > 0)
    if not fired.any():
        return None
    k = int(np.argmax(fired.any(1)))
    return int(positions[k]), st.aborts[slots[int(np.argmax(fired[k]))]]


def acted_report(tok: StepTokens, host: np.ndarray, G: int) -> tuple[list[str], list[int], list[int], list[str]]:
    """Per request of one read-back: ``(ids, upto, acted_at, signature)``: every position ``< upto`` is reported;
    ``acted_at`` is the first position at which a steering gate was applied non-zero (``-1``: none). Vectorised
    over the step's tokens (a request's tokens are contiguous)."""
    acted = ((host[G:2 * G] != 0) & _gate_bits(tok.act, G)).any(axis=0)
    req, position = tok.req, tok.position
    if len(req) < 2 or (req[1:] != req[:-1]).all():  # one token per request (a decode step): no grouping
        ids = [tok.req_ids[i] for i in req.tolist()]
        return ids, (position + 1).tolist(), np.where(acted, position, -1).tolist(), tok.signature.tolist()
    starts = np.flatnonzero(np.r_[True, req[1:] != req[:-1]])
    upto = np.maximum.reduceat(position, starts) + 1
    never = np.iinfo(np.int64).max
    first = np.minimum.reduceat(np.where(acted, position, never), starts)
    first[first == never] = -1
    ids = [tok.req_ids[i] for i in req[starts].tolist()]
    return ids, upto.tolist(), first.tolist(), tok.signature[starts].tolist()


def _gate_bits(act: np.ndarray, G: int) -> np.ndarray:
    """``[G, n]`` bool: gate slot ``g`` of token ``k`` steers (bit ``g`` of ``act[k]``)."""
    return (act[None, :] >> np.arange(G, dtype=np.int64)[:, None]) & 1 != 0


def _has_custom(spec: Any) -> bool:
    while spec is not None:
        if spec.kind == "custom":
            return True
        spec = spec.inner
    return False


def raw_gates(scores: np.ndarray, params: np.ndarray) -> np.ndarray:
    """The kernel's gate in float32, ``σ(sharpness·(score − threshold))``, 0 below the floor, for scores ``[..., G]``
    and ``params`` = float32 ``[3, G]`` (sharpness, threshold, floor), or ``[3, T, G]`` per token of scores
    ``[T, G]``."""
    k, th, floor = params
    with np.errstate(over="ignore"):  # exp overflow is a gate of exactly 0, as in the kernel
        g = np.float32(1) / (np.float32(1) + np.exp(-(k * (np.asarray(scores, np.float32) - th))))
    return np.where(g >= floor, g, np.float32(0)).astype(np.float32)


# ---- the per-step driver ------------------------------------------------------------------------------------------------
@dataclass
class StepTokens:
    """This step's dynamic decode tokens, one array entry per token: owning request (index into ``req_ids``),
    batch index, position, and the request's device slot (-1: none), sync tier, record slot (-1: none) and host
    tier (the runtime keeps these per request and gathers them for the batch)."""

    req_ids: tuple[str, ...]
    req: np.ndarray
    index: np.ndarray
    position: np.ndarray
    slot: np.ndarray
    sync: np.ndarray
    record: np.ndarray
    host: np.ndarray
    act: np.ndarray  # bitmask of the gate slots whose gate steers (rules with actions)
    signature: np.ndarray  # object: the request's decode configuration digest (what acts, for prefix caching)

    def __len__(self) -> int:
        return len(self.index)

    def subset(self, k: np.ndarray) -> "StepTokens":
        return StepTokens(self.req_ids, self.req[k], self.index[k], self.position[k], self.slot[k], self.sync[k],
                          self.record[k], self.host[k], self.act[k], self.signature[k])

    @classmethod
    def empty(cls) -> "StepTokens":
        i, b = np.zeros(0, np.int64), np.zeros(0, bool)
        return cls((), i, i, i, i, b, i, b, i, np.zeros(0, object))


@dataclass
class _Pending:
    event: Any
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


class PromptGates:
    """Prompt-level (CAST-style) gates on the device, the host never waiting.

    A prompt-level slot's monitor sits in the request's prefill row, so the forward writes its score at every prompt
    token. After a forward, ``latch`` adds the scores of prompt-mean slots to the request's running sum (each prompt
    position once, in float64) and, once the prompt's last token has been computed, turns the last token's score (or
    the mean) into the gate (``σ(sharpness·(score − threshold))``, 0 below the floor: the kernel's formula) in the
    request's row of ``held``. Before every later forward, ``stage`` writes the held gate into the slot's ``gates``
    column of each generated token (the decode row has no monitor for it, so the value stands for the whole pass)
    and, for a rule with a prompt-level ``condition``, the condition's held gate into that rule's ``gate_mul`` (the
    kernel multiplies its per-token gate by it). All of it is indexing on device buffers with indices copied from
    pinned memory. A request decides once: recomputed after preemption, it keeps its first decision.
    """

    def __init__(self, gates: torch.Tensor, gate_mul: torch.Tensor, scores: torch.Tensor, max_requests: int) -> None:
        G = gates.shape[0]
        self.gates, self.gate_mul, self.scores, self.G = gates, gate_mul, scores, G
        n = max(max_requests, 1)
        # column G is 1: the multiplier of a slot without a condition
        self.held = torch.zeros(n, G + 1, dtype=torch.float32, device=gates.device)
        self.held[:, G] = 1.0
        self.sums = torch.zeros(n, max(G, 1), dtype=torch.float64, device=gates.device)  # prompt-mean running sums
        self._free = list(range(n - 1, -1, -1))
        self._latch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._sum: list[tuple[int, int, int, int]] = []  # (first column, end column, held row, slot)
        # By held row and slot, from the row's request's slots (see ``_plan``): what ``stage`` writes for each of its
        # generated tokens (1: the held gate into ``gates``; 2: the condition into ``gate_mul``; 0: nothing) and the
        # held column of the multiplying condition (G: the constant 1). Gathered by row each step, no per-token loop.
        self._kind = np.zeros((n, G), np.int8)
        self._cond = np.full((n, G), G, np.int64)
        self._has_cond = np.zeros(n, bool)  # the row has a kind-2 slot
        self._src: list[Any] = [None] * n  # the slot list each row's plan was taken from (a new list: taken again)

    def place(self, st: DynState) -> None:
        if not st.prompt_level or st.held is not None:
            return
        if not self._free:
            raise RuntimeError("no free prompt-level gate row (every one holds a live request)")
        st.held = self._free.pop()
        self.held[st.held, :self.G].zero_()  # no decision yet: the gate is 0 until the prompt's last token latches
        self.sums[st.held].zero_()
        self._plan(st)

    def _plan(self, st: DynState) -> int:
        """Take the held row's plan (``_kind``, ``_cond``) from ``st.slots``; returns the row. Run when the state is
        placed and again if its slot list is replaced (``retune``: the same slot kinds, but checked, not assumed)."""
        row = st.held
        kind, cond = self._kind[row], self._cond[row]
        kind[:] = 0
        cond[:] = self.G
        for g, slot in enumerate(st.slots):
            if slot.prompt or slot.cond is not None:
                kind[g] = 1 if slot.prompt else 2
                if slot.cond is not None:
                    cond[g] = slot.cond
        self._has_cond[row] = bool((kind == 2).any())
        self._src[row] = st.slots
        return row

    def free(self, st: DynState) -> None:
        if st.held is not None:
            self._free.append(st.held)
            st.held = None

    def stage(self, states: list[DynState | None], decode: np.ndarray, d_req: np.ndarray, prompt: np.ndarray,
              p_req: np.ndarray, p_pos: np.ndarray, p_len: np.ndarray) -> bool:
        """Before the forward: the held gates of this step's generated tokens (``decode``: token columns, ``d_req``:
        index into ``states``), and what the forward's prompt tokens of undecided requests contribute (``prompt``,
        ``p_req``, their positions and prompt lengths). Returns whether a ``gate_mul`` column was written (the driver
        resets those columns at the next step)."""
        lat: list[tuple] = []
        held_g = cond_g = np.zeros((4, 0), np.int64)  # (token column, held row, slot, condition's column) per write
        if len(prompt):
            starts = np.flatnonzero(np.r_[True, p_req[1:] != p_req[:-1]])  # a request's tokens are contiguous
            for a, b in zip(starts.tolist(), [*starts[1:].tolist(), len(prompt)]):
                st = states[int(p_req[a])]
                if st is None or st.decided or st.held is None:
                    continue
                ts, ps, plen = prompt[a:b], p_pos[a:b], int(p_len[a])
                new = ps >= st.mean_next
                if new.any():
                    t0, t1 = int(ts[new][0]), int(ts[new][-1]) + 1
                    self._sum += [(t0, t1, st.held, g) for g, slot in enumerate(st.slots) if slot.mean]
                    st.mean_next = int(ps[new][-1]) + 1
                last = np.flatnonzero(ps == plen - 1)
                if not len(last):
                    continue
                st.decided = True
                for g, slot in enumerate(st.slots):
                    if slot.prompt:
                        # a mean slot reads its sum (encoded as column -prompt length); a last token slot its score
                        col = -plen if slot.mean else int(ts[last[0]])
                        lat.append((col, st.held, g, st.params[0, g], st.params[1, g], st.params[2, g]))
        if len(decode):
            # generated tokens: each request's held row (-1: none), then its row's plan gathered for its tokens; the
            # only Python is one look-up per request (its plan is taken again only if its slot list was replaced)
            src = self._src
            rows = np.array([-1 if st is None or st.held is None else st.held if st.slots is src[st.held]
                             else self._plan(st) for st in states], np.int64)
            t, p = np.asarray(decode, np.int64), rows[d_req]
            if p.min() < 0:  # tokens of requests without a held row write nothing
                k = p >= 0
                t, p = t[k], p[k]
            # np.nonzero walks tokens in order, each one's slots ascending: the order of the per-token loop it replaces
            i, g = np.nonzero(self._kind[p] == 1)
            pi = p[i]
            held_g = np.stack((t[i], pi, g, self._cond[pi, g]))
            if self._has_cond[p].any():
                i, g = np.nonzero(self._kind[p] == 2)
                pi = p[i]
                cond_g = np.stack((t[i], pi, g, self._cond[pi, g]))
        if lat:
            a = np.array(lat, np.float64)
            self._latch = (_device(a[:, :3].T.astype(np.int64), self.held.device),
                           _device(a[:, 3:].T.astype(np.float32), self.held.device))
        # each (token column, slot) pair at most once (distinct columns, a slot once per token): order-free writes
        if held_g.shape[1]:
            t, p, g, c = _device(held_g, self.held.device)
            self.gates[g, t] = self.held[p, g] * self.held[p, c]
        if cond_g.shape[1]:
            t, p, g, c = _device(cond_g, self.held.device)
            self.gate_mul[g, t] = self.held[p, c]
        return bool(cond_g.shape[1])

    def latch(self) -> None:
        """After the forward: prompt-mean sums, then the gates of the prompts whose last token it computed."""
        for t0, t1, p, g in self._sum:  # one small reduction per request and slot: deterministic on every rank
            self.sums[p, g] += self.scores[g, t0:t1].to(torch.float64).sum()
        self._sum = []
        if self._latch is None:
            return
        (col, p, g), (sharp, thresh, floor) = self._latch
        self._latch = None
        mean = col < 0  # the prompt's mean: sum / length (length = -col)
        score = torch.where(mean, (self.sums[p, g] / (-col).clamp(min=1)).to(torch.float32),
                            self.scores[g, col.clamp(min=0)])
        raw = torch.sigmoid(sharp * (score - thresh))
        self.held[p, g] = torch.where(raw >= floor, raw, torch.zeros_like(raw))


def _device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """``a`` on ``device`` without waiting: from pinned memory, non-blocking (the caching host allocator keeps the
    pinned block until the copy has run)."""
    host = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


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
        from dynsteer.kernels.controller_reference import Layout
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
            from dynsteer.kernels.graphed import GraphedLaunch

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
            from dynsteer.kernels.controller_reference import controller_row

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

    def retune(self, st: DynState, policy: "DynamicSteeringPolicy") -> None:
        """Move a live request's gate parameters to ``policy``'s (a monitor's ``threshold`` or ``rule`` command) in
        every copy the driver keeps: the host's (read-backs, host-tier controllers) and, in the device tier, its
        slot of the controller state, which carries ``next_step`` / ``rest_of_request`` gates and feeds its
        controller. The table row (the in-graph gate) is recompiled by the runtime in the same step, so the step's
        forward, its update kernel and the host all use the new parameters from that step on."""
        st.retune(policy)
        if st.device_slot is None:
            return
        from dynsteer.kernels.controller_reference import controller_row

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
    def plan(self, states: dict[str, DynState], lookup: Any, tokens: StepTokens, upto: int) -> None:
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
        if n_sync or self._dirty:
            self._control_at(span)
            self._dirty = span if n_sync else 0
        self._step = (self._read_tokens(tokens, read), len(upd), m)
        self.stats.host_ms += (time.perf_counter() - t1) * 1e3

    def _stage_reads(self, tokens: StepTokens, read: np.ndarray) -> None:
        """A step of plain gates read back (traces, prefix caching): only the read-back's column list goes to the
        device (its row of the control words, up to the read-back's grid), not the whole (4, N+1) buffer."""
        words = self._words.next()
        self._words.copy_to(self._stage_cols(words, tokens, read), row=COLS)
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

    def _stage_replays(self, states: dict[str, DynState], lookup: Any, tokens: StepTokens,
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

    def after_forward(self, lookup: Any) -> None:
        """Advance the device sync tier and start copying this step's dynamic-token values to the host; then feed
        earlier steps' completed read-backs to their requests (``lookup``: ``req_id -> state``), while the device
        runs the forward just launched."""
        self._launch_readback(lookup)
        self.poll(lookup)

    def _launch_readback(self, lookup: Any) -> None:
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

    def _watch_aborts(self, lookup: Any, tok: StepTokens, host: np.ndarray) -> None:
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

    def poll(self, lookup: Any, block: bool = False, leave: int = 0) -> None:
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
