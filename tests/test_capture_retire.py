"""A finished request's capture record leaves the step path without a wait: not for its last device copy, not for the
spool writer (no engine)."""

from __future__ import annotations

import gc
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


@pytest.fixture(autouse=True)
def collect_spools():
    """A delivery and its collector refer to each other, so the records they hold (and their spool files in
    /dev/shm) go with the cyclic collector: collect them here rather than during a later test that counts files."""
    yield
    spool_mod.WRITER.drain(10)
    gc.collect()
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


# ---- consumers that write to disk run off the step ------------------------------------------------------------------
class GatedFilesystem:
    """A filesystem consumer whose writes wait for ``gate`` (a slow or stalled disk)."""

    def __init__(self, root, gate: threading.Event, layout: str = "packed") -> None:
        from dynsteer.capture.consumers import FilesystemConsumer

        self.inner, self.gate, self.calls = FilesystemConsumer(root, layout=layout), gate, []
        self.background = FilesystemConsumer.background
        self.streams = self.inner.streams

    def on_chunk(self, record, positions, values) -> None:
        self.gate.wait(30)
        self.calls.append(("chunk", record.tag, positions.tolist(), {p: v.copy() for p, v in values.items()}))
        self.inner.on_chunk(record, positions, values)

    def on_finish(self, record) -> None:
        self.gate.wait(30)
        self.calls.append(("finish", record.tag))
        self.inner.on_finish(record)


def _fs_engine(tmp_path, gate, layout="packed"):
    stage = torch.zeros(16, H)
    col = CaptureCollector({PLACE: stage}, engine_places={PLACE}, spool=spool_mod.spool_dir() is not None)
    memory, fs = MemoryConsumer(), GatedFilesystem(tmp_path, gate, layout)
    delivery = CaptureDelivery(col, {"memory": memory, "filesystem": fs}, RuntimeStats())
    col.streams = lambda spec: "filesystem" in spec.consumers and fs.streams
    return delivery, memory, fs, stage


FS_SPEC = CaptureSpec(layers=(1,), sites=("post_block",), positions="all", consumers=("memory", "filesystem"))


def test_a_slow_disk_never_holds_up_a_step_and_take_waits_for_its_write(tmp_path):
    from dynsteer import CaptureReader

    gate = threading.Event()  # the disk does not answer until the test says so
    delivery, memory, fs, stage = _fs_engine(tmp_path, gate)
    gen, rows = torch.Generator().manual_seed(3), []
    delivery.begin("a", "tag-a", FS_SPEC, 2)
    delivery.begin("b", "tag-b", FS_SPEC, 2)
    _steps(delivery, stage, ["a", "b"], 2, 0, 3, rows, gen)
    t0 = time.perf_counter()
    delivery.finish("a")
    _steps(delivery, stage, ["b"], 2, 3, 3, rows, gen)  # a's record reaches its consumers meanwhile
    assert time.perf_counter() - t0 < 5  # (a wait for the disk would last 30 s)
    deadline = time.monotonic() + 10
    while "tag-a" not in memory.records and time.monotonic() < deadline:  # the spool writer's marker, then a poll
        time.sleep(0.01)
        delivery.collector.poll()
    assert "tag-a" in memory.records and fs.calls == [] and delivery.background.pending(["tag-a"]) == 1
    threading.Timer(0.2, gate.set).start()
    (rec,) = delivery.take(["tag-a"])  # waits for the write: the caller sees its outcome
    assert fs.calls == [("finish", "tag-a")] and rec.deliveries == {"memory": "delivered", "filesystem": "written"}
    positions, arrays, _ = CaptureReader(tmp_path).read("tag-a")
    want_pos, want = rec.arrays()
    assert positions.tolist() == want_pos.tolist() == [0, 1, 2, 3]
    np.testing.assert_array_equal(arrays[PLACE], want[PLACE])


def test_streamed_chunks_reach_a_background_consumer_as_they_were(tmp_path):
    gate = threading.Event()
    delivery, memory, fs, stage = _fs_engine(tmp_path, gate, layout="per_file")
    gen, rows = torch.Generator().manual_seed(4), []
    delivery.begin("a", "tag-a", FS_SPEC, 2)
    _steps(delivery, stage, ["a"], 2, 0, 4, rows, gen)  # the stage buffer is overwritten every step
    gate.set()
    delivery.finish("a")
    delivery.complete()
    (rec,) = delivery.take(["tag-a"])
    chunks = [c for c in fs.calls if c[0] == "chunk"]
    assert [c[2] for c in chunks] == [[0, 1], [2], [3], [4]] and fs.calls[-1] == ("finish", "tag-a")
    want = [rows[0][0:2], rows[1][0:1], rows[2][0:1], rows[3][0:1]]
    for (_, _, _, values), rows_of_step in zip(chunks, want):
        np.testing.assert_array_equal(values[PLACE], rows_of_step.numpy())
    assert rec.status == "ok" and rec.deliveries["filesystem"] == "written"


def test_a_full_background_queue_marks_the_capture_and_keeps_its_data(tmp_path, monkeypatch):
    gate = threading.Event()
    delivery, memory, fs, stage = _fs_engine(tmp_path, gate)
    delivery.background.max_pending = 1
    delivery.background._queue = __import__("queue").Queue(1)
    only_fs = CaptureSpec(layers=(1,), sites=("post_block",), positions="all", consumers=("filesystem",))
    gen, rows = torch.Generator().manual_seed(5), []
    for r in "abc":
        delivery.begin(r, f"tag-{r}", only_fs, 2)
    _steps(delivery, stage, list("abc"), 2, 0, 2, rows, gen)
    delivery.finish("a")  # a's write holds the thread (the disk does not answer) ...
    delivery.complete()
    deadline = time.monotonic() + 10
    while not delivery.background._queue.empty() and time.monotonic() < deadline:
        time.sleep(0.001)
    for r in "bc":  # ... b's waits in the queue, c's finds it full
        delivery.finish(r)
    delivery.complete()
    assert delivery.background.refused == 1
    c = memory.records["tag-c"]  # kept in memory, never lost
    assert c.status == "partial" and "'filesystem'" in c.errors[0] and "queue is full" in c.errors[0]
    assert "filesystem" not in c.deliveries
    np.testing.assert_array_equal(c.arrays()[1][PLACE], np.concatenate([rows[0][4:6].numpy(),
                                                                          rows[1][2:3].numpy()]))
    gate.set()
    recs = {r.tag: r for r in delivery.take(["tag-a", "tag-b", "tag-c"])}
    assert set(recs) == {"tag-c"}  # a and b went to disk only, as their specs asked
    assert [c for c in fs.calls] == [("finish", "tag-a"), ("finish", "tag-b")]


def test_a_failing_background_consumer_keeps_the_record_in_memory(tmp_path):
    gate = threading.Event()
    gate.set()
    delivery, memory, fs, stage = _fs_engine(tmp_path, gate)

    def broken(record):
        raise OSError(28, "No space left on device")

    fs.on_finish = broken
    only_fs = CaptureSpec(layers=(1,), sites=("post_block",), positions="all", consumers=("filesystem",))
    gen, rows = torch.Generator().manual_seed(6), []
    delivery.begin("a", "tag-a", only_fs, 2)
    _steps(delivery, stage, ["a"], 2, 0, 2, rows, gen)
    delivery.finish("a")
    delivery.complete()
    (rec,) = delivery.take(["tag-a"])
    assert rec.status == "partial" and "No space left on device" in rec.errors[0]
    assert rec.arrays()[0].tolist() == [0, 1, 2]
