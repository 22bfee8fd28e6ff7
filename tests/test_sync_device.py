"""The device sync tier's kernels: the torch reference equals the pure Python controllers on recorded score
sequences (identical decisions), and the Triton twin equals the reference (interpreter on CPU, compiled on CUDA,
inside a CUDA graph too)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from dynsteer import Action, DynamicSteeringPolicy, ProbeGate, Rule, SyncControllerSpec
from dynsteer.kernels.controller_reference import (Layout, control_reference, controller_row, readback_reference,
                                                   update_reference)
from dynsteer.device.graphs import bucket
from dynsteer.request.compile_policy import policy_slots
from dynsteer.steering.dynamic.state import DynState
from dynsteer.steering.dynamic.tokens import StepTokens
from tests.conftest import run_interpreted

H, G = 8, 2

CONTROLLERS = {
    "none": None,
    "latch": SyncControllerSpec(kind="latch", on=0.5, off=-0.25, scale=2.0),
    "ema_latch": SyncControllerSpec(kind="ema_latch", alpha=0.3, on=0.2, off=0.0, scale=1.5),
    "pid": SyncControllerSpec(kind="pid", target=0.1, kp=0.8, ki=0.3, kd=0.2, min_scale=-0.5, max_scale=1.0),
    "budget": SyncControllerSpec(kind="budget", max_steered_tokens=5,
                                 inner=SyncControllerSpec(kind="latch", on=0.0, off=-1.0, scale=1.0)),
    "budget_nested": SyncControllerSpec(kind="budget", max_steered_tokens=9, inner=SyncControllerSpec(
        kind="budget", max_steered_tokens=4, inner=SyncControllerSpec(kind="ema_latch", alpha=0.5, on=0.1,
                                                                      off=-0.1, scale=3.0))),
}
SCOPES = ["this_token", "next_step", "rest_of_request"]


def _unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(H)
    return (v / np.linalg.norm(v)).astype(np.float32)


def make_policy(controller: str, scope: str, second_scope: str = "next_step") -> DynamicSteeringPolicy:
    mons = [ProbeGate(name="a", layer=1, direction=_unit(1), sharpness=3.0, threshold=0.2),
            ProbeGate(name="b", layer=1, direction=_unit(2), sharpness=1.5, threshold=-0.1)]
    act = [Action(kind="add", layer=2, vector=_unit(3))]
    rules = [Rule(monitor="a", actions=act, scope=scope, gate_floor=0.1)]
    if controller != "pid":
        rules.append(Rule(monitor="b", actions=act, scope=second_scope))
    ctrl = CONTROLLERS[controller]
    if ctrl is not None:
        ctrl = ctrl.model_copy(update={"monitor": "a"})
    return DynamicSteeringPolicy(monitors=mons, rules=rules, controller=ctrl)


def recorded_scores(seed: int, steps: int = 48) -> np.ndarray:
    """Score sequences like a monitor's over a generation (drifts, bursts), with a few non-finite values."""
    rng = np.random.default_rng(seed)
    walk = np.cumsum(rng.normal(0, 0.3, (steps, G)), axis=0) + rng.normal(0, 0.4, (steps, G))
    walk[rng.integers(0, steps, 2), 0] = [np.nan, np.inf]
    walk[rng.integers(0, steps), 0] = 0.5  # exactly on a latch threshold
    return walk.astype(np.float32)


def run_python(policy: DynamicSteeringPolicy, scores: np.ndarray) -> list[tuple[list[float], list[float], float]]:
    """The host path (pure Python controllers): (mul, add, scale) in effect at every step."""
    st = DynState.for_policy(policy)
    st.tier = "host" if st.sync else "plain"  # the Python controllers, as the host tier runs them
    out = []
    g = len(st.slots)
    for t, row in enumerate(scores):
        mul, add = st.multipliers()
        out.append(([float(np.float32(x)) for x in mul], [float(np.float32(x)) for x in add], float(np.float32(st.scale))))
        block = np.zeros((2 * g, 1), np.float32)
        block[:g, 0] = row[:g]
        st.observe(block, 0, 10 + t)
    return out


