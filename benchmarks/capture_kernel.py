"""The device side of capture: the steering launches of one forward, without capture buffers, with them and nobody
capturing, and with every token captured.

An engine with capture buffers runs the same kernels per step as one without; the steering op at each captured place
also stores the unsteered residual of the tokens the host gave a capture row this step (``stage_slot``; -1 for the
rest). This measures what that costs, apart from everything else in an engine step (host work, scheduling, other
processes): the 96 steering launches of a 32-layer, 4096-wide model (three sites per layer, dynsteer's default
tables, nothing steered) are captured in CUDA graphs and replayed alternately:

* ``base``: no capture buffers (as the ``base`` engine of the earlier ``capture_overhead.py``, superseded by
  ``overhead.py``; its reports stay in ``benchmarks/results/``);
* ``idle``: capture buffers at ``post_block`` of every layer, every slot -1 (its ``capture`` engine, idle);
* ``all``: the same with every token given a row (every request capturing every position at 32 places).

    python3 benchmarks/capture_kernel.py --out benchmarks/results \\
        --step-from benchmarks/results/capture_overhead-NVIDIA_H200-<date>.json

With ``--step-from`` (a ``capture_overhead`` report) each difference is also given as a share of that report's
measured time per decode step of the ``base`` engine at the same batch size (time per step = batch / tokens per s).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from dynsteer import DynsteerConfig, SITES  # noqa: E402
from dynsteer.steering.site import SiteHook  # noqa: E402
from dynsteer.steering.tables import SteeringTables  # noqa: E402
from lib.graphs import alternate, capture_graph, time_replays
from lib.report import print_table_head, utc_now, write_report
from lib.stats import paired_difference


def build_hooks(layers: int, hidden: int, max_tokens: int, capture: bool, dtype: torch.dtype,
                device: str = "cuda") -> tuple[list[SiteHook], torch.Tensor | None]:
    """The site hooks of a model (dynsteer's default tables; capture buffers at every ``post_block`` if asked) and
    the capture slots they share (all -1: nobody captures)."""
    cfg = DynsteerConfig()
    tables = SteeringTables([(l, s) for l in range(layers) for s in SITES], hidden, cfg.max_rows, cfg.max_clamps,
                            max_tokens, device=device, max_gates=cfg.max_gates)
    slot = torch.full((max_tokens,), -1, dtype=torch.int32, device=device) if capture else None
    hooks = [SiteHook(tables, layer, site,
                      stage=torch.zeros(max_tokens, hidden, dtype=dtype, device=device)
                      if capture and site == "post_block" else None, stage_slot=slot)
             for layer in range(layers) for site in SITES]
    return hooks, slot


def graph_of(hooks: list[SiteHook], h: torch.Tensor, r: torch.Tensor) -> torch.cuda.CUDAGraph:
    """The launches of one forward (each site's output feeds the next, as in a model), captured once."""

    def forward() -> torch.Tensor:
        x = h
        for hook in hooks:
            x = hook(x, None if (hook.layer, hook.site) == (0, "pre_attn") else r)
        return x

    return capture_graph(forward)


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
    built = {name: build_hooks(args.layers, args.hidden, args.max_tokens, name == "capture", dtype)
             for name in ("base", "capture")}
    slot = built["capture"][1]
    steps = step_ms(args.step_from)
    rows = {}
    for T in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(T)
        h = torch.randn(T, args.hidden, device="cuda", dtype=dtype, generator=gen)
        r = torch.randn(T, args.hidden, device="cuda", dtype=dtype, generator=gen)
        graphs = {"base": graph_of(built["base"][0], h, r), "idle": graph_of(built["capture"][0], h, r)}
        graphs["all"] = graphs["idle"]  # the same graph, run with every slot set

        def measure(name: str) -> float:
            slot[:T] = torch.arange(T, dtype=torch.int32, device="cuda") if name == "all" else -1
            return time_replays(graphs[name], args.replays)

        us = alternate(list(graphs), args.rounds, measure)
        slot.fill_(-1)
        row = {f"{name}_us": round(statistics.median(v), 2) for name, v in us.items()}
        for name in ("idle", "all"):
            row[f"{name}_delta_us"], row[f"{name}_delta_us_range"] = paired_difference(us["base"], us[name])
            if T in steps:
                row[f"{name}_pct_of_step"] = round(row[f"{name}_delta_us"] / (steps[T] * 1e3) * 100, 4)
        row["stored_mb_all"] = round(T * args.hidden * dtype.itemsize * args.layers / 2**20, 2)
        if T in steps:
            row["step_ms"] = round(steps[T], 3)
        rows[str(T)] = row
        print(f"T={T}: {row}", flush=True)
    report = {
        "benchmark": "capture_kernel", "date": utc_now(),
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": "bfloat16",
        "layers": args.layers, "hidden": args.hidden, "sites": list(SITES), "capture_places": "post_block x all layers",
        "variants": {"base": "no capture buffers", "idle": "capture buffers, every slot -1",
                     "all": "capture buffers, every token captured"},
        "replays": args.replays, "rounds": args.rounds, "step_from": str(args.step_from or ""), "tokens": rows,
    }
    path = write_report(report, args.out)
    print_table_head("tokens per forward", args.tokens)
    for key, label in [("base_us", "96 steering launches, no capture buffers (µs)"),
                       ("idle_delta_us", "capture buffers at 32 places, nobody capturing: difference (µs)"),
                       ("all_delta_us", "every token captured at 32 places: difference (µs)")]:
        print(f"| {label} | " + " | ".join(f"{rows[str(T)][key]:+.2f}" for T in args.tokens) + " |")
    for name in ("idle", "all"):
        if steps:
            print(f"| {name}: share of a measured decode step (%) | " +
                  " | ".join(f"{rows[str(T)][f'{name}_pct_of_step']:+.3f}" if f"{name}_pct_of_step" in rows[str(T)]
                             else "—" for T in args.tokens) + " |")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
