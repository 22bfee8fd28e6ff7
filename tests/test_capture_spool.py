"""Capture spools: rows written to /dev/shm as they land, handed to the caller without a copy (no engine)."""

from __future__ import annotations

import errno
import gc
import os

import numpy as np
import pytest
import torch

from dynsteer.capture import result as result_mod
from dynsteer.capture import spool as spool_mod
from dynsteer.capture import step_runs
from dynsteer.capture import store as store_mod
from dynsteer.capture.spec import CaptureSpec
from dynsteer.capture.store import CaptureCollector

pytestmark = pytest.mark.skipif(spool_mod.spool_dir() is None, reason="no writable /dev/shm here")
H = 8
PLACES = [(1, "post_block"), (2, "post_attn")]


def _spool_files() -> set[str]:
    return {p.name for p in spool_mod.SHM_DIR.glob(f"{spool_mod.SHM_PREFIX}{spool_mod.pid_namespace()}-{os.getpid()}-*")}


def _drive(spool: bool, specs: dict[str, CaptureSpec], steps: int = 6, seed: int = 0,
           finish: bool = True) -> tuple[CaptureCollector, dict]:
    """A prefill of 5 + 3 prompt tokens, then decode steps; the stage buffers hold random rows each step (as the
    steering op would write them). Returns the collector and the finished records by request id."""
    stages = {p: torch.zeros(16, H) for p in PLACES}
    col = CaptureCollector(stages, engine_places=set(PLACES), spool=spool)
    prompt = {"a": 5, "b": 3}
    for req, spec in specs.items():
        col.begin(req, f"tag-{req}", spec, prompt[req])
    gen = torch.Generator().manual_seed(seed)
    ids = list(specs)
    for step in range(steps):
        if step == 0:
            qs = np.cumsum([0] + [prompt[r] for r in ids])
            computed = np.zeros(len(ids), np.int64)
        else:
            qs = np.arange(len(ids) + 1)
            computed = np.array([prompt[r] + step - 1 for r in ids])
        col.plan(ids, qs, computed)
        for buf in stages.values():  # the op writes the captured rows at their capture rows
            buf.copy_(torch.randn(buf.shape, generator=gen))
        col.after_forward()
    return col, ({r: col.finish(r) for r in ids} if finish else {})


SPECS = {"a": CaptureSpec(layers=(1, 2), sites=("post_block", "post_attn"), positions="all"),
         "b": CaptureSpec(layers=(1,), sites=("post_block",), positions="all_generated")}


def _same(a, b) -> None:
    pos_a, arr_a = a.arrays()
    pos_b, arr_b = b.arrays()
    np.testing.assert_array_equal(pos_a, pos_b)
    assert set(arr_a) == set(arr_b)
    for place in arr_a:
        np.testing.assert_array_equal(arr_a[place], arr_b[place])


def test_spooled_records_equal_in_memory_ones_and_cross_the_hop_without_a_copy():
    before = _spool_files()
    _, plain = _drive(False, SPECS)
    _, spooled = _drive(True, SPECS)
    for req in SPECS:
        assert spooled[req].spooled and not plain[req].spooled and plain[req].spool is None
        _same(spooled[req], plain[req])
    assert spooled["a"].spool.rows == 5 + 5 and spooled["b"].spool.rows == 5  # positions 0-9 / 3-7
    spool_names = _spool_files() - before
    assert len(spool_names) == 3  # a: two places, b: one
    want = {r: rec.arrays() for r, rec in plain.items()}
    packed = result_mod.pack_records(list(spooled.values()), result_mod.host_id())
    assert all("shm" not in p and all("shm" in f for f in p["arrays"].values()) for p in packed)
    handed = {os.path.basename(f["shm"]) for p in packed for f in p["arrays"].values()}
    assert len(handed) == 3 and not handed & spool_names and not spool_names & _spool_files()  # renamed
    caps = result_mod.unpack_records(packed)
    assert _spool_files() == before  # mapped and unlinked on arrival
    for cap, req in zip(caps, SPECS):
        assert cap.tag == f"tag-{req}" and cap.positions.tolist() == want[req][0].tolist()
        for place, arr in want[req][1].items():
            np.testing.assert_array_equal(cap[place], arr)
    caps[0][(1, "post_block")][0, 0] = 7.0  # writable, private to the caller


