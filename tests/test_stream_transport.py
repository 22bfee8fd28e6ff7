"""The async tier's ZeroMQ transport (no engine): StreamHub <-> StreamSubscriber round trips, overload policies with
exact accounting, resume after SIGKILL, fuzzing of the client protocol, endpoint security, and the spill ring.
"""

from __future__ import annotations

import gc
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dynsteer.monitor.subscriber import StreamError, StreamSubscriber
from dynsteer.transport.wire import (Hello, StreamAck, WireError, decode_client, decode_frame, encode_client,
                                     encode_frame)
from dynsteer.streams.hub import StreamHub
from dynsteer.transport.security import CurveKeys, check_endpoint
from dynsteer.streams.spill import SpillRing

REPO = Path(__file__).resolve().parents[1]
COUNTERS = ("published", "delivered", "dropped", "spilled", "pending")


@pytest.fixture
def ipc_dir(tmp_path: Path) -> Iterator[Path]:
    """A private folder for ipc sockets: tmp_path, unless its path is too long for a Unix socket (108 bytes)."""
    if len(str(tmp_path)) < 80:
        yield tmp_path
        return
    short = Path(tempfile.mkdtemp(prefix="dst-"))
    yield short
    for f in short.iterdir():
        f.unlink()
    short.rmdir()


@pytest.fixture
def hubs(ipc_dir: Path) -> Iterator[Callable[..., StreamHub]]:
    """Makes hubs on ipc endpoints (stream ``a`` declared) and closes them all at the end."""
    made: list[StreamHub] = []

    def make(**kwargs: Any) -> StreamHub:
        hub = StreamHub(f"ipc://{ipc_dir}/hub{len(made)}", **{"heartbeat_s": 0.5, **kwargs})
        hub.declare("a", {"kind": "test"})
        made.append(hub)
        return hub

    yield make
    for hub in made:
        hub.close()


def counters(stats: dict[str, Any], name: str, stream: str = "a") -> dict[str, Any]:
    return stats[stream]["subscribers"][name]


def assert_identity(stats: dict[str, Any]) -> None:
    """published = delivered + dropped + spilled + pending, for every stream and subscriber."""
    checked = 0
    for stream, info in stats.items():
        if stream.startswith("_"):
            continue
        for name, c in info["subscribers"].items():
            assert c["published"] == c["delivered"] + c["dropped"] + c["spilled"] + c["pending"], (stream, name, c)
            assert min(c[k] for k in COUNTERS) >= 0, (stream, name, c)
            checked += 1
    assert checked, "no subscriber to check"


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def message(seq: int, rows: int = 4, hidden: int = 16) -> tuple[dict[str, Any], list[np.ndarray]]:
    rng = np.random.default_rng(seq)
    return ({"step": seq, "req_ids": [f"r{seq}", "all"]},
            [rng.standard_normal((rows, hidden)).astype(np.float32), np.arange(rows, dtype=np.int64) + seq])


def check_payload(frame: Any) -> None:
    meta, arrays = message(frame.seq, *frame.arrays[0].shape)
    assert frame.meta == meta
    assert all(a.tobytes() == b.tobytes() and a.dtype == b.dtype for a, b in zip(frame.arrays, arrays))


def drain(sub: StreamSubscriber, quiet_s: float = 0.5) -> list[Any]:
    """Every frame until none comes for ``quiet_s``, then ack them all."""
    frames = []
    while (frame := sub.recv(quiet_s)) is not None:
        frames.append(frame)
    sub.ack()
    return frames


# ---- 1. round trip ------------------------------------------------------------------------------------------------


def test_round_trip_bit_identical(hubs: Callable[..., StreamHub]) -> None:
    hub = hubs()
    rng = np.random.default_rng(0)
    sent: list[tuple[dict[str, Any], list[np.ndarray]]] = []
    with StreamSubscriber(hub.endpoint, "rt", ["a"]) as sub:
        assert hub.subscribed("a") and not hub.subscribed("b")
        for i in range(200):
            arrays: list[np.ndarray] = [rng.standard_normal((int(rng.integers(0, 9)), 32)).astype(np.float32),
                      rng.integers(-2**62, 2**62, size=int(rng.integers(1, 50)), dtype=np.int64),
                      rng.integers(0, 2**16, size=(3, 5), dtype=np.uint16),  # bfloat16 bits
                      np.asarray(rng.standard_normal(), dtype=np.float64)]  # 0-d
            meta = {"i": i, "nested": {"x": [1.5, "y", None]}, "req_ids": [f"q{i}"]}
            assert hub.publish("a", meta, arrays) == i
            sent.append((meta, arrays))
        frames = [f for _ in range(200) if (f := sub.recv(5.0)) is not None]
        assert sub.recv(0.2) is None
        assert [f.seq for f in frames] == list(range(200))
        for frame, (meta, arrays) in zip(frames, sent):
            assert frame.stream == "a" and frame.meta == meta
            assert len(frame.arrays) == len(arrays)
            for got, want in zip(frame.arrays, arrays):
                assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
        assert sub.next_seq == {"a": 200}
        sub.ack()
        wait_until(lambda: counters(hub.stats(), "rt")["delivered"] == 200, what="acks")
        assert_identity(hub.stats())


