"""Capture durability and confinement, no engine: tags never leave the capture folder, concurrent shard writers,
killed writers' leftovers, /dev/shm delivery files of dead callers, honest delivery states, memory bounds."""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import uuid
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dynsteer.capture import consumers as consumers_mod
from dynsteer.capture import result as result_mod
from dynsteer.capture.consumers import LAYOUTS, FilesystemConsumer, MemoryConsumer, build_consumer
from dynsteer.capture.reader import CaptureReader
from dynsteer.capture.spec import CaptureSpec
from dynsteer.capture.store import CaptureRecord, check_tag
from dynsteer.memo import resident_bytes
from dynsteer.spec import SteeringValidationError

SPEC = CaptureSpec(layers=(0, 2), sites=("post_attn",), positions="all")


def _record(tag: str, n: int = 5, hidden: int = 8) -> CaptureRecord:
    """A finished record whose data follows from its tag alone (the same in every process)."""
    rng = np.random.default_rng(zlib.crc32(tag.encode()))
    rec = CaptureRecord(tag=tag, req_id=tag, spec=SPEC, prompt_len=3)
    for chunk in (np.arange(0, 3), np.arange(3, n)):
        rec.add_chunk(chunk, {p: rng.standard_normal((len(chunk), hidden)).astype(np.float32) for p in SPEC.places()})
    return rec


def _assert_reads_back(reader: CaptureReader, rec: CaptureRecord) -> None:
    positions, arrays, meta = reader.read(rec.tag)
    want_pos, want = rec.arrays()
    assert meta["tag"] == rec.tag
    np.testing.assert_array_equal(positions, want_pos)
    assert set(arrays) == set(want)
    for place, arr in want.items():
        np.testing.assert_array_equal(arrays[place], arr)


def _files(under: Path) -> set[Path]:
    return {p for p in under.rglob("*") if p.is_file() or p.is_symlink()}


# ---- tags never name a path outside the capture folder -----------------------------------------------------------
def test_check_tag_names_the_field_and_accepts_plain_tags():
    for good in ("req-1", "a.b_c-D9", "0", "x" * 128, "a..b"):
        assert check_tag(good) == good
    for bad in ("../x", "/abs", "a/b", "", ".hidden", "..", "-x", "x" * 129, "a\n", "a b", "ü", None, 5):
        with pytest.raises(SteeringValidationError, match=r"^extra_args\.dynsteer\.tag: "):
            check_tag(bad, "extra_args.dynsteer.tag")  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_filesystem_consumer_refuses_tags_that_leave_its_root(tmp_path, layout):
    root = tmp_path / "root"
    consumer = FilesystemConsumer(root, layout=layout)
    outside_before = _files(tmp_path) - _files(root)
    bad = ["../x", "../../x", str(tmp_path / "abs" / "path"), "a/b", "", "..", ".", "y" * 200]
    for tag in bad:
        rec = _record("ok")
        rec.tag = tag  # as a client's payload could have named it
        with pytest.raises(ValueError, match=r"^tag: "):
            if layout == "per_file":
                consumer.on_chunk(rec, *rec.arrays())
            consumer.on_finish(rec)
        assert "filesystem" not in rec.deliveries
    assert _files(tmp_path) - _files(root) == outside_before  # nothing written next to (or above) the root
    assert not (tmp_path / "abs").exists() and not (tmp_path / "x").exists()
    # A plain tag still works, and lands inside the root.
    rec = _record("fine")
    if layout == "per_file":
        consumer.on_chunk(rec, *rec.arrays())
    consumer.on_finish(rec)
    _assert_reads_back(CaptureReader(root), rec)
    assert all(p.resolve().is_relative_to(root.resolve()) for p in _files(root))


def test_a_symlink_under_the_root_does_not_lead_writes_outside(tmp_path):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    elsewhere.mkdir()
    consumer = FilesystemConsumer(root, layout="per_file")
    (root / "evil").symlink_to(elsewhere, target_is_directory=True)
    rec = _record("evil")
    with pytest.raises(ValueError, match=r"^tag: .*outside"):
        consumer.on_chunk(rec, *rec.arrays())
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("tag", ["shard-00000", "pp0"])
def test_tags_the_reader_would_misread_are_refused(tmp_path, tag):
    for layout in ("packed", "per_file"):
        with pytest.raises(ValueError, match=r"^tag: .*reserved"):
            FilesystemConsumer(tmp_path, layout=layout).on_finish(_record(tag))
    assert _files(tmp_path) == set()


