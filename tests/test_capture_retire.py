"""A finished request's capture record leaves the step path without a wait: not for its last device copy, not for the
spool writer (no engine)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from dynsteer.capture import spool as spool_mod
from dynsteer.capture import store as store_mod
from dynsteer.capture.consumers import MemoryConsumer
from dynsteer.capture.spec import CaptureSpec
from dynsteer.capture.store import CaptureCollector
from dynsteer.steering.delivery import CaptureDelivery
from dynsteer.steering.stats import RuntimeStats

H = 8
PLACE = (1, "post_block")
SPEC = CaptureSpec(layers=(1,), sites=("post_block",), positions="all")


class DeviceCopy:
    """A copy's completion event that stays pending until the test lets it complete."""

    def __init__(self, gate: threading.Event, waits: list) -> None:
        self.gate, self.waits = gate, waits

    def query(self) -> bool:
        return self.gate.is_set()

    def synchronize(self) -> None:
        self.waits.append(time.perf_counter())
        self.gate.set()


@pytest.fixture
def pending_copies(monkeypatch):
    """Every step's copy out of the stage buffers is pending until ``gate`` is set, as a device copy is."""
    gate, waits = threading.Event(), []
    real = store_mod.PendingCopy
    monkeypatch.setattr(store_mod, "PendingCopy",
                        lambda event, *a, **k: real(DeviceCopy(gate, waits), *a, **k))
    return gate, waits


def _engine(spool: bool) -> tuple[CaptureDelivery, MemoryConsumer, torch.Tensor, list]:
    stage = torch.zeros(16, H)
    col = CaptureCollector({PLACE: stage}, engine_places={PLACE}, spool=spool)
    memory = MemoryConsumer()
    delivery = CaptureDelivery(col, {"memory": memory}, RuntimeStats())
    return delivery, memory, stage, []


def _steps(delivery, stage, ids, prompt, first_step, steps, rows, gen):
    """Decode steps of requests ``ids`` (prefill at ``first_step == 0``); records each step's rows in ``rows``."""
    col = delivery.collector
    for step in range(first_step, first_step + steps):
        if step == 0:
            qs = np.arange(len(ids) + 1) * prompt
            computed = np.zeros(len(ids), np.int64)
        else:
            qs = np.arange(len(ids) + 1)
            computed = np.full(len(ids), prompt + step - 1, np.int64)
        delivery.plan(tuple(ids), qs, computed, [])
        stage.copy_(torch.randn(stage.shape, generator=gen))
        rows.append(stage.clone())
        delivery.after_forward()


@pytest.mark.parametrize("spool", [False, True])
def test_a_finished_record_is_handed_out_once_its_last_copy_lands(pending_copies, spool):
    if spool and spool_mod.spool_dir() is None:
        pytest.skip("no writable /dev/shm here")
    gate, waits = pending_copies
    delivery, memory, stage, rows = _engine(spool)
    gen = torch.Generator().manual_seed(0)
    delivery.begin("a", "tag-a", SPEC, 3)
    delivery.begin("b", "tag-b", SPEC, 3)
    _steps(delivery, stage, ["a", "b"], 3, 0, 4, rows, gen)
    delivery.finish("a")  # the step path: must not wait for the pending copies
    assert waits == [] and "tag-a" not in memory.records
    assert [r.tag for r in delivery.collector.retiring] == ["tag-a"]
    _steps(delivery, stage, ["b"], 3, 4, 1, rows, gen)  # a later step, copies still pending
    assert waits == [] and "tag-a" not in memory.records
    gate.set()  # the device copies complete
    _steps(delivery, stage, ["b"], 3, 5, 1, rows, gen)
    deadline = time.monotonic() + 10
    while "tag-a" not in memory.records and time.monotonic() < deadline:  # the writer's marker, then a poll
        time.sleep(0.01)
        delivery.collector.poll()
    assert waits == [] and delivery.collector.retiring == []
    rec = memory.take("tag-a")
    positions, arrays = rec.arrays()
    assert positions.tolist() == [0, 1, 2, 3, 4, 5]  # prompt rows 0..2, then decode rows of steps 1..3
    want = np.concatenate([rows[0][0:3].numpy()] + [rows[s][0:1].numpy() for s in (1, 2, 3)])
    np.testing.assert_array_equal(arrays[PLACE], want)


