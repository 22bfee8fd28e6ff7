"""The device side of capture-enabled idle: the steering launches of one forward, with and without capture buffers.

An engine with capture buffers runs the same kernels per step as one without; the steering op at each captured place
also stores every token's unsteered residual into that place's buffer. This measures what that store costs, apart
from everything else in an engine step (host work, scheduling, other processes): the 96 steering launches of a
32-layer, 4096-wide model (three sites per layer, dynsteer's default tables, nothing steered) are captured in a CUDA
graph, once with capture buffers at ``post_block`` of every layer (as in ``capture_overhead.py``'s ``capture``
engine) and once without, and the two graphs are replayed alternately.

    python3 benchmarks/capture_kernel.py --out benchmarks/results \\
        --step-from benchmarks/results/capture_overhead-NVIDIA_H200-<date>.json

With ``--step-from`` (a ``capture_overhead`` report) each difference is also given as a share of that report's
measured time per decode step of the ``base`` engine at the same batch size (time per step = batch / tokens per s).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_overhead import print_table_head, write_report  # noqa: E402

from dynsteer import DynsteerConfig, SITES  # noqa: E402
from dynsteer.steering.site import SiteHook  # noqa: E402
from dynsteer.steering.tables import SteeringTables  # noqa: E402


def build_hooks(layers: int, hidden: int, max_tokens: int, capture: bool, dtype: torch.dtype,
                device: str = "cuda") -> list[SiteHook]:
    """The site hooks of a model (dynsteer's default tables; capture buffers at every ``post_block`` if asked)."""
    cfg = DynsteerConfig()
    tables = SteeringTables([(l, s) for l in range(layers) for s in SITES], hidden, cfg.max_rows, cfg.max_clamps,
                            max_tokens, device=device, max_gates=cfg.max_gates)
    return [SiteHook(tables, layer, site,
                     stage=torch.zeros(max_tokens, hidden, dtype=dtype, device=device)
                     if capture and site == "post_block" else None)
            for layer in range(layers) for site in SITES]


def graph_of(hooks: list[SiteHook], h: torch.Tensor, r: torch.Tensor) -> torch.cuda.CUDAGraph:
    """The launches of one forward (each site's output feeds the next, as in a model), captured once."""

    def forward() -> torch.Tensor:
        x = h
        for hook in hooks:
            x = hook(x, None if (hook.layer, hook.site) == (0, "pre_attn") else r)
        return x

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton compiles) off the capture
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph


def time_replays(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Microseconds per replay."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def step_ms(report: Path | None) -> dict[int, float]:
    if report is None:
        return {}
    tok_s = json.loads(report.read_text())["tokens_per_s"]["base/idle"]
    return {int(b): int(b) / v * 1e3 for b, v in tok_s.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512, 2048],
                    help="tokens per forward (decode batch size, or a prefill chunk)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=16384, help="rows of each capture buffer")
    ap.add_argument("--replays", type=int, default=200, help="replays per measurement")
    ap.add_argument("--rounds", type=int, default=15, help="alternating measurements per graph")
    ap.add_argument("--step-from", type=Path, help="a capture_overhead report, for the share of a decode step")
    args = ap.parse_args()
    dtype = torch.bfloat16
    variants = {name: build_hooks(args.layers, args.hidden, args.max_tokens, name == "capture", dtype)
                for name in ("base", "capture")}
    steps = step_ms(args.step_from)
    rows = {}
    for T in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(T)
        h = torch.randn(T, args.hidden, device="cuda", dtype=dtype, generator=gen)
        r = torch.randn(T, args.hidden, device="cuda", dtype=dtype, generator=gen)
        graphs = {name: graph_of(hooks, h, r) for name, hooks in variants.items()}
        us: dict[str, list[float]] = {name: [] for name in graphs}
        for rnd in range(args.rounds):
            for name in (list(graphs) if rnd % 2 == 0 else list(graphs)[::-1]):
                us[name].append(time_replays(graphs[name], args.replays))
        base, cap = statistics.median(us["base"]), statistics.median(us["capture"])
        diffs = [c - b for b, c in zip(us["base"], us["capture"])]
        row = {"base_us": round(base, 2), "capture_us": round(cap, 2),
               "delta_us_median": round(statistics.median(diffs), 3),
               "delta_us_min": round(min(diffs), 3), "delta_us_max": round(max(diffs), 3),
               "stash_mb_per_forward": round(T * args.hidden * dtype.itemsize * args.layers / 2**20, 2)}
        if T in steps:
            row["step_ms"] = round(steps[T], 3)
            row["pct_of_step"] = round(row["delta_us_median"] / (steps[T] * 1e3) * 100, 4)
        rows[str(T)] = row
        print(f"T={T}: {row}", flush=True)
    report = {
        "benchmark": "capture_kernel", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": "bfloat16",
        "layers": args.layers, "hidden": args.hidden, "sites": list(SITES), "capture_places": "post_block x all layers",
        "replays": args.replays, "rounds": args.rounds, "step_from": str(args.step_from or ""), "tokens": rows,
    }
    path = write_report(report, args.out)
    print_table_head("tokens per forward", args.tokens)
    for key, label in [("base_us", "96 steering launches, no capture buffers (µs)"),
                       ("capture_us", "same, capture buffers at 32 places (µs)"),
                       ("delta_us_median", "difference (µs, median)")]:
        print(f"| {label} | " + " | ".join(f"{rows[str(T)][key]:.2f}" for T in args.tokens) + " |")
    if steps:
        print("| share of a measured decode step (%) | " +
              " | ".join(f"{rows[str(T)]['pct_of_step']:+.3f}" if "pct_of_step" in rows[str(T)] else "—"
                         for T in args.tokens) + " |")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