# ---- two writers on one sharded folder ---------------------------------------------------------------------------
def _write_many(root: str, prefix: str, count: int, start: multiprocessing.synchronize.Barrier) -> None:
    consumer = FilesystemConsumer(root, layout="sharded", shard_bytes=2000)  # ~5 records a shard: many rollovers
    start.wait()  # both writers are up (spawning takes seconds): their appends overlap
    for i in range(count):
        consumer.on_finish(_record(f"{prefix}-{i}", n=3 + i % 7))


def test_two_writer_processes_on_one_sharded_folder_lose_and_mix_nothing(tmp_path):
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads and locks
    start = ctx.Barrier(2)
    count = 150
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), prefix, count, start)) for prefix in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    reader = CaptureReader(tmp_path)
    want = {f"{prefix}-{i}": i for prefix in ("a", "b") for i in range(count)}
    assert reader.tags() == sorted(want)
    for tag, i in want.items():
        _assert_reads_back(reader, _record(tag, n=3 + i % 7))
    assert len(list(tmp_path.glob("shard-*.json"))) > 10
    assert reader.leftovers() == []  # every appended byte is indexed


# ---- leftovers of killed writers ---------------------------------------------------------------------------------
def test_reader_ignores_reports_and_cleans_killed_writers_leftovers(tmp_path):
    published = (_record("p"), _record("s1"), _record("s2"))  # one packed, two sharded (one root, mixed layouts)
    FilesystemConsumer(tmp_path, layout="packed").on_finish(published[0])
    shard_writer = FilesystemConsumer(tmp_path, layout="sharded")
    for rec in published[1:]:
        shard_writer.on_finish(rec)
    per_file = _record("f")
    pf = FilesystemConsumer(tmp_path, layout="per_file")
    pf.on_chunk(per_file, *per_file.arrays())
    pf.on_finish(per_file)
    old = time.time() - 3600
    # What a writer killed at various points leaves behind:
    temp_old = tmp_path / ".q.json.k3j2.tmp"  # an atomic write never renamed
    temp_old.write_bytes(b"{half")
    temp_fresh = tmp_path / "f" / ".0.post_attn.000002.npz.a1b2.tmp"  # a live writer's, in a per_file folder
    temp_fresh.write_bytes(b"PK")
    orphan = tmp_path / "q.bin"  # packed data whose index was never written
    orphan.write_bytes(b"\0" * 100)
    shard_bin = tmp_path / "shard-00000.bin"
    end = shard_bin.stat().st_size
    with open(shard_bin, "ab") as f:  # an append whose index was never published
        f.write(b"\xff" * 77)
    lone_shard = tmp_path / "shard-00001.bin"  # a new shard started, its first index never written
    lone_shard.write_bytes(b"\xee" * 10)
    for p in (temp_old, orphan, shard_bin, lone_shard):
        os.utime(p, (old, old))

    reader = CaptureReader(tmp_path)
    assert reader.tags() == ["f", "p", "s1", "s2"]
    for rec in (*published, per_file):
        _assert_reads_back(reader, rec)
    got = {(lo.path, lo.kind, lo.size) for lo in reader.leftovers()}
    assert got == {(temp_old, "temp", 5), (temp_fresh, "temp", 2), (orphan, "unindexed_bin", 100),
                   (shard_bin, "shard_tail", 77), (lone_shard, "unindexed_bin", 10)}

    removed = reader.clean(min_age_s=60.0)
    assert set(removed) == {temp_old, orphan, shard_bin, lone_shard}
    assert temp_fresh.exists() and not temp_old.exists() and not orphan.exists() and not lone_shard.exists()
    assert shard_bin.stat().st_size == end  # cut back to the indexed end, published records intact
    assert [lo.path for lo in reader.leftovers()] == [temp_fresh]
    for rec in (*published, per_file):
        _assert_reads_back(reader, rec)
    # The next writer appends cleanly after the clean.
    later = _record("s3")
    FilesystemConsumer(tmp_path, layout="sharded").on_finish(later)
    _assert_reads_back(CaptureReader(tmp_path), later)
    assert reader.clean(min_age_s=0.0) == [temp_fresh] and reader.leftovers() == []


