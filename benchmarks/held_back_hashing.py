"""Engine-core host time per decode step of held-back block hashing (requests with a dynamic policy), without a model.

Per step, vLLM's scheduler folds the workers' report of where dynamic steering acted (``_apply_acts``: one
report, every request reported up to its last computed token; only the columns that can change a hash are
visited) and appends each request's new token (vLLM's ``Request.append_output_token_ids``, which calls
``update_block_hashes``: for these requests dynsteer's held-back version). This benchmark builds real vLLM ``Request`` objects with vLLM's block hasher (block size 16, prompts of
32 tokens) and times both parts by this thread's CPU time, median over ``--steps`` decode steps, for ``dynamic``
requests (half of the reports say steering acted, once per request) and, as the reference, ``plain`` requests
(vLLM's own methods, no report). It imports the dynsteer on ``PYTHONPATH`` (an A/B: run it under each checkout).

    PYTHONPATH=. .venv/bin/python benchmarks/held_back_hashing.py --batch 128 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

BLOCK = 16  # the block hasher's block size


def run(batch: int, steps: int, dynamic: bool) -> dict[str, float]:
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from dynsteer.engine import prefix_cache
    from dynsteer.engine.keys import DYNAMIC_KEY
    from dynsteer.engine.scheduler import _apply_acts
    from dynsteer.steering.dynamic.tokens import ActedReport

    prefix_cache.patch_request(Request)
    prefix_cache.patch_block_hashing(kv_cache_utils)
    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    hasher = get_request_block_hasher(BLOCK, fn)
    extra = {DYNAMIC_KEY: "1"} if dynamic else None
    requests = {}
    for i in range(batch):
        params = SamplingParams(max_tokens=10**6, extra_args=extra)
        requests[f"r{i}"] = Request(request_id=f"r{i}", prompt_token_ids=[(i * 7 + j) % 900 for j in range(32)],
                                    sampling_params=params, pooling_params=None, block_hasher=hasher)

    class Scheduler:  # what _apply_acts reads of vLLM's scheduler
        pass

    sched = Scheduler()
    sched.requests = requests
    ids = tuple(requests)
    cols, sig = np.arange(batch), np.array(["sig"] * batch, object)
    acts_t, append_t = [], []
    for step in range(steps):
        if dynamic:  # reported up to each request's last computed token; half of them acted once, at step 40
            upto = np.array([r.num_tokens for r in requests.values()])
            acts = [ActedReport(ids, cols, upto - 1, upto, np.where((cols % 2 == 1) & (step == 40), upto - 1, -1), sig)]
        t0 = time.thread_time()
        if dynamic:  # (the workers build the report: not timed here)
            _apply_acts(sched, acts, BLOCK)
        t1 = time.thread_time()
        for r in requests.values():
            r.append_output_token_ids(5 + step % 500)
        t2 = time.thread_time()
        acts_t.append(t1 - t0)
        append_t.append(t2 - t1)
    assert not dynamic or all(len(r.block_hashes) == (r.num_tokens - 1) // BLOCK for r in requests.values())
    skip = steps // 10
    return {"acts_us": statistics.median(acts_t[skip:]) * 1e6, "append_us": statistics.median(append_t[skip:]) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    import dynsteer

    print(f"dynsteer from {dynsteer.__file__}")
    print("| requests | batch | _apply_acts µs | append_output_token_ids µs (all requests) |")
    print("|---|---|---|---|")
    for kind in ("plain", "dynamic"):
        for b in args.batch:
            r = run(b, args.steps, kind == "dynamic")
            print(f"| {kind} | {b} | {r['acts_us']:.0f} | {r['append_us']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
