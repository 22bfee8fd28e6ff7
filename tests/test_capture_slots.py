"""The capture slot map (each token's capture row, read by the steering ops) on the device matches the step's rows at
every step, and a steady decode step, whose rows are the step before's, stages nothing (no engine)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from dynsteer.capture import spool as spool_mod
from dynsteer.capture.spec import CaptureSpec
from dynsteer.capture.store import CaptureCollector

H = 4
PLACE = (1, "post_block")
ALL = CaptureSpec(layers=(1,), sites=("post_block",), positions="all")
GENERATED = CaptureSpec(layers=(1,), sites=("post_block",), positions="all_generated")


@pytest.fixture(autouse=True)
def collect_spools():
    yield
    spool_mod.WRITER.drain(10)
    gc.collect()


def _expected(rows: list[int], size: int) -> torch.Tensor:
    ref = torch.full((size,), -1, dtype=torch.int32)
    ref[rows] = torch.arange(len(rows), dtype=torch.int32)
    return ref


def test_slot_map_matches_every_step_and_steady_decode_stages_nothing(monkeypatch):
    stage = torch.zeros(32, H)
    col = CaptureCollector({PLACE: stage}, engine_places={PLACE}, spool=False)
    uploads: list[int] = []
    real = type(col._slots).copy_to
    monkeypatch.setattr(col._slots, "copy_to", lambda *a, **k: (uploads.append(1), real(col._slots, *a, **k))[1])
    prompt = {"a": 3, "b": 2, "c": 4}
    specs = {"a": ALL, "b": GENERATED, "c": ALL}
    for rid in "abc":
        col.begin(rid, None, specs[rid], prompt[rid])
    computed = {rid: 0 for rid in "abc"}
    rng = np.random.default_rng(0)

    def step(ids: list[str], counts: list[int]) -> tuple[list[int], int]:
        before = len(uploads)
        qs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        col.plan(tuple(ids), qs, np.asarray([computed[r] for r in ids], np.int64))
        rows = list(col._rows)
        assert torch.equal(col.slot, _expected(rows, stage.shape[0])), (ids, counts, rows)
        stage.copy_(torch.from_numpy(rng.standard_normal(stage.shape).astype(np.float32)))
        col.after_forward()
        for rid, n in zip(ids, counts):
            computed[rid] += n
        return rows, len(uploads) - before

    rows, staged = step(["a", "b", "c"], [3, 2, 4])  # prefill: a's and c's prompt rows, none of b's
    assert rows == [0, 1, 2, 5, 6, 7, 8] and staged == 1
    rows, staged = step(["a", "b", "c"], [1, 1, 1])  # first decode step: a new map
    assert rows == [0, 1, 2] and staged == 1
    for _ in range(4):  # steady decode: the device holds this map already
        rows, staged = step(["a", "b", "c"], [1, 1, 1])
        assert rows == [0, 1, 2] and staged == 0
    col.finish("b")  # b leaves: c moves up a row
    rows, staged = step(["a", "c"], [1, 1])
    assert rows == [0, 1] and staged == 1
    rows, staged = step(["a", "c"], [1, 1])
    assert staged == 0
    rows, staged = step(["c", "a"], [1, 1])  # the same requests in another order: the same rows, the same map
    assert rows == [0, 1] and staged == 0
    col.begin("d", None, ALL, 2)  # a prompt joins the decodes: a mixed step, then a larger steady map
    computed["d"] = 0
    rows, staged = step(["c", "a", "d"], [1, 1, 2])
    assert rows == [0, 1, 2, 3] and staged == 1
    rows, staged = step(["c", "a", "d"], [1, 1, 1])
    assert rows == [0, 1, 2] and staged == 1  # the last step's fourth entry is cleared
    computed["e"] = 5  # a request that captures nothing takes c's place in the batch (c not scheduled)
    rows, staged = step(["e", "a", "d"], [1, 1, 1])
    assert rows == [1, 2] and staged == 1
    rows, staged = step(["a", "e", "d"], [1, 1, 1])  # as many rows, others: a new map
    assert rows == [0, 2] and staged == 1
    col.finish("a")
    col.finish("c")
    col.finish("d")
    rows, staged = step(["e"], [1])  # nobody captures: the last map is cleared once, then nothing is staged
    assert rows == [] and staged == 1
    rows, staged = step(["e"], [1])
    assert rows == [] and staged == 0 and not col.needs_plan