def run_device(policy: DynamicSteeringPolicy, scores: np.ndarray, control=control_reference, update=update_reference,
               device: str = "cpu") -> tuple[list[tuple[list[float], list[float], float]], torch.Tensor]:
    slots, ctrl_slot = policy_slots(policy)
    L = Layout(G)
    state = torch.zeros(4, L.width, dtype=torch.float64)
    state[2] = torch.tensor(controller_row(L, slots, ctrl_slot, policy.controller), dtype=torch.float64)
    state = state.to(device)
    n = 4
    ctl = torch.full((n,), -1, dtype=torch.int32, device=device)
    ctl[1] = 2  # token 1 is the request's fresh decode token, of slot 2
    idx = torch.tensor([1], dtype=torch.int32, device=device)
    pos = torch.zeros(n, dtype=torch.int32, device=device)
    replay = torch.zeros(0, 2 * G + 1, dtype=torch.float32, device=device)
    mul, add = torch.zeros(G, n, device=device), torch.zeros(G, n, device=device)
    scale, sc = torch.zeros(n, device=device), torch.zeros(G, n, device=device)
    out = []
    for t, row in enumerate(scores):
        control(ctl, state, replay, mul, add, scale, n)
        k = len(slots)
        out.append((mul[:k, 1].cpu().tolist(), add[:k, 1].cpu().tolist(), float(scale[1])))
        assert torch.all(mul[:, [0, 2, 3]] == 1) and torch.all(add[:, [0, 2, 3]] == 0)  # not in the sync tier
        sc[:, 1] = torch.from_numpy(row)
        pos[1] = 10 + t
        update(idx, ctl, pos, sc, state, 1)
        update(idx, ctl, pos, sc, state, 1)  # a recomputed position (not after it): ignored
    return out, state.cpu()


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("controller", list(CONTROLLERS))
def test_device_reference_decides_exactly_like_the_python_controllers(controller: str, scope: str) -> None:
    policy = make_policy(controller, scope)
    for seed in range(4):
        scores = recorded_scores(seed)
        want = run_python(policy, scores)
        got, state = run_device(policy, scores)
        assert got == want, (controller, scope, seed)
        L = Layout(G)
        assert state[2, L.STEPS] == len(scores) and state[2, L.LAST_POS] == 10 + len(scores) - 1
        assert torch.all(state[[0, 1, 3]] == 0)  # other slots untouched


def test_the_comparison_can_fail() -> None:
    """A controller that differs in one parameter gives a different decision sequence on the same scores."""
    policy = make_policy("latch", "this_token")
    other = policy.model_copy(update={"controller": policy.controller.model_copy(update={"on": 1.5})})
    scores = recorded_scores(0)
    assert run_device(other, scores)[0] != run_python(policy, scores)


def test_replay_rows_and_defaults() -> None:
    L = Layout(G)
    state = torch.zeros(2, L.width, dtype=torch.float64)
    ctl = torch.tensor([-1, -2, -3, 0], dtype=torch.int32)
    state[0, L.SCALE_NOW] = 0.75
    replay = torch.tensor([[0.5, 0.25, 0.0, 0.125, 3.0], [0.0, 1.0, 2.0, 0.0, 4.0]], dtype=torch.float32)
    mul, add, scale = torch.full((G, 6), 9.0), torch.full((G, 6), 9.0), torch.full((6,), 9.0)
    control_reference(ctl, state, replay, mul, add, scale, 4)
    assert mul[:, :4].tolist() == [[1, 0.5, 0.0, 0.75], [1, 0.25, 1.0, 0.75]]
    assert add[:, :4].tolist() == [[0, 0.0, 2.0, 0.0], [0, 0.125, 0.0, 0.0]]
    assert scale[:4].tolist() == [1, 3.0, 4.0, 0.75] and torch.all(mul[:, 4:] == 9)  # past upto: untouched


