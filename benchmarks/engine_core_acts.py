"""Engine-core host time per decode step for folding the workers' acted reports into requests' prefix-cache
hashing (``dynsteer.engine.scheduler._apply_acts``), on vLLM ``Request`` objects without an engine (CPU).

With prefix caching on, every dynamic request is reported on at every step (how far its KV was computed, where
steering acted), and a block is hashed only once it is reported on. This times that fold for a decode batch, the
steps that complete a block (and hash it) included; the median is the common step.

    python3 benchmarks/engine_core_acts.py --batch 1 16 64
"""

from __future__ import annotations

import argparse
import statistics
import time


def run(batch: int, steps: int, acted_every: int) -> dict[str, float]:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from dynsteer.engine import keys, prefix_cache, scheduler

    prefix_cache.patch_request(Request)
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(16, sha256_cbor)

    class Scheduler:  # what _apply_acts reads of vLLM's scheduler
        requests: dict[str, Request] = {}

    sched = Scheduler()
    for i in range(batch):
        params = SamplingParams(max_tokens=steps + 1, extra_args={keys.DYNAMIC_KEY: "bench"})
        sched.requests[f"r{i}"] = Request(f"r{i}", list(range(32)), params, None, block_hasher=hasher)
    ids = list(sched.requests)
    times = []
    for step in range(steps):
        pos = 32 + step
        for request in sched.requests.values():
            request.append_output_token_ids(7)  # vLLM's append (it hashes up to what was reported)
        acted = pos if acted_every and step % acted_every == 0 else -1
        acts = [(ids, [pos + 1] * batch, [acted] * batch, ["sig"] * batch)]
        t0 = time.perf_counter()
        scheduler._apply_acts(sched, acts)
        times.append((time.perf_counter() - t0) * 1e6)
    hashed = min(len(r.block_hashes) for r in sched.requests.values())
    assert hashed == (32 + steps) // 16, hashed  # every reported full block was hashed
    return {"median_us": round(statistics.median(times), 1), "mean_us": round(statistics.fmean(times), 1),
            "per_request_median_us": round(statistics.median(times) / batch, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--acted-every", type=int, default=0, help="a report with steering acted every N steps (0: none)")
    args = ap.parse_args()
    for b in args.batch:
        print(f"batch {b}: {run(b, args.steps, args.acted_every)}", flush=True)


if __name__ == "__main__":
    main()