def test_take_waits_for_a_retired_record(pending_copies):
    gate, waits = pending_copies
    delivery, memory, stage, rows = _engine(spool_mod.spool_dir() is not None)
    gen = torch.Generator().manual_seed(1)
    delivery.begin("a", "tag-a", SPEC, 2)
    _steps(delivery, stage, ["a"], 2, 0, 3, rows, gen)
    delivery.finish("a")
    assert waits == []
    (rec,) = delivery.take(["tag-a"])  # the caller knows it is done: waits for the copy and the writer
    assert len(waits) == 1
    positions, arrays = rec.arrays()
    assert positions.tolist() == [0, 1, 2, 3]
    want = np.concatenate([rows[0][0:2].numpy(), rows[1][0:1].numpy(), rows[2][0:1].numpy()])
    np.testing.assert_array_equal(arrays[PLACE], want)


def test_a_busy_spool_writer_never_holds_up_the_step_path(pending_copies):
    if spool_mod.spool_dir() is None:
        pytest.skip("no writable /dev/shm here")
    gate, waits = pending_copies
    gate.set()  # copies land at once: only the writer is slow
    delivery, memory, stage, rows = _engine(True)
    gen = torch.Generator().manual_seed(2)
    delivery.begin("a", "tag-a", SPEC, 2)
    delivery.begin("b", "tag-b", SPEC, 2)
    _steps(delivery, stage, ["a", "b"], 2, 0, 2, rows, gen)
    hold = threading.Event()
    spool_mod.WRITER.submit(lambda: hold.wait(30) and ())  # the writer is busy with earlier work
    try:
        delivery.finish("a")
        t0 = time.perf_counter()
        _steps(delivery, stage, ["b"], 2, 2, 2, rows, gen)
        assert time.perf_counter() - t0 < 5  # (a wait for the writer would last until `hold` is set: 30 s)
        assert "tag-a" not in memory.records and [r.tag for r in delivery.collector.retiring] == ["tag-a"]
    finally:
        hold.set()
    spool_mod.WRITER.drain(10)
    delivery.collector.poll()
    assert "tag-a" in memory.records and delivery.collector.retiring == []


def test_an_engine_with_no_request_left_delivers_at_once(pending_copies):
    from dynsteer.spec import ModelShape
    from dynsteer.steering.runtime import BatchView, SteeringRuntime
    from dynsteer.steering.tables import SteeringTables
    from dynsteer.request.payload import encode_payload

    gate, waits = pending_copies
    shape = ModelShape(num_layers=2, hidden_size=H, sites=("post_block",), max_gates=2)
    tables = SteeringTables([(l, "post_block") for l in range(2)], H, num_rows=8, max_clamps=1, max_tokens=16,
                            device="cpu", max_gates=2)
    rt = SteeringRuntime(shape, tables)
    stage = torch.zeros(16, H)
    memory = MemoryConsumer()
    rt.attach_capture(CaptureCollector({PLACE: stage}, engine_places={PLACE}), {"memory": memory})
    payload = {r: encode_payload(capture=SPEC, tag=f"tag-{r}") for r in ("a", "b")}
    ids = ["a", "b"]
    qs = np.arange(3) * 2
    rt.plan(BatchView(ids, qs, np.zeros(2, np.int64), np.full(2, 2), 4, 4), payload.__getitem__)
    rt.after_forward()
    rt.plan(BatchView(ids, np.arange(3), np.full(2, 2, np.int64), np.full(2, 2), 2, 2), payload.__getitem__)
    rt.after_forward()
    rt.release(["a"])
    assert waits == [] and "tag-a" not in memory.records  # b still runs: no wait
    rt.release(["b"])  # nothing left to run: delivered now
    assert len(waits) == 1 and {"tag-a", "tag-b"} <= set(memory.records)
    assert memory.take("tag-b").arrays()[0].tolist() == [0, 1, 2]