# ---- Triton twin vs reference --------------------------------------------------------------------------------------
def random_case(seed: int, device: str = "cpu") -> dict:
    """Many slots of random controllers in random states; a batch whose tokens mix fresh, replayed and other
    tokens; the recorded updates of a few steps."""
    rng = np.random.default_rng(seed)
    L = Layout(G)
    kinds = list(CONTROLLERS)
    state = torch.zeros(12, L.width, dtype=torch.float64)
    for s in range(12):
        pol = make_policy(kinds[s % len(kinds)], SCOPES[s % 3], SCOPES[(s + 1) % 3])
        slots, ctrl_slot = policy_slots(pol)
        state[s] = torch.tensor(controller_row(L, slots, ctrl_slot, pol.controller))
        state[s, L.SCALE_NOW] = float(rng.normal())
        state[s, L.prev_gate(0)], state[s, L.prev_gate(1)] = rng.random(2)
        state[s, L.latched(0)], state[s, L.latched(1)] = rng.integers(0, 2, 2)
        state[s, L.LAST_POS] = float(rng.integers(0, 5))
    n = 16
    slots = rng.permutation(12)[:6]
    ctl = np.full(n, -1, np.int32)
    fresh = rng.permutation(n)[:6]
    ctl[fresh] = slots
    ctl[rng.permutation(np.setdiff1d(np.arange(n), fresh))[:3]] = [-2, -3, -4]
    return {"ctl": torch.from_numpy(ctl).to(device), "state": state.to(device),
            "replay": torch.from_numpy(rng.normal(size=(3, 2 * G + 1)).astype(np.float32)).to(device),
            "idx": torch.from_numpy(fresh.astype(np.int32)).to(device),
            "pos": torch.from_numpy(rng.integers(0, 12, n).astype(np.int32)).to(device),
            "scores": [torch.from_numpy(recorded_scores(seed + k, n).T.copy()).to(device) for k in range(6)]}


def padded(case: dict) -> dict:
    """``case`` as the driver stages it for a graphed update grid: one more control word (-1, the padding column
    n, past the score buffers), the update list padded to a power of two with entries naming it."""
    n, m = case["scores"][0].shape[1], case["idx"].shape[0]
    dev = case["ctl"].device
    pad = torch.full((bucket(m, n) - m + 2,), n, dtype=torch.int32, device=dev)  # 2 past the bucket: any extra
    return {**case, "ctl": torch.cat([case["ctl"], torch.full((1,), -1, dtype=torch.int32, device=dev)]),
            "idx": torch.cat([case["idx"], pad])}


def run_case(case: dict, control, update) -> dict:
    state = case["state"].clone()
    n = case["scores"][0].shape[1]
    mul, add = torch.zeros(G, n + 3, device=state.device), torch.zeros(G, n + 3, device=state.device)
    scale = torch.zeros(n + 3, device=state.device)
    outs = []
    pos = case["pos"].clone()
    for sc in case["scores"]:
        control(case["ctl"], state, case["replay"], mul, add, scale, n)
        outs.append(torch.cat([mul[:, :n].flatten(), add[:, :n].flatten(), scale[:n]]).cpu())
        update(case["idx"], case["ctl"], pos, sc.to(state.device), state, case["idx"].shape[0])
        pos += 1
    return {"outs": torch.stack(outs), "state": state.cpu()}


def compare(got: dict, want: dict) -> dict:
    return {"out_err": (got["outs"] - want["outs"]).abs().max().item(),
            "state_err": (got["state"] - want["state"]).abs().nan_to_num(0.0).max().item(),
            "nan_equal": bool(torch.equal(got["state"].isnan(), want["state"].isnan()))}


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def readback_cases(device: str = "cpu") -> list[tuple]:
    """Random gate buffers and read-back columns: G of 1 (one gate), 3 (not a power of 2) and 8; columns repeated,
    out of order, none at all."""
    out = []
    for seed, (g, n, m) in enumerate([(1, 5, 3), (3, 17, 9), (8, 64, 64), (2, 9, 0)]):
        gen = torch.Generator().manual_seed(seed)
        bufs = [torch.randn(g, n, generator=gen).to(device) for _ in range(4)]
        scale = torch.randn(n, generator=gen).to(device)
        cols = torch.randint(0, n, (m,), generator=gen, dtype=torch.int32).to(device)
        out.append((*bufs, scale, cols))
    return out


def _interp_worker() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from dynsteer.kernels.triton_controller import control_triton, readback_triton, update_triton

    results = {}
    for seed in range(4):
        case = random_case(seed)
        results[str(seed)] = compare(run_case(case, control_triton, update_triton),
                                     run_case(case, control_reference, update_reference))
        # padding entries of a graphed grid are no-ops: the padded twin equals the unpadded reference
        results[f"padded{seed}"] = compare(run_case(padded(case), control_triton, update_triton),
                                           run_case(case, control_reference, update_reference))
    # the read-back gather: bit-equal (a copy); a mismatch reports the case
    results["readback"] = [i for i, case in enumerate(readback_cases())
                           if not torch.equal(readback_triton(*case), readback_reference(*case))]
    # into a caller's buffer (the graphed launch's), larger than needed: its head holds the same values
    results["readback_out"] = [i for i, case in enumerate(readback_cases())
                               if not torch.equal(readback_triton(*case, out=torch.full((3000,), 7.0)),
                                                  readback_reference(*case))]
    print("RESULTS " + json.dumps(results))
    return 0


