"""A light client's latency over HTTP, alone and beside two clients sending heavy valid payloads (architecture §10).

A ``dynsteer serve`` of the tiny Llama (default limits). The light client sends ``--light`` completions one after
another (no payload, 8 tokens); each heavy client sends completions back to back, each with a new ~190 KB payload
of 250 additive vectors (valid; its admission decodes, validates and compiles every vector) and 1 token. Reported:
the light client's latency p50 / p90 / p99 / max alone and beside the heavy clients; the same for ``GET /health``
probed every 20 ms meanwhile (the event loop's own responsiveness: no engine step in it); the heavy requests
completed, and the machine's load average (the figures are CPU time shared with whatever else runs).

``--code DIR`` runs the server from another dynsteer checkout (e.g. the code before a change), ``--label`` names
the run; ``results/admission_latency-cpu-<date>.json`` keeps one entry per label.

    .venv/bin/python benchmarks/admission_latency.py --label after                                  # ~3 min
    .venv/bin/python benchmarks/admission_latency.py --label before --code /tmp/old-checkout
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from lib.report import write_labelled_run
from lib.serve import Server

HIDDEN = 128


def heavy_payload(seed: int, n: int) -> str:
    from dynsteer.request.payload import encode_payload
    from dynsteer.spec import AddVector, SteeringSpec

    rng = np.random.default_rng(seed)
    return encode_payload(SteeringSpec(vectors=[AddVector(layer=i % 4, vector=(rng.standard_normal(HIDDEN) * 0.01)
                                                          .astype(np.float32)) for i in range(n)]))


def _post(url: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def light_latencies(url: str, model: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        _post(url, {"model": model, "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0})
        out.append((time.perf_counter() - t0) * 1e3)
    return out


class Probe:
    """``GET /health`` every ``period`` seconds on its own thread: what the API server's event loop alone answers
    in (no engine step involved), while a phase runs."""

    def __init__(self, url: str, period: float = 0.02) -> None:
        self.url, self.period, self.ms, self._stop = url, period, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            with urllib.request.urlopen(f"{self.url}/health", timeout=60) as r:
                r.read()
            self.ms.append((time.perf_counter() - t0) * 1e3)
            self._stop.wait(self.period)

    def __enter__(self) -> "Probe":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(60)


def _stats(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"n": len(ms), **{f"p{q}_ms": round(float(np.percentile(a, q)), 1) for q in (50, 90, 99)},
            "max_ms": round(float(a.max()), 1), "mean_ms": round(float(a.mean()), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="after")
    parser.add_argument("--code", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--light", type=int, default=100, help="light requests per phase")
    parser.add_argument("--heavy-clients", type=int, default=2)
    parser.add_argument("--vectors", type=int, default=250, help="additive vectors per heavy payload (250: ~190 KB; "
                        "more raise the server's limits.max_entries to fit)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    from dynsteer.testing.tiny_models import tiny_model

    model = tiny_model("llama")
    # made before timing: the client's own CPU stays out of the figures
    payloads = [heavy_payload(seed, args.vectors) for seed in range(400)]
    sha = subprocess.run(["git", "-C", str(args.code), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    log = Path(tempfile.gettempdir()) / f"admission_latency-{args.label}-server.log"
    max_entries = max(256, args.vectors + 8)  # 256: the default
    cfg = {"dynsteer": {"limits": {"max_entries": max_entries}}}
    with Server(model, log, ["--max-num-seqs", "8", "--additional-config", json.dumps(cfg)], args.code) as server:
        url = server.url
        light_latencies(url, str(model), 10)  # warm
        load0 = os.getloadavg()
        with Probe(url) as probe_alone:
            alone = light_latencies(url, str(model), args.light)
        stop, sent, errors = threading.Event(), [0], []
        taken = iter(range(len(payloads)))
        lock = threading.Lock()

        def heavy() -> None:
            while not stop.is_set():
                with lock:
                    i = next(taken, None)
                    if i is None:
                        return
                try:
                    _post(url, {"model": str(model), "prompt": "the quick brown fox", "max_tokens": 1,
                                "vllm_xargs": {"dynsteer": payloads[i]}})
                    with lock:
                        sent[0] += 1
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    errors.append(repr(exc)[:300])

        threads = [threading.Thread(target=heavy, daemon=True) for _ in range(args.heavy_clients)]
        for t in threads:
            t.start()
        time.sleep(2)  # the heavy clients at full pace
        t0 = time.perf_counter()
        with Probe(url) as probe_beside:
            beside = light_latencies(url, str(model), args.light)
        seconds = time.perf_counter() - t0
        heavy_done = sent[0]
        stop.set()
        for t in threads:
            t.join(300)
        load1 = os.getloadavg()
    run = {"code": str(args.code), "git": sha, "payload_bytes": len(payloads[0]), "vectors": args.vectors,
           "max_entries": max_entries, "heavy_clients": args.heavy_clients,
           "light_alone": _stats(alone), "light_beside_heavy": _stats(beside),
           "health_alone": _stats(probe_alone.ms), "health_beside_heavy": _stats(probe_beside.ms),
           "heavy_completed_during_light_phase": heavy_done,
           "heavy_per_s": round(heavy_done / seconds, 1), "heavy_errors": len(errors), "error_examples": errors[:3],
           "loadavg_before": load0, "loadavg_after": load1}
    for what in ("light", "health"):
        print(f"[{args.label}] {what} alone {run[f'{what}_alone']}\n[{args.label}] {what} beside "
              f"{args.heavy_clients} heavy clients {run[f'{what}_beside_heavy']}")
    print(f"[{args.label}] heavy {run['heavy_per_s']}/s, {len(errors)} errors")
    print(f"wrote {write_labelled_run(args.out, 'admission_latency', args.label, run)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
