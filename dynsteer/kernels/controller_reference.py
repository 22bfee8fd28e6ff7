"""The sync tier on the device: per-request controller state in persistent buffers, and its two step kernels.

Every request in the sync tier (a built-in controller, or a ``next_step`` / ``rest_of_request`` scope) owns a *slot*
of a persistent float64 ``[S, F]`` buffer holding its controller's parameters and state (layout: :class:`Layout`).
The host never reads it: it stages one int32 per token (``ctl``) and launches two kernels per step on the compute
stream, so vLLM's asynchronous scheduling keeps running ahead of the device.

Contract (shared by every implementation)::

    control(ctl, state, replay, gate_mul, gate_add, scale_used, upto)        before the forward
      ctl:        int32 [N >= upto]   per token: s >= 0  -> a fresh decode token of slot s
                                                 -1      -> not in the sync tier: mul = 1, add = 0, scale 1
                                                 -2 - j  -> replay row j (a recomputed position, or a host-side
                                                            custom controller): its staged values
      state:      float64 [S, F]      read only here
      replay:     float32 [J, 2G+1]   per replay row: mul[G], add[G], scale
      gate_mul, gate_add: float32 [G, N]   written for every t < upto (rows >= G untouched)
      scale_used: float32 [N]              the dyn_scale in effect for each token (traces)
      for a fresh token of slot s, with d = state[s, SCALE_NOW], per gate slot g by its scope:
        next_step          -> mul 0, add d · prev_gate[g]
        rest_of_request    -> latched[g] ? (mul 0, add d) : (mul d, add 0)
        this_token/monitor -> mul d, add 0

    update(idx, ctl, position, scores, state, m)                             after the forward
      idx: int32 [m] the tokens to consider (the host lists each sync-tier request's fresh decode token; no two
           share a slot); position: int32 [N]
      for every t in idx[:m] with ctl[t] = s >= 0 and position[t] > state[s, LAST_POS]:
        raw[g] = σ(sharp[g]·(scores[g, t] − thresh[g])) in float32, 0 below floor[g]   (the kernel's gate)
        prev_gate[g] = raw[g];  latched[g] |= raw[g] >= 0.5 and raw[g] > 0
        if a controller: score = scores[ctrl_slot, t]; the controller steps (below) and sets SCALE_NOW
        LAST_POS = position[t]; STEPS += 1

Controllers are those of :mod:`dynsteer.controllers.sync`, in float64 with the same operations in the same order
(decisions equal the Python controllers'): latch, EMA latch, PID with conditional-integration anti-windup, and a
budget (nested budgets fold into the smallest) that stops stepping its inner controller once spent. A non-finite
score leaves the state unchanged and repeats the previous output.

The torch functions below are the reference and the CPU implementation; ``dynsteer.kernels.triton_controller``
is the CUDA twin. Both are CUDA-graph safe (no host sync, no allocation beyond temporaries of fixed size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["KIND", "SCOPE", "Layout", "controller_row", "control_reference", "raw_gate", "readback_head",
           "readback_reference", "update_reference"]

KIND = {"none": 0, "latch": 1, "ema_latch": 2, "pid": 3}
SCOPE = {"this_token": 0, "next_step": 1, "rest_of_request": 2, "monitor": 3}
FIRE_GATE = 0.5  # a rest_of_request rule latches once its gate reaches the probe's decision boundary


@dataclass(frozen=True)
class Layout:
    """Column offsets of the ``[S, F]`` state buffer for ``G`` gate slots."""

    G: int

    # parameters (written at admission)
    KIND = 0
    ON = 1
    OFF = 2
    SCALE = 3
    ALPHA = 4
    TARGET = 5
    KP = 6
    KI = 7
    KD = 8
    MIN = 9
    MAX = 10
    BUDGET = 11  # -1: no budget
    CTRL = 12  # gate slot feeding the controller (-1: none)
    # state
    SCALE_NOW = 13
    LAST_POS = 14
    STEPS = 15
    LATCH_ON = 16
    EMA = 17
    HAS_EMA = 18
    INTEGRAL = 19
    PREV_ERR = 20
    HAS_PREV = 21
    PID_SCALE = 22
    STEERED = 23
    FIXED = 24

    def scope(self, g: int) -> int:
        return self.FIXED + g

    def sharp(self, g: int) -> int:
        return self.FIXED + self.G + g

    def thresh(self, g: int) -> int:
        return self.FIXED + 2 * self.G + g

    def floor(self, g: int) -> int:
        return self.FIXED + 3 * self.G + g

    def prev_gate(self, g: int) -> int:
        return self.FIXED + 4 * self.G + g

    def latched(self, g: int) -> int:
        return self.FIXED + 5 * self.G + g

    @property
    def width(self) -> int:
        return self.FIXED + 6 * self.G

    @classmethod
    def of(cls, state: torch.Tensor) -> "Layout":
        """The layout of a ``[S, F]`` state buffer."""
        return cls((state.shape[1] - cls.FIXED) // 6)


def _flatten(spec: Any) -> tuple[Any, int]:
    """The innermost non-budget controller spec and the effective budget (-1: none; nested budgets: the smallest)."""
    budget = -1
    while spec is not None and spec.kind == "budget":
        budget = spec.max_steered_tokens if budget < 0 else min(budget, spec.max_steered_tokens)
        spec = spec.inner
    return spec, budget


def controller_row(layout: Layout, slots: list[Any], ctrl_slot: int | None, controller: Any) -> list[float]:
    """The initial ``[F]`` row of a request: its gate slots (``dynsteer.request.compile_policy.SlotPlan``), the slot
    feeding its controller, and the controller's spec (a built-in kind, or ``None``)."""
    row = [0.0] * layout.width
    row[layout.BUDGET] = -1.0
    row[layout.CTRL] = -1.0 if ctrl_slot is None else float(ctrl_slot)
    row[layout.LAST_POS] = -1.0
    row[layout.SCALE_NOW] = 1.0
    for g, s in enumerate(slots):
        row[layout.scope(g)] = float(SCOPE[s.scope])
        row[layout.sharp(g)], row[layout.thresh(g)], row[layout.floor(g)] = s.sharpness, s.threshold, s.floor
    if controller is not None:
        inner, budget = _flatten(controller)
        row[layout.KIND] = float(KIND[inner.kind])
        row[layout.BUDGET] = float(budget)
        row[layout.SCALE_NOW] = 0.0  # a controller's output before its first observation
        for name, col in (("on", layout.ON), ("off", layout.OFF), ("scale", layout.SCALE), ("alpha", layout.ALPHA),
                          ("target", layout.TARGET), ("kp", layout.KP), ("ki", layout.KI), ("kd", layout.KD)):
            value = getattr(inner, name, None)
            row[col] = 0.0 if value is None else float(value)
        if inner.kind == "pid":
            row[layout.MIN] = 0.0 if inner.min_scale is None else float(inner.min_scale)
            row[layout.MAX] = 1.0 if inner.max_scale is None else float(inner.max_scale)
    return row