def _check(res: dict, tol: float = 0.0) -> None:
    """Exact in the interpreter (numpy's float32 exp, as the reference); on CUDA the gate's float32 exp may differ
    by an ulp, so a carried gate (and ``d·gate``) may differ by ~6e-8, never a decision (scores drive those)."""
    assert res["out_err"] <= tol and res["state_err"] <= max(tol, 1e-9) and res["nan_equal"], res


def test_triton_twin_equals_reference_in_the_interpreter() -> None:
    results = run_interpreted(__file__, timeout=600)
    assert results.pop("readback") == []  # read-back gathers equal to the torch ops, every case
    assert results.pop("readback_out") == []
    assert len(results) == 8
    for res in results.values():
        _check(res)


def test_padding_entries_are_no_ops_in_the_reference() -> None:
    for seed in range(3):
        case = random_case(seed)
        _check(compare(run_case(padded(case), control_reference, update_reference),
                       run_case(case, control_reference, update_reference)))


def test_bucket_rounds_up_to_a_power_of_two_within_the_limit() -> None:
    assert [bucket(n, 64) for n in (1, 2, 3, 5, 16, 17, 63, 64)] == [1, 2, 4, 8, 16, 32, 64, 64]
    assert bucket(33, 40) == 40
    for bad in (0, 65):
        with pytest.raises(ValueError, match="n must be in"):
            bucket(bad, 64)


def test_readback_rejects_an_output_buffer_it_cannot_fill() -> None:
    from dynsteer.kernels.triton_controller import readback_triton

    scores, gates, mul, add, scale, cols = readback_cases()[2]  # G 8, m 64: 33 × 64 values
    for impl in (readback_triton, readback_reference):
        for bad in (torch.empty(33 * 64 - 1), torch.empty(33 * 64, dtype=torch.float64), torch.empty(66, 64).t()):
            with pytest.raises(ValueError, match="out must be a contiguous float32 buffer of at least 2112"):
                impl(scores, gates, mul, add, scale, cols, out=bad)


def test_readback_reference_fills_the_head_of_an_output_buffer() -> None:
    for case in readback_cases():
        buf = torch.full((5000,), 7.0)
        head = readback_reference(*case, out=buf)
        assert torch.equal(head, readback_reference(*case))
        assert head.numel() == 0 or head.data_ptr() == buf.data_ptr()  # an empty view has no address
        assert (buf[head.numel():] == 7.0).all()  # nothing past the head is written


def test_readback_reference_is_the_columns_of_the_buffers() -> None:
    for scores, gates, mul, add, scale, cols in readback_cases():
        out = readback_reference(scores, gates, mul, add, scale, cols)
        G, m = scores.shape[0], cols.shape[0]
        assert out.shape == (4 * G + 1, m)
        for j, c in enumerate(cols.tolist()):
            want = torch.cat([scores[:, c], gates[:, c], mul[:, c], add[:, c], scale[c:c + 1]])
            assert torch.equal(out[:, j], want)


@needs_cuda
def test_readback_triton_equals_reference_on_cuda() -> None:
    from dynsteer.kernels.triton_controller import readback_triton

    for case in readback_cases("cuda"):
        got = readback_triton(*case)
        assert torch.equal(got.cpu(), readback_reference(*(t.cpu() for t in case)))


@needs_cuda
@pytest.mark.parametrize("seed", range(4))
def test_triton_twin_equals_reference_on_cuda(seed: int) -> None:
    from dynsteer.kernels.triton_controller import control_triton, update_triton

    case = random_case(seed, "cuda")
    _check(compare(run_case(case, control_triton, update_triton),
                   run_case({k: (v.cpu() if isinstance(v, torch.Tensor) else [x.cpu() for x in v])
                             for k, v in case.items()}, control_reference, update_reference)), tol=1e-6)


