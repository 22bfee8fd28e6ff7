"""Host time per decode step of per-token reports (payload ``report="tokens"``), without a model or a device.

What a step costs for ``R`` requests that each asked for a report, one generated token each, in the two places the
values pass through in the engine-core process (on a GPU the v2 runner's worker shares it, so both parts are on the
step's critical path):

* ``worker``: the dynamic tier's collection of the step's landed values into report deltas
  (``ReportCursors.flush_all``, all requests at once; ``flush`` one request at a time is the reference);
* ``relay``: the engine core's relay of the deltas onto the step's outputs (``ReportRelay.fold`` + ``deliver``).

The API server's part (``ReportValues.add`` and the chunk's ``dynsteer`` field) is per streamed chunk, not per
step. ``--pythonpath`` imports dynsteer from another checkout (an A/B); a checkout without ``flush_all`` times the
one-by-one flush only.

    .venv/bin/python benchmarks/report_path.py --requests 16 32 64 128 256
    .venv/bin/python benchmarks/report_path.py --pythonpath /tmp/old
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from types import SimpleNamespace

G = 2  # gate slots of the read-back layout; each request's policy uses one


def _store_and_states(n_req: int, steps: int) -> tuple:
    from dynsteer.device.readback import ReadbackStore
    from dynsteer.steering.dynamic.state import DynState

    store = ReadbackStore(4 * G + 1, slots=n_req, length=steps + 2)
    states = {}
    for i in range(n_req):
        st = SimpleNamespace(slots=[SimpleNamespace(prompt=False, monitor="m", scope="this_token", acts=True)],
                             record=store.acquire(), prompt_level=False)
        st.report_fields = lambda p, v, st=st: DynState.report_fields(st, p, v)
        states[f"r{i}"] = st
    return store, states


def worker_us(n_req: int, steps: int, at_once: bool) -> float:
    """µs per step of the worker's report flush for ``n_req`` requests."""
    import numpy as np

    from dynsteer.steering.dynamic.reports import ReportCursors

    store, states = _store_and_states(n_req, steps)
    cursors = ReportCursors()
    for req_id, st in states.items():
        cursors.start(req_id, "tokens", st, store)

    def flush() -> None:
        if at_once:
            cursors.flush_all(states.get, store)
        else:
            for req_id in list(cursors.sent):
                cursors.flush(req_id, states[req_id], store)
        cursors.take()

    flush()  # the headers
    slot = np.array([st.record for st in states.values()], np.int64)
    rng = np.random.default_rng(0)
    total = 0.0
    for s in range(steps):
        store.append(slot, np.full(n_req, 100 + s, np.int64), rng.standard_normal((4 * G + 1, n_req)).astype(np.float32))
        t0 = time.perf_counter()
        flush()
        total += time.perf_counter() - t0
    return total / steps * 1e6


def relay_us(n_req: int, steps: int) -> float:
    """µs per step of the engine core's relay (fold the step's deltas, attach them to the step's outputs)."""
    from dynsteer.engine.reports import ReportRelay

    class Outputs:
        def __init__(self) -> None:
            self.outputs: list = []

    relay = ReportRelay()
    ids = [f"r{i}" for i in range(n_req)]
    sched = SimpleNamespace(requests={r: SimpleNamespace(num_prompt_tokens=64) for r in ids})
    relay.fold(sched, {r: {"report": "tokens", "monitors": ["m"], "scopes": ["this_token"], "acts": [True]}
                       for r in ids})
    total = 0.0
    for s in range(steps):
        deltas = {r: {"position": [63 + s], "score": [[0.5]], "applied": [[0.7]]} for r in ids}
        step = Outputs()
        step.outputs = [SimpleNamespace(request_id=r, new_token_ids=[1], finish_reason=None, kv_transfer_params=None)
                        for r in ids]
        t0 = time.perf_counter()
        relay.fold(sched, deltas)
        relay.deliver({0: step}, Outputs)
        total += time.perf_counter() - t0
    return total / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="best of this many runs per cell")
    ap.add_argument("--pythonpath", help="import dynsteer from this checkout instead (an A/B against other code)")
    args = ap.parse_args()
    if args.pythonpath:
        env = dict(os.environ, PYTHONPATH=args.pythonpath + os.pathsep + os.environ.get("PYTHONPATH", ""))
        argv = [a for a in sys.argv[1:] if a not in ("--pythonpath", args.pythonpath)]
        sys.exit(subprocess.run([sys.executable, __file__, *argv], env=env, cwd="/tmp").returncode)
    from dynsteer.steering.dynamic.reports import ReportCursors

    batched = hasattr(ReportCursors, "flush_all")
    print("| requests | worker, one by one: µs/step (per request) | worker, at once | relay |")
    print("|---|---|---|---|")
    for n in args.requests:
        one = min(worker_us(n, args.steps, False) for _ in range(args.repeats))
        once = min(worker_us(n, args.steps, True) for _ in range(args.repeats)) if batched else None
        relay = min(relay_us(n, args.steps) for _ in range(args.repeats))
        cell = f"{once:.0f} ({once / n:.2f})" if once is not None else "—"
        print(f"| {n} | {one:.0f} ({one / n:.2f}) | {cell} | {relay:.0f} ({relay / n:.2f}) |", flush=True)


if __name__ == "__main__":
    main()
