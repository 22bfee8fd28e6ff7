"""PromptGates.stage on CPU tensors, no engine: the vectorised staging of generated tokens writes exactly what the
per-token loop it replaced wrote (``reference_stage`` below is that loop, verbatim), over random batches of real
policy states (prompt_last / prompt_mean rules, conditions on token and prompt-level rules, plain token rules, no
state at all), several tokens per request, shuffled token columns and held rows, and replaced slot lists."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from dynsteer import Action, DynamicSteeringPolicy, ProbeGate, Rule
from dynsteer.steering.dynamic.prompt_gates import PromptGates, _device
from dynsteer.steering.dynamic.state import DynState
from tests.conftest import unit, vec

H, G, N = 8, 5, 96


def _mon(name: str, seed: int, reads: str = "token") -> ProbeGate:
    return ProbeGate(name=name, layer=0, direction=unit(H, seed), sharpness=2.0, threshold=0.1 * seed, reads=reads)


def _act(seed: int) -> list[Action]:
    return [Action(kind="add", layer=1, vector=vec(H, seed))]


POLICIES = {
    # one prompt_last rule: slot 0 held, no condition
    "last": DynamicSteeringPolicy(monitors=[_mon("p", 1, "prompt_last")], rules=[Rule(monitor="p", actions=_act(1))]),
    # prompt_mean rule, a token rule conditioned on a prompt_last monitor (slot 2: the condition's own held slot)
    "mean+cond": DynamicSteeringPolicy(
        monitors=[_mon("m", 2, "prompt_mean"), _mon("t", 3), _mon("c", 4, "prompt_last")],
        rules=[Rule(monitor="m", actions=_act(2)), Rule(monitor="t", actions=_act(3), condition="c")]),
    # a prompt-level rule with a condition (its held gate times the condition's), a token rule under the same
    # condition, a disabled prompt rule, a plain token rule: slots 0..3 plus the condition at 4
    "cond-on-prompt": DynamicSteeringPolicy(
        monitors=[_mon("a", 5, "prompt_last"), _mon("t", 6), _mon("b", 7, "prompt_mean"), _mon("u", 8),
                  _mon("c", 9, "prompt_mean")],
        rules=[Rule(monitor="a", actions=_act(4), condition="c"), Rule(monitor="t", actions=_act(5), condition="c"),
               Rule(monitor="b", actions=_act(6), enabled=False), Rule(monitor="u", actions=_act(7))]),
    # token rules only: no prompt-level slot, never placed in a held row
    "token": DynamicSteeringPolicy(monitors=[_mon("t", 10)], rules=[Rule(monitor="t", actions=_act(8))]),
}


def reference_stage(self: PromptGates, states, decode, d_req, prompt, p_req, p_pos, p_len) -> bool:
    """PromptGates.stage before vectorisation (the per-token, per-slot loop), kept as the reference."""
    lat, held_g, cond_g = [], [], []
    if len(prompt):
        starts = np.flatnonzero(np.r_[True, p_req[1:] != p_req[:-1]])
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
                    col = -plen if slot.mean else int(ts[last[0]])
                    lat.append((col, st.held, g, st.params[0, g], st.params[1, g], st.params[2, g]))
    for t, r in zip(decode.tolist(), d_req.tolist()):
        st = states[r]
        if st is None or st.held is None:
            continue
        for g, slot in enumerate(st.slots):
            c = self.G if slot.cond is None else slot.cond
            if slot.prompt:
                held_g.append((t, st.held, g, c))
            elif slot.cond is not None:
                cond_g.append((t, st.held, g, c))
    if lat:
        a = np.array(lat, np.float64)
        self._latch = (_device(a[:, :3].T.astype(np.int64), self.held.device),
                       _device(a[:, 3:].T.astype(np.float32), self.held.device))
    if held_g:
        t, p, g, c = _device(np.array(held_g, np.int64).T, self.held.device)
        self.gates[g, t] = self.held[p, g] * self.held[p, c]
    if cond_g:
        t, p, g, c = _device(np.array(cond_g, np.int64).T, self.held.device)
        self.gate_mul[g, t] = self.held[p, c]
    return bool(cond_g)


def _gates(rng: np.random.Generator, max_requests: int) -> PromptGates:
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    pg = PromptGates(torch.rand(G, N, generator=gen), torch.rand(G, N, generator=gen) + 2.0,
                     torch.rand(G, N, generator=gen), max_requests)
    pg._free = [int(x) for x in rng.permutation(pg._free)]  # held rows in no relation to request order
    return pg


def _batch(rng: np.random.Generator, pg: PromptGates, n_req: int) -> list[DynState | None]:
    kinds = [*POLICIES, None, "unplaced"]
    states: list[DynState | None] = []
    for _ in range(n_req):
        kind = kinds[rng.integers(len(kinds))]
        if kind is None:
            states.append(None)
            continue
        st = DynState.for_policy(POLICIES["last" if kind == "unplaced" else kind])
        if kind != "unplaced":  # "unplaced": prompt-level slots but no held row (skipped like a plain state)
            pg.place(st)
        states.append(st)
    for st in states:  # some decided with prompt-mean sums started, some not
        if st is not None and rng.random() < 0.5:
            st.decided, st.mean_next = True, int(rng.integers(0, 6))
    return states


def _decode(rng: np.random.Generator, n_req: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct token columns in shuffled order; some requests with several tokens, some with none."""
    m = int(rng.integers(0, N // 2))
    cols = rng.permutation(N)[:m].astype(np.int64)
    d_req = np.sort(rng.integers(0, n_req, m)).astype(np.int64)
    if rng.random() < 0.3:  # tokens not grouped by request
        d_req = rng.permutation(d_req)
    return cols, d_req


def _prompt(rng: np.random.Generator, states, taken: np.ndarray) -> tuple[np.ndarray, ...]:
    """Prompt tokens of a few requests (contiguous per request, columns not used by generated tokens), some
    reaching the prompt's last position."""
    free = np.setdiff1d(np.arange(N), taken)
    prompt, p_req, p_pos, p_len = [], [], [], []
    at = 0
    for r in rng.permutation(len(states))[: int(rng.integers(0, 4))].tolist():
        k = int(rng.integers(1, 6))
        if at + k > len(free):
            break
        start, plen = int(rng.integers(0, 6)), int(rng.integers(3, 12))
        prompt += free[at:at + k].tolist()
        p_req += [r] * k
        p_pos += list(range(start, start + k))
        p_len += [plen] * k
        at += k
    return tuple(np.array(x, np.int64) for x in (prompt, p_req, p_pos, p_len))


def _check(pg: PromptGates, ref: PromptGates, states, ref_states, args) -> bool:
    got = pg.stage(states, *args)
    want = reference_stage(ref, ref_states, *args)
    assert got == want
    torch.testing.assert_close(pg.gates, ref.gates, rtol=0, atol=0)
    torch.testing.assert_close(pg.gate_mul, ref.gate_mul, rtol=0, atol=0)
    assert pg._sum == ref._sum
    assert (pg._latch is None) == (ref._latch is None)
    if pg._latch is not None:
        for a, b in zip(pg._latch, ref._latch):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for st, rs in zip(states, ref_states):
        if st is not None:
            assert (st.decided, st.mean_next, st.held) == (rs.decided, rs.mean_next, rs.held)
    return got


def _twin(pg: PromptGates, states) -> tuple[PromptGates, list]:
    """A reference PromptGates with the same buffers (cloned) and states (deep copies)."""
    ref = PromptGates(pg.gates.clone(), pg.gate_mul.clone(), pg.scores.clone(), pg.held.shape[0])
    ref.held.copy_(pg.held)
    ref._sum, ref._latch = list(pg._sum), pg._latch
    return ref, copy.deepcopy(states)


@pytest.mark.parametrize("seed", range(8))
def test_stage_writes_what_the_per_token_loop_wrote(seed):
    rng = np.random.default_rng(seed)
    n_req = int(rng.integers(1, 24))
    pg = _gates(rng, max_requests=n_req + 8)
    for _ in range(int(rng.integers(0, 4))):  # rows held by requests not in this batch
        pg.place(DynState.for_policy(POLICIES["mean+cond"]))
    states = _batch(rng, pg, n_req)
    # distinct random held gates: a wrong row, slot, condition or column shows as a different value
    pg.held[:, :G] = torch.rand(pg.held.shape[0], G, generator=torch.Generator().manual_seed(seed)) + 0.5
    gen = torch.Generator().manual_seed(1000 + seed)
    for step in range(6):
        decode, d_req = _decode(rng, n_req)
        prompt = _prompt(rng, states, decode) if step % 2 == 0 else (np.zeros(0, np.int64),) * 4
        if step == 3:  # a replaced slot list (as retune leaves it): the same kinds, taken again
            for st in states:
                if st is not None and st.held is not None:
                    st.slots = list(st.slots)
        ref, ref_states = _twin(pg, states)
        _check(pg, ref, states, ref_states, (decode, d_req, *prompt))
        pg.gates.copy_(torch.rand(G, N, generator=gen))  # fresh buffers for the next step: every write is checked anew
        pg.gate_mul.copy_(torch.rand(G, N, generator=gen) + 2.0)
        pg.held[:, :G] += 1.0


def test_replaced_slot_kinds_are_taken_again():
    """A placed request's slot list replaced by one of other kinds: the next step stages the new kinds."""
    rng = np.random.default_rng(99)
    pg = _gates(rng, max_requests=4)
    states = [DynState.for_policy(POLICIES["last"]), DynState.for_policy(POLICIES["cond-on-prompt"])]
    for st in states:
        pg.place(st)
    pg.held[:, :G] = torch.rand(4, G, generator=torch.Generator().manual_seed(1)) + 0.5
    decode, d_req = np.array([7, 3, 11, 40], np.int64), np.array([0, 1, 1, 0], np.int64)
    empty = (np.zeros(0, np.int64),) * 4
    ref, ref_states = _twin(pg, states)
    _check(pg, ref, states, ref_states, (decode, d_req, *empty))
    states[0].slots, states[1].slots = states[1].slots, states[0].slots
    ref, ref_states = _twin(pg, states)
    assert _check(pg, ref, states, ref_states, (decode, d_req, *empty))  # request 0 now has conditional slots


def test_sixty_four_decode_tokens_two_prompt_slots():
    """The benchmark shape: 64 requests, one generated token each, two prompt-level rules (last, mean)."""
    pol = DynamicSteeringPolicy(monitors=[_mon("a", 1, "prompt_last"), _mon("b", 2, "prompt_mean")],
                                rules=[Rule(monitor="a", actions=_act(1)), Rule(monitor="b", actions=_act(2))])
    rng = np.random.default_rng(5)
    pg = _gates(rng, max_requests=64)
    states = [DynState.for_policy(pol) for _ in range(64)]
    for st in states:
        pg.place(st)
        st.decided = True
    pg.held[:, :G] = torch.rand(64, G, generator=torch.Generator().manual_seed(2)) + 0.5
    decode = rng.permutation(N)[:64].astype(np.int64)
    ref, ref_states = _twin(pg, states)
    assert not _check(pg, ref, states, ref_states, (decode, np.arange(64), *(np.zeros(0, np.int64),) * 4))
    rows = np.array([st.held for st in states])
    np.testing.assert_array_equal(pg.gates[:2, decode].numpy(), pg.held[rows, :2].numpy().T)