@needs_cuda
def test_kernels_replay_inside_a_cuda_graph() -> None:
    from dynsteer.kernels.triton_controller import control_triton, update_triton

    case = random_case(7, "cuda")
    state = case["state"].clone()
    n = case["ctl"].shape[0]
    mul, add, scale = (torch.zeros(G, n, device="cuda"), torch.zeros(G, n, device="cuda"),
                       torch.zeros(n, device="cuda"))
    sc = case["scores"][0].clone()
    control_triton(case["ctl"], state, case["replay"], mul, add, scale, n)  # compile outside the capture
    update_triton(case["idx"], case["ctl"], case["pos"], sc, state, case["idx"].shape[0])
    state.copy_(case["state"])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        control_triton(case["ctl"], state, case["replay"], mul, add, scale, n)
        update_triton(case["idx"], case["ctl"], case["pos"], sc, state, case["idx"].shape[0])
    state.copy_(case["state"])
    graph.replay()
    torch.cuda.synchronize()
    ref = case["state"].cpu().clone()
    m2, a2, s2 = torch.zeros(G, n), torch.zeros(G, n), torch.zeros(n)
    control_reference(case["ctl"].cpu(), ref, case["replay"].cpu(), m2, a2, s2, n)
    update_reference(case["idx"].cpu(), case["ctl"].cpu(), case["pos"].cpu(), sc.cpu(), ref, case["idx"].shape[0])
    assert torch.allclose(mul.cpu(), m2, atol=1e-6) and torch.allclose(add.cpu(), a2, atol=1e-6)
    assert torch.equal(scale.cpu(), s2)
    assert (state.cpu() - ref).abs().nan_to_num(0.0).max().item() < 1e-6


def _drive(graphed: bool, batches: list[int], seed: int = 0, plain_at: frozenset[int] = frozenset(),
           ring: int | None = None, pending: list[int] | None = None) -> list[torch.Tensor]:
    """A DynamicDriver on CUDA through decode steps of the given batch sizes (requests of every controller kind,
    scores drawn per step): gate multipliers, scales and controller state after every step, copied. Steps in
    ``plain_at`` run traced plain-gate requests only (no sync token: read-back columns staged alone, unless an
    earlier sync step's multipliers are still to be reset). With ``ring``, read-backs go through that many pinned
    slots while the device is kept ~1 ms behind the host each step (nothing synchronises), and ``pending`` receives
    the read-backs left pending after each step."""
    from dynsteer.steering.dynamic.driver import DynamicDriver
    from dynsteer.device.staging import HostRing

    N = 64
    bufs = [torch.zeros(G, N, device="cuda") for _ in range(4)]
    drv = DynamicDriver(bufs[0], bufs[1], bufs[2], bufs[3], max_slots=32, graphed=graphed)
    assert drv.graphed == graphed
    if ring is not None:
        drv._ring = HostRing(drv._ring.slots[0].numel(), depth=ring)
    kinds = [k for k in CONTROLLERS if k != "none"]
    states, plain = {}, {}
    for i in range(max(batches)):
        st = DynState.for_policy(make_policy(kinds[i % len(kinds)], SCOPES[1 + i % 2]))
        drv.place(st)
        states[f"r{i}"] = st
        st = DynState.for_policy(make_policy("none", "this_token", "this_token"))
        st.keep = True
        drv.place(st)
        assert st.tier == "plain" and not st.sync
        plain[f"p{i}"] = st
    everyone = {**states, **plain}
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for step, b in enumerate(batches):
        ids = tuple(plain if step in plain_at else states)[:b]
        sts = [everyone[i] for i in ids]
        r = np.arange(b)
        tokens = StepTokens(ids, r, r.copy(), np.full(b, 10 + step, np.int64),
                            np.array([-1 if st.device_slot is None else st.device_slot for st in sts], np.int64),
                            np.array([st.sync for st in sts]), np.array([st.record for st in sts], np.int64),
                            np.zeros(b, bool), np.zeros(b, np.int64), np.array(["x"] * b, dtype=object))
        drv.plan(everyone, everyone.get, tokens, b)
        drv.scores[:, :b] = torch.randn(G, b, device="cuda", generator=gen)  # the forward's scores
        drv.gates[:, :b] = torch.rand(G, b, device="cuda", generator=gen)  # and gates
        if ring is not None:
            torch.cuda._sleep(2_000_000)  # a slow forward: the host runs ahead, read-backs pile up
        drv.after_forward(everyone.get)
        if pending is not None:
            pending.append(len(drv._pending))
        row = torch.cat([drv.gate_mul.flatten(), drv.gate_add.flatten(), drv.scale_used, drv.state.flatten().float()])
        out.append(row.clone() if ring is not None else row.cpu())
    drv.poll(everyone.get, block=True)
    out[:len(batches)] = [row.cpu() for row in out[:len(batches)]]
    for st in everyone.values():  # every request's read-back record: scores, gates, multipliers, scale per position
        positions, values = drv.records.record(st.record)
        out.append(torch.cat([torch.from_numpy(positions).float(), torch.from_numpy(values).flatten()]))
    return out