def test_reader_does_not_follow_path_like_tags(tmp_path):
    root = tmp_path / "root"
    FilesystemConsumer(tmp_path, layout="packed").on_finish(_record("secret"))  # next to the root, not in it
    FilesystemConsumer(root, layout="packed").on_finish(_record("mine"))
    reader = CaptureReader(root)
    with pytest.raises(KeyError):
        reader.read("../secret")
    assert reader.read_partial("../secret")[1] == {}


def test_an_empty_capture_reads_back(tmp_path):
    rec = CaptureRecord(tag="empty", req_id="empty", spec=SPEC, prompt_len=3)
    for layout in ("packed", "sharded"):
        FilesystemConsumer(tmp_path / layout, layout=layout).on_finish(rec)
        positions, arrays, _ = CaptureReader(tmp_path / layout).read("empty")
        assert positions.size == 0 and all(a.size == 0 for a in arrays.values())


# ---- /dev/shm delivery files -------------------------------------------------------------------------------------
@pytest.fixture
def shm():
    if not result_mod.SHM_DIR.is_dir():
        pytest.skip("no /dev/shm here")
    made: list[Path] = []

    def make(namespace: str, pid: int) -> Path:
        path = result_mod.SHM_DIR / f"{result_mod.SHM_PREFIX}{namespace}-{pid}-{uuid.uuid4().hex}"
        path.write_bytes(b"x")
        made.append(path)
        return path

    yield make
    for p in made:
        p.unlink(missing_ok=True)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_delivery_files_of_dead_callers_are_swept(shm):
    ns = result_mod._pid_namespace()
    dead = _dead_pid()
    gone, live, init, foreign = shm(ns, dead), shm(ns, os.getpid()), shm(ns, 1), shm("999", dead)
    assert result_mod.pack_records([], result_mod.host_id()) == []  # every pack sweeps, even with nothing to send
    assert not gone.exists()
    assert live.exists() and init.exists()  # alive (pid 1: maybe not ours to signal, still alive)
    assert foreign.exists()  # another pid namespace: its pids mean nothing here
    again = shm(ns, dead)
    assert result_mod.unpack_records([]) == [] and not again.exists()  # every unpack sweeps too


def test_a_delivery_file_carries_its_callers_pid_and_dies_with_it(shm):
    dead = _dead_pid()
    host = result_mod.host_id()
    assert host.endswith(f"/{os.getpid()}")
    before = set(os.listdir(result_mod.SHM_DIR))
    packed = result_mod.pack_records([_record("a")], host, caller_pid=dead)  # the caller died before unpacking
    path = Path(packed[0]["shm"])
    assert path.exists() and path.name not in before and f"-{dead}-" in path.name
    assert result_mod.sweep_shared() == [path] and not path.exists()
    # A live caller's file survives sweeps until the caller maps (and unlinks) it.
    packed = result_mod.pack_records([_record("b")], host)
    path = Path(packed[0]["shm"])
    assert f"-{os.getpid()}-" in path.name
    result_mod.sweep_shared()
    assert path.exists()
    cap, = result_mod.unpack_records(packed)
    assert not path.exists()
    np.testing.assert_array_equal(cap[(0, "post_attn")], _record("b").arrays()[1][(0, "post_attn")])


@pytest.mark.parametrize("shared", [True, False])
def test_deliveries_cross_both_wire_forms(shared):
    if shared and not result_mod.SHM_DIR.is_dir():
        pytest.skip("no /dev/shm here")
    rec = _record("d")
    rec.deliveries.update({"memory": "delivered", "zmq": "queued"})
    packed = result_mod.pack_records([rec], result_mod.host_id() if shared else None)
    assert ("shm" in packed[0]) == shared
    cap, = result_mod.unpack_records(packed)
    assert cap.deliveries == {"memory": "delivered", "zmq": "queued"}


