"""Memory that admission keeps for distinct large payloads, against ``Limits.cache_bytes`` (architecture §10).

Two parts, each in processes of their own:

* ``memo``: 2,000 distinct ~185 KB payloads through ``FrontendState.admit`` (default limits: 256 MiB per memo) in a
  fresh process per kind: ``vectors`` (240 additive vectors at hidden size 128) and ``positions`` (a capture of
  46,000 explicit positions: ~10x its wire size once decoded). Per memo (admission, decoded payloads): what
  clearing it frees, measured as RSS after ``malloc_trim``, and in a third, traced process with tracemalloc for
  ``vectors`` (few objects per payload keep tracing affordable), against its budget and its own accounting.
* ``serve``: a ``dynsteer serve`` of the tiny Llama (``limits.max_entries = 1024``, so 600 vectors, ~400 KB, make a
  valid payload) receiving 1,000 distinct ~400 KB payloads 4 at a time after 20 warm-up requests: RSS of the API
  server, engine core and worker at start and end, and the budgets of the memos each holds.

``--code DIR`` runs dynsteer from ``DIR`` (another worktree, e.g. the code before a change) and ``--label`` names
the run; ``results/admission_memory-cpu-<date>.json`` keeps one entry per label.

    .venv/bin/python benchmarks/admission_memory.py --label after                          # ~6 min
    .venv/bin/python benchmarks/admission_memory.py --label before --code /tmp/old-checkout
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from lib.report import write_labelled_run
from lib.serve import Server

HIDDEN = 128
MIB = 1 << 20


def _vectors(seed: int, n: int) -> str:
    from dynsteer.request.payload import encode_payload
    from dynsteer.spec import AddVector, SteeringSpec

    rng = np.random.default_rng(seed)
    return encode_payload(SteeringSpec(vectors=[AddVector(layer=i % 4, vector=(rng.standard_normal(HIDDEN) * 0.01)
                                                          .astype(np.float32)) for i in range(n)]))


def _positions(seed: int, n: int) -> str:
    from dynsteer.capture.spec import CaptureSpec
    from dynsteer.request.payload import encode_payload

    return encode_payload(capture=CaptureSpec(layers=(1,), positions=tuple(range(seed, seed + n))))


def _rss() -> int:
    """This process's RSS once freed memory went back to the system (a full collection, then malloc_trim)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


def memo_child(kind: str, count: int, trace: bool) -> dict[str, Any]:
    """Runs in a fresh process: ``count`` distinct payloads of ``kind`` through admission; what each memo holds
    (RSS untraced: tracemalloc's own record of every block would be freed with them)."""
    import dynsteer.request.payload as payload_mod
    from dynsteer.config import Limits
    from dynsteer.engine.frontend import FrontendState
    from dynsteer.spec import ModelShape

    make = (lambda s: _vectors(s, 240)) if kind == "vectors" else (lambda s: _positions(s, 46_000))
    limits = Limits()
    state = FrontendState(ModelShape(num_layers=4, hidden_size=HIDDEN), limits=limits, capacity=63,
                          capture_places={(1, "post_block")})
    state.admit(make(10**6))  # warm
    if trace:
        tracemalloc.start()
    traced = (lambda: (gc.collect(), tracemalloc.get_traced_memory()[0])[1]) if trace else (lambda: 0)
    rss0, t0, size = _rss(), time.perf_counter(), 0
    for seed in range(count):
        payload = make(seed)
        size = len(payload)
        state.admit(payload)
    del payload
    seconds = time.perf_counter() - t0
    rss1, tm1 = _rss(), traced()
    accounted = {"admission": (state._memo.currsize, len(state._memo)),
                 "payload": (payload_mod._memo.currsize, len(payload_mod._memo))}
    state._memo.clear()
    rss2, tm2 = _rss(), traced()
    payload_mod._memo.clear()
    rss3, tm3 = _rss(), traced()
    memos = {}
    for name, rss_freed, tm_freed in (("admission", rss1 - rss2, tm1 - tm2), ("payload", rss2 - rss3, tm2 - tm3)):
        memos[name] = {"budget_mib": limits.cache_bytes / MIB, "accounted_mib": round(accounted[name][0] / MIB, 1),
                       "entries": accounted[name][1],
                       **({"freed_traced_mib": round(tm_freed / MIB, 1)} if trace else
                          {"freed_rss_mib": round(rss_freed / MIB, 1)})}
    out = {"kind": kind, "traced": trace, "payloads": count, "payload_bytes": size, "seconds": round(seconds, 1),
           "memos": memos}
    if not trace:
        out.update(rss_start_mib=round(rss0 / MIB, 1), rss_end_mib=round(rss1 / MIB, 1),
                   rss_grown_mib=round((rss1 - rss0) / MIB, 1))
    return out