def test_a_spool_that_fails_midway_falls_back_to_memory_and_loses_nothing(monkeypatch):
    before = _spool_files()
    _, plain = _drive(False, SPECS, seed=3)
    calls = [0]

    def flaky(real):
        def write(fd, data, offset):
            calls[0] += 1
            if calls[0] > 4:  # the prefill and some decode rows land, then /dev/shm is full
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, data, offset)
        return write

    monkeypatch.setattr(spool_mod.os, "pwrite", flaky(os.pwrite))  # single chunks
    monkeypatch.setattr(spool_mod.os, "pwritev", flaky(os.pwritev))  # runs of decode steps
    _, spooled = _drive(True, SPECS, seed=3)
    for req in SPECS:
        assert spooled[req].spool is None and not spooled[req].spooled
        _same(spooled[req], plain[req])
    assert _spool_files() == before  # the failed spools' files are gone
    packed = result_mod.pack_records(list(spooled.values()), result_mod.host_id())
    for cap, req in zip(result_mod.unpack_records(packed), SPECS):
        np.testing.assert_array_equal(cap[(1, "post_block")], plain[req].arrays()[1][(1, "post_block")])


def test_steady_decode_steps_are_written_once_per_run_per_request_and_equal_memory(monkeypatch):
    # Runs of two steps, so a request's rows cross runs; requests join (a prefill beside decodes: a step off the
    # batched path) and finish (the writer drains a held run) midway: each change ends the run it interrupts.
    monkeypatch.setattr(step_runs, "MAX_STEPS", 2)
    writes: list[tuple[str, int]] = []

    def counted(name, real):
        def write(fd, data, offset):
            writes.append((name, len(data) if name == "pwritev" else 1))
            return real(fd, data, offset)
        return write

    def drive(spool: bool) -> dict:
        stages = {p: torch.zeros(16, H) for p in PLACES}
        col = CaptureCollector(stages, engine_places=set(PLACES), spool=spool)
        gen = torch.Generator().manual_seed(11)
        prompt, computed, live, done = {"a": 5, "b": 3, "c": 4}, {}, [], {}
        specs = {"a": SPECS["a"], "b": SPECS["b"], "c": CaptureSpec(layers=(2,), sites=("post_attn",), positions="all")}
        plan = {0: ["a", "b"], 4: ["c"]}  # step -> requests that join (their whole prompt that step)
        for step in range(12):
            joining = plan.get(step, [])
            for req in joining:
                col.begin(req, req, specs[req], prompt[req])
                computed[req] = 0
            live += joining
            counts = [prompt[r] if r in joining else 1 for r in live]
            col.plan(live, np.cumsum([0] + counts), np.array([computed[r] for r in live]))
            for buf in stages.values():
                buf.copy_(torch.randn(buf.shape, generator=gen))
            col.after_forward()
            for r, n in zip(live, counts):
                computed[r] += n
            if step == 8:  # b finishes while a and c decode on
                live.remove("b")
                done["b"] = col.finish("b")
        done |= {r: col.finish(r) for r in live}
        return done

    plain = drive(False)
    monkeypatch.setattr(spool_mod.os, "pwrite", counted("pwrite", os.pwrite))
    monkeypatch.setattr(spool_mod.os, "pwritev", counted("pwritev", os.pwritev))
    spooled = drive(True)
    for req in plain:
        assert spooled[req].spooled
        _same(spooled[req], plain[req])
    assert spooled["a"].arrays()[0].tolist() == list(range(5 + 11))  # prompt, then 11 decode steps
    assert spooled["b"].arrays()[0].tolist() == list(range(3, 3 + 8))  # generated only: 8 decode steps
    assert spooled["c"].arrays()[0].tolist() == list(range(4 + 7))  # joined at step 4
    # The batched steps went out in runs, one pwritev per request and place (a: 2 places, b and c: 1): steps 2-3
    # for a, b; 5-6 and 7-8 for a, b, c; 9-10 and 11 (ended by the last finish) for a, c. Steps 0 and 4 hold a
    # prefill and step 1 is b's first generated position: those take the per-request path, one pwrite per chunk.
    # A row written outside its run, or twice, changes these.
    runs = [n for name, n in writes if name == "pwritev"]
    assert runs == [2] * 3 + [2] * 4 + [2] * 4 + [2] * 3 + [1] * 3
    assert [name for name, _ in writes].count("pwrite") == 2 + 3 + 4


