"""Async-tier transport throughput: a StreamHub publishing as fast as it can to one subscriber in another process.

Per policy (``drop`` with a generous ``max_pending``, then ``spill``) the publisher sends messages of ``--rows`` rows
of ``--hidden`` values (float32, or bfloat16 bits as uint16) plus a small int64 index array for ``--seconds``; the
subscriber process counts what it received (bytes of the arrays it got, frames, seq gaps) between its first and last
frame. Throughput is what arrived at the receiver, not what was published; the hub's drop and spill counters say
where the rest went.

    python benchmarks/stream_throughput.py --seconds 5 --out benchmarks/results/stream_throughput.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

RECEIVER = """
import json, sys, time
from dynsteer.monitor.subscriber import StreamSubscriber
endpoint, name, policy, max_pending, window, idle_s = sys.argv[1:7]
sub = StreamSubscriber(endpoint, name, ["bench"], policy=policy, max_pending=int(max_pending), window=int(window))
print("ready", flush=True)
frames = nbytes = gaps = 0
first = last = None
expect = None
while True:
    frame = sub.recv(float(idle_s) if frames else 120.0)
    if frame is None:
        break
    now = time.perf_counter()
    first = now if first is None else first
    last = now
    frames += 1
    nbytes += sum(a.nbytes for a in frame.arrays)
    if expect is not None and frame.seq != expect:
        gaps += 1
    expect = frame.seq + 1
sub.close(bye=False)  # the hub keeps its counters for the report
print(json.dumps({"frames": frames, "bytes": nbytes, "gaps": gaps, "seconds": (last - first) if frames > 1 else 0.0}))
"""


def run_policy(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    from dynsteer.streams.hub import StreamHub
    from dynsteer.transport.security import default_endpoint

    endpoint = args.endpoint or default_endpoint(f"bench-{policy}")
    spill_dir = tempfile.mkdtemp(prefix="dynsteer-bench-spill-")
    hub = StreamHub(endpoint, spill_dir=spill_dir, spill_bytes=args.spill_bytes)
    hub.declare("bench", {"rows": args.rows, "hidden": args.hidden, "dtype": args.dtype})
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, hub.endpoint, f"bench-{policy}", policy,
                                 str(args.max_pending), str(args.window), "2.0"],
                                stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert receiver.stdout is not None
        if receiver.stdout.readline().strip() != "ready":
            raise RuntimeError("the receiver did not start")
        rng = np.random.default_rng(0)
        dtype = np.float32 if args.dtype == "float32" else np.uint16
        # A pool of distinct arrays, never mutated (the hub keeps them by reference, as the engine's would be).
        pool = [(rng.standard_normal((args.rows, args.hidden)).astype(np.float32).view(np.int32) >> 16)
                .astype(dtype) if dtype == np.uint16 else rng.standard_normal((args.rows, args.hidden)).astype(dtype)
                for _ in range(16)]
        index = np.arange(args.rows, dtype=np.int64)
        latencies, published, t0 = [], 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            t = time.perf_counter()
            hub.publish("bench", {"step": published, "req_ids": ["bench"]}, [index, pool[published % len(pool)]])
            latencies.append(time.perf_counter() - t)
            published += 1
            if args.rate:
                time.sleep(max(0.0, published / args.rate - (time.perf_counter() - t0)))
        publish_s = time.perf_counter() - t0
        out, _ = receiver.communicate(timeout=args.seconds * 10 + 120)
        got = json.loads(out.strip().splitlines()[-1])
        counters = hub.stats()["bench"]["subscribers"].get(f"bench-{policy}", {})
    finally:
        if receiver.poll() is None:
            receiver.kill()
        hub.close()
    message_bytes = index.nbytes + pool[0].nbytes
    lat = np.asarray(latencies) * 1e6
    return {"policy": policy, "message_bytes": message_bytes, "published": published,
            "published_per_s": published / publish_s, "publish_us_p50": float(np.percentile(lat, 50)),
            "publish_us_p99": float(np.percentile(lat, 99)), "publish_us_max": float(lat.max()),
            "received_frames": got["frames"], "received_bytes": got["bytes"], "receive_seconds": got["seconds"],
            "received_gb_per_s": got["bytes"] / got["seconds"] / 1e9 if got["seconds"] else 0.0,
            "received_frames_per_s": got["frames"] / got["seconds"] if got["seconds"] else 0.0,
            "seq_gaps": got["gaps"], "dropped_total": counters.get("dropped_total"),
            "spilled_total": counters.get("spilled_total")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", default=None, help="where the hub listens (default: a private ipc socket)")
    parser.add_argument("--seconds", type=float, default=5.0, help="publishing time per policy")
    parser.add_argument("--rows", type=int, default=64, help="tokens per message")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="bfloat16 travels as its uint16 bits")
    parser.add_argument("--policies", default="drop,spill")
    parser.add_argument("--max-pending", type=int, default=4096)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--spill-bytes", type=int, default=2 << 30)
    parser.add_argument("--rate", type=float, default=0.0, help="messages/s to publish (0: as fast as possible)")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    results = [run_policy(p, args) for p in args.policies.split(",")]
    report = {"args": vars(args), "host": platform.node(), "python": platform.python_version(), "results": results}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    for r in results:
        print(f"{r['policy']}: received {r['received_gb_per_s']:.2f} GB/s, {r['received_frames_per_s']:.0f} frames/s "
              f"({r['message_bytes'] / 1e6:.2f} MB each); published {r['published_per_s']:.0f}/s, "
              f"publish p99 {r['publish_us_p99']:.0f} us; dropped {r['dropped_total']}, "
              f"spilled {r['spilled_total']}, gaps seen {r['seq_gaps']}")


if __name__ == "__main__":
    main()
