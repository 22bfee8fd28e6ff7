"""The step-batched host path: per-request arrays gathered once per batch composition, read-backs appended a step at
a time. Both must give exactly what the per-request, per-token version gave."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynsteer import (Action, AddVector, DynamicSteeringPolicy, ModelShape, ProbeGate, Rule, SteeringSpec,
                      SyncControllerSpec)
from dynsteer.request.payload import encode_payload
from dynsteer.device.readback import ReadbackStore
from dynsteer.steering.batch import BatchArrays, Columns
from dynsteer.steering.dynamic.tokens import ActedReport
from dynsteer.steering.runtime import BatchView, SteeringRuntime
from dynsteer.steering.tables import SteeringTables

H = 8
SHAPE = ModelShape(num_layers=3, hidden_size=H, max_gates=2)


# ---- ReadbackStore against a dictionary model --------------------------------------------------------------------
@st.composite
def steps(draw):
    """Steps of read-backs: each a list of (request, [positions]) runs, positions possibly recomputed."""
    n_req = draw(st.integers(1, 5))
    frontier = [0] * n_req
    out = []
    for _ in range(draw(st.integers(1, 25))):
        runs = []
        for r in draw(st.permutations(range(n_req))):
            if draw(st.booleans()):
                start = draw(st.integers(max(0, frontier[r] - 3), frontier[r]))  # recompute a few, or go on
                length = draw(st.integers(1, 4))
                runs.append((r, list(range(start, start + length))))
                frontier[r] = max(frontier[r], start + length)
        out.append(runs)
    return n_req, out, draw(st.lists(st.booleans(), min_size=n_req, max_size=n_req))


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=steps())
def test_readback_store_keeps_each_position_once_in_order(case):
    n_req, schedule, recorded = case
    store = ReadbackStore(width=3, slots=2, length=2)  # tiny: both dimensions must grow
    slot = [store.acquire() if rec else -1 for rec in recorded]  # -1: a request that keeps no record
    model: dict[int, dict[int, list[float]]] = {r: {} for r in range(n_req)}
    rng = np.random.default_rng(0)
    for runs in schedule:
        s = np.array([slot[r] for r, ps in runs for _ in ps], np.int64)
        pos = np.array([p for _, ps in runs for p in ps], np.int64)
        block = rng.standard_normal((3, len(pos))).astype(np.float32)
        store.append(s, pos, block)
        k = 0
        for r, ps in runs:
            last = max(model[r], default=-1)
            for p in ps:
                if p > last:  # the first computation of a position is the one kept
                    model[r][p] = block[:, k].tolist()
                k += 1
    for r in range(n_req):
        if slot[r] < 0:
            continue
        positions, values = store.record(slot[r])
        assert positions.tolist() == sorted(model[r])
        assert values.tolist() == [model[r][p] for p in sorted(model[r])]
        for p, v in model[r].items():
            assert store.at(slot[r], p).tolist() == v


def test_retired_record_slots_wait_for_their_read_backs():
    store = ReadbackStore(width=1, slots=1)
    a = store.acquire()
    store.retire(a, after=5)
    store.reclaim(4)
    b = store.acquire()
    assert b != a  # read-back 5 may still name slot a
    store.reclaim(5)
    assert store.acquire() == a


# ---- the runtime's per-batch arrays --------------------------------------------------------------------------------
def _unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(H)
    return (v / np.linalg.norm(v)).astype(np.float32)


def _runtime() -> SteeringRuntime:
    sites = [(l, "post_block") for l in range(3)]
    return SteeringRuntime(SHAPE, SteeringTables(sites, H, 16, 1, max_tokens=64, max_gates=2))


PAYLOADS = [
    None,
    encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector=_unit(1), tier="decode")])),
    encode_payload(SteeringSpec(vectors=[AddVector(layer=0, vector=_unit(2))])),
    encode_payload(policy=DynamicSteeringPolicy(
        monitors=[ProbeGate(name="m", layer=0, direction=_unit(3), sharpness=2.0, threshold=0.0)],
        rules=[Rule(monitor="m", actions=[Action(kind="add", layer=2, vector=_unit(4))])]), trace=True),
    encode_payload(policy=DynamicSteeringPolicy(  # the device sync tier
        monitors=[ProbeGate(name="m", layer=0, direction=_unit(5), sharpness=2.0, threshold=0.0)],
        rules=[Rule(monitor="m", actions=[Action(kind="add", layer=2, vector=_unit(6))], scope="next_step")],
        controller=SyncControllerSpec(kind="ema_latch", alpha=0.5, on=0.1, off=0.0, scale=2.0, monitor="m")),
        trace=True),
]


@st.composite
def traffic(draw):
    """Steps of a batch that changes (joins, finishes, preemptions) or stays, and global spec changes."""
    ops = draw(st.lists(st.sampled_from(["step", "step", "step", "join", "finish", "preempt", "global"]),
                        min_size=5, max_size=40))
    return ops, draw(st.lists(st.integers(0, len(PAYLOADS) - 1), min_size=40, max_size=40)), draw(st.booleans())


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=traffic())
def test_cached_batch_arrays_plan_exactly_like_a_fresh_gather(case):
    """Two runtimes see the same traffic; one gathers its per-request arrays afresh every step (and its dynamic
    tokens, and uploads their read-back columns every step). Their row index, their dynamic tokens' control words
    and what their read-backs report (where steering acted, with prefix caching) must be identical at every step."""
    ops, kinds, report_acts = case
    cached, fresh = _runtime(), _runtime()
    for rt in (cached, fresh):
        rt.dynamic.report_acts = report_acts
    live: dict[str, list[int]] = {}  # req_id -> [prompt_len, computed]
    payload: dict[str, str | None] = {}
    serial = reported = dyn_decodes = 0
    for op in ops:
        if op == "join" or not live:
            req = f"r{serial}"
            payload[req] = PAYLOADS[kinds[serial % len(kinds)]]
            live[req] = [3 + serial % 4, 0]
            serial += 1
        elif op == "finish":
            req = next(iter(live))
            del live[req]
            for rt in (cached, fresh):
                rt.release([req])
        elif op == "preempt":
            req = next(reversed(live))
            live[req][1] = 0  # it recomputes its prompt and what it generated
            for rt in (cached, fresh):
                rt.release([req], finished=False)
        elif op == "global":
            spec = SteeringSpec(vectors=[AddVector(layer=2, vector=_unit(serial), tier="decode")] if serial % 2
                                else [])
            for rt in (cached, fresh):
                rt.set_global(spec)
        ids = list(live)
        counts = [max(1, live[r][0] - live[r][1]) if live[r][1] < live[r][0] else 1 for r in ids]
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        view = BatchView(ids, qsl, np.array([live[r][1] for r in ids], np.int64),
                         np.array([live[r][0] for r in ids], np.int64), int(qsl[-1]), int(qsl[-1]) + 2)
        fresh._batch, fresh._columns = None, Columns()  # no batch arrays, nor request values, kept
        fresh.dynamic_tier._tokens, fresh.dynamic._cols_on_device = None, None  # nor tokens, nor columns uploaded
        for rt in (cached, fresh):
            rt.release(())  # as the runner glue does at every step (vLLM's usually empty finished set)
            rt.plan(view, payload.__getitem__)
            rt.after_forward()
        for f in dataclasses.fields(BatchArrays):  # the arrays themselves, values and dtypes
            a, b = getattr(cached._batch, f.name), getattr(fresh._batch, f.name)
            if isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all(), f.name
            elif isinstance(a, dict):
                assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), f.name
            elif f.name != "version":
                assert a == b, f.name
        n = int(qsl[-1]) + 2
        assert torch.equal(cached.tables.row_index, fresh.tables.row_index)  # the whole buffer, padding and past
        assert cached.tables.row_index.numpy().tolist() == _expected_row_index(
            cached, counts, [live[r][1] for r in ids], [live[r][0] for r in ids])
        read = np.array([r for r in np.unique(cached.tables.row_index[:n].numpy()) if r != 0], np.int64)
        for key in cached.tables.sites:  # each site's summary covers every row this step's tokens read
            flags = cached.tables.views(*key)["row_live"].numpy()
            union = int(np.bitwise_or.reduce(flags[read])) if read.size else 0
            assert int(flags[0]) & union == union, (key, int(flags[0]), union)
        assert torch.equal(cached.dynamic.words, fresh.dynamic.words)
        acts = [[_plain(a) for a in rt.take_acts()] for rt in (cached, fresh)]
        assert acts[0] == acts[1]
        reported += len(acts[0])
        dyn_decodes += sum(payload[r] in PAYLOADS[3:] and live[r][1] >= live[r][0] for r in ids)
        for r, c in zip(ids, counts):
            live[r][1] += c
    for rt in (cached, fresh):
        rt.release(list(live))
    assert cached.take_traces([r for r in payload]) == fresh.take_traces([r for r in payload])
    if report_acts and dyn_decodes:
        assert reported  # read-backs of dynamic decode tokens landed, and were compared


def _plain(report: ActedReport) -> tuple:
    """An acts report's columns as Python values (comparable with ``==``)."""
    return tuple(np.asarray(f).tolist() if isinstance(f, np.ndarray) else f for f in report)