def test_records_are_written_one_by_one_as_they_are_landed(monkeypatch):
    # The writer lands a step's or a run's records one at a time and writes each before landing the next, so a
    # write (which releases the GIL) comes every record: landing them all first holds the GIL for every record's
    # Python, which the engine's thread waits out mid-step at large batches. Equal rows: the tests above.
    monkeypatch.setattr(step_runs, "MAX_STEPS", 3)
    events: list[str] = []
    real_take = spool_mod.Spool.take

    def take(self, *args):
        events.append("land")
        return real_take(self, *args)

    def written(real):
        def write(fd, data, offset):
            events.append("write")
            return real(fd, data, offset)
        return write

    monkeypatch.setattr(spool_mod.Spool, "take", take)
    monkeypatch.setattr(spool_mod.os, "pwritev", written(os.pwritev))  # runs of decode steps
    monkeypatch.setattr(spool_mod.os, "pwrite", written(os.pwrite))  # the prefill's per-request chunks
    specs = {"a": CaptureSpec(layers=(1,), sites=("post_block",), positions="all"),
             "b": CaptureSpec(layers=(1,), sites=("post_block",), positions="all")}
    _, plain = _drive(False, specs, steps=8)
    events.clear()
    _, spooled = _drive(True, specs, steps=8)
    for req in specs:
        _same(spooled[req], plain[req])
    order = "".join("L" if e == "land" else "W" for e in events)
    # The prefill step: one chunk per record (a job of the writer); decode steps 1-7: runs of 3, 3 and 1 steps, one
    # pwritev per record and run. Each write right after its record's landing (before: "LLWW" each time).
    assert order == "LW" * (2 + 6), order


def test_a_run_the_writer_fails_on_marks_its_records_and_the_writer_lives_on(monkeypatch):
    def broken(self):
        raise RuntimeError("boom")

    with monkeypatch.context() as m:
        m.setattr(step_runs.StepRun, "entries", broken)
        _, lost = _drive(True, SPECS)
    for rec in lost.values():  # every record of the run says so; none claims to be whole
        assert rec.status == "partial" and any("lost in the spool writer" in e and "boom" in e for e in rec.errors)
    _, plain = _drive(False, SPECS)
    _, spooled = _drive(True, SPECS)  # the same writer thread, still serving
    for req in SPECS:
        assert spooled[req].status == "ok"
        _same(spooled[req], plain[req])


def test_dropped_and_inline_delivered_spools_leave_no_files():
    # Earlier tests' spools (engines in this process) may be released at any time: the test follows the files its
    # own collectors create, not the process's whole set.
    gc.collect()
    assert spool_mod.WRITER.drain(10)  # no earlier queued write creates a file mid-test
    before = _spool_files()
    col, _ = _drive(True, SPECS, finish=False)
    assert spool_mod.WRITER.drain(10)  # the writer thread creates the files (a step's split runs there)
    mine = _spool_files() - before
    assert len(mine) == 3
    col.records.clear()  # an engine dropping its collector (or records nobody takes, evicted)
    del col
    assert spool_mod.WRITER.drain(10)  # queued writes hold their spools until written
    gc.collect()
    assert not _spool_files() & mine
    before = _spool_files()
    _, spooled = _drive(True, SPECS)
    mine = _spool_files() - before
    assert len(mine) == 3
    _, plain = _drive(False, SPECS)
    packed = result_mod.pack_records(list(spooled.values()), None)  # a caller on another host: bytes inline
    assert all("data" in f for p in packed for f in p["arrays"].values())
    for cap, req in zip(result_mod.unpack_records(packed), SPECS):
        np.testing.assert_array_equal(cap[(1, "post_block")], plain[req].arrays()[1][(1, "post_block")])
    del spooled
    assert spool_mod.WRITER.drain(10)
    gc.collect()
    assert not _spool_files() & mine