@needs_cuda
def test_graphed_launches_equal_triton_launches_on_cuda() -> None:
    """The controller and read-back kernels replayed from CUDA graphs (grids rounded up, padding words) leave the
    same multipliers, state and read-back records, bit for bit, as launched directly, through batch sizes that change
    the bucket both ways, and through steps of traced plain gates only (read-back columns staged alone)."""
    batches = [3, 3, 5, 9, 2, 16, 17, 7, 1, 4, 6, 2]
    plain_at = frozenset({2, 3, 6, 9, 10})  # 2, 6, 9: after a sync step (multipliers reset); 3, 10: columns alone
    direct, graphed = _drive(False, batches, plain_at=plain_at), _drive(True, batches, plain_at=plain_at)
    for step, (a, b) in enumerate(zip(direct, graphed)):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), f"step {step}"
    assert any(not torch.equal(direct[0], d) for d in direct[1:])  # the states did move
    plain_records = direct[len(batches) + max(batches):]
    assert all(len(r) for r in plain_records[:2])  # traced plain requests were read back


@needs_cuda
def test_read_backs_wrap_the_pinned_ring_without_losing_or_mixing_steps_on_cuda() -> None:
    """With the device behind the host, read-backs fill the pinned ring; launching one more waits for the oldest and
    feeds it first. Every step's multipliers, state and read-back records equal a run that synchronised each step."""
    batches = [3, 5, 9, 2, 16, 17, 7, 1, 4, 6, 2, 8]
    plain_at = frozenset({3, 7})
    synced = _drive(True, batches, plain_at=plain_at)
    pending: list[int] = []
    behind = _drive(True, batches, plain_at=plain_at, ring=2, pending=pending)
    assert max(pending) == 2, pending  # the ring was full: later launches had to free a slot first
    assert len(synced) == len(behind)
    for step, (a, b) in enumerate(zip(synced, behind)):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), f"step {step}"


