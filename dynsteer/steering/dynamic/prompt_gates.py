"""Prompt-level (CAST-style) gates: decided once at the prompt's last token on the device, held while the request
generates; the host never waits for them."""

from __future__ import annotations

import numpy as np
import torch

from dynsteer.request.compile_policy import SlotPlan
from dynsteer.steering.dynamic.state import DynState


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
        # the slot list each row's plan was taken from (a new list: taken again)
        self._src: list[list[SlotPlan] | None] = [None] * n

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