def control_reference(ctl: torch.Tensor, state: torch.Tensor, replay: torch.Tensor, gate_mul: torch.Tensor,
                      gate_add: torch.Tensor, scale_used: torch.Tensor, upto: int) -> None:
    """Write ``gate_mul``/``gate_add``/``scale_used`` for tokens ``[0, upto)`` (contract: module docstring)."""
    if upto == 0:
        return
    L = Layout.of(state)
    G = min(L.G, gate_mul.shape[0])
    c = ctl[:upto].long()
    fresh = c >= 0
    rep = c <= -2
    s = c.clamp(min=0)
    j = (-2 - c).clamp(min=0)
    st = state.index_select(0, s)  # [T, F]
    d = st[:, L.SCALE_NOW]
    rows = replay.index_select(0, j) if replay.shape[0] else torch.zeros(upto, 2 * L.G + 1, dtype=torch.float32,
                                                                           device=ctl.device)
    one, zero = torch.ones_like(d), torch.zeros_like(d)
    for g in range(G):
        scope = st[:, L.scope(g)]
        latched = st[:, L.latched(g)] > 0
        mul = torch.where((scope == SCOPE["next_step"]) | ((scope == SCOPE["rest_of_request"]) & latched), zero, d)
        add = torch.where(scope == SCOPE["next_step"], d * st[:, L.prev_gate(g)],
                          torch.where((scope == SCOPE["rest_of_request"]) & latched, d, zero))
        mul = torch.where(fresh, mul, torch.where(rep, rows[:, g].double(), one))
        add = torch.where(fresh, add, torch.where(rep, rows[:, L.G + g].double(), zero))
        gate_mul[g, :upto] = mul.float()
        gate_add[g, :upto] = add.float()
    scale_used[:upto] = torch.where(fresh, d, torch.where(rep, rows[:, 2 * L.G].double(), one)).float()


def _latch(on_now: bool, value: float, on: float, off: float) -> bool:
    return value > off if on_now else value >= on


def raw_gate(score: np.float32, sharp: float, thresh: float, floor: float) -> np.float32:
    """The kernel's gate in float32, ``σ(sharp·(score − thresh))``, 0 below ``floor`` (as the host computes it)."""
    k, th = np.float32(sharp), np.float32(thresh)
    with np.errstate(over="ignore"):  # exp overflow is a gate of exactly 0, as in the kernel
        g = np.float32(1) / (np.float32(1) + np.exp(-(k * (np.float32(score) - th))))
    return g if g >= np.float32(floor) else np.float32(0)


