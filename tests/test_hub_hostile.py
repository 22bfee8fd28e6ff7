"""The stream hub against hostile or broken subscribers (architecture §10: a monitor is a peer, not the operator).

A monitor must not delay a step beyond the operator's cap, take another monitor's name, exhaust subscriber slots or
streams, or make the hub hold unbounded memory or disk. Each test drives a raw connection that sends exactly what an
attacker would, and checks counters, ``stats()`` and ``hub.version`` rather than timings wherever it can.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from dynsteer.monitor.subscriber import StreamError, StreamSubscriber
from dynsteer.transport.wire import Bye, Hello, Ping, StreamAck, encode_client
from dynsteer.streams.hub import StreamHub
from dynsteer.transport.security import CurveKeys, connect_curve
from tests.test_stream_transport import assert_identity, counters, message, wait_until

MSG_BYTES = 4096  # what one message of big() carries


@pytest.fixture
def ipc_dir(tmp_path: Path) -> Iterator[Path]:
    if len(str(tmp_path)) < 80:
        yield tmp_path
        return
    short = Path(tempfile.mkdtemp(prefix="dsh-"))
    yield short
    for f in short.iterdir():
        f.unlink()
    short.rmdir()


@pytest.fixture
def hubs(ipc_dir: Path) -> Iterator[Callable[..., StreamHub]]:
    """Makes hubs on ipc endpoints (stream ``a`` declared by the engine) and closes them all at the end."""
    made: list[StreamHub] = []

    def make(**kwargs: Any) -> StreamHub:
        hub = StreamHub(f"ipc://{ipc_dir}/hub{len(made)}", **{"heartbeat_s": 5.0, **kwargs})
        hub.declare("a", {"kind": "test"})
        made.append(hub)
        return hub

    yield make
    for hub in made:
        hub.close()


class Peer:
    """A hand-driven connection: it sends exactly what the test says and never acks on its own."""

    def __init__(self, endpoint: str, curve: tuple[str, str, str] | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            connect_curve(self.sock, *curve)
        self.sock.connect(endpoint)
        self.frames = 0

    def hello(self, name: str, streams: tuple[str, ...] = ("a",), **fields: Any) -> dict[str, Any]:
        """Say hello; return the hub's welcome or error."""
        self.sock.send(encode_client(Hello(name=name, streams=streams, **fields)))
        return self.reply()

    def send(self, msg: Any) -> None:
        self.sock.send(encode_client(msg))

    def reply(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The next welcome or error (data frames and pings on the way are counted and skipped)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and self.sock.poll(int(left * 1000) + 1):
            header = msgspec.msgpack.decode(self.sock.recv_multipart()[0])
            if header.get("op") in ("welcome", "error"):
                return header
            self.frames += header.get("op") == "frame"
        raise AssertionError("no reply from the hub")

    def count_frames(self, quiet_s: float = 0.3) -> int:
        while self.sock.poll(int(quiet_s * 1000)):
            header = msgspec.msgpack.decode(self.sock.recv_multipart()[0])
            self.frames += header.get("op") == "frame"
        return self.frames

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def peers() -> Iterator[Callable[..., Peer]]:
    made: list[Peer] = []

    def make(endpoint: str, curve: tuple[str, str, str] | None = None) -> Peer:
        made.append(Peer(endpoint, curve))
        return made[-1]

    yield make
    for peer in made:
        peer.close()


def refused(reply: dict[str, Any], field: str) -> str:
    assert reply.get("op") == "error" and reply.get("field") == field, reply
    return str(reply["message"])


def big(seq: int, step: int | None = None) -> tuple[dict[str, Any], list[np.ndarray]]:
    return {"step": seq if step is None else step}, [np.full(MSG_BYTES // 4, seq, np.float32)]


def registered(hub: StreamHub, stream: str = "a") -> set[str]:
    return set(hub.stats()[stream]["subscribers"])


# ---- block: the operator's cap, per step ---------------------------------------------------------------------------


def test_block_needs_the_operator_and_stays_under_the_cap(hubs: Callable[..., StreamHub],
                                                           peers: Callable[..., Peer]) -> None:
    hub = hubs(block_subscribers=("trusted",), max_block_delay_ms=50.0)
    peer = peers(hub.endpoint)
    # The attack: any monitor asking to hold every step for up to a minute.
    assert "block_subscribers" in refused(peer.hello("mallory", policy="block", max_delay_ms=60_000.0),
                                          "hello.policy")
    assert "max_block_delay_ms" in refused(peer.hello("trusted", policy="block", max_delay_ms=60_000.0),
                                           "hello.max_delay_ms")
    assert "50" in refused(peer.hello("trusted", policy="block", max_delay_ms=50.5), "hello.max_delay_ms")
    assert registered(hub) == set() and hub.stats()["_errors"] == 3
    assert peer.hello("trusted", policy="block", max_delay_ms=50.0)["op"] == "welcome"
    assert peer.hello("trusted", policy="drop", max_delay_ms=60_000.0)["op"] == "welcome"  # no wait: no cap


def test_a_never_acking_block_subscriber_delays_one_step_at_most_the_cap(hubs: Callable[..., StreamHub],
                                                                          peers: Callable[..., Peer]) -> None:
    cap_ms = 50.0
    hub = hubs(block_subscribers=("stall",), max_block_delay_ms=cap_ms)
    streams = ("a", "b", "c", "d")
    for name in streams[1:]:
        hub.declare(name)
    stall = peers(hub.endpoint)
    assert stall.hello("stall", streams, policy="block", max_pending=1, window=1, max_delay_ms=cap_ms)["op"] == \
        "welcome"
    for step in range(6):
        for name in streams:  # one message per stream and step, as the engine publishes
            hub.publish(name, *big(step))
        stall.send(Ping())  # alive, never acking
    stats = hub.stats()
    for name in streams:
        assert_identity({name: stats[name]})
    per_stream = [counters(stats, "stall", name) for name in streams]
    # Step 0 fills it; step 1's first publish waits until the step's deadline (its start plus the cap: a wait ends
    # only there or with room), and from then on it is overdue: no publish waits for it again, in this step's other
    # streams or in later steps. So the whole run waited once, one cap. (Wall-clock bounds: benchmarks/hostile_hub.)
    assert [c["block_waits"] for c in per_stream] == [1, 0, 0, 0]
    assert [c["block_timeouts"] for c in per_stream] == [1, 0, 0, 0]
    assert all(c["overdue"] for c in per_stream)
    assert per_stream[0]["blocked_ms_max"] >= cap_ms * 0.99


def test_block_deadline_is_shared_by_the_steps_streams(hubs: Callable[..., StreamHub],
                                                       peers: Callable[..., Peer]) -> None:
    hub = hubs(block_subscribers=("b1", "b2"), max_block_delay_ms=40.0)
    hub.declare("b")
    one, two = peers(hub.endpoint), peers(hub.endpoint)
    assert one.hello("b1", ("a",), policy="block", max_pending=1, window=1, max_delay_ms=40.0)["op"] == "welcome"
    assert two.hello("b2", ("b",), policy="block", max_pending=1, window=1, max_delay_ms=40.0)["op"] == "welcome"
    for name in ("a", "b"):
        hub.publish(name, *big(0))  # both full now
    hub.publish("a", *big(1))  # waits for b1 until the step's deadline
    hub.publish("b", *big(1))  # same step: its deadline has passed, so b2 is not waited for
    stats = hub.stats()
    one_c, two_c = counters(stats, "b1", "a"), counters(stats, "b2", "b")
    assert (one_c["block_waits"], two_c["block_waits"]) == (1, 0)
    assert (one_c["block_timeouts"], two_c["block_timeouts"]) == (1, 1)


def test_an_overdue_subscriber_is_waited_for_again_only_after_progress(hubs: Callable[..., StreamHub],
                                                                       peers: Callable[..., Peer]) -> None:
    hub = hubs(block_subscribers=("slow",), max_block_delay_ms=30.0)
    peer = peers(hub.endpoint)
    assert peer.hello("slow", policy="block", max_pending=1, window=1, max_delay_ms=30.0)["op"] == "welcome"
    hub.publish("a", *big(0))
    hub.publish("a", *big(1))  # times out: overdue
    assert counters(hub.stats(), "slow")["block_waits"] == 1
    # Saying bye and hello again does not make it punctual.
    peer.send(Bye())
    wait_until(lambda: registered(hub) == set(), what="the bye")
    assert peer.hello("slow", policy="block", max_pending=1, window=1, max_delay_ms=30.0)["op"] == "welcome"
    hub.publish("a", *big(2))
    hub.publish("a", *big(3))
    assert counters(hub.stats(), "slow")["block_waits"] == 0
    assert counters(hub.stats(), "slow")["overdue"]
    peer.send(StreamAck("a", 3))  # progress (2 or 3 is in flight, the other dropped)
    wait_until(lambda: not counters(hub.stats(), "slow")["overdue"], what="the ack")
    hub.publish("a", *big(4))
    hub.publish("a", *big(5))  # full again: waited for (and timed out) again
    c = counters(hub.stats(), "slow")
    assert c["overdue"] and c["block_timeouts"] == 1 and c["block_waits"] == 1
    assert_identity(hub.stats())


# ---- names and slots -------------------------------------------------------------------------------------------------


def test_a_held_name_cannot_be_taken(hubs: Callable[..., StreamHub], peers: Callable[..., Peer]) -> None:
    hub = hubs()
    with StreamSubscriber(hub.endpoint, "probe", ["a"]) as real:
        thief = peers(hub.endpoint)
        assert "held by another connection" in refused(thief.hello("probe"), "hello.name")
        # A subscriber retries that refusal until its hello_timeout_s, then gives up.
        with pytest.raises(StreamError, match=r"^hello\.name: held by another connection"):
            StreamSubscriber(hub.endpoint, "probe", ["a"], hello_timeout_s=0.6)
        for seq in range(5):
            hub.publish("a", *message(seq))
        assert [f.seq for f in (real.recv(5.0) for _ in range(5)) if f is not None] == list(range(5))
        assert thief.count_frames() == 0
        assert counters(hub.stats(), "probe")["connected"]


def test_a_name_frees_when_its_holder_is_gone(hubs: Callable[..., StreamHub], peers: Callable[..., Peer]) -> None:
    hub = hubs(heartbeat_s=0.2)
    holder = peers(hub.endpoint)
    assert holder.hello("mon")["op"] == "welcome"
    holder.close()  # gone without a bye: the hub's ping finds the connection closed, the name is free at once
    with StreamSubscriber(hub.endpoint, "mon", ["a"], hello_timeout_s=5) as again:
        hub.publish("a", *message(0))
        frame = again.recv(5.0)
        assert frame is not None and frame.seq == 0
    # A holder that is there but silent frees the name after 3 heartbeats; the new subscriber keeps retrying.
    silent = peers(hub.endpoint)
    t0 = time.monotonic()  # before the hub last heard of it
    assert silent.hello("mon")["op"] == "welcome"
    with StreamSubscriber(hub.endpoint, "mon", ["a"], hello_timeout_s=10) as third:
        assert time.monotonic() - t0 >= 3 * 0.2 - 1e-6
        hub.publish("a", *message(1))
        frame = third.recv(5.0)
        assert frame is not None and frame.seq == 1
    assert silent.count_frames() == 0


def test_one_connection_speaks_for_one_name(hubs: Callable[..., StreamHub], peers: Callable[..., Peer]) -> None:
    hub = hubs(max_subscribers=4)
    flood = peers(hub.endpoint)
    for i in range(64):  # the attack: one connection registering every free name
        assert flood.hello(f"n{i}")["op"] == "welcome"
    assert registered(hub) == {"n63"}
    with StreamSubscriber(hub.endpoint, "real", ["a"]) as real:
        hub.publish("a", *message(0))
        assert real.recv(5.0) is not None
        assert registered(hub) == {"n63", "real"}


def test_slots_go_to_connected_subscribers_first(hubs: Callable[..., StreamHub], peers: Callable[..., Peer]) -> None:
    hub = hubs(max_subscribers=3, heartbeat_s=0.5, subscribers=("m0", "m1", "m2", "m3", "late"))
    crowd = [peers(hub.endpoint) for _ in range(3)]
    for i, peer in enumerate(crowd):
        assert peer.hello(f"m{i}")["op"] == "welcome"

    def m0_gone() -> bool:  # m0 is silent; the others keep pinging
        crowd[1].send(Ping())
        crowd[2].send(Ping())
        return not counters(hub.stats(), "m0")["connected"]

    # A new name takes the slot of the disconnected one.
    wait_until(m0_gone, what="m0's disconnect")
    assert counters(hub.stats(), "m1")["connected"] and counters(hub.stats(), "m2")["connected"]
    assert peers(hub.endpoint).hello("late")["op"] == "welcome"
    assert registered(hub) == {"m1", "m2", "late"}
    # All connected: a further name is refused, and names outside the operator's list always are.
    assert "all connected" in refused(peers(hub.endpoint).hello("m3"), "hello.name")
    assert "MonitorConfig.subscribers" in refused(peers(hub.endpoint).hello("stranger"), "hello.name")
    assert registered(hub) == {"m1", "m2", "late"}


def test_disconnected_subscribers_are_released_after_their_ttl(hubs: Callable[..., StreamHub],
                                                               peers: Callable[..., Peer]) -> None:
    hub = hubs(heartbeat_s=0.1, subscriber_ttl_s=3.0, allow_declare=True)  # room for a stalled test thread
    peer = peers(hub.endpoint)
    assert peer.hello("gone", ("a", "own"), declare={"own": {"k": 1}})["op"] == "welcome"
    version = hub.version
    for seq in range(10):
        hub.publish("a", *message(seq))
    wait_until(lambda: not counters(hub.stats(), "gone")["connected"], what="the disconnect")
    assert registered(hub) == {"gone"}  # kept for a while, for a resume
    wait_until(lambda: registered(hub) == set(), timeout_s=15, what="the release")
    assert "own" not in hub.streams() and hub.version == version + 1


def test_curve_keys_bound_to_names(peers: Callable[..., Peer]) -> None:
    server_public, server_secret = (k.decode() for k in zmq.curve_keypair())
    alice_public, alice_secret = (k.decode() for k in zmq.curve_keypair())
    bob_public, bob_secret = (k.decode() for k in zmq.curve_keypair())
    keys = CurveKeys(server_secret=server_secret, server_public=server_public,
                     client_public_keys=(alice_public, bob_public), client_names={alice_public: ("alice",)})
    with StreamHub("tcp://127.0.0.1:0", curve=keys) as hub:
        hub.declare("a")
        alice = peers(hub.endpoint, (server_public, alice_secret, alice_public))
        bob = peers(hub.endpoint, (server_public, bob_secret, bob_public))
        assert "CurveKeys.client_names" in refused(bob.hello("alice"), "hello.name")
        assert "CurveKeys.client_names" in refused(alice.hello("bob"), "hello.name")
        assert bob.hello("bob")["op"] == "welcome"
        assert alice.hello("alice")["op"] == "welcome"
        assert registered(hub) == {"alice", "bob"}


# ---- declared streams ------------------------------------------------------------------------------------------------


def test_declares_are_refused_by_default_and_change_nothing(hubs: Callable[..., StreamHub],
                                                            peers: Callable[..., Peer]) -> None:
    hub = hubs()
    before, version = hub.streams(), hub.version
    peer = peers(hub.endpoint)
    for i in range(256):
        name = f"s{i}"
        message_ = refused(peer.hello(f"m{i % 3}", (name,), declare={name: {"places": ["1.post_block"]}}),
                           "hello.declare")
        assert "MonitorConfig.allow_declare" in message_
    assert hub.streams() == before and hub.version == version
    assert hub.stats()["_errors"] == 256 and registered(hub) == set()


def test_declared_streams_are_capped_and_removed_when_unwanted(hubs: Callable[..., StreamHub],
                                                               peers: Callable[..., Peer]) -> None:
    hub = hubs(allow_declare=True, max_declared_streams=3)
    hub.declare("engine1")  # the engine's own streams do not count
    peer, other = peers(hub.endpoint), peers(hub.endpoint)
    assert peer.hello("m", ("a", "x0", "x1"), declare={"x0": {}, "x1": {}})["op"] == "welcome"
    assert other.hello("o", ("x1", "x2"), declare={"x1": {}, "x2": {}})["op"] == "welcome"
    before, version = hub.streams(), hub.version
    assert set(before) == {"a", "engine1", "x0", "x1", "x2"}
    # Past the cap: refused, nothing changes (not even m's registration, which this hello would have replaced).
    assert "max_declared_streams" in refused(peer.hello("m", ("x3",), declare={"x3": {}}), "hello.declare['x3']")
    assert refused(peer.hello("m", ("x1",), declare={"x1": {"other": 1}}), "hello.declare['x1']")
    assert refused(peer.hello("m", ("a",), declare={"x9": {}}), "hello.declare['x9']")  # not subscribed
    assert hub.streams() == before and hub.version == version
    assert set(hub.stats()["x0"]["subscribers"]) == {"m"}
    # A stream goes once nobody is registered for it (x1 stays while o wants it).
    peer.send(Bye())
    wait_until(lambda: "x0" not in hub.streams(), what="x0's removal")
    assert set(hub.streams()) == {"a", "engine1", "x1", "x2"} and hub.version == version + 1
    assert other.hello("o", ("x2",))["op"] == "welcome"  # o leaves x1
    assert set(hub.streams()) == {"a", "engine1", "x2"} and hub.version == version + 2
    hub.declare("x2", {})  # the engine takes x2 over: it stays without subscribers
    other.send(Bye())
    wait_until(lambda: registered(hub, "x2") == set(), what="o's bye")
    assert set(hub.streams()) == {"a", "engine1", "x2"}


# ---- memory and disk, in bytes ---------------------------------------------------------------------------------------


def test_spill_total_bytes_bounds_every_ring_together(hubs: Callable[..., StreamHub], peers: Callable[..., Peer],
                                                      tmp_path: Path) -> None:
    total = 10 * MSG_BYTES
    hub = hubs(spill_dir=str(tmp_path / "spill"), spill_bytes=1 << 30, spill_total_bytes=total)
    a, b = peers(hub.endpoint), peers(hub.endpoint)
    for peer, name in ((a, "sa"), (b, "sb")):
        assert peer.hello(name, policy="spill", max_pending=1, window=1)["op"] == "welcome"
    for seq in range(40):
        hub.publish("a", *big(seq))

    def settled() -> bool:
        stats = hub.stats()
        return all(counters(stats, n)["pending"] <= 2 for n in ("sa", "sb"))

    wait_until(settled, what="the spill")
    stats = hub.stats()
    assert_identity(stats)
    spilled = sum(counters(stats, n)["spilled"] for n in ("sa", "sb"))
    assert 0 < spilled * MSG_BYTES <= total
    assert sum(counters(stats, n)["dropped"] for n in ("sa", "sb")) > 0


def test_a_never_acking_subscriber_pins_bounded_bytes(hubs: Callable[..., StreamHub],
                                                      peers: Callable[..., Peer]) -> None:
    budget, replay = 16 * MSG_BYTES, 8
    hub = hubs(replay_messages=replay, max_held_bytes=budget)
    peer = peers(hub.endpoint)
    # Huge max_pending and window: only the byte budget holds it.
    assert peer.hello("hog", policy="drop", max_pending=1 << 24, window=1 << 16)["op"] == "welcome"
    worst = 0
    for seq in range(400):
        hub.publish("a", *big(seq))
        c = counters(hub.stats(), "hog")
        worst = max(worst, c["pending"])
    # What it holds beyond the replay buffer: at most the budget unsent plus the budget in flight (each give or
    # take a message).
    assert worst * MSG_BYTES <= replay * MSG_BYTES + 2 * budget + 2 * MSG_BYTES, worst
    c = counters(hub.stats(), "hog")
    assert c["unsent_bytes"] <= budget and c["inflight_bytes"] <= budget + MSG_BYTES and c["dropped"] > 0
    assert_identity(hub.stats())


def test_in_flight_bytes_are_bounded_whatever_the_window(hubs: Callable[..., StreamHub], peers: Callable[..., Peer],
                                                         tmp_path: Path) -> None:
    budget = 16 * MSG_BYTES
    hub = hubs(replay_messages=4, max_held_bytes=budget, spill_dir=str(tmp_path / "spill"))
    peer = peers(hub.endpoint)
    # Never acking, with a huge window: past the replay buffer its messages go to disk, and the budget bounds what
    # is in flight. Batches smaller than the budget, the disk catching up in between: nothing is dropped.
    assert peer.hello("hog", policy="spill", max_pending=1 << 24, window=1 << 16)["op"] == "welcome"
    for seq in range(200):
        hub.publish("a", *big(seq))
        if seq % 10 == 9:  # at most the replay buffer's 4 left unsent in memory: the rest is on disk
            wait_until(lambda: (c := counters(hub.stats(), "hog"))["pending"] - c["inflight"] <= 4, what="the spill")
    wait_until(lambda: counters(hub.stats(), "hog")["inflight"] >= budget // MSG_BYTES, what="sends")
    time.sleep(0.3)  # room for the hub to send more, if it would
    c = counters(hub.stats(), "hog")
    assert c["inflight"] * MSG_BYTES <= budget + MSG_BYTES, c
    assert c["inflight_bytes"] <= budget + 2 * MSG_BYTES, c
    assert c["spilled"] > 150 and c["dropped"] == 0, c
    assert_identity(hub.stats())
    peer.send(StreamAck("a", 199))  # settles everything, on disk included
    wait_until(lambda: counters(hub.stats(), "hog")["pending"] == 0, what="the ack")
    c = counters(hub.stats(), "hog")
    assert (c["spilled"], c["unsent_bytes"], c["inflight_bytes"], c["delivered"]) == (0, 0, 0, 200)
    assert hub.stats()["_spill_bytes"] == 0


def test_a_stream_removed_during_a_step_is_skipped_quietly_by_the_worker() -> None:
    """A subscriber-declared stream whose last subscriber leaves between planning and publishing is no error; a
    publish that fails for a stream that still exists is counted."""
    from types import SimpleNamespace

    from dynsteer.spec import ModelShape
    from dynsteer.steering.publish import StreamPublisher
    from dynsteer.steering.runtime import SteeringRuntime
    from dynsteer.steering.tables import SteeringTables

    class Hub:
        def __init__(self, streams: dict[str, Any]) -> None:
            self._streams = streams

        def streams(self) -> dict[str, Any]:
            return self._streams

        def publish(self, stream: str, meta: dict[str, Any], arrays: Any) -> int:
            raise ValueError(f"publish: unknown stream {stream!r} (declare it first)")

    rt = SteeringRuntime(ModelShape(num_layers=2, hidden_size=4), SteeringTables([(0, "post_block")], 4, num_rows=2,
                                                                                 max_clamps=0, max_tokens=4))
    sel = SimpleNamespace(name="gone", step=3, req=np.array([0]), req_ids=("r",), places=[(0, "post_block")],
                          positions=np.array([5]), dtype="float32")
    StreamPublisher(Hub({}), rt.stats).publish(sel, {(0, "post_block"): np.zeros((1, 4), np.float32)})
    assert rt.stats.stream_errors == 0
    StreamPublisher(Hub({"gone": {}}), rt.stats).publish(sel, {(0, "post_block"): np.zeros((1, 4), np.float32)})
    assert rt.stats.stream_errors == 1