# ---- in the engine -------------------------------------------------------------------------------------------------------
def test_device_tier_equals_host_tier_in_the_engine(tiny_llama_path):
    """Same engine, controllers on the device vs the Python controllers on the host: identical tokens, scales and
    gates for every built-in controller and carried scope, and the device tier never waits for a step."""
    from vllm import SamplingParams

    import dynsteer
    from dynsteer import DynsteerConfig
    from tests.conftest import make_llm, token_ids

    h = 128
    rng = np.random.default_rng(5)
    d = rng.standard_normal(h)
    d = (d / np.linalg.norm(d)).astype(np.float32)
    push = (rng.standard_normal(h) * 4).astype(np.float32)

    def pol(scope: str, ctrl: SyncControllerSpec | None) -> DynamicSteeringPolicy:
        return DynamicSteeringPolicy(
            monitors=[ProbeGate(name="m", layer=1, direction=d, sharpness=0.8, threshold=0.0)],
            rules=[Rule(monitor="m", actions=[Action(kind="add", layer=2, vector=push)], scope=scope)],
            controller=ctrl)

    policies = [pol("this_token", CONTROLLERS["latch"].model_copy(update={"on": 0.0, "off": -0.5})),
                pol("this_token", CONTROLLERS["ema_latch"].model_copy(update={"on": 0.0, "off": -0.3})),
                pol("this_token", CONTROLLERS["pid"].model_copy(update={"target": -0.5})),
                pol("this_token", CONTROLLERS["budget"]), pol("next_step", None), pol("rest_of_request", None),
                pol("this_token", None), None]
    prompts = ["the quick brown fox", "once upon a time", "in the beginning", "she opened the door and",
               "a b c d e", "it was a dark", "we the people", "to be or not"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = {}
    for tier in ("device", "host"):
        with make_llm(tiny_llama_path, **DynsteerConfig(max_gates=2, sync_tier=tier).engine_kwargs()) as llm:
            st = dynsteer.attach(llm)
            outs = st.generate(prompts, params, policy=policies)
            stats = st.describe()[0]["dynamic"]
            runs[tier] = (outs, stats)
    (dev, dev_stats), (host, host_stats) = runs["device"], runs["host"]
    assert token_ids(dev) == token_ids(host)
    for a, b, p in zip(dev, host, policies):
        if p is None:
            assert a.trace is None and b.trace is None
            continue
        assert a.trace.scale == b.trace.scale and a.trace.position == b.trace.position
        # exact on CPU; on CUDA a carried gate's float32 exp may differ by an ulp from the host's numpy
        np.testing.assert_allclose(a.trace.applied_gates(), b.trace.applied_gates(), rtol=1e-5, atol=1e-7)
    fired = [o.trace is not None and np.any(o.trace.scale) for o in dev[:4]]
    assert all(fired), fired  # every controller did switch steering on at some point
    assert dev_stats["host_sync_steps"] == 0 and host_stats["host_sync_steps"] > 0
    assert dev_stats["device_slots_exhausted"] == 0


def test_poll_feeds_read_backs_in_step_order_until_as_many_as_asked_are_left() -> None:
    """The read-back ring frees a slot with ``poll(block=True, leave=depth - 1)``: the oldest read-backs are fed
    first, in step order, and exactly as many as asked stay pending (CPU: read-backs complete at once)."""
    from dynsteer.steering.dynamic.driver import DynamicDriver

    N = 8
    drv = DynamicDriver(torch.ones(G, N), torch.zeros(G, N), torch.zeros(G, N), torch.zeros(G, N), max_slots=4)
    st = DynState.for_policy(make_policy("none", "this_token", "this_token"))
    st.keep = True
    drv.place(st)
    states = {"p0": st}
    for step in range(3):
        tokens = StepTokens(("p0",), np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([10 + step]),
                            np.array([-1]), np.array([False]), np.array([st.record]), np.zeros(1, bool),
                            np.zeros(1, np.int64), np.array(["x"], dtype=object))
        drv.plan(states, states.get, tokens, 1)
        drv.scores[:, 0] = float(step + 1)
        drv._launch_readback(states.get)  # launched, not fed
    assert len(drv._pending) == 3
    drv.poll(states.get, block=True, leave=1)
    assert len(drv._pending) == 1
    positions, values = drv.records.record(st.record)
    assert positions.tolist() == [10, 11] and values[:, 0].tolist() == [1.0, 2.0]
    drv.poll(states.get, block=True)
    positions, values = drv.records.record(st.record)
    assert not drv._pending and positions.tolist() == [10, 11, 12] and values[:, 0].tolist() == [1.0, 2.0, 3.0]


def test_slots_and_state_do_not_depend_on_the_order_requests_were_freed_in() -> None:
    """TP ranks free a step's finished requests in their own set order: the next requests must still take the same
    slots, so both ranks' state buffers stay bit-identical."""
    from dynsteer.steering.dynamic.driver import DynamicDriver

    def driver_after(free_order: list[int]) -> tuple[list[int], str]:
        gates = torch.zeros(G, 16)
        drv = DynamicDriver(torch.ones(G, 16), torch.zeros(G, 16), torch.zeros(G, 16), gates, max_slots=8)
        first = [DynState.for_policy(make_policy("ema_latch", "this_token")) for _ in range(4)]
        for st in first:
            drv.place(st)
        for i in free_order:
            drv.free(first[i])
        later = [DynState.for_policy(make_policy(c, "this_token")) for c in ("pid", "latch")]
        for st in later:
            drv.place(st)
        return [st.device_slot for st in later], drv.state_digest()[0]

    slots_a, digest_a = driver_after([0, 1, 2, 3])
    slots_b, digest_b = driver_after([3, 1, 0, 2])
    assert slots_a == slots_b == [0, 1]
    assert digest_a == digest_b


if __name__ == "__main__":
    sys.exit(_interp_worker())
