"""Decode-step time on a real engine while stream subscribers misbehave (in-process CPU engine, tiny Llama).

Two streams (layers 0 and 1, every generated token of every request) go to an acking subscriber throughout. Three
phases, each ``--calls`` generate calls of ``--batch`` prompts and ``--tokens`` tokens, timing every engine step
(the first step of a call, its prefill, and its last are left out):

* ``baseline``: only the acking subscriber.
* ``never_acking_block``: a subscriber on the operator's ``block_subscribers`` list joins both streams with
  ``policy="block"``, ``max_pending=1`` and ``max_delay_ms`` equal to the operator's cap, and pings without ever
  acking. The hub waits for it at most once, in one step, for at most the cap (both streams together); the delay of
  a step is its time less the baseline's median.
* ``after_refused_declares``: ``--declares`` hellos declaring one new stream each (``allow_declare`` is off) have
  been refused; the hub's streams and ``version`` are unchanged and steps run as in the baseline.

Each phase also reports, per engine step, the time spent in ``StreamHub.publish`` (both streams together: what the
hub itself adds to the step, block waits included) and the CPU time of the hub's I/O thread. On a shared machine
single steps stall for reasons of their own: the step times' max is noise-prone, the publish times are not.

    .venv/bin/python benchmarks/hostile_hub.py --out benchmarks/results/hostile_hub-cpu-<date>.json
"""

from __future__ import annotations

import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its steps are what we time
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import datetime as dt
import json
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

STREAMS = {"resid0": "0.post_block", "resid1": "1.post_block"}
STALL = "stall"


class Acker(threading.Thread):
    """A well-behaved monitor: receives every frame of both streams and acks as it goes."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.frames, self.stop = endpoint, 0, threading.Event()
        self.ready = threading.Event()

    def run(self) -> None:
        from dynsteer.monitor.subscriber import StreamSubscriber

        with StreamSubscriber(self.endpoint, "acker", list(STREAMS), policy="drop", max_pending=1 << 16) as sub:
            self.ready.set()
            while not self.stop.is_set():
                if sub.recv(0.05) is not None:
                    self.frames += 1


class Stall(threading.Thread):
    """A block subscriber that pings and never acks (its socket lives on this thread)."""

    def __init__(self, endpoint: str, cap_ms: float) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.cap_ms = endpoint, cap_ms
        self.welcome: dict[str, Any] = {}
        self.ready, self.stop = threading.Event(), threading.Event()

    def run(self) -> None:
        from dynsteer.transport.wire import Bye, Hello, Ping, encode_client

        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        sock.send(encode_client(Hello(name=STALL, streams=tuple(STREAMS), policy="block", max_pending=1, window=1,
                                      max_delay_ms=self.cap_ms)))
        self.welcome = _reply(sock)
        self.ready.set()
        while not self.stop.wait(0.5):
            sock.send(encode_client(Ping()))
            while sock.poll(0):
                sock.recv_multipart()  # frames: read, never acked
        sock.send(encode_client(Bye()))
        time.sleep(0.1)
        sock.close(0)
        ctx.term()


def _reply(sock: zmq.Socket, timeout_s: float = 10.0) -> dict[str, Any]:
    """The hub's next welcome, error or stats reply (data frames skipped)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0 and sock.poll(int(left * 1000) + 1):
        header = msgspec.msgpack.decode(sock.recv_multipart()[0])
        if header.get("op") in ("welcome", "error", "stats"):
            return header
    raise TimeoutError("no reply from the stream hub")


def hub_stats(endpoint: str) -> dict[str, Any]:
    """``StreamHub.stats()`` over the wire (any connection may ask)."""
    from dynsteer.transport.wire import StatsRequest, encode_client

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(encode_client(StatsRequest()))
        return _reply(sock)["stats"]
    finally:
        sock.close(0)
        ctx.term()