def test_merged_stages_report_the_weakest_delivery():
    a = result_mod.Capture("t", np.arange(3), {}, deliveries={"memory": "delivered", "zmq": "queued", "fs": "written"})
    b = result_mod.Capture("t", np.arange(3), {}, deliveries={"memory": "delivered", "zmq": "incomplete"})
    merged = result_mod.merge_captures([a, b])["t"]
    assert merged.deliveries == {"memory": "delivered", "zmq": "incomplete"}  # fs reached only one stage


# ---- delivery states ---------------------------------------------------------------------------------------------
def test_consumers_record_their_own_delivery_state_under_their_configured_name(tmp_path):
    archive = build_consumer("archive", {"kind": "filesystem", "root": str(tmp_path)})
    memory = build_consumer("memory", {})
    assert archive.name == "archive" and memory.name == "memory"
    rec = _record("r")
    archive.on_finish(rec)
    memory.on_finish(rec)
    assert rec.deliveries == {"archive": "written", "memory": "delivered"}


def test_zmq_consumer_says_queued_never_delivered():
    import zmq

    from dynsteer.capture.zmq_consumer import receive_capture

    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    # Nobody listens here. (Not a closed loopback TCP port: a connect to one can meet itself, TCP self-connect.)
    dead = f"ipc://{tempfile.mkdtemp()}/nobody"
    consumer = build_consumer("wire", {"kind": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"})
    nobody = build_consumer("nobody", {"kind": "zmq", "endpoint": dead})
    try:
        assert consumer.name == "wire"
        rec = _record("z", n=9)
        deadline = time.monotonic() + 10
        while True:  # the connection comes up asynchronously; until then a send has no peer (IMMEDIATE)
            try:
                consumer.on_finish(rec)
                break
            except RuntimeError:
                assert time.monotonic() < deadline, "never connected"
                time.sleep(0.05)
        assert rec.deliveries == {"wire": "queued"}
        assert pull.poll(10_000)
        kind, cap = receive_capture(pull)
        want_pos, want = rec.arrays()
        assert kind == "record" and cap.tag == "z"
        np.testing.assert_array_equal(cap.positions, want_pos)
        assert set(cap.arrays) == set(want)
        for place, arr in want.items():
            np.testing.assert_array_equal(cap[place], arr)
        lost = _record("lost")
        with pytest.raises(RuntimeError, match="no room"):
            nobody.on_finish(lost)
        assert "nobody" not in lost.deliveries  # failed: no claim at all
        # Streamed: a chunk that could not be sent keeps the request from looking whole.
        streamer = build_consumer("live", {"kind": "zmq", "endpoint": dead, "stream": True})
        part = _record("part")
        with pytest.raises(RuntimeError):
            streamer.on_chunk(part, *part.arrays())
        assert part.deliveries == {"live": "incomplete"}
        streamer.close()
    finally:
        consumer.close()
        nobody.close()
        pull.close(linger=0)


# ---- memory bounds -----------------------------------------------------------------------------------------------
@pytest.fixture
def clock(monkeypatch):
    now = SimpleNamespace(t=1000.0)
    monkeypatch.setattr(consumers_mod, "time", SimpleNamespace(monotonic=lambda: now.t))
    return now


def test_record_size_counts_positions_and_rows():
    assert _record("a").nbytes == 5 * 8 + 2 * 5 * 8 * 4  # int64 positions + two float32 [5, 8] places


def _held(rec: CaptureRecord) -> int:
    """What the memory consumer charges a record: its rows and positions, and what its capture spec keeps."""
    return rec.nbytes + resident_bytes(rec.spec)


HELD = _held(_record("a"))


def test_memory_consumer_expires_records_nobody_takes(clock, caplog):
    mem = MemoryConsumer(ttl_s=10.0)
    mem.on_finish(_record("a"))
    clock.t += 6
    mem.on_finish(_record("b"))
    clock.t += 5  # a: 11 s old, b: 5 s
    with caplog.at_level(logging.ERROR, logger="dynsteer"):
        assert mem.take("a") is None
    assert mem.take("b").tag == "b"
    assert (mem.expired, mem.expired_bytes, mem.evicted, mem.bytes) == (1, HELD, 0, 0)
    assert any("not taken within ttl_s" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    mem.on_finish(_record("c"))
    clock.t += 10.5
    assert mem.expire() == 1 and mem.records == {} and mem.bytes == 0


def test_memory_consumer_evicts_oldest_past_its_byte_budget(clock, caplog):
    mem = MemoryConsumer(max_bytes=2 * HELD + HELD // 2)
    with caplog.at_level(logging.ERROR, logger="dynsteer"):
        for tag in ("a", "b", "c"):  # the third passes the budget
            mem.on_finish(_record(tag))
    assert list(mem.records) == ["b", "c"]
    assert (mem.evicted, mem.evicted_bytes, mem.bytes, mem.expired) == (1, HELD, 2 * HELD, 0)
    assert any("evicted the oldest record a" in r.getMessage() for r in caplog.records)
    again = _record("b")
    mem.on_finish(again)  # a repeated tag replaces its record (counted once) and becomes the newest
    assert list(mem.records) == ["c", "b"] and mem.bytes == 2 * HELD and mem.take("b") is again
    big = _record("big", n=200)
    mem.on_finish(big)  # alone larger than the budget: dropped too, and not claimed as delivered
    assert "big" not in mem.records and "memory" not in big.deliveries and mem.bytes == 0
    assert mem.evicted == 3  # c, then big itself


def test_memory_consumer_charges_what_a_records_capture_spec_keeps(clock):
    """A request asking for many explicit positions that capture nothing still costs its spec: records nobody takes
    (HTTP requests) cannot pin memory beyond the budget through their position lists."""
    heavy = CaptureSpec(layers=SPEC.layers, sites=SPEC.sites, positions=tuple(range(10_000, 70_000)))
    mem = MemoryConsumer(max_bytes=8 << 20)
    for i in range(40):  # each spec alone keeps over 2 MB of Python ints
        mem.on_finish(CaptureRecord(tag=f"h{i}", req_id=f"h{i}", spec=heavy, prompt_len=3))
    assert mem.evicted > 30 and mem.bytes <= 8 << 20
    assert resident_bytes(heavy) > 2 << 20


def test_memory_consumer_still_bounds_the_record_count(clock):
    mem = MemoryConsumer(max_records=2)
    for tag in ("a", "b", "c"):
        mem.on_finish(_record(tag))
    assert list(mem.records) == ["b", "c"] and mem.evicted == 1 and mem.bytes == 2 * HELD
    assert mem.records["c"].deliveries == {"memory": "delivered"}


def test_memory_consumer_weighs_a_shared_spec_once_and_each_distinct_spec_by_its_own_weight(clock, monkeypatch):
    """A batch's records share their spec: it is walked once; a different spec is weighed by its own size, and the
    charge always equals what each record's spec keeps."""
    walks = []
    real = consumers_mod.resident_bytes
    monkeypatch.setattr(consumers_mod, "resident_bytes", lambda obj: walks.append(obj) or real(obj))
    light = CaptureSpec(layers=SPEC.layers, sites=SPEC.sites, positions="all_generated")
    heavy = CaptureSpec(layers=SPEC.layers, sites=SPEC.sites, positions=tuple(range(1000, 3000)))
    mem = MemoryConsumer()
    for i in range(5):
        mem.on_finish(CaptureRecord(tag=f"l{i}", req_id=f"l{i}", spec=light, prompt_len=3))
    assert walks == [light] and mem.bytes == 5 * real(light)
    mem.on_finish(CaptureRecord(tag="h", req_id="h", spec=heavy, prompt_len=3))
    assert walks == [light, heavy] and mem.bytes == 5 * real(light) + real(heavy)
    for i in range(70):  # more distinct specs than are remembered: the oldest are forgotten, and weighed again
        mem.on_finish(CaptureRecord(tag=f"d{i}", req_id=f"d{i}", spec=CaptureSpec(
            layers=SPEC.layers, sites=SPEC.sites, positions=(i,)), prompt_len=3))
    mem.on_finish(CaptureRecord(tag="l-again", req_id="l-again", spec=light, prompt_len=3))
    assert walks[-1] is light and len(walks) == 2 + 70 + 1
    assert mem.bytes == sum(_held(r) for r in mem.records.values())