def update_reference(idx: torch.Tensor, ctl: torch.Tensor, position: torch.Tensor, scores: torch.Tensor,
                     state: torch.Tensor, m: int) -> None:
    """Advance the slot of every listed fresh sync-tier token (contract: module docstring).

    In list order. This reference reads its inputs on the host (it is the CPU implementation); the CUDA twin never
    synchronises.
    """
    if m == 0:
        return
    L = Layout.of(state)
    c = ctl.cpu().numpy()
    picked = [int(t) for t in idx[:m].cpu().numpy() if c[int(t)] >= 0]
    if not picked:
        return
    on_host = state.device.type == "cpu"
    host = state.numpy() if on_host else state.cpu().numpy()  # a CPU tensor's array shares its memory
    sc = scores.float().cpu().numpy()
    pos = position.cpu().numpy()
    G = min(L.G, sc.shape[0])
    for t in picked:
        row = host[int(c[t])]
        if pos[t] <= row[L.LAST_POS]:
            continue
        for g in range(G):
            raw = raw_gate(sc[g, t], row[L.sharp(g)], row[L.thresh(g)], row[L.floor(g)])
            row[L.prev_gate(g)] = float(raw)
            if raw >= FIRE_GATE and raw > 0:
                row[L.latched(g)] = 1.0
        kind = int(row[L.KIND])
        if kind:
            score = float(sc[int(row[L.CTRL]), t])
            budget = row[L.BUDGET]
            if budget >= 0 and row[L.STEERED] >= budget:
                out = 0.0
            else:
                out = _step(L, row, kind, score)
                if budget >= 0:
                    row[L.STEERED] += float(out != 0.0)
            row[L.SCALE_NOW] = out
        row[L.LAST_POS] = float(pos[t])
        row[L.STEPS] += 1
    if not on_host:
        state.copy_(torch.from_numpy(host))


def _step(L: Layout, row: torch.Tensor, kind: int, score: float) -> float:
    """One controller step on ``row`` (float64, in place), in the Python controllers' operation order."""
    p = {name: float(row[getattr(L, name)]) for name in ("ON", "OFF", "SCALE", "ALPHA", "TARGET", "KP", "KI", "KD",
                                                          "MIN", "MAX")}
    if kind in (KIND["latch"], KIND["ema_latch"]):
        if math.isfinite(score):
            value = score
            if kind == KIND["ema_latch"]:
                has = row[L.HAS_EMA] > 0
                value = score if not has else p["ALPHA"] * score + (1.0 - p["ALPHA"]) * row[L.EMA]
                row[L.EMA], row[L.HAS_EMA] = value, 1.0
            row[L.LATCH_ON] = float(_latch(row[L.LATCH_ON] > 0, value, p["ON"], p["OFF"]))
        return p["SCALE"] if row[L.LATCH_ON] > 0 else 0.0
    # PID
    if not math.isfinite(score):
        return row[L.PID_SCALE]
    e = score - p["TARGET"]
    de = 0.0 if row[L.HAS_PREV] == 0 else e - row[L.PREV_ERR]
    integral = row[L.INTEGRAL] + e
    u = p["KP"] * e + p["KI"] * integral + p["KD"] * de
    scale = min(max(u, p["MIN"]), p["MAX"])
    if (u > p["MAX"] and e > 0) or (u < p["MIN"] and e < 0):
        integral = row[L.INTEGRAL]
    row[L.INTEGRAL], row[L.PREV_ERR], row[L.HAS_PREV], row[L.PID_SCALE] = integral, e, 1.0, scale
    return scale


def readback_head(out: torch.Tensor, rows: int, m: int, who: str) -> torch.Tensor:
    """The head of a caller's read-back buffer ``out`` as ``[rows, m]`` (what both read-back impls write into), or a
    ValueError naming ``who`` where ``out`` is not a contiguous float32 buffer of at least ``rows·m`` values."""
    if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() < rows * m:
        raise ValueError(f"{who}: out must be a contiguous float32 buffer of at least {rows * m} values, got "
                         f"{out.dtype} with {out.numel()}")
    return out.view(-1)[:rows * m].view(rows, m)


def readback_reference(scores: torch.Tensor, gates: torch.Tensor, gate_mul: torch.Tensor, gate_add: torch.Tensor,
                       scale_used: torch.Tensor, cols: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """What the host reads back after a forward, for the token columns ``cols`` (int32 [m]): float32
    ``[4G + 1, m]``, rows ``scores[G]``, ``gates[G]``, ``gate_mul[G]``, ``gate_add[G]``, then ``scale_used``.
    ``out``: a contiguous float32 buffer of at least ``(4G + 1)·m`` values whose head receives them (returned)."""
    both = torch.cat([scores.index_select(1, cols), gates.index_select(1, cols), gate_mul.index_select(1, cols),
                      gate_add.index_select(1, cols), scale_used.index_select(0, cols).unsqueeze(0)])
    if out is None:
        return both
    return readback_head(out, *both.shape, "readback_reference").copy_(both)