def _expected_row_index(rt: SteeringRuntime, counts: list[int], computed: list[int], prompt: list[int]) -> list[int]:
    """The whole row-index buffer a step should leave on the device, from the step's batch arrays: each token's row
    (prefill or decode), 0 for every other entry (none steered: all 0)."""
    req = np.repeat(np.arange(len(counts)), counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    pos = np.asarray(computed)[req] + (np.arange(len(req)) - starts[req])
    expect = np.zeros(rt.tables.row_index.shape[0], np.int32)
    if rt._batch.steered:
        expect[:len(req)] = rt._batch.rows[req, (pos >= np.asarray(prompt)[req]).astype(np.int64)]
    return expect.tolist()


def test_a_steady_decode_gathers_once(monkeypatch):
    """The runner releases vLLM's (usually empty) finished set at every step: an empty release must not make the
    runtime gather every request's arrays again."""
    rt = _runtime()
    gathers = []
    real = rt._gather
    monkeypatch.setattr(rt, "_gather", lambda *a: (gathers.append(1), real(*a))[1])
    ids = [f"r{i}" for i in range(4)]
    payload = dict(zip(ids, PAYLOADS[:4]))
    computed = np.full(4, 3, np.int64)
    for _ in range(5):
        rt.release(set())
        rt.release(set(), finished=False)
        rt.plan(BatchView(ids, np.arange(5, dtype=np.int64), computed.copy(), np.full(4, 3, np.int64), 4, 4),
                payload.__getitem__)
        rt.after_forward()
        computed += 1
    assert len(gathers) == 1
    rt.release(["r0"])  # a real release: the next step gathers the new composition
    rt.plan(BatchView(ids[1:], np.arange(4, dtype=np.int64), computed[1:].copy(), np.full(3, 3, np.int64), 3, 3),
            payload.__getitem__)
    assert len(gathers) == 2


def test_a_steady_decode_uploads_its_row_index_once(monkeypatch):
    """A decode step of an unchanged batch reads the rows of the step before: the device holds them, nothing is
    uploaded; any change (a request leaves, the order changes, a prompt joins) uploads, and the buffer is exact."""
    rt = _runtime()
    uploads = []
    real = type(rt._staging).copy_to
    monkeypatch.setattr(rt._staging, "copy_to", lambda *a, **k: (uploads.append(1), real(rt._staging, *a, **k))[1])
    ids = [f"r{i}" for i in range(4)]
    other = encode_payload(SteeringSpec(vectors=[AddVector(layer=2, vector=_unit(7))]))
    payload = dict(zip(ids, [PAYLOADS[1], PAYLOADS[2], None, other]))
    computed = dict.fromkeys(ids, 3)

    def step(batch: list[str], counts: list[int]) -> int:
        before = len(uploads)
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        rt.release(set())
        rt.plan(BatchView(batch, qsl, np.array([computed[r] for r in batch], np.int64), np.full(len(batch), 3),
                          int(qsl[-1]), int(qsl[-1])), payload.__getitem__)
        assert rt.tables.row_index.numpy().tolist() == _expected_row_index(
            rt, counts, [computed[r] for r in batch], [3] * len(batch)), (batch, counts)
        rt.after_forward()
        for r, c in zip(batch, counts):
            computed[r] += c
        return len(uploads) - before

    assert step(ids, [1, 1, 1, 1]) == 1
    assert [step(ids, [1, 1, 1, 1]) for _ in range(3)] == [0, 0, 0]
    rt.release(["r0"])
    assert step(ids[1:], [1, 1, 1]) == 1  # r0 left: every row moves up
    assert step(ids[1:], [1, 1, 1]) == 0
    assert step([ids[3], ids[2], ids[1]], [1, 1, 1]) == 1  # another order, the same rows in another order
    payload["r4"], computed["r4"] = PAYLOADS[1], 0
    assert step([ids[3], ids[2], ids[1], "r4"], [1, 1, 1, 3]) == 1  # a prompt joins: its prefill rows
    assert step([ids[3], ids[2], ids[1], "r4"], [1, 1, 1, 1]) == 1  # its first decode step: the decode row
    assert step([ids[3], ids[2], ids[1], "r4"], [1, 1, 1, 1]) == 0
    for r in (ids[1], ids[3], "r4"):
        rt.release([r])
    assert step([ids[2]], [1]) == 1  # nothing steered: the last rows are cleared once
    assert step([ids[2]], [1]) == 0