def test_encode_decode_frame_zero_copy_and_errors() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    frames = encode_frame("s", 3, {"k": 1}, [arr])
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), arr)  # no copy on the way out
    frame = decode_frame(frames)
    assert np.shares_memory(frame.arrays[0], np.frombuffer(frames[1], np.uint8))  # nor on the way in
    assert (frame.arrays[0] == arr).all() and frame.seq == 3 and frame.meta == {"k": 1}
    with pytest.raises(WireError, match=r"^frame\.arrays: 1 arrays described but 0"):
        decode_frame(frames[:1])
    with pytest.raises(WireError, match=r"^frame\.arrays\[0\]: float32 \[3, 4\] needs 48 bytes"):
        decode_frame([frames[0], b"x" * 47])
    bad = msgspec.msgpack.encode({"op": "frame", "v": 1, "stream": "s", "seq": 0, "meta": {},
                                  "arrays": [{"dtype": "O", "shape": [1]}]})
    with pytest.raises(WireError, match=r"^frame\.arrays\[0\]\.dtype"):
        decode_frame([bad, b"12345678"])


# ---- 2. slow subscribers, per policy --------------------------------------------------------------------------------


class SubscriberThread(threading.Thread):
    """Runs a StreamSubscriber on its own thread (its socket never leaves it), sleeping ``delay_s`` per frame."""

    def __init__(self, endpoint: str, name: str, delay_s: float, start_after_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(daemon=True)
        self.args, self.delay_s, self.start_after_s = (endpoint, name, ["a"]), delay_s, start_after_s
        self.kwargs = kwargs
        self.frames: list[Any] = []
        self.ready, self.stop = threading.Event(), threading.Event()
        self.stats: list[dict[str, Any]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with StreamSubscriber(*self.args, **self.kwargs) as sub:
                self.ready.set()
                time.sleep(self.start_after_s)
                while not self.stop.is_set():
                    frame = sub.recv(0.05)
                    if frame is None:
                        sub.ack()
                        continue
                    check_payload(frame)
                    self.frames.append(frame.seq)
                    if len(self.frames) % 25 == 0:
                        self.stats.append(sub.stats())  # the stats op, mid-run
                    time.sleep(self.delay_s)
                sub.ack()
        except BaseException as exc:  # surfaced by the test
            self.error = exc
            self.ready.set()


def run_publisher(hub: StreamHub, n: int, pause_s: float, snapshots: list[dict[str, Any]]) -> list[float]:
    durations = []
    for seq in range(n):
        meta, arrays = message(seq)
        t0 = time.perf_counter()
        assert hub.publish("a", meta, arrays) == seq
        durations.append(time.perf_counter() - t0)
        if seq % 40 == 0:
            snapshots.append(hub.stats())
        time.sleep(pause_s)
    return durations


def finish(hub: StreamHub, sub: SubscriberThread, name: str, n: int) -> dict[str, Any]:
    """Wait until the subscriber settled everything, stop it, and return the final stats."""
    wait_until(lambda: counters(hub.stats(), name)["pending"] + counters(hub.stats(), name)["spilled"] == 0,
               timeout_s=30, what=f"{name} to settle")
    stats = hub.stats()  # before the subscriber leaves (its bye unregisters it)
    sub.stop.set()
    sub.join(10)
    assert sub.error is None, sub.error
    assert counters(stats, name)["published"] == n
    return stats


def test_drop_policy_exact_accounting(hubs: Callable[..., StreamHub]) -> None:
    hub = hubs()
    sub = SubscriberThread(hub.endpoint, "slow", delay_s=0.004, policy="drop", max_pending=8, window=4)
    sub.start()
    assert sub.ready.wait(20) and sub.error is None
    snapshots: list[dict[str, Any]] = []
    run_publisher(hub, 400, 0.0005, snapshots)
    stats = finish(hub, sub, "slow", 400)
    for snap in snapshots + sub.stats + [stats]:
        assert_identity(snap)
    c = counters(stats, "slow")
    received = sub.frames
    assert c["dropped"] > 0 and c["dropped"] == c["dropped_total"] and c["spilled_total"] == 0
    assert c["delivered"] == len(received) and c["delivered"] + c["dropped"] == 400
    assert all(a < b for a, b in zip(received, received[1:])), "delivery must be in increasing seq order"
    lost = sorted(set(range(400)) - set(received))
    assert len(lost) == c["dropped"]
    assert hub.request_losses("all") == len(lost)
    assert all(hub.request_losses(f"r{s}") == 1 for s in lost)
    assert all(hub.request_losses(f"r{s}") == 0 for s in received)


def test_spill_policy_delivers_everything_in_order(hubs: Callable[..., StreamHub], tmp_path: Path) -> None:
    spill = tmp_path / "spill"
    # max_pending above what is published: only the replay buffer's evictions (of messages not yet acked) can send
    # messages to disk here (test_resume_past_spilled_messages_settles_them covers overflow past max_pending).
    hub = hubs(spill_dir=str(spill), replay_messages=32, heartbeat_s=2.0)
    sub = SubscriberThread(hub.endpoint, "spiller", delay_s=0.0, start_after_s=1.5, policy="spill", max_pending=1000,
                           window=4)
    sub.start()
    assert sub.ready.wait(20) and sub.error is None
    snapshots: list[dict[str, Any]] = []
    run_publisher(hub, 300, 0.0005, snapshots)
    during = hub.stats()
    assert counters(during, "spiller")["spilled"] > 0 and any(spill.rglob("seg-*")), "nothing went to disk"
    stats = finish(hub, sub, "spiller", 300)
    for snap in snapshots + sub.stats + [during, stats]:
        assert_identity(snap)
    c = counters(stats, "spiller")
    assert sub.frames == list(range(300)), "a spilling subscriber receives every message, in order"
    assert c["spilled_total"] > 0 and c["dropped"] == 0 and c["delivered"] == 300
    assert not any(spill.rglob("seg-*")), "consumed spill segments are deleted"


def test_resume_past_spilled_messages_settles_them(hubs: Callable[..., StreamHub], tmp_path: Path) -> None:
    spill = tmp_path / "spill"
    hub = hubs(spill_dir=str(spill))
    sub = StreamSubscriber(hub.endpoint, "skipper", ["a"], policy="spill", max_pending=2, window=1)
    for seq in range(30):
        hub.publish("a", *message(seq))
    wait_until(lambda: counters(hub.stats(), "skipper")["spilled"] == 28, what="the spill")
    sub.close(bye=False)
    # Restarted, it says it processed everything before 30: what was on disk counts as delivered and is deleted.
    with StreamSubscriber(hub.endpoint, "skipper", ["a"], policy="spill", resume={"a": 30}) as again:
        c = counters(hub.stats(), "skipper")
        assert (c["published"], c["delivered"], c["spilled"], c["pending"]) == (30, 30, 0, 0)
        assert c["spilled_total"] >= 28
        assert not any(spill.rglob("seg-*"))
        hub.publish("a", *message(30))
        assert [f.seq for f in drain(again)] == [30]


def test_block_policy_bounded_wait_then_drop(hubs: Callable[..., StreamHub], frozen_heap: None) -> None:
    max_delay_ms = 20.0
    hub = hubs(block_subscribers=("blocker",), max_block_delay_ms=max_delay_ms)
    sub = SubscriberThread(hub.endpoint, "blocker", delay_s=0.3, policy="block", max_pending=4, window=2,
                           max_delay_ms=max_delay_ms)
    sub.start()
    assert sub.ready.wait(20) and sub.error is None
    snapshots: list[dict[str, Any]] = []
    durations = run_publisher(hub, 60, 0.0, snapshots)
    stats = finish(hub, sub, "blocker", 60)
    for snap in snapshots + sub.stats + [stats]:
        assert_identity(snap)
    c = counters(stats, "blocker")
    # slack for the OS waking the publisher late on a loaded CI box; a wait for room would take the subscriber's
    # 300 ms per frame
    assert max(durations) * 1000 <= max_delay_ms + 180, max(durations)
    assert c["block_waits"] > 0 and c["blocked_ms_max"] <= max_delay_ms + 180, c
    assert c["dropped"] > 0  # 300 ms per frame: longer than a publish may wait, so the oldest are dropped
    assert all(a < b for a, b in zip(sub.frames, sub.frames[1:]))


def test_block_policy_keeping_up_drops_nothing(hubs: Callable[..., StreamHub]) -> None:
    hub = hubs(block_subscribers=("fast",), max_block_delay_ms=2000.0)
    sub = SubscriberThread(hub.endpoint, "fast", delay_s=0.0, policy="block", max_pending=16, window=8,
                           max_delay_ms=2000.0)
    sub.start()
    assert sub.ready.wait(20) and sub.error is None
    durations = run_publisher(hub, 500, 0.0, [])
    stats = finish(hub, sub, "fast", 500)
    assert_identity(stats)
    c = counters(stats, "fast")
    assert sub.frames == list(range(500)) and c["dropped"] == 0 and c["delivered"] == 500
    assert max(durations) * 1000 <= 2000 + 30


# ---- 3. a subscriber SIGKILLed mid-run, restarted with resume -------------------------------------------------------

SUBSCRIBER_SCRIPT = textwrap.dedent("""
    import json, sys
    from dynsteer.monitor.subscriber import StreamSubscriber
    endpoint, out, resume, max_pending = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    with open(out, "w") as f:
        sub = StreamSubscriber(endpoint, "victim", ["a"], policy="drop", max_pending=max_pending, window=16,
                               resume=resume, heartbeat_s=0.2, hello_timeout_s=60)
        while True:
            frame = sub.recv(0.2)
            if frame is None:
                sub.ack()
                continue
            f.write(f"{frame.seq}\\n")
            f.flush()
""")


def seqs_in(path: Path) -> list[int]:
    text = path.read_text() if path.exists() else ""
    return [int(line) for line in text.split("\n")[:-1]]  # a line without its newline was cut by the kill


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """The process's objects so far kept out of the collector's scans, as vLLM does after start-up: a full collection
    of pytest's and earlier tests' heap (100+ ms here) would land in whichever publish allocated at the time."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def test_sigkilled_subscriber_resumes_without_gaps(hubs: Callable[..., StreamHub], tmp_path: Path,
                                                   frozen_heap: None) -> None:
    hub = hubs(replay_messages=1 << 20, replay_bytes=1 << 30, heartbeat_s=0.5)
    stop, durations, errors = threading.Event(), [], []

    def publish() -> None:
        seq = 0
        try:
            while not stop.is_set():
                meta, arrays = message(seq)
                t0 = time.perf_counter()
                hub.publish("a", meta, arrays)
                durations.append(time.perf_counter() - t0)
                seq += 1
                time.sleep(0.001)
        except BaseException as exc:
            errors.append(exc)

    def spawn(out: Path, resume: dict[str, int] | None, max_pending: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", SUBSCRIBER_SCRIPT, hub.endpoint, str(out),
                                 msgspec.json.encode(resume).decode(), str(max_pending)], cwd=REPO)

    first_out, second_out = tmp_path / "first.txt", tmp_path / "second.txt"
    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    # Room for a second's stall of a live subscriber on a loaded box (a gap in its frames would fail the first
    # check); once it is dead, more than that is published, and the rest is dropped past max_pending.
    victim = spawn(first_out, None, 1024)
    try:
        wait_until(lambda: len(seqs_in(first_out)) >= 100, timeout_s=60, what="the first subscriber's frames")
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        at_kill = len(durations)
        wait_until(lambda: len(durations) - at_kill > 1100, timeout_s=60, what="publishes past max_pending")
        first = seqs_in(first_out)
        assert first == list(range(first[0], first[0] + len(first)))
        # Room for the live messages that arrive while it works through the replayed backlog (``drop`` would
        # otherwise drop them: the policy bounds the live backlog, not the resume's replays).
        while_dead = len(durations) - at_kill
        resumed = spawn(second_out, {"a": first[-1] + 1}, 1 << 16)
        try:
            wait_until(lambda: len(seqs_in(second_out)) >= 200, timeout_s=60, what="the resumed subscriber")
            stop.set()
            publisher.join(10)
            assert not errors, errors
            head = hub.stats()["a"]["head"]
            wait_until(lambda: seqs_in(second_out)[-1:] == [head - 1], timeout_s=30, what="the resumed tail")
            wait_until(lambda: counters(hub.stats(), "victim")["pending"] == 0, timeout_s=10, what="acks")
        finally:
            resumed.kill()
            resumed.wait(10)
    finally:
        stop.set()
        if victim.poll() is None:
            victim.kill()
    assert seqs_in(second_out) == list(range(first[-1] + 1, head)), "every following seq, no gap, no repeat"
    # a drop-policy publish never waits for a subscriber: publishing went on while this one was dead (how fast is
    # benchmarks/hostile_hub.py's question, not a test's)
    assert while_dead >= 10, f"{while_dead} publishes while the subscriber was dead"
    stats = hub.stats()
    assert_identity(stats)
    c = counters(stats, "victim")
    # Drops while it was dead were all recovered from the replay buffer by the resume.
    assert c["dropped_total"] > 0 and c["replayed"] > 0 and c["dropped"] == 0
    assert c["published"] == c["delivered"] == head - first[0]


def test_resume_counts_each_message_once(hubs: Callable[..., StreamHub]) -> None:
    hub = hubs(replay_messages=10)
    with StreamSubscriber(hub.endpoint, "early", ["a"]) as sub:
        for seq in range(10):
            hub.publish("a", *message(seq))
        assert [f.seq for f in drain(sub)] == list(range(10))
        wait_until(lambda: counters(hub.stats(), "early")["delivered"] == 10, what="acks")
    for seq in range(10, 20):
        hub.publish("a", *message(seq))
    # A restarted monitor asking again for messages it had already acked: re-sent, not counted twice.
    with StreamSubscriber(hub.endpoint, "early", ["a"], resume={"a": 12}) as again:
        assert again.welcome["a"] == {"head": 20, "first": 10, "next": 12}
        assert [f.seq for f in drain(again)] == list(range(12, 20))
    # A new subscriber resuming before the oldest kept message: those before it are published and dropped.
    with StreamSubscriber(hub.endpoint, "late", ["a"], resume={"a": 0}) as late:
        frames = drain(late)
        assert [f.seq for f in frames] == list(range(10, 20))
        for frame in frames:
            check_payload(frame)
        wait_until(lambda: counters(hub.stats(), "late")["pending"] == 0, what="acks")
        c = counters(hub.stats(), "late")
        assert (c["published"], c["delivered"], c["dropped"], c["replayed"]) == (20, 10, 10, 10)
        assert_identity(hub.stats())


def test_a_resume_before_what_was_acked_comes_in_order_with_what_was_in_flight(hubs: Callable[..., StreamHub]) -> None:
    """A monitor that acked 0..9, had 10..19 in flight and comes back resuming at 5 (its checkpoint lagged its acks)
    gets 5..19 in order: the re-opened 5..9 before the re-sends of 10..19 (the subscriber drops anything below
    what it has seen, so re-sends first would lose 5..9 silently)."""
    hub = hubs(replay_messages=64)
    first = StreamSubscriber(hub.endpoint, "back", ["a"], window=64)
    for seq in range(20):
        hub.publish("a", *message(seq))
    assert [first.recv(5).seq for _ in range(10)] == list(range(10))  # type: ignore[union-attr]
    first.ack()
    wait_until(lambda: counters(hub.stats(), "back")["delivered"] == 10, what="the acks of 0..9")
    assert counters(hub.stats(), "back")["pending"] == 10  # 10..19: sent, not acked
    first.close(bye=False)  # gone without a bye: 10..19 are re-sent on its next connection
    wait_until(lambda: not counters(hub.stats(), "back")["connected"], timeout_s=5, what="the disconnect")
    with StreamSubscriber(hub.endpoint, "back", ["a"], resume={"a": 5}) as again:
        frames = drain(again)
        assert [f.seq for f in frames] == list(range(5, 20))
        for frame in frames:
            check_payload(frame)
        wait_until(lambda: counters(hub.stats(), "back")["pending"] == 0, what="acks")
        c = counters(hub.stats(), "back")
        assert (c["published"], c["delivered"], c["dropped"]) == (20, 20, 0)
        assert_identity(hub.stats())


def test_reconnect_without_resume_gets_what_the_hub_held(hubs: Callable[..., StreamHub]) -> None:
    hub = hubs()
    first = StreamSubscriber(hub.endpoint, "back", ["a"], window=64)
    for seq in range(5):
        hub.publish("a", *message(seq))
    assert [f.seq for f in drain(first)] == list(range(5))
    first.close(bye=False)  # gone without a bye: still registered, its messages queue
    for seq in range(5, 25):
        hub.publish("a", *message(seq))
    wait_until(lambda: not counters(hub.stats(), "back")["connected"], timeout_s=5, what="the disconnect")
    with StreamSubscriber(hub.endpoint, "back", ["a"]) as again:
        assert again.welcome["a"]["next"] == 5 and again.next_seq == {"a": 5}
        frames = drain(again)
        assert [f.seq for f in frames] == list(range(5, 25))
        check_payload(frames[-1])
        wait_until(lambda: counters(hub.stats(), "back")["pending"] == 0, what="acks")
        c = counters(hub.stats(), "back")
        assert (c["published"], c["delivered"], c["dropped"]) == (25, 25, 0)


def test_say_hello_errors_for_earlier_messages_start_one_hello_not_two(ipc_dir: Path) -> None:
    """A hub that lost the connection answers every ack and ping sent meanwhile with "say hello". One hello settles
    them all: a second hello's welcome, arriving after the first's frames were returned, used to move the position
    back, so those frames were returned twice."""
    from dynsteer.transport.wire import encode_error, encode_welcome

    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{ipc_dir}/scripted"
    router.bind(endpoint)
    hellos: list[dict[str, int] | None] = []
    got_0_to_3, got_4_to_7, hub_done = threading.Event(), threading.Event(), threading.Event()

    def next_hello(timeout_s: float) -> tuple[bytes, Hello] | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if router.poll(20):
                identity, body = router.recv_multipart()
                msg = decode_client(body)
                if isinstance(msg, Hello):  # acks and pings: this script has no use for them
                    hellos.append(msg.resume)
                    return identity, msg
        return None

    def answer(identity: bytes, hello: Hello, stop: int) -> None:
        start = (hello.resume or {}).get("a", 0)
        router.send_multipart([identity, encode_welcome({"a": {"head": stop, "first": 0, "next": start}})])
        for seq in range(start, stop):
            router.send_multipart([identity, *encode_frame("a", seq, {}, [np.full(2, seq, np.float32)])])

    def scripted_hub() -> None:
        try:
            got = next_hello(10)
            assert got is not None
            answer(*got, stop=4)
            got_0_to_3.wait(10)
            for _ in range(2):  # two messages sent while the hub had marked the connection lost
                router.send_multipart([got[0], encode_error("hello", "this connection has not said hello")])
            got = next_hello(10)
            assert got is not None
            answer(*got, stop=8)
            got_4_to_7.wait(10)
            extra = next_hello(1.0)
            if extra is not None:  # a second hello: answered as a hub would, after 4..7 were returned
                answer(*extra, stop=8)
        finally:
            hub_done.set()

    thread = threading.Thread(target=scripted_hub, daemon=True)
    thread.start()
    try:
        with StreamSubscriber(endpoint, "m", ["a"], heartbeat_s=5.0) as sub:
            seqs = [getattr(sub.recv(timeout_s=5), "seq", None) for _ in range(4)]
            assert seqs == [0, 1, 2, 3]
            got_0_to_3.set()
            seqs = [getattr(sub.recv(timeout_s=5), "seq", None) for _ in range(4)]
            assert seqs == [4, 5, 6, 7]
            got_4_to_7.set()
            assert hub_done.wait(10)
            again = sub.recv(timeout_s=0.5)
            assert again is None, f"seq {again.seq} returned twice"
            assert hellos == [None, {"a": 4}]
            assert sub.next_seq == {"a": 8}
    finally:
        thread.join(10)
        router.close(0)


def test_a_subscriber_polled_with_timeout_zero_keeps_its_connection(hubs: Callable[..., StreamHub]) -> None:
    """``recv(0)`` (how MonitorClient takes turns over replicas) pings when due: a hub that heard nothing for 3 of
    its heartbeats would mark the subscriber gone and send it nothing more."""
    hub = hubs(heartbeat_s=0.5)
    with StreamSubscriber(hub.endpoint, "poller", ["a"], heartbeat_s=0.1) as sub:
        until = time.monotonic() + 2.5  # more than 3 of the hub's heartbeats (a stall below 1.5 s is harmless)
        while time.monotonic() < until:
            assert sub.recv(0) is None
            time.sleep(0.02)
        assert counters(hub.stats(), "poller")["connected"]
        hub.publish("a", *message(0))
        deadline, frame = time.monotonic() + 5, None
        while frame is None and time.monotonic() < deadline:
            frame = sub.recv(0)
            time.sleep(0.01)
        assert frame is not None and frame.seq == 0


def test_a_held_name_is_retried_past_a_heartbeat_without_a_spurious_error(hubs: Callable[..., StreamHub]) -> None:
    """While a refused hello waits for its retry, pings come back as "say hello" errors: they are not a refusal."""
    hub = hubs(heartbeat_s=0.2)
    holder = StreamSubscriber(hub.endpoint, "held", ["a"], heartbeat_s=0.1)
    releaser = threading.Timer(1.0, holder.close)  # the name frees after 10 of the newcomer's heartbeats
    releaser.start()
    try:
        with StreamSubscriber(hub.endpoint, "held", ["a"], heartbeat_s=0.1, hello_timeout_s=10) as late:
            assert late.welcome["a"]["head"] == 0
    finally:
        releaser.join()


def test_refusals_name_the_field(hubs: Callable[..., StreamHub]) -> None:
    def on_declare(name: str, spec: dict[str, Any]) -> None:
        if spec.get("layer", 0) > 3:
            raise ValueError(f"layer {spec['layer']} does not exist")

    hub = hubs(on_declare=on_declare, max_subscribers=2, allow_declare=True)
    with pytest.raises(StreamError, match=r"^hello\.streams\[1\]: unknown stream 'x'"):
        StreamSubscriber(hub.endpoint, "m", ["a", "x"], hello_timeout_s=5)
    with pytest.raises(StreamError, match=r"^hello\.declare\['x'\]: layer 9 does not exist"):
        StreamSubscriber(hub.endpoint, "m", ["x"], declare={"x": {"layer": 9}}, hello_timeout_s=5)
    with pytest.raises(WireError, match=r"^hello\.max_pending: must be >= 1"):
        StreamSubscriber(hub.endpoint, "m", ["a"], max_pending=0)
    version = hub.version
    with StreamSubscriber(hub.endpoint, "m1", ["x"], declare={"x": {"layer": 2}}), \
            StreamSubscriber(hub.endpoint, "m2", ["a"]):
        assert hub.streams()["x"] == {"layer": 2} and hub.version == version + 1
        with pytest.raises(StreamError, match=r"^hello\.name: .*maximum of 2 subscribers"):
            StreamSubscriber(hub.endpoint, "m3", ["a"], hello_timeout_s=5)
    assert hub.stats()["_errors"] == 3


# ---- 4. fuzzing ----------------------------------------------------------------------------------------------------

FIELD_ROOTS = ("message", "op", "hello", "ack", "ping", "bye", "stats")
VALID_HELLO = {"op": "hello", "v": 1, "name": "fuzz", "streams": ["a"], "policy": "drop", "max_pending": 8,
               "max_delay_ms": 5.0, "window": 4, "resume": {"a": 0}, "declare": None}
VALID_ACK = {"op": "ack", "stream": "a", "seq": 3}
# Cheap to draw (the budget is >= 2000 examples in seconds), with the edges that matter: huge ints, NaN, names one
# past the 128-char bound, long strings, binary, nesting.
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=16), st.binary(max_size=16),
                    st.sampled_from(["a", "drop", "block", "spill", "hello", "x" * 128, "x" * 129, "é" * 3000]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=8)
keys = st.one_of(st.sampled_from(sorted(VALID_HELLO) + ["seq", "stream", "extra"]), st.text(max_size=12))


def mutate(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    edits = st.lists(st.tuples(st.sampled_from(["set", "delete"]), keys, values), min_size=1, max_size=3)

    def apply(changes: list[tuple[str, str, Any]]) -> dict[str, Any]:
        body = dict(base)
        for kind, key, value in changes:
            if kind == "set":
                body[key] = value
            else:
                body.pop(key, None)
        return body

    return edits.map(apply)


def encodable(body: Any) -> bytes:
    try:
        return msgspec.msgpack.encode(body)
    except (OverflowError, TypeError):
        assume(False)
        raise


client_frames = st.one_of(
    st.binary(max_size=256),
    st.builds(encodable, values),
    st.builds(encodable, st.dictionaries(keys, values, max_size=8)),
    st.builds(encodable, st.one_of(mutate(VALID_HELLO), mutate(VALID_ACK), mutate({"op": "ping"}))),
)


def check_decode(frame: bytes) -> Any:
    try:
        msg = decode_client(frame)
    except WireError as exc:
        assert str(exc).startswith(f"{exc.field}: ") and exc.field.split(".")[0].split("[")[0] in FIELD_ROOTS, exc
        return None
    if isinstance(msg, Hello):
        assert 1 <= msg.max_pending and 1 <= msg.window and 0 <= msg.max_delay_ms and 1 <= len(msg.streams) <= 64
        assert msg.policy in ("drop", "block", "spill") and all(len(s) <= 128 for s in msg.streams)
    if isinstance(msg, StreamAck):
        assert msg.seq >= 0 and isinstance(msg.stream, str)
    assert decode_client(encode_client(msg)) == msg  # what decodes, re-encodes to itself
    return msg


@settings(max_examples=1200, deadline=None)
@given(client_frames)
def test_fuzz_decode_client(frame: bytes) -> None:
    check_decode(frame)


@settings(max_examples=900, deadline=None)
@given(mutate(VALID_HELLO))
def test_fuzz_decode_mutated_hello(body: dict[str, Any]) -> None:
    check_decode(encodable(body))


def test_decode_client_error_fields() -> None:
    cases = {b"\xc1": "message: not valid msgpack", msgspec.msgpack.encode([1]): "message: expected a map",
             msgspec.msgpack.encode({"op": "nope"}): "op: unknown operation",
             msgspec.msgpack.encode({**VALID_HELLO, "max_pending": 0}): "hello.max_pending: must be >= 1",
             msgspec.msgpack.encode({**VALID_HELLO, "name": "x" * 129}): "hello.name: ",
             msgspec.msgpack.encode({**VALID_HELLO, "streams": ["s"] * 65}): "hello.streams: ",
             msgspec.msgpack.encode({**VALID_HELLO, "window": True}): "hello.window: expected an integer",
             msgspec.msgpack.encode({**VALID_ACK, "seq": -1}): "ack.seq: must be >= 0",
             msgspec.msgpack.encode({"op": "ping", "x": 1}): "ping.x: unknown field"}
    for frame, prefix in cases.items():
        with pytest.raises(WireError) as info:
            decode_client(frame)
        assert str(info.value).startswith(prefix), (str(info.value), prefix)


def test_live_fuzz_hub_keeps_serving(hubs: Callable[..., StreamHub]) -> None:
    hub = hubs()
    ctx = zmq.Context()
    evil = ctx.socket(zmq.DEALER)
    evil.setsockopt(zmq.LINGER, 0)
    evil.connect(hub.endpoint)
    seq = 0
    try:
        with StreamSubscriber(hub.endpoint, "good", ["a"]) as good:

            @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
            @given(st.lists(client_frames, min_size=1, max_size=3))
            def attack(frames: list[bytes]) -> None:
                nonlocal seq
                # whatever it sends (a block hello, a hello as "good"), it can neither stall publishing nor take
                # over "good"
                evil.send_multipart(frames)
                meta, arrays = message(seq)
                assert hub.publish("a", meta, arrays) == seq
                frame = good.recv(5.0)
                assert frame is not None and frame.seq == seq
                check_payload(frame)
                seq += 1

            attack()
            assert good.recv(0.2) is None
            good.ack()
            wait_until(lambda: counters(hub.stats(), "good")["delivered"] == seq, what="acks")
        stats = hub.stats()
        assert stats["_errors"] > 0
        assert_identity(stats)
    finally:
        evil.close()
        ctx.term()


# ---- 5. security ---------------------------------------------------------------------------------------------------


def test_check_endpoint() -> None:
    for bad in ("tcp://0.0.0.0:5555", "tcp://10.1.2.3:1", "tcp://*:1", "tcp://example.com:80"):
        with pytest.raises(ValueError, match=r"^monitor\.endpoint: .*beyond loopback"):
            check_endpoint(bad, curve=False, field="monitor.endpoint")
        check_endpoint(bad, curve=True)
    # loopback TCP is open to every local user: it needs CURVE like any other host (ipc is the same-user channel)
    for loopback in ("tcp://127.0.0.1:5555", "tcp://localhost:0", "tcp://[::1]:7"):
        with pytest.raises(ValueError, match=r"^monitor\.command_endpoint: .*on loopback.*ipc://.*CURVE"):
            check_endpoint(loopback, curve=False, field="monitor.command_endpoint")
        check_endpoint(loopback, curve=True)
    check_endpoint("ipc:///tmp/x/streams", curve=False)
    for bad in ("inproc://x", "udp://127.0.0.1:1", "tcp://127.0.0.1", "ipc://", "tcp://127.0.0.1:70000",
                "ipc://@abstract"):
        with pytest.raises(ValueError, match=r"^endpoint: "):
            check_endpoint(bad, curve=False)


def test_ipc_permissions(ipc_dir: Path) -> None:
    sockdir = ipc_dir / "new"
    hub = StreamHub(f"ipc://{sockdir}/s")
    try:
        assert stat.S_IMODE(os.stat(sockdir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(sockdir / "s").st_mode) == 0o600
    finally:
        hub.close()
    shared = ipc_dir / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match=r"^endpoint: .*writable by group or others"):
        StreamHub(f"ipc://{shared}/s")


def test_curve_round_trip_and_allowlist() -> None:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    intruder_public, intruder_secret = zmq.curve_keypair()
    keys = CurveKeys(server_secret=server_secret.decode(), server_public=server_public.decode(),
                     client_public_keys=(client_public.decode(),))
    with pytest.raises(ValueError):
        CurveKeys(server_secret="short", server_public=server_public.decode(), client_public_keys=())
    with StreamHub("tcp://127.0.0.1:0", curve=keys) as hub:
        hub.declare("a")
        assert hub.endpoint.startswith("tcp://127.0.0.1:") and not hub.endpoint.endswith(":0")
        with StreamSubscriber(hub.endpoint, "ok", ["a"], curve_server_public=server_public.decode(),
                              curve_client_secret=client_secret.decode(),
                              curve_client_public=client_public.decode()) as sub:
            for seq in range(5):
                hub.publish("a", *message(seq))
            frames = [sub.recv(5.0) for _ in range(5)]
            assert [f.seq for f in frames if f is not None] == list(range(5))
            check_payload(frames[0])
        with pytest.raises(TimeoutError):
            StreamSubscriber(hub.endpoint, "intruder", ["a"], curve_server_public=server_public.decode(),
                             curve_client_secret=intruder_secret.decode(),
                             curve_client_public=intruder_public.decode(), hello_timeout_s=1.0)
        # A plain (unencrypted) client gets nothing either, stats included.
        ctx = zmq.Context()
        plain = ctx.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(hub.endpoint)
        plain.send(encode_client(Hello(name="plain", streams=("a",))))
        hub.publish("a", *message(5))
        assert plain.poll(500) == 0
        plain.close()
        ctx.term()
        assert "intruder" not in hub.stats()["a"]["subscribers"]


# ---- 6. spill ring -------------------------------------------------------------------------------------------------

ring_ops = st.lists(st.one_of(st.tuples(st.just("push"), st.lists(st.binary(max_size=120), max_size=4)),
                              st.just(("pop", None))), max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ring_ops)
def test_spill_ring_matches_a_deque(tmp_path: Path, ops: list[tuple[str, Any]]) -> None:
    directory = Path(tempfile.mkdtemp(dir=tmp_path)) / "ring"
    ring, seq = SpillRing(directory, max_bytes=600, segment_bytes=200), 0
    model: deque[tuple[int, list[bytes], int]] = deque()
    for op, frames in ops:
        if op == "push":
            size = 12 + 8 * len(frames) + sum(map(len, frames))
            fits = sum(s for _, _, s in model) + size <= 600
            assert ring.push(seq, frames) is fits
            if fits:
                model.append((seq, frames, size))
            seq += 1
        elif model:
            want_seq, want_frames, _ = model.popleft()
            got = ring.peek()
            assert got is not None and got[0] == want_seq and [bytes(f) for f in got[1]] == want_frames
            ring.pop()
        assert len(ring) == len(model) and ring.nbytes == sum(s for _, _, s in model)
        assert ring.head_seq == (model[0][0] if model else None)
        files = list(directory.iterdir())
        if not model:
            assert not files, "an empty ring keeps no file"
        else:  # consumed segments are gone: every file but the one being written holds a queued record
            assert len(files) <= len({e.segment for e in ring._index}) + 1
    ring.close()
    assert not directory.exists()


@pytest.mark.timeout(30)  # a scrape that waited out the 60 s timeout for a closed hub fails here
def test_metrics_scrape_skips_closed_hubs_and_asks_live_ones_at_once(ipc_dir: Path) -> None:
    """A process that made several engines scrapes each live hub once and never waits for a closed one (a closed
    hub removes its socket file; the file of a later server bound at the same path is left alone)."""
    from dynsteer.streams.metrics import StreamMetricsCollector

    live, gone = StreamHub(f"ipc://{ipc_dir}/live"), StreamHub(f"ipc://{ipc_dir}/gone")
    live.declare("a", {})
    gone_path = ipc_dir / "gone"
    assert gone_path.exists()
    gone.close()
    assert not gone_path.exists()
    try:
        answers = StreamMetricsCollector(timeout_ms=60_000).query_all([gone.endpoint, live.endpoint])
        assert answers[gone.endpoint] is None and "a" in answers[live.endpoint]
    finally:
        live.close()
    # a closed binding leaves another server's socket at the same path alone
    again = StreamHub(f"ipc://{ipc_dir}/gone")
    try:
        gone._binding.close()  # the old hub's binding, closed twice
        assert gone_path.exists()
    finally:
        again.close()
