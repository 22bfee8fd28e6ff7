"""Host time of capture's per-call hand-over, without a model: from finished requests to the caller's arrays.

A :class:`dynsteer.steering.runtime.SteeringRuntime` (the worker's side, as ``host_step.py`` builds it) captures every
generated token of ``--batch`` requests at one place through a decode of ``--tokens`` steps; the requests finish,
and the hand-over that ``Steerer.take_captures`` runs is timed part by part:

* ``take``: the worker finishes the records (``SteeringRuntime.take_captures``);
* ``pack``: their wire form (``pack_records``: spooled files handed over to the caller's name);
* ``wire``: the reply's msgpack round trip (vLLM's RPC encodes the reply; the caller decodes it);
* ``unpack``: the caller maps and unlinks each file and views its arrays (``unpack_records``).

The spool writer's queue is drained before the take (in an engine it has emptied by the time the call ends).

    .venv/bin/python benchmarks/capture_handover.py --batches 64 256 --hidden 4096 --tokens 64 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dynsteer.capture.result import host_id, pack_records, unpack_records  # noqa: E402
from dynsteer.capture.spec import CaptureSpec  # noqa: E402
from dynsteer.capture.spool import WRITER  # noqa: E402
from dynsteer.request.payload import encode_payload  # noqa: E402
from dynsteer.steering.runtime import BatchView  # noqa: E402
from host_step import build  # noqa: E402

PARTS = ("take", "pack", "wire", "unpack")


def once(batch: int, hidden: int, tokens: int, layers: int, prompt_len: int = 32) -> dict[str, float]:
    """One decode of ``tokens`` steps capturing every generated token, then one timed hand-over (ms per part)."""
    rt = build(layers, hidden, max(512, batch * prompt_len), "cpu", "skip")
    cap = CaptureSpec(layers=(layers // 2,), positions="all_generated")
    live = [f"r{i}" for i in range(batch)]
    payload = {r: encode_payload(capture=cap, tag=f"t{i}") for i, r in enumerate(live)}
    qsl = np.arange(batch + 1, dtype=np.int64) * prompt_len
    rt.plan(BatchView(live, qsl, np.zeros(batch, np.int64), np.full(batch, prompt_len), batch * prompt_len,
                      batch * prompt_len), payload.__getitem__)
    rt.after_forward()
    qsl = np.arange(batch + 1, dtype=np.int64)
    for step in range(tokens - 1):
        computed = np.full(batch, prompt_len + step, np.int64)
        rt.plan(BatchView(list(live), qsl, computed, np.full(batch, prompt_len), batch, batch), payload.__getitem__)
        rt.after_forward()
        rt.take_acts()
    rt.plan(BatchView([], np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), 0, 0),
            payload.__getitem__)
    rt.release(live)
    WRITER.drain()
    tags, host = [f"t{i}" for i in range(batch)], host_id()
    t0 = time.perf_counter()
    records = rt.take_captures(tags)
    t1 = time.perf_counter()
    packed = pack_records(records, host)
    t2 = time.perf_counter()
    reply = msgspec.msgpack.decode(msgspec.msgpack.encode(packed))
    t3 = time.perf_counter()
    captures = unpack_records(reply)
    t4 = time.perf_counter()
    assert len(captures) == batch and all(c.arrays[(layers // 2, "post_block")].shape == (tokens - 1, hidden)
                                          for c in captures), "a capture lost rows"
    return {"take": (t1 - t0) * 1e3, "pack": (t2 - t1) * 1e3, "wire": (t3 - t2) * 1e3, "unpack": (t4 - t3) * 1e3,
            "spooled": float(sum("shm" in next(iter(p["arrays"].values())) for p in packed))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per request (the first is the prefill's)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5, help="hand-overs per batch size; the best is reported")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results: dict[str, dict[str, float]] = {}
    print("| batch | take ms | pack ms | wire ms | unpack ms | total ms | µs per record | spooled records |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in args.batches:
        runs = [once(batch, args.hidden, args.tokens, args.layers) for _ in range(args.repeats)]
        best = {part: min(r[part] for r in runs) for part in PARTS}
        best["total"] = min(sum(r[p] for p in PARTS) for r in runs)
        best["median_total"] = statistics.median(sum(r[p] for p in PARTS) for r in runs)
        best["spooled"] = runs[-1]["spooled"]
        results[str(batch)] = best
        print(f"| {batch} | " + " | ".join(f"{best[p]:.2f}" for p in PARTS)
              + f" | {best['total']:.2f} | {best['total'] / batch * 1e3:.0f} | {best['spooled']:.0f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
