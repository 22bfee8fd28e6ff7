"""The soak's control: plain ``vllm serve`` and ``dynsteer serve`` side by side under the same unsteered traffic.

``benchmarks/soak.py`` finds the server's memory still rising slowly after its memos fill. This script tells how much
of such a curve is vLLM's own: both servers of the tiny local Llama (CPU) run at once, each driven by ``--clients``
HTTP clients sending unsteered completions of fresh random prompts (so neither server's prefix cache holds the
traffic), and a sampler records the resident memory of each server's processes every ``--sample-s`` seconds. The
report gives each server's RSS slope (least squares, MB per minute) after ``--warmup-min`` and the difference; every
text must come back with status 200.

    python benchmarks/soak_control.py --minutes 20 --out benchmarks/results/soak-control-cpu.json \
        --plot benchmarks/results/soak-control-cpu.png
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from lib.serve import Server, VanillaServer

WORDS = ("river stone light market paper window garden engine silver quiet winter music orange letter bridge forest "
         "number simple yellow family ocean doctor planet summer mirror animal bottle castle pencil rocket").split()


def tree_rss_mb(pid: int) -> float:
    import psutil

    root = psutil.Process(pid)
    procs = [root]
    try:
        procs += root.children(recursive=True)
    except psutil.Error:
        pass
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=3, help="clients per server")
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--sample-s", type=float, default=15.0)
    ap.add_argument("--warmup-min", type=float, default=5.0, help="minutes left out of the slope")
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()

    from dynsteer.testing.tiny_models import tiny_model

    model = str(tiny_model("llama"))
    work = Path(tempfile.mkdtemp(prefix="dynsteer-soak-control-"))
    common = ["--max-num-seqs", "16"]
    servers = {"vllm": VanillaServer(model, work / "vllm.log", common),
               "dynsteer": Server(model, work / "dynsteer.log", common)}
    for s in servers.values():
        s.start()
    stop = threading.Event()
    lock = threading.Lock()
    counts = {name: {"ok": 0, "errors": 0} for name in servers}
    errors: list[str] = []
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}

    def client(name: str, seed: int) -> None:
        rng = random.Random(seed)
        url = servers[name].url + "/v1/completions"
        while not stop.is_set():
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))
            body = json.dumps({"model": model, "prompt": prompt, "max_tokens": args.tokens, "temperature": 0}).encode()
            req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    json.loads(r.read())
                with lock:
                    counts[name]["ok"] += 1
            except Exception as exc:  # a failed request is data: counted and reported
                with lock:
                    counts[name]["errors"] += 1
                    errors.append(f"{name}: {exc!r}"[:300])

    t0 = time.monotonic()

    def sampler() -> None:
        while True:
            for name, s in servers.items():
                samples[name].append((time.monotonic() - t0, tree_rss_mb(s.proc.pid)))
            if stop.wait(args.sample_s):
                return

    threads = [threading.Thread(target=sampler, daemon=True)]
    threads += [threading.Thread(target=client, args=(name, 1000 * i + c), daemon=True)
                for i, name in enumerate(servers) for c in range(args.clients)]
    try:
        for t in threads:
            t.start()
        end = t0 + args.minutes * 60
        while time.monotonic() < end:
            time.sleep(30)
            print(f"[control] {time.monotonic() - t0:6.0f} s  " + "  ".join(
                f"{n}: {counts[n]['ok']} ok {counts[n]['errors']} err {samples[n][-1][1]:.0f} MB" for n in servers),
                flush=True)
        stop.set()
        for t in threads:
            t.join(150)
    finally:
        stop.set()
        for s in servers.values():
            s.stop()

    report: dict[str, Any] = {"minutes": args.minutes, "clients_per_server": args.clients, "counts": counts,
                              "errors": errors[:50], "warmup_min": args.warmup_min, "servers": {}}
    for name, pts in samples.items():
        arr = np.array(pts)
        late = arr[arr[:, 0] >= args.warmup_min * 60]
        slope = float(np.polyfit(late[:, 0] / 60, late[:, 1], 1)[0]) if len(late) >= 3 else float("nan")
        report["servers"][name] = {"rss_mb_start": round(float(arr[0, 1]), 1),
                                   "rss_mb_at_warmup": round(float(late[0, 1]), 1) if len(late) else None,
                                   "rss_mb_end": round(float(arr[-1, 1]), 1),
                                   "slope_mb_per_min_after_warmup": round(slope, 3),
                                   "samples": [[round(t, 1), round(m, 1)] for t, m in pts]}
    report["slope_difference_mb_per_min"] = round(report["servers"]["dynsteer"]["slope_mb_per_min_after_warmup"]
                                                  - report["servers"]["vllm"]["slope_mb_per_min_after_warmup"], 3)
    report["ok"] = not errors
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        for name, pts in samples.items():
            arr = np.array(pts)
            ax.plot(arr[:, 0] / 60, arr[:, 1], label=f"{name} serve ({counts[name]['ok']} requests)")
        ax.set_xlabel("minutes")
        ax.set_ylabel("RSS of the server's processes (MB)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    print(json.dumps({k: v for k, v in report.items() if k != "servers"}
                     | {n: {k: v for k, v in d.items() if k != "samples"} for n, d in report["servers"].items()},
                     indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
