"""Capture's batched decode path (no per-request Python on the host path) against the selector semantics, through
joins, mixed steps, preemption with recompute, selectors that take the per-request path, a spool that fails and a
streaming consumer (no engine: the steering op is simulated from the collector's slot tensor)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynsteer.capture import spool as spool_mod
from dynsteer.capture.select import PositionLedger
from dynsteer.capture.spec import CaptureSpec
from dynsteer.capture.store import CaptureCollector

H = 6
PLACES = [(1, "post_block"), (2, "post_block")]
MAX_TOKENS = 64


def _spec(positions, layers=(1, 2)) -> CaptureSpec:
    return CaptureSpec(layers=layers, sites=("post_block",), positions=positions)


def _selected(positions, pos: int, prompt_len: int) -> bool:
    if positions == "all":
        return True
    if positions == "all_generated":
        return pos >= prompt_len
    if positions == "all_prompt":
        return pos < prompt_len
    if positions == "last_prompt":
        return pos == prompt_len - 1
    return pos in set(positions)


class Harness:
    """Drives a collector step by step and keeps the expected rows of every request."""

    def __init__(self, spool: bool, seed: int = 0) -> None:
        self.stages = {p: torch.zeros(MAX_TOKENS, H) for p in PLACES}
        self.col = CaptureCollector(self.stages, engine_places=set(PLACES), spool=spool)
        self.rng = np.random.default_rng(seed)
        self.specs: dict[str, CaptureSpec] = {}
        self.prompt: dict[str, int] = {}
        self.expected: dict[str, dict[int, dict]] = {}  # req -> position -> {place: row}
        self.batched_steps = 0

    def begin(self, req: str, spec: CaptureSpec | None, prompt_len: int) -> None:
        self.prompt[req] = prompt_len
        if spec is not None:
            self.specs[req] = spec
            self.expected[req] = {}
            self.col.begin(req, f"tag-{req}", spec, prompt_len)

    def step(self, work: list[tuple[str, int, int]]) -> None:
        """``work``: (request, first position, token count) in batch order."""
        ids = [r for r, _, _ in work]
        qs = np.cumsum([0] + [c for _, _, c in work])
        computed = np.array([f for _, f, _ in work], np.int64)
        self.col.plan(ids, qs, computed)
        self.batched_steps += self.col._step_batch is not None
        # the steering op: each token's residual goes to its capture row (-1: none)
        n = int(qs[-1])
        res = {p: torch.from_numpy(self.rng.standard_normal((n, H)).astype(np.float32)) for p in PLACES}
        slot = self.col.slot[:n].clone()
        for p in PLACES:
            self.stages[p].fill_(float("nan"))  # rows nobody wrote must never be read
            hit = slot >= 0
            self.stages[p][slot[hit].long()] = res[p][hit]
        for (req, first, count), start in zip(work, qs[:-1].tolist()):
            spec = self.specs.get(req)
            if spec is None:
                continue
            for k in range(count):
                pos = first + k
                if _selected(spec.positions, pos, self.prompt[req]) and pos not in self.expected[req]:
                    self.expected[req][pos] = {p: res[p][start + k].numpy().copy() for p in PLACES
                                               if p[0] in spec.layers}
        self.col.after_forward()

    def check(self, req: str) -> None:
        rec = self.col.finish(req)
        want = self.expected[req]
        if not want:
            assert rec is None or len(rec.arrays()[0]) == 0
            return
        positions, arrays = rec.arrays()
        assert positions.tolist() == sorted(want), req
        for place, got in arrays.items():
            np.testing.assert_array_equal(got, np.stack([want[p][place] for p in sorted(want)]), err_msg=req)


def _scenario(h: Harness) -> None:
    h.begin("a", _spec("all_generated"), 5)
    h.begin("b", _spec("all", layers=(1,)), 3)
    h.begin("x", None, 4)  # in the batch, captures nothing
    h.step([("a", 0, 5), ("b", 0, 3), ("x", 0, 4)])
    gen = {"a": 5, "b": 3, "x": 4}  # next position of each request

    def decode(reqs: list[str]) -> None:
        h.step([(r, gen[r], 1) for r in reqs])
        for r in reqs:
            gen[r] += 1

    for _ in range(5):
        decode(["a", "b", "x"])
    h.begin("e", _spec("all_generated", layers=(2,)), 2)
    h.step([("a", gen["a"], 1), ("e", 0, 2), ("b", gen["b"], 1), ("x", gen["x"], 1)])  # a join: mixed step
    for r in ("a", "b", "x"):
        gen[r] += 1
    gen["e"] = 2
    for _ in range(4):
        decode(["a", "e", "b", "x"])
    for _ in range(3):  # b preempted: the batch goes on without it
        decode(["a", "e", "x"])
    h.step([("a", gen["a"], 1), ("b", 0, gen["b"]), ("e", gen["e"], 1)])  # b resumes: recomputes every position
    gen["a"] += 1
    gen["e"] += 1
    for _ in range(3):
        decode(["a", "b", "e"])
    h.begin("c", _spec("last_prompt"), 4)
    h.begin("d", _spec([2, 6, 7]), 4)
    h.step([("a", gen["a"], 1), ("c", 0, 4), ("d", 0, 4), ("b", gen["b"], 1)])
    gen.update(a=gen["a"] + 1, b=gen["b"] + 1, c=4, d=4)
    for _ in range(4):  # selectors the batched path does not take: every request by the per-request path
        decode(["a", "b", "c", "d", "e"])
    for _ in range(2):  # every capturing request waits: nobody in the batch captures
        decode(["x"])
    for _ in range(2):
        decode(["a", "e"])


@pytest.mark.parametrize("spool", [True, False])
def test_batched_decode_steps_land_exactly_the_selected_rows(spool):
    if spool and spool_mod.spool_dir() is None:
        pytest.skip("no writable /dev/shm here")
    h = Harness(spool)
    _scenario(h)
    assert h.batched_steps >= 12  # most decode steps took the batched path
    for req in ("a", "b", "c", "d", "e"):
        h.check(req)
    assert h.col.records == {} and h.col._batch is None  # nothing holds a finished record


def test_a_spool_failing_in_the_writer_thread_loses_nothing(monkeypatch):
    if spool_mod.spool_dir() is None:
        pytest.skip("no writable /dev/shm here")
    h = Harness(True, seed=1)
    real = spool_mod.Spool.reserve
    calls = {"n": 0}

    def flaky(self, arrays, start, end, places):
        calls["n"] += 1
        a = h.col.records.get("a") or next(r for r in h.col.retiring if r.req_id == "a")  # retired: not yet written
        if calls["n"] >= 9 and self is a.spool:
            raise OSError(28, "No space left on device")  # ENOSPC: /dev/shm full
        return real(self, arrays, start, end, places)

    monkeypatch.setattr(spool_mod.Spool, "reserve", flaky)
    _scenario(h)
    assert h.batched_steps >= 12
    for req in ("a", "b", "c", "d", "e"):
        h.check(req)


def test_streaming_records_see_every_chunk_on_the_host_path():
    h = Harness(True, seed=2)
    seen: dict[str, list[int]] = {}
    h.col.streams = lambda spec: spec.positions == "all"  # b's consumer streams
    h.col.on_chunk = lambda rec, positions, values: seen.setdefault(rec.req_id, []).extend(positions.tolist())
    _scenario(h)
    assert seen["b"] == sorted(h.expected["b"]) and set(seen) == {"b"}
    for req in ("a", "b", "c", "d", "e"):
        h.check(req)


def test_ledger_runs_fold_into_seen_positions():
    led = PositionLedger()
    for pos in range(3, 8):
        led.mark(pos)
    led.mark(10)  # a gap starts a new run
    led.start_run()
    led.high = 12  # two positions taken by the batched path (11, 12)
    assert led.take(np.arange(0, 14)).tolist() == [0, 1, 2, 8, 9, 13]
    assert led.seen == set(range(14)) and led.high == 13
