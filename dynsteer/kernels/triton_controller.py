"""Triton twins of the device sync tier's two step kernels (contract: ``dynsteer.kernels.controller_reference``).

``control``: one program per token writes its gate multipliers (fresh sync-tier token: from its slot's state;
replay row: staged values; otherwise 1 and 0). ``update``: one program per listed token advances its slot (the
host lists each request's one fresh decode token of the step, so no two programs share a slot). Both are CUDA-graph
safe: no host sync, no allocation, grids depend only on ``upto`` / ``m``.

Like the steering kernels, ``TRITON_INTERPRET=1`` must be set before this module is first imported to run it on
CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dynsteer.kernels.controller_reference import FIRE_GATE, Layout, readback_head

__all__ = ["control_triton", "update_triton"]

L = Layout


@triton.jit
def _control_kernel(ctl_ptr, st_ptr, rep_ptr, mul_ptr, add_ptr, scale_ptr, F, R, N, G: tl.constexpr,
                    GB: tl.constexpr, SCALE_NOW: tl.constexpr, FIXED: tl.constexpr):
    t = tl.program_id(0)
    c = tl.load(ctl_ptr + t)
    fresh = c >= 0
    rep = c <= -2
    s = tl.maximum(c, 0).to(tl.int64)
    j = tl.maximum(-2 - c, 0).to(tl.int64)
    d = tl.load(st_ptr + s * F + SCALE_NOW, mask=fresh, other=1.0)
    g = tl.arange(0, GB)
    gm = g < G
    scope = tl.load(st_ptr + s * F + FIXED + g, mask=gm & fresh, other=0.0)
    prev = tl.load(st_ptr + s * F + FIXED + 4 * G + g, mask=gm & fresh, other=0.0)
    latched = tl.load(st_ptr + s * F + FIXED + 5 * G + g, mask=gm & fresh, other=0.0) > 0
    hold = (scope == 1.0) | ((scope == 2.0) & latched)
    mul = tl.where(hold, 0.0, d)
    add = tl.where(scope == 1.0, d * prev, tl.where((scope == 2.0) & latched, d, 0.0))
    rmul = tl.load(rep_ptr + j * R + g, mask=gm & rep, other=1.0)
    radd = tl.load(rep_ptr + j * R + G + g, mask=gm & rep, other=0.0)
    rscale = tl.load(rep_ptr + j * R + 2 * G, mask=rep, other=1.0)
    mul = tl.where(fresh, mul, tl.where(rep, rmul.to(tl.float64), 1.0))
    add = tl.where(fresh, add, tl.where(rep, radd.to(tl.float64), 0.0))
    tl.store(mul_ptr + g * N + t, mul.to(tl.float32), mask=gm)
    tl.store(add_ptr + g * N + t, add.to(tl.float32), mask=gm)
    scale = tl.where(fresh, d, tl.where(rep, rscale.to(tl.float64), 1.0))
    tl.store(scale_ptr + t, scale.to(tl.float32))


@triton.jit
def _update_kernel(idx_ptr, ctl_ptr, pos_ptr, sc_ptr, st_ptr, F, N, G: tl.constexpr, GB: tl.constexpr,
                   KIND: tl.constexpr, ON: tl.constexpr, OFF: tl.constexpr, SCALE: tl.constexpr,
                   ALPHA: tl.constexpr, TARGET: tl.constexpr, KP: tl.constexpr, KI: tl.constexpr, KD: tl.constexpr,
                   MIN: tl.constexpr, MAX: tl.constexpr, BUDGET: tl.constexpr, CTRL: tl.constexpr,
                   SCALE_NOW: tl.constexpr, LAST_POS: tl.constexpr, STEPS: tl.constexpr, LATCH_ON: tl.constexpr,
                   EMA: tl.constexpr, HAS_EMA: tl.constexpr, INTEGRAL: tl.constexpr, PREV_ERR: tl.constexpr,
                   HAS_PREV: tl.constexpr, PID_SCALE: tl.constexpr, STEERED: tl.constexpr, FIXED: tl.constexpr,
                   FIRE: tl.constexpr):
    g = tl.arange(0, GB)
    gm = g < G
    t = tl.load(idx_ptr + tl.program_id(0)).to(tl.int64)
    c = tl.load(ctl_ptr + t)
    # An entry whose word is not a fresh token's (padding of a graphed grid names a column past the buffers) reads
    # column 0 and stores nothing: every store below is masked by go.
    t = tl.where(c >= 0, t, 0)
    s = tl.maximum(c, 0).to(tl.int64)
    base = st_ptr + s * F
    pos = tl.load(pos_ptr + t).to(tl.float64)
    last = tl.load(base + LAST_POS)
    go = (c >= 0) & (pos > last)
    # gates of every slot, in float32 like the forward's kernel: σ(k·(score − th)), 0 below the floor
    x = tl.load(sc_ptr + g * N + t, mask=gm, other=0.0).to(tl.float32)
    k = tl.load(base + FIXED + G + g, mask=gm, other=0.0).to(tl.float32)
    th = tl.load(base + FIXED + 2 * G + g, mask=gm, other=0.0).to(tl.float32)
    fl = tl.load(base + FIXED + 3 * G + g, mask=gm, other=0.0).to(tl.float32)
    raw = 1.0 / (1.0 + tl.exp(-(k * (x - th))))
    raw = tl.where(raw >= fl, raw, 0.0)
    was = tl.load(base + FIXED + 5 * G + g, mask=gm, other=0.0)
    now = tl.where((raw >= FIRE) & (raw > 0.0), 1.0, was)
    tl.store(base + FIXED + 4 * G + g, raw.to(tl.float64), mask=gm & go)
    tl.store(base + FIXED + 5 * G + g, now, mask=gm & go)
    # the controller, when the request has one
    kind = tl.load(base + KIND)
    ctrl = tl.maximum(tl.load(base + CTRL), 0.0).to(tl.int64)
    score = tl.load(sc_ptr + ctrl * N + t).to(tl.float64)
    finite = (score == score) & (tl.abs(score) <= 1.7976931348623157e308)
    on, off, scale = tl.load(base + ON), tl.load(base + OFF), tl.load(base + SCALE)
    alpha = tl.load(base + ALPHA)
    latch_on = tl.load(base + LATCH_ON) > 0
    ema, has_ema = tl.load(base + EMA), tl.load(base + HAS_EMA) > 0
    is_ema = kind == 2.0
    new_ema = tl.where(has_ema, alpha * score + (1.0 - alpha) * ema, score)
    value = tl.where(is_ema, new_ema, score)
    engaged = tl.where(latch_on, value > off, value >= on)
    latch_on2 = tl.where(finite, engaged, latch_on)
    latch_out = tl.where(latch_on2, scale, 0.0)
    # PID (conditional-integration anti-windup)
    target, kp, ki, kd = tl.load(base + TARGET), tl.load(base + KP), tl.load(base + KI), tl.load(base + KD)
    lo, hi = tl.load(base + MIN), tl.load(base + MAX)
    integ, prev_e = tl.load(base + INTEGRAL), tl.load(base + PREV_ERR)
    has_prev = tl.load(base + HAS_PREV) > 0
    e = score - target
    de = tl.where(has_prev, e - prev_e, 0.0)
    integ2 = integ + e
    u = kp * e + ki * integ2 + kd * de
    pid_scale = tl.minimum(tl.maximum(u, lo), hi)
    integ2 = tl.where(((u > hi) & (e > 0.0)) | ((u < lo) & (e < 0.0)), integ, integ2)
    pid_prev = tl.load(base + PID_SCALE)
    pid_out = tl.where(finite, pid_scale, pid_prev)
    is_pid = kind == 3.0
    out = tl.where(is_pid, pid_out, latch_out)
    # budget: once spent, the inner controller is not stepped and the output is 0
    budget, steered = tl.load(base + BUDGET), tl.load(base + STEERED)
    spent = (budget >= 0.0) & (steered >= budget)
    step = go & (kind > 0.0) & (spent == 0)
    out = tl.where(spent, 0.0, out)
    tl.store(base + LATCH_ON, tl.where(latch_on2, 1.0, 0.0), mask=step & (is_pid == 0))
    tl.store(base + EMA, new_ema, mask=step & is_ema & finite)
    tl.store(base + HAS_EMA, 1.0, mask=step & is_ema & finite)
    tl.store(base + INTEGRAL, integ2, mask=step & is_pid & finite)
    tl.store(base + PREV_ERR, e, mask=step & is_pid & finite)
    tl.store(base + HAS_PREV, 1.0, mask=step & is_pid & finite)
    tl.store(base + PID_SCALE, pid_scale, mask=step & is_pid & finite)
    tl.store(base + STEERED, steered + tl.where(out != 0.0, 1.0, 0.0), mask=step & (budget >= 0.0))
    tl.store(base + SCALE_NOW, out, mask=go & (kind > 0.0))
    tl.store(base + LAST_POS, pos, mask=go)
    tl.store(base + STEPS, tl.load(base + STEPS) + 1.0, mask=go)


def _gb(G: int) -> int:
    return max(1, triton.next_power_of_2(G))


def control_triton(ctl: torch.Tensor, state: torch.Tensor, replay: torch.Tensor, gate_mul: torch.Tensor,
                   gate_add: torch.Tensor, scale_used: torch.Tensor, upto: int) -> None:
    """Triton ``control`` (see ``control_reference``)."""
    if upto == 0:
        return
    G = gate_mul.shape[0]
    assert state.dtype == torch.float64 and replay.dtype == torch.float32 and ctl.dtype == torch.int32
    rep = replay if replay.shape[0] else state.new_zeros((1, 2 * G + 1), dtype=torch.float32)
    _control_kernel[(upto,)](ctl, state, rep, gate_mul, gate_add, scale_used, state.shape[1], rep.shape[1],
                             gate_mul.shape[1], G=G, GB=_gb(G), SCALE_NOW=L.SCALE_NOW, FIXED=L.FIXED)


def update_triton(idx: torch.Tensor, ctl: torch.Tensor, position: torch.Tensor, scores: torch.Tensor,
                  state: torch.Tensor, m: int) -> None:
    """Triton ``update`` (see ``update_reference``)."""
    if m == 0:
        return
    G = scores.shape[0]
    _update_kernel[(m,)](idx, ctl, position, scores, state, state.shape[1], scores.shape[1], G=G, GB=_gb(G),
                         KIND=L.KIND, ON=L.ON, OFF=L.OFF, SCALE=L.SCALE, ALPHA=L.ALPHA, TARGET=L.TARGET, KP=L.KP,
                         KI=L.KI, KD=L.KD, MIN=L.MIN, MAX=L.MAX, BUDGET=L.BUDGET, CTRL=L.CTRL,
                         SCALE_NOW=L.SCALE_NOW, LAST_POS=L.LAST_POS, STEPS=L.STEPS, LATCH_ON=L.LATCH_ON, EMA=L.EMA,
                         HAS_EMA=L.HAS_EMA, INTEGRAL=L.INTEGRAL, PREV_ERR=L.PREV_ERR, HAS_PREV=L.HAS_PREV,
                         PID_SCALE=L.PID_SCALE, STEERED=L.STEERED, FIXED=L.FIXED, FIRE=FIRE_GATE)


@triton.jit(do_not_specialize=["m"])  # one binary for every m: a graph-captured launch must not compile
def _readback_kernel(scores_ptr, gates_ptr, mul_ptr, add_ptr, scale_ptr, cols_ptr, out_ptr, N, m,
                     G: tl.constexpr, GB: tl.constexpr):
    """One program per read-back column j: the column's G values of each gate buffer and its scale, into
    ``out[:, j]`` (``out``: [4G + 1, m])."""
    j = tl.program_id(0)
    col = tl.load(cols_ptr + j).to(tl.int64)
    g = tl.arange(0, GB)
    ok = g < G
    src = g * N + col
    dst = g * m + j
    tl.store(out_ptr + dst, tl.load(scores_ptr + src, mask=ok, other=0.0), mask=ok)
    tl.store(out_ptr + G * m + dst, tl.load(gates_ptr + src, mask=ok, other=0.0), mask=ok)
    tl.store(out_ptr + 2 * G * m + dst, tl.load(mul_ptr + src, mask=ok, other=0.0), mask=ok)
    tl.store(out_ptr + 3 * G * m + dst, tl.load(add_ptr + src, mask=ok, other=0.0), mask=ok)
    tl.store(out_ptr + 4 * G * m + j, tl.load(scale_ptr + col))


def readback_triton(scores: torch.Tensor, gates: torch.Tensor, gate_mul: torch.Tensor, gate_add: torch.Tensor,
                    scale_used: torch.Tensor, cols: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``readback`` (see ``readback_reference``): one launch where the torch ops take six. ``out``: a
    contiguous float32 buffer of at least ``(4G + 1)·m`` values to write into (its head, as ``[4G + 1, m]``, is
    returned) instead of a new tensor: a graph-captured launch needs a buffer that stays."""
    G, N = scores.shape
    m = cols.shape[0]
    for name, t in (("scores", scores), ("gates", gates), ("gate_mul", gate_mul), ("gate_add", gate_add)):
        if t.shape != (G, N) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"readback_triton: {name} must be a contiguous float32 [{G}, {N}] tensor")
    if scale_used.shape != (N,) or cols.dtype != torch.int32 or cols.dim() != 1:
        raise ValueError("readback_triton: scale_used must be [N] and cols int32 [m]")
    if out is None:
        out = torch.empty(4 * G + 1, m, dtype=torch.float32, device=scores.device)
    else:
        out = readback_head(out, 4 * G + 1, m, "readback_triton")
    if m:
        _readback_kernel[(m,)](scores, gates, gate_mul, gate_add, scale_used, cols, out, N, m, G=G, GB=_gb(G))
    return out