def refused_declares(endpoint: str, count: int) -> dict[str, int]:
    """Send ``count`` hellos each declaring a new stream; the hub's replies by field (``welcome`` if accepted)."""
    from dynsteer.transport.wire import Hello, encode_client

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    replies: dict[str, int] = {}
    try:
        for i in range(count):
            name = f"decl{i}"
            sock.send(encode_client(Hello(name=f"intruder{i % 4}", streams=(name,),
                                          declare={name: {"places": ["1.post_block"]}})))
            reply = _reply(sock)
            key = reply["op"] if reply["op"] != "error" else reply["field"]
            replies[key] = replies.get(key, 0) + 1
    finally:
        sock.close(0)
        ctx.term()
    return replies


def thread_cpu_ms(thread: threading.Thread) -> float | None:
    """CPU time a thread of this process has used (Linux), in ms."""
    try:
        fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")  # utime + stime


def summary(ms: list[float], base_median: float | None = None) -> dict[str, Any]:
    ordered = sorted(ms)
    out = {"steps": len(ms), "median_ms": round(statistics.median(ms), 3),
           "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 3), "max_ms": round(max(ms), 3)}
    if base_median is not None:
        out["median_delay_ms"] = round(out["median_ms"] - base_median, 3)
        out["max_delay_ms"] = round(out["max_ms"] - base_median, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--batch", type=int, default=4, help="prompts per generate call")
    parser.add_argument("--tokens", type=int, default=48, help="tokens generated per prompt")
    parser.add_argument("--calls", type=int, default=5, help="generate calls per phase")
    parser.add_argument("--cap-ms", type=float, default=50.0, help="MonitorConfig.max_block_delay_ms")
    parser.add_argument("--declares", type=int, default=256, help="declare attempts before the last phase")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from dynsteer.config import DynsteerConfig, MonitorConfig, StreamSpec
    from dynsteer.engine import build
    from dynsteer.testing.tiny_models import tiny_model

    mon = MonitorConfig.private(streams={name: StreamSpec(places=(place,)) for name, place in STREAMS.items()},
                                block_subscribers=(STALL,), max_block_delay_ms=args.cap_ms)
    cfg = DynsteerConfig(capture_sites=("post_block",), capture_layers=(0, 1), monitor=mon)
    llm = LLM(model=str(tiny_model("llama")), dtype="float32", enforce_eager=True, max_model_len=256,
              max_num_seqs=args.batch, seed=0, kv_cache_memory_bytes=256 << 20, **cfg.engine_kwargs())
    engine = llm.llm_engine
    step_times: list[float] = []
    plain_step = engine.step

    def timed_step() -> Any:
        t0 = time.perf_counter()
        out = plain_step()
        step_times.append(time.perf_counter() - t0)
        return out

    engine.step = timed_step
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    prompts = [f"prompt number {i} about streams" for i in range(args.batch)]

    io_cpu: list[float | None] = []
    publish_ms: dict[int, float] = {}

    def phase() -> list[float]:
        ms, cpu0 = [], thread_cpu_ms(hub._thread)
        publish_ms.clear()
        for _ in range(args.calls):
            step_times.clear()
            llm.generate(prompts, params, use_tqdm=False)
            ms += [t * 1000 for t in step_times[1:-1]]
        cpu1 = thread_cpu_ms(hub._thread)
        io_cpu.append(None if cpu0 is None or cpu1 is None else round(cpu1 - cpu0, 1))
        return ms

    def report(ms: list[float], base_median: float | None = None) -> dict[str, Any]:
        per_step = sorted(publish_ms.values())
        return {**summary(ms, base_median), "hub_io_cpu_ms": io_cpu[-1],
                "publish_ms_per_step": {"steps": len(per_step), "median": round(statistics.median(per_step), 3),
                                        "max": round(per_step[-1], 3),
                                        "over_half_cap": sum(t > args.cap_ms / 2 for t in per_step)}}

    acker = Acker(mon.endpoint)
    acker.start()
    if not acker.ready.wait(30):
        raise SystemExit("the acking subscriber did not connect")
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    # the worker's hub, in this process (built with the runtime; vLLM's gc.freeze() hides it from gc.get_objects)
    hub = next(rt.hub for rt in build._building.values() if rt.hub is not None)
    plain_publish = hub.publish

    def timed_publish(stream: str, meta: dict[str, Any], arrays: Any) -> int:
        t0 = time.perf_counter()
        try:
            return plain_publish(stream, meta, arrays)
        finally:
            publish_ms[meta["step"]] = publish_ms.get(meta["step"], 0.0) + (time.perf_counter() - t0) * 1000

    hub.publish = timed_publish  # type: ignore[method-assign]  # the runtime looks it up on each call
    results: dict[str, Any] = {}
    base = phase()
    results["baseline"] = report(base)
    base_median = results["baseline"]["median_ms"]

    stall = Stall(mon.endpoint, args.cap_ms)
    stall.start()
    if not stall.ready.wait(30) or stall.welcome.get("op") != "welcome":
        raise SystemExit(f"the stalling subscriber was not welcomed: {stall.welcome}")
    blocked = phase()
    stats = hub_stats(mon.endpoint)
    results["never_acking_block"] = {
        **report(blocked, base_median),
        "steps_delayed_over_half_cap": sum(t - base_median > args.cap_ms / 2 for t in blocked),
        "hub": {name: {k: stats[name]["subscribers"][STALL][k]
                       for k in ("block_waits", "block_timeouts", "blocked_ms_max", "overdue", "dropped")}
                for name in STREAMS}}
    stall.stop.set()
    stall.join(10)

    streams_before = sorted(k for k in hub_stats(mon.endpoint) if not k.startswith("_"))
    version_before = hub.version
    replies = refused_declares(mon.endpoint, args.declares)
    version_after = hub.version
    stats = hub_stats(mon.endpoint)
    streams_after = sorted(k for k in stats if not k.startswith("_"))
    after = phase()
    results["after_refused_declares"] = {**report(after, base_median), "replies": replies,
                                         "streams_before": streams_before, "streams_after": streams_after,
                                         "version_before": version_before, "version_after": version_after,
                                         "hub_errors": stats["_errors"]}
    acker.stop.set()
    acker.join(10)

    print(f"{'':<24}{'------------ step time -------------':>50}{'-- publish per step --':>24}")
    print(f"{'phase':<24}{'steps':>7}{'median ms':>11}{'p90 ms':>9}{'max ms':>9}{'max delay ms':>14}"
          f"{'median ms':>11}{'max ms':>9}{'hub I/O cpu ms':>16}")
    for name, r in results.items():
        delay, cpu, pub = r.get("max_delay_ms"), r["hub_io_cpu_ms"], r["publish_ms_per_step"]
        print(f"{name:<24}{r['steps']:>7}{r['median_ms']:>11.2f}{r['p90_ms']:>9.2f}{r['max_ms']:>9.2f}"
              f"{'' if delay is None else f'{delay:.2f}':>14}{pub['median']:>11.3f}{pub['max']:>9.2f}"
              f"{'' if cpu is None else f'{cpu:.0f}':>16}")
    nb = results["never_acking_block"]
    print(f"never-acking block subscriber, cap {args.cap_ms:g} ms: publish took more than half the cap in "
          f"{nb['publish_ms_per_step']['over_half_cap']} step(s) (step time: {nb['steps_delayed_over_half_cap']}); "
          f"hub per stream: {nb['hub']}")
    ad = results["after_refused_declares"]
    print(f"{args.declares} declare attempts: replies {ad['replies']}; streams {ad['streams_before']} -> "
          f"{ad['streams_after']}; hub.version {ad['version_before']} -> {ad['version_after']}")
    meta = {"date": dt.date.today().isoformat(), "host": platform.node(), "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(), "args": vars(args), "acker_frames": acker.frames}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