def _run_child(code: Path, kind: str, count: int, trace: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(code)}
    proc = subprocess.run([sys.executable, __file__, "--child", kind, "--count", str(count),
                           *(["--trace"] if trace else [])], env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"memo child failed:\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def serve_part(code: Path, count: int, warm: int, log: Path) -> dict[str, Any]:
    import openai

    from dynsteer.testing.tiny_models import tiny_model

    model = tiny_model("llama")
    cfg = {"dynsteer": {"limits": {"max_entries": 1024}}}
    server = Server(model, log, ["--max-num-seqs", "8", "--additional-config", json.dumps(cfg)], code)
    url = server.start()
    try:
        api = psutil.Process(server.proc.pid)
        procs = {p.name(): p for p in (api, *api.children(recursive=True)) if p.name() != "python"}
        payloads = [_vectors(seed, 600) for seed in range(2)]  # the size, for the record
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        failures: list[str] = []

        def send(seed: int) -> None:
            try:
                client.completions.create(model=str(model), prompt="the quick brown fox", max_tokens=1,
                                          extra_body={"vllm_xargs": {"dynsteer": _vectors(seed, 600)}})
            except Exception as exc:  # noqa: BLE001 - counted and reported
                failures.append(repr(exc)[:300])

        rss = lambda: {name: p.memory_info().rss for name, p in procs.items()}  # noqa: E731
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(send, range(warm)))
            start, trajectory = rss(), []
            for chunk in range(0, count, 100):
                list(pool.map(send, range(warm + chunk, warm + min(count, chunk + 100))))
                trajectory.append({n: round(v / MIB, 1) for n, v in rss().items()})
        end = rss()
        seconds = time.perf_counter() - t0
    finally:
        server.stop()
    from dynsteer.config import Limits

    budget = Limits().cache_bytes
    memos = {"dynsteer": ("admission", "payload"), "VLLM::EngineCore": ("payload (monitor commands only)",),
             "VLLM::Worker": ("payload", "compiled rows")}
    processes = {}
    for name in procs:
        held = memos.get(name, ())
        processes[name] = {"rss_start_mib": round(start[name] / MIB, 1), "rss_end_mib": round(end[name] / MIB, 1),
                           "rss_grown_mib": round((end[name] - start[name]) / MIB, 1), "memos": list(held),
                           "memo_budgets_mib": len(held) * budget / MIB,
                           "within_budgets_plus_10pct": end[name] - start[name] <= 1.1 * len(held) * budget}
    return {"payloads": count, "warm_up": warm, "payload_bytes": len(payloads[0]), "concurrency": 4,
            "failures": len(failures), "failure_examples": failures[:3], "seconds": round(seconds, 1),
            "cache_bytes_mib": budget / MIB, "processes": processes, "rss_every_100_mib": trajectory}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="after")
    parser.add_argument("--code", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the dynsteer checkout to measure (default: this one)")
    parser.add_argument("--parts", default="memo,serve")
    parser.add_argument("--count", type=int, default=2000, help="payloads per kind in the memo part")
    parser.add_argument("--serve-count", type=int, default=1000)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(memo_child(args.child, args.count, args.trace)))
        return 0
    sha = subprocess.run(["git", "-C", str(args.code), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    run: dict[str, Any] = {"code": str(args.code), "git": sha, "loadavg_at_start": os.getloadavg()}
    if "memo" in args.parts:
        run["memo"] = [_run_child(args.code, kind, args.count, trace)
                       for kind, trace in (("vectors", False), ("positions", False), ("vectors", True))]
        for r in run["memo"]:
            how = "traced" if r["traced"] else "rss"
            print(f"[{args.label}] memo {r['kind']} ({how}): {r['payloads']} x {r['payload_bytes']} B; " + "; ".join(
                f"{n}: freed {m[f'freed_{how}_mib']} MiB (budget {m['budget_mib']:.0f}, accounted "
                f"{m['accounted_mib']}, {m['entries']} entries)" for n, m in r["memos"].items()))
    if "serve" in args.parts:
        log = Path(tempfile.gettempdir()) / f"admission_memory-{args.label}-server.log"
        run["serve"] = serve_part(args.code, args.serve_count, 20, log)
        for name, p in run["serve"]["processes"].items():
            print(f"[{args.label}] serve {name}: RSS {p['rss_start_mib']} -> {p['rss_end_mib']} MiB "
                  f"(+{p['rss_grown_mib']}; memo budgets {p['memo_budgets_mib']:.0f} MiB)")
    run["loadavg_at_end"] = os.getloadavg()
    print(f"wrote {write_labelled_run(args.out, 'admission_memory', args.label, run)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
