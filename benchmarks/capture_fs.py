"""Filesystem capture layouts on local disk: files written, MB/s, and finalize latency (p50/p95) per layout.

Each simulated request captures ``--positions`` rows of ``--hidden`` float32 at ``--places`` places, arriving in
``--chunks`` chunks (as decode steps would deliver them); the consumer then finalizes it.

    python benchmarks/capture_fs.py --requests 200 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from dynsteer.capture.consumers import LAYOUTS, FilesystemConsumer
from dynsteer.capture.reader import CaptureReader
from dynsteer.capture.spec import CaptureSpec
from dynsteer.capture.store import CaptureRecord


def make_record(i: int, args: argparse.Namespace, rng: np.random.Generator) -> CaptureRecord:
    spec = CaptureSpec(layers=tuple(range(args.places)), sites=("post_block",), positions="all")
    rec = CaptureRecord(tag=f"req-{i:06d}", req_id=str(i), spec=spec, prompt_len=args.positions // 2,
                        values={p: [] for p in spec.places()})
    bounds = np.linspace(0, args.positions, args.chunks + 1).astype(int)
    for a, b in zip(bounds[:-1], bounds[1:]):
        rec.positions.append(np.arange(a, b))
        for place in spec.places():
            rec.values[place].append(rng.standard_normal((b - a, args.hidden)).astype(np.float32))
    return rec


def run_layout(layout: str, args: argparse.Namespace) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix=f"capfs-{layout}-", dir=args.dir))
    consumer = FilesystemConsumer(root, layout=layout)
    rng = np.random.default_rng(0)
    records = [make_record(i, args, rng) for i in range(args.requests)]
    payload = sum(a.nbytes for r in records for parts in r.values.values() for a in parts)
    finalize = []
    t0 = time.perf_counter()
    for rec in records:
        if layout == "per_file":  # chunks are written as they arrive
            for k, pos in enumerate(rec.positions):
                rec.chunks = k + 1
                consumer.on_chunk(rec, pos, {p: parts[k] for p, parts in rec.values.items()})
        t = time.perf_counter()
        consumer.on_finish(rec)
        finalize.append(time.perf_counter() - t)
    total = time.perf_counter() - t0
    files = sum(1 for p in root.rglob("*") if p.is_file())
    t = time.perf_counter()
    reader = CaptureReader(root)
    assert len(reader.tags()) == args.requests
    for tag in reader.tags():
        reader.read(tag)
    read_s = time.perf_counter() - t
    shutil.rmtree(root)
    return {"files": files, "write_MBps": payload / total / 1e6, "read_MBps": payload / read_s / 1e6,
            "finalize_p50_ms": float(np.percentile(finalize, 50) * 1e3),
            "finalize_p95_ms": float(np.percentile(finalize, 95) * 1e3), "payload_MB": payload / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--places", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    results = {layout: run_layout(layout, args) for layout in LAYOUTS}
    report = {"benchmark": "capture_fs", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
              "params": {k: v for k, v in vars(args).items() if k not in ("out", "dir")}, "results": results}
    print("| layout | files | write MB/s | read MB/s | finalize p50 ms | finalize p95 ms |")
    print("|---|---|---|---|---|---|")
    for layout, r in results.items():
        print(f"| {layout} | {r['files']} | {r['write_MBps']:.0f} | {r['read_MBps']:.0f} | "
              f"{r['finalize_p50_ms']:.2f} | {r['finalize_p95_ms']:.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"capture_fs-{report['date'][:10]}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