def test_finished_records_hold_no_descriptor_and_the_file_budget_caps_spooling(monkeypatch):
    def fds() -> int:  # descriptors open on this process's spool files only (other tests' threads open their own)
        n, ours = 0, _spool_files()
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) in ours
            except OSError:  # closed meanwhile (listdir's own descriptor, another thread's)
                pass
        return n

    col, _ = _drive(True, SPECS, finish=False)
    assert spool_mod.WRITER.drain(10)  # the writer thread opens the files (a step's split runs there)
    gc.collect()  # earlier tests' records, if any still hold a spool, close it now rather than mid-count
    live = fds()
    assert live >= 3
    recs = [col.finish(r) for r in SPECS]
    assert fds() == live - 3 and col.spool_files == 0  # sealed: files stay, descriptors close
    for rec in recs:
        rec.arrays()  # still readable by name
    monkeypatch.setattr(store_mod, "MAX_SPOOL_FILES", 2)
    col, done = _drive(True, SPECS)
    assert done["a"].spool is not None and done["b"].spool is None  # a took both files; b keeps rows in memory
    _, plain = _drive(False, SPECS)
    for req in SPECS:
        _same(done[req], plain[req])


def test_only_records_the_memory_consumer_delivers_spool():
    specs = {"a": CaptureSpec(layers=(1,), positions="all", consumers=("filesystem",)), "b": SPECS["b"]}
    col, done = _drive(True, specs)
    assert done["a"].spool is None and done["b"].spool is not None


def test_spool_rejects_rows_that_do_not_match_its_layout(tmp_path):
    sp = spool_mod.Spool(tmp_path)
    sp.append({"p": np.ones((2, 4), np.float32)})
    with pytest.raises(ValueError, match="place p"):
        sp.append({"p": np.ones((2, 5), np.float32)})
    with pytest.raises(ValueError, match="place p"):
        sp.append({"p": np.ones((2, 4), np.float64)})
    assert sp.rows == 2
    np.testing.assert_array_equal(sp.read("p"), np.ones((2, 4), np.float32))
    sp.discard()
    assert not list(tmp_path.iterdir())


def test_file_names_are_unique_across_a_fork_and_parse_as_the_sweep_reads_them():
    """Names come from the creating process's pid, a random part drawn once per process and a counter: a forked
    child draws its own, so parent and child never hand two files the same name (a rename would replace one)."""
    ns = spool_mod.pid_namespace()
    names = [spool_mod.shm_name(ns, 4242) for _ in range(1000)]
    assert len(set(names)) == 1000
    for name in names[:3]:
        namespace, pid, unique = name[len(spool_mod.SHM_PREFIX):].split("-")
        assert (namespace, pid) == (ns, "4242") and unique and "-" not in unique
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its next names, to the parent
        try:
            os.write(write, "\n".join(spool_mod.shm_name(ns, 4242) for _ in range(100)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        theirs = pipe.read().split("\n")
    os.waitpid(child, 0)
    ours = [spool_mod.shm_name(ns, 4242) for _ in range(100)]
    assert len(theirs) == 100 and not set(theirs) & set(ours + names)


def test_the_sweep_judges_each_process_once_and_removes_only_the_gone_ones(monkeypatch):
    ns = spool_mod.pid_namespace()
    gone_pid = 2 ** 22 + 17  # above Linux's default pid_max: no such process
    mine = [result_mod.SHM_DIR / spool_mod.shm_name(ns, os.getpid()) for _ in range(5)]
    theirs = [result_mod.SHM_DIR / spool_mod.shm_name(ns, gone_pid) for _ in range(5)]
    for path in mine + theirs:
        path.write_bytes(b"x")
    asked: list[int] = []
    real = result_mod._alive
    monkeypatch.setattr(result_mod, "_alive", lambda pid: asked.append(pid) or real(pid))
    try:
        gone = result_mod.sweep_shared()
        assert set(theirs) <= set(gone) and not set(mine) & set(gone)
        assert all(p.exists() for p in mine) and not any(p.exists() for p in theirs)
        assert asked.count(os.getpid()) == 1 and asked.count(gone_pid) == 1
    finally:
        for path in mine + theirs:
            path.unlink(missing_ok=True)
