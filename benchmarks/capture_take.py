"""The capture take path on the host, phase by phase: a batch of requests capturing every generated token at one
place (spooled to ``/dev/shm`` as the steps land), then what ``take_captures`` does once they finish: finish the
records (the spool writer drained, files sealed), hand the files over and pack the records (the engine core), and
map them in the caller (``unpack_records``). No engine: a ``CaptureCollector`` fed random rows as the steering op
would write them (CPU).

``benchmarks/overhead.py`` put capture's whole-call cost at batch 64 in the call's tail (run S, H100: +12.3 ms);
this shows how much of that the take path's own host work can be.

    .venv/bin/python benchmarks/capture_take.py --batch 1 16 64 --tokens 127 --hidden 4096
"""

from __future__ import annotations

import argparse
import statistics
import time


def run(batch: int, tokens: int, hidden: int, prompt: int = 32) -> dict[str, float]:
    import numpy as np
    import torch

    from dynsteer.capture import result
    from dynsteer.capture.spec import CaptureSpec
    from dynsteer.capture.spool import WRITER
    from dynsteer.capture.store import CaptureCollector

    place = (1, "post_block")
    stages = {place: torch.zeros(batch * prompt, hidden)}
    col = CaptureCollector(stages, engine_places={place}, spool=True)
    spec = CaptureSpec(layers=(1,), sites=("post_block",), positions="all_generated")
    ids = [f"r{i}" for i in range(batch)]
    for r in ids:
        col.begin(r, f"tag-{r}", spec, prompt)
    gen = torch.Generator().manual_seed(0)
    for step in range(tokens + 1):
        if step == 0:
            qs, computed = np.arange(batch + 1) * prompt, np.zeros(batch, np.int64)
        else:
            qs, computed = np.arange(batch + 1), np.full(batch, prompt + step - 1)
        col.plan(ids, qs, computed)
        stages[place][:batch].normal_(generator=gen)
        col.after_forward()
    t0 = time.perf_counter()
    backlog = WRITER.backlog()
    col.poll(block=True)
    recs = [col.finish(r) for r in ids]
    t1 = time.perf_counter()
    packed = result.pack_records(recs, result.host_id())
    t2 = time.perf_counter()
    caps = result.unpack_records(packed)
    t3 = time.perf_counter()
    assert all(len(c.positions) == tokens for c in caps)
    return {"writer_queue": backlog, "finish_ms": (t1 - t0) * 1e3, "pack_ms": (t2 - t1) * 1e3,
            "unpack_ms": (t3 - t2) * 1e3, "total_ms": (t3 - t0) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=127, help="captured rows per request")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    for b in args.batch:
        runs = [run(b, args.tokens, args.hidden) for _ in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        mib = b * args.tokens * args.hidden * 4 / 2**20
        print(f"batch {b} ({mib:.0f} MiB float32): finish {med['finish_ms']:.2f} ms, hand over + pack "
              f"{med['pack_ms']:.2f} ms, caller's unpack {med['unpack_ms']:.2f} ms, total {med['total_ms']:.2f} ms "
              f"(medians of {args.repeats}; writer queue at the take {med['writer_queue']:.0f})", flush=True)


if __name__ == "__main__":
    main()
